#include "server/parse_failure_interceptor.h"

#include <grpcpp/support/status.h>

namespace kvtrie {
namespace {

using grpc::experimental::InterceptionHookPoints;

class ParseFailureInterceptor final : public grpc::experimental::Interceptor {
 public:
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      parse_failed_ = true;
    }
    if (parse_failed_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        methods->GetSendStatus().error_code() == grpc::StatusCode::INTERNAL &&
        methods->GetSendStatus().error_message().empty()) {
      methods->ModifySendStatus(
          grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                       "request: did not parse (proto3 string fields such as namespace and "
                       "model_id must be valid UTF-8)"));
    }
    methods->Proceed();
  }

 private:
  bool parse_failed_ = false;
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // Only requests that gRPC deserializes before the handler runs (one request message).
    const auto type = info->type();
    if (type != grpc::experimental::ServerRpcInfo::Type::UNARY &&
        type != grpc::experimental::ServerRpcInfo::Type::SERVER_STREAMING) {
      return nullptr;
    }
    return new ParseFailureInterceptor;
  }
};

}  // namespace

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
MakeParseFailureInterceptors() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
  v.push_back(std::make_unique<Factory>());
  return v;
}

}  // namespace kvtrie
