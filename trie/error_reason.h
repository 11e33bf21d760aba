// trie/error_reason.h
//
// Machine-readable reasons on absl::Status, for the errors a caller acts on rather than shows
// (the message stays for people and may change). A reason is a payload of the status (type URL
// kErrorReasonUrl, value the reason, UPPER_SNAKE_CASE and stable); the server sends it as a
// google.rpc.ErrorInfo in the status details (server/grpc_status.h,
// proto/google/rpc/error_details.proto) and clients read it from there
// (client/status_reason.h), never from the message text.
//
// Reasons:
//   kStalePredictorVersion  FAILED_PRECONDITION: a block was encoded against a learned predictor
//                           state version that is no longer kept (trie/predictor_registry.h).
#ifndef KVTRIE_TRIE_ERROR_REASON_H_
#define KVTRIE_TRIE_ERROR_REASON_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

namespace kvtrie {

inline constexpr char kErrorReasonUrl[] = "kvtrie/error_reason";
inline constexpr char kStalePredictorVersion[] = "STALE_PREDICTOR_VERSION";

// `s` with `reason` attached. REQUIRES: !s.ok().
inline absl::Status WithErrorReason(absl::Status s, absl::string_view reason) {
  s.SetPayload(kErrorReasonUrl, absl::Cord(reason));
  return s;
}

// The reason attached to `s`; "" when none.
inline std::string ErrorReason(const absl::Status& s) {
  const auto r = s.GetPayload(kErrorReasonUrl);  // absl::optional<absl::Cord>
  return r ? std::string(*r) : std::string();
}

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_ERROR_REASON_H_
