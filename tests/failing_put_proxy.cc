#include "tests/failing_put_proxy.h"

#include <atomic>
#include <vector>

#include "kvtrie/v1/kvtrie.grpc.pb.h"

namespace kvtrie::testing {

class FailingPutProxy::Service final : public v1::KVCache::Service {
 public:
  explicit Service(const FailingPutProxyOptions& options)
      : options_(options),
        stub_(v1::KVCache::NewStub(
            grpc::CreateChannel(options.target, grpc::InsecureChannelCredentials()))) {}

  grpc::Status Put(grpc::ServerContext* context, grpc::ServerReader<v1::PutRequest>* reader,
                   v1::PutResponse* response) override {
    std::vector<v1::PutRequest> messages;
    v1::PutRequest m;
    bool committed = false;
    while (reader->Read(&m)) {
      committed = committed || m.has_commit();
      messages.push_back(m);
    }
    const int n = puts_.fetch_add(1);
    if (!committed) return grpc::Status(grpc::StatusCode::CANCELLED, "proxy: no PutCommit");
    if (n < options_.put_failures) {
      return grpc::Status(options_.put_code,
                          "put: the prefix kept changing under concurrent Puts; retry");
    }
    grpc::ClientContext forward;
    CopyToken(*context, &forward);
    std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer(stub_->Put(&forward, response));
    for (const v1::PutRequest& r : messages) {
      if (!writer->Write(r)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status Lookup(grpc::ServerContext* context, const v1::LookupRequest* request,
                      v1::LookupResponse* response) override {
    if (lookups_.fetch_add(1) < options_.lookup_failures) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "proxy: not yet");
    }
    grpc::ClientContext forward;
    CopyToken(*context, &forward);
    return stub_->Lookup(&forward, *request, response);
  }

  grpc::Status Get(grpc::ServerContext* context, const v1::GetRequest* request,
                   grpc::ServerWriter<v1::GetResponse>* writer) override {
    gets_.fetch_add(1);
    if (request->node_id() != 0 && node_gets_.fetch_add(1) < options_.node_get_failures) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "node_id: " + std::to_string(request->node_id()) + " is not a node of '" +
                              request->model_id() + "'");
    }
    return Forward(
        *context, [&](grpc::ClientContext* c) { return stub_->Get(c, *request); }, writer);
  }

  grpc::Status GetPredictor(grpc::ServerContext* context, const v1::GetPredictorRequest* request,
                            grpc::ServerWriter<v1::PredictorChunk>* writer) override {
    return Forward(
        *context, [&](grpc::ClientContext* c) { return stub_->GetPredictor(c, *request); }, writer);
  }

  int puts() const { return puts_.load(); }
  int lookups() const { return lookups_.load(); }
  int gets() const { return gets_.load(); }

 private:
  static void CopyToken(const grpc::ServerContext& from, grpc::ClientContext* to) {
    auto it = from.client_metadata().find("authorization");
    if (it != from.client_metadata().end()) {
      to->AddMetadata("authorization", std::string(it->second.data(), it->second.size()));
    }
  }

  // A server stream (`open` starts it on the real server), forwarded message by message.
  template <typename Open, typename Response>
  static grpc::Status Forward(const grpc::ServerContext& context, Open open,
                              grpc::ServerWriter<Response>* writer) {
    grpc::ClientContext forward;
    CopyToken(context, &forward);
    std::unique_ptr<grpc::ClientReader<Response>> reader = open(&forward);
    Response m;
    while (reader->Read(&m)) {
      if (!writer->Write(m)) {
        forward.TryCancel();
        break;
      }
    }
    return reader->Finish();
  }

  const FailingPutProxyOptions options_;
  std::unique_ptr<v1::KVCache::Stub> stub_;
  std::atomic<int> puts_{0};
  std::atomic<int> lookups_{0};
  std::atomic<int> gets_{0};
  std::atomic<int> node_gets_{0};
};

absl::StatusOr<std::unique_ptr<FailingPutProxy>> FailingPutProxy::Start(
    const FailingPutProxyOptions& options) {
  std::unique_ptr<FailingPutProxy> p(new FailingPutProxy());
  p->service_ = std::make_unique<Service>(options);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &p->port_);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.RegisterService(p->service_.get());
  p->server_ = builder.BuildAndStart();
  if (p->server_ == nullptr || p->port_ == 0) {
    return absl::InternalError("proxy: cannot listen on " + options.listen);
  }
  return p;
}

FailingPutProxy::~FailingPutProxy() {
  if (server_ != nullptr) server_->Shutdown();
}

int FailingPutProxy::puts() const { return service_->puts(); }
int FailingPutProxy::lookups() const { return service_->lookups(); }
int FailingPutProxy::gets() const { return service_->gets(); }
void FailingPutProxy::Wait() { server_->Wait(); }

}  // namespace kvtrie::testing
