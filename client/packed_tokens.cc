#include "client/packed_tokens.h"

#include <cstring>

#include "absl/base/config.h"

namespace kvtrie {

void PackTokens(absl::Span<const uint32_t> token_ids, std::string* out) {
  out->resize(token_ids.size() * 4);
  if (token_ids.empty()) return;  // an empty span's data() may be null: no memcpy from it
  if (ABSL_IS_LITTLE_ENDIAN) {
    std::memcpy(out->data(), token_ids.data(), out->size());
    return;
  }
  for (size_t i = 0; i < token_ids.size(); ++i) {
    for (int b = 0; b < 4; ++b) (*out)[4 * i + b] = static_cast<char>(token_ids[i] >> (8 * b));
  }
}

grpc::ByteBuffer WithPackedTokens(const google::protobuf::MessageLite& rest, uint32_t field,
                                  absl::Span<const uint32_t> token_ids, std::string* head) {
  head->clear();
  rest.AppendToString(head);
  if (token_ids.empty()) {
    grpc::Slice only(head->data(), head->size(), grpc::Slice::STATIC_SLICE);
    return grpc::ByteBuffer(&only, 1);
  }
  const auto varint = [head](uint64_t v) {
    for (; v >= 0x80; v >>= 7) head->push_back(static_cast<char>(v | 0x80));
    head->push_back(static_cast<char>(v));
  };
  varint((uint64_t{field} << 3) | 2);  // the tag: field, wire type LEN
  varint(token_ids.size() * 4);
  grpc::Slice parts[2] = {
      grpc::Slice(head->data(), head->size(), grpc::Slice::STATIC_SLICE),
      grpc::Slice(token_ids.data(), token_ids.size() * 4, grpc::Slice::STATIC_SLICE)};
  return grpc::ByteBuffer(parts, 2);
}

}  // namespace kvtrie
