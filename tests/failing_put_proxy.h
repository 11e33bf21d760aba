// tests/failing_put_proxy.h
//
// A KVCache server on a loopback port for the clients' retry tests: it fails the first
// `put_failures` Puts with `put_code` and forwards every later Put to a real kvtrie-server, and
// answers the first `lookup_failures` Lookups UNAVAILABLE and forwards the rest. A failed Put is
// read whole, its PutCommit included, and nothing of it is forwarded — as the real server ends a
// Put ABORTED ("the prefix kept changing under concurrent Puts; retry") at its commit, having
// stored nothing. Gets (but the first `node_get_failures` of a node by id) and GetPredictor are
// forwarded. The bearer token is forwarded; other calls are UNIMPLEMENTED (tests read back from
// the real server).
// Thread-safe.
#ifndef KVTRIE_TESTS_FAILING_PUT_PROXY_H_
#define KVTRIE_TESTS_FAILING_PUT_PROXY_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvtrie::testing {

struct FailingPutProxyOptions {
  std::string target;  // the real server, HOST:PORT
  int put_failures = 0;
  grpc::StatusCode put_code = grpc::StatusCode::ABORTED;
  int lookup_failures = 0;  // answered UNAVAILABLE
  // The first Gets of a node by id (GetRequest.node_id: a client fetching a centroid) answered
  // NOT_FOUND, as the server answers once that node is deleted.
  int node_get_failures = 0;
  std::string listen = "127.0.0.1:0";
};

class FailingPutProxy {
 public:
  // Errors: INTERNAL if it cannot listen on options.listen.
  static absl::StatusOr<std::unique_ptr<FailingPutProxy>> Start(
      const FailingPutProxyOptions& options);
  ~FailingPutProxy();  // shuts the server down
  FailingPutProxy(const FailingPutProxy&) = delete;
  FailingPutProxy& operator=(const FailingPutProxy&) = delete;

  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  int puts() const;     // Puts received, failed ones included
  int lookups() const;  // Lookups received, failed ones included
  int gets() const;     // Gets received, failed ones included
  void Wait();          // until the server shuts down

 private:
  class Service;
  FailingPutProxy() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace kvtrie::testing

#endif  // KVTRIE_TESTS_FAILING_PUT_PROXY_H_
