// server/grpc_status.h
//
// The one place where library errors (absl::Status) become gRPC statuses. Codes map one to one
// (absl and gRPC share the canonical code numbering); the message is kept, so it still names the
// field. A machine-readable reason on the status (trie/error_reason.h) is sent as a
// google.rpc.ErrorInfo (domain "kvtrie.v1") in the status details: grpc::Status::error_details
// holds the serialized google.rpc.Status (code, message, that detail), which gRPC sends in the
// grpc-status-details-bin trailer (proto/google/rpc/error_details.proto lists the reasons).
#ifndef KVTRIE_SERVER_GRPC_STATUS_H_
#define KVTRIE_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvtrie {

grpc::Status ToGrpcStatus(const absl::Status& s);

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_GRPC_STATUS_H_
