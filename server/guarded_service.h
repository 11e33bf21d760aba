// server/guarded_service.h
//
// The service kvtrie-server registers: kvtrie.v1.KVCache with tenants, quotas and metrics around
// KvCacheService (which stays the one place that validates requests and talks to the store).
//
// For every call: the Authenticator (server/auth.h) decides the namespace from the caller's
// token and the request's `namespace` is replaced by it before KvCacheService sees it; then
//   Put    checks the namespace's quotas when its header arrives: put_streams (streams in
//          flight), stored_bytes (refused once the namespace stores at least that many bytes, so a
//          namespace may pass it by at most one Put) and nodes (refused if its nodes plus the
//          Put's new full blocks would pass it). A refusal is RESOURCE_EXHAUSTED naming the quota:
//          "quota nodes: namespace 'a' holds 60 nodes, this Put adds 8, its quota is 64".
//   Stats  of a tenant (not admin) is that of its own namespace, and the server-wide counters in
//          it (lookups, gets, puts, deletes, blocks stored / deduplicated) are replaced by that
//          namespace's own; the store-wide tier and eviction counters are zeroed.
//   Get    is registered as a split stream of grpc::ByteBuffer responses, so KvCacheService's
//          zero-copy sink (server/get_sink.h) frames them; a request that does not parse is
//          INVALID_ARGUMENT "request: did not parse ...", as for the other calls.
// Metrics (server/metrics.h) record each call's method, final code, latency and namespace.
//
// Thread-safe. `inner`, `auth`, `store` and `metrics` (may be null) must outlive it.
#ifndef KVTRIE_SERVER_GUARDED_SERVICE_H_
#define KVTRIE_SERVER_GUARDED_SERVICE_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "server/auth.h"
#include "server/kvcache_service.h"
#include "server/metrics.h"
#include "trie/kv_store.h"

namespace kvtrie {

class GuardedService final : public v1::KVCache::Service {
 public:
  GuardedService(KvCacheService* inner, const Authenticator* auth, KvStore* store,
                 Metrics* metrics);
  GuardedService(const GuardedService&) = delete;
  GuardedService& operator=(const GuardedService&) = delete;

  grpc::Status Lookup(grpc::ServerContext* context, const v1::LookupRequest* request,
                      v1::LookupResponse* response) override;
  grpc::Status Put(grpc::ServerContext* context, grpc::ServerReader<v1::PutRequest>* reader,
                   v1::PutResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::GetRequest* request,
                   grpc::ServerWriter<v1::GetResponse>* writer) override;
  grpc::Status Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                     v1::StatsResponse* response) override;
  grpc::Status Inspect(grpc::ServerContext* context, const v1::InspectRequest* request,
                       v1::InspectResponse* response) override;
  grpc::Status Delete(grpc::ServerContext* context, const v1::DeleteRequest* request,
                      v1::DeleteResponse* response) override;
  grpc::Status Pin(grpc::ServerContext* context, const v1::PinRequest* request,
                   v1::PinResponse* response) override;

 private:
  // Per-namespace call counters, kept for the namespaces of authorized tenants.
  struct NamespaceCounters {
    std::atomic<uint64_t> lookups{0}, lookup_hits{0}, gets{0}, puts{0}, deletes{0};
    std::atomic<uint64_t> blocks_stored{0}, blocks_deduplicated{0};
    std::atomic<int64_t> put_streams{0};
  };
  class PutReader;
  class GetWriter;
  static constexpr int kGetMethodIndex = 2;  // of Get in kvtrie.v1.KVCache (generated order)

  // Get as registered: the request read from the stream, the responses framed by hand.
  grpc::Status StreamedGet(grpc::ServerContext* context,
                           grpc::ServerSplitStreamer<v1::GetRequest, grpc::ByteBuffer>* stream);
  // Authorizes `request` (its namespace replaced by the caller's) and serves it into `sink`.
  grpc::Status GuardedGet(grpc::ServerContext* context, v1::GetRequest* request, GetSink* sink);

  // Authorizes, runs `body` with the resolved caller, records metrics. `body` returns the status.
  template <typename Body>
  grpc::Status Guard(const char* method, grpc::ServerContext* context,
                     const std::string& requested_ns, Body body);
  NamespaceCounters* CountersOf(const std::string& ns);
  // Put admission for `header` (already rewritten to caller.ns): quotas, streams in flight.
  grpc::Status AdmitPut(const Caller& caller, const v1::PutHeader& header);

  KvCacheService* const inner_;
  const Authenticator* const auth_;
  KvStore* const store_;
  Metrics* const metrics_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<NamespaceCounters>> counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_GUARDED_SERVICE_H_
