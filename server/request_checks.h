// server/request_checks.h
//
// The request checks and conversions KvCacheService's calls share (server/kvcache_service.cc,
// server/kvcache_get.cc): INVALID_ARGUMENT / RESOURCE_EXHAUSTED statuses naming the field.
#ifndef KVTRIE_SERVER_REQUEST_CHECKS_H_
#define KVTRIE_SERVER_REQUEST_CHECKS_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvtrie/v1/kvtrie.pb.h"
#include "trie/store_types.h"

namespace kvtrie::service_checks {

inline grpc::Status Invalid(std::string message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(message));
}

// Namespaces and model ids are opaque strings; NUL is reserved by the store's key encoding.
inline grpc::Status CheckName(absl::string_view field, const std::string& value, bool required) {
  if (required && value.empty()) return Invalid(absl::StrCat(field, ": required"));
  if (value.size() > 1024) return Invalid(absl::StrCat(field, ": longer than 1024 bytes"));
  if (value.find('\0') != std::string::npos) {
    return Invalid(absl::StrCat(field, ": must not contain NUL"));
  }
  return grpc::Status::OK;
}

inline grpc::Status CheckTokens(absl::string_view field, int count, uint32_t max_tokens) {
  if (static_cast<uint32_t>(count) > max_tokens) {
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat(field, ": ", count, " tokens exceed the server's --max_tokens=", max_tokens));
  }
  return grpc::Status::OK;
}

// The request's token ids: `token_ids`, or `token_ids_packed` (little-endian uint32s) viewed in
// place when aligned (copied into `scratch` otherwise).
template <typename Request>
grpc::Status TokensOf(const Request& r, std::vector<uint32_t>* scratch,
                      absl::Span<const uint32_t>* out) {
  const std::string& packed = r.token_ids_packed();
  if (packed.empty()) {
    *out = absl::MakeConstSpan(r.token_ids().data(), r.token_ids().size());
    return grpc::Status::OK;
  }
  if (r.token_ids_size() > 0) {
    return Invalid("token_ids_packed: set together with token_ids; send one of them");
  }
  if (packed.size() % 4 != 0) {
    return Invalid(absl::StrCat("token_ids_packed: ", packed.size(),
                                " bytes, not a multiple of 4 (little-endian uint32 token ids)"));
  }
  const size_t n = packed.size() / 4;
  if (ABSL_IS_LITTLE_ENDIAN && reinterpret_cast<uintptr_t>(packed.data()) % 4 == 0) {
    *out = absl::MakeConstSpan(reinterpret_cast<const uint32_t*>(packed.data()), n);
    return grpc::Status::OK;
  }
  scratch->resize(n);
  for (size_t i = 0; i < n; ++i) {
    const auto* p = reinterpret_cast<const uint8_t*>(packed.data()) + 4 * i;
    (*scratch)[i] = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24);
  }
  *out = *scratch;
  return grpc::Status::OK;
}

// `info` as the proto's ModelSpec.
void ToModelSpec(const ModelInfo& info, v1::ModelSpec* spec);

}  // namespace kvtrie::service_checks

#endif  // KVTRIE_SERVER_REQUEST_CHECKS_H_
