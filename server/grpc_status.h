// server/grpc_status.h
//
// The one place where library errors (absl::Status) become gRPC statuses. Codes map one to one
// (absl and gRPC share the canonical code numbering); the message is kept, so it still names the
// field.
#ifndef KVTRIE_SERVER_GRPC_STATUS_H_
#define KVTRIE_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace kvtrie {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_GRPC_STATUS_H_
