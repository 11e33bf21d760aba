#include "client/status_reason.h"

#include "absl/strings/cord.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace kvtrie {

std::string StatusReason(const grpc::Status& s) {
  if (s.ok() || s.error_details().empty()) return "";
  google::rpc::Status details;
  if (!details.ParseFromString(s.error_details())) return "";
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::ErrorInfo info;
    if (any.Is<google::rpc::ErrorInfo>() && any.UnpackTo(&info) && info.domain() == "kvtrie.v1") {
      return info.reason();
    }
  }
  return "";
}

std::string StatusReason(const absl::Status& s) {
  const auto r = s.GetPayload(kStatusReasonUrl);  // absl::optional<absl::Cord>
  return r ? std::string(*r) : std::string();
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  if (const std::string reason = StatusReason(s); !reason.empty()) {
    out.SetPayload(kStatusReasonUrl, absl::Cord(reason));
  }
  return out;
}

}  // namespace kvtrie
