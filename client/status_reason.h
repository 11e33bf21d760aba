// client/status_reason.h
//
// The machine-readable reason of a kvtrie error. The server attaches a google.rpc.ErrorInfo
// (domain "kvtrie.v1") to the statuses a client acts on rather than shows: grpc::Status's
// error_details holds the serialized google.rpc.Status with it (the grpc-status-details-bin
// trailer; proto/google/rpc/error_details.proto lists the reasons). FromGrpcStatus keeps the
// reason on the client's absl::Status (as a payload, type URL kStatusReasonUrl), so every layer
// above the wire (Client, ShardedClient, the Python package's kvtrie.Error.reason) matches on
// the reason, never on the message text.
//
// Reasons:
//   kStalePredictorVersion  FAILED_PRECONDITION of a Put: a block was encoded against a learned
//                           predictor state version the server no longer keeps; fetch the
//                           latest (GetPredictor) and encode again.
#ifndef KVTRIE_CLIENT_STATUS_REASON_H_
#define KVTRIE_CLIENT_STATUS_REASON_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace kvtrie {

inline constexpr char kStalePredictorVersion[] = "STALE_PREDICTOR_VERSION";
inline constexpr char kStatusReasonUrl[] = "kvtrie/error_reason";

// The ErrorInfo reason of `s`'s details; "" when it carries none (or they do not parse).
std::string StatusReason(const grpc::Status& s);
// The reason FromGrpcStatus kept on `s`; "" when none.
std::string StatusReason(const absl::Status& s);

// `s` as an absl::Status: the same code and message, and its reason (if any) as a payload.
absl::Status FromGrpcStatus(const grpc::Status& s);

// True when `s` says the predictor state version a Put was encoded against is gone.
inline bool IsStalePredictorVersion(const absl::Status& s) {
  return s.code() == absl::StatusCode::kFailedPrecondition &&
         StatusReason(s) == kStalePredictorVersion;
}

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_STATUS_REASON_H_
