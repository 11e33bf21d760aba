#include "server/get_sink.h"

#include <grpcpp/support/slice.h>

#include <string>
#include <vector>

namespace kvtrie {
namespace {

constexpr uint8_t kResponseBlockTag = (2 << 3) | 2;  // GetResponse.block, length-delimited
constexpr uint8_t kBlockKvTag = (5 << 3) | 2;        // GetBlock.kv
constexpr uint8_t kBlockEncodedTag = (6 << 3) | 2;   // GetBlock.encoded

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void ReleaseOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

}  // namespace

bool MessageGetSink::WriteBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                                std::shared_ptr<const void>) {
  v1::GetBlock* out = msg_.mutable_block();
  *out = block;
  if (encoded) {
    out->set_encoded(bytes.data(), bytes.size());
  } else {
    out->set_kv(bytes.data(), bytes.size());
  }
  return writer_->Write(msg_);
}

grpc::ByteBuffer FrameGetBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                               std::shared_ptr<const void> owner) {
  const std::string fields = block.SerializeAsString();  // kv and encoded are empty: left out
  const size_t inner =
      fields.size() + (bytes.empty() ? 0 : 1 + VarintSize(bytes.size()) + bytes.size());
  std::string head;
  head.reserve(fields.size() + 24);
  head.push_back(static_cast<char>(kResponseBlockTag));
  PutVarint(inner, &head);
  head += fields;
  if (bytes.empty()) {  // proto3 leaves an empty bytes field out
    grpc::Slice slice(head);
    return grpc::ByteBuffer(&slice, 1);
  }
  head.push_back(static_cast<char>(encoded ? kBlockEncodedTag : kBlockKvTag));
  PutVarint(bytes.size(), &head);
  grpc::Slice slices[2] = {
      grpc::Slice(head),
      owner == nullptr ? grpc::Slice(bytes.data(), bytes.size())  // copied
                       : grpc::Slice(const_cast<char*>(bytes.data()), bytes.size(), &ReleaseOwner,
                                     new std::shared_ptr<const void>(std::move(owner))),
  };
  return grpc::ByteBuffer(slices, 2);
}

bool ByteBufferGetSink::WriteHeader(const v1::GetResponse& header) {
  grpc::Slice slice(header.SerializeAsString());
  grpc::ByteBuffer buffer(&slice, 1);
  return writer_->Write(buffer);
}

bool ByteBufferGetSink::WriteBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                                   std::shared_ptr<const void> owner) {
  return writer_->Write(FrameGetBlock(block, encoded, bytes, std::move(owner)));
}

}  // namespace kvtrie
