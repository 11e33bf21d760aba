#include "server/grpc_status.h"

#include <string>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "trie/error_reason.h"

namespace kvtrie {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(s.code());
  std::string message(s.message());
  const std::string reason = ErrorReason(s);
  if (reason.empty()) return grpc::Status(code, std::move(message));
  google::rpc::ErrorInfo info;
  info.set_reason(reason);
  info.set_domain("kvtrie.v1");
  google::rpc::Status details;
  details.set_code(static_cast<int32_t>(code));
  details.set_message(message);
  details.add_details()->PackFrom(info);
  return grpc::Status(code, std::move(message), details.SerializeAsString());
}

}  // namespace kvtrie
