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
//   Get    responses are framed by hand (server/get_sink.h: FrameGetBlock) into grpc::ByteBuffers
//          whose payload slices point at the stored (or decoded) buffers, so they go out uncopied.
//   GetPredictor  only the caller's own namespace's learned states (the namespace is replaced
//          like every call's), so no tenant can fetch a table learned from another's prompts.
// A request that does not parse (e.g. invalid UTF-8 in a proto3 string field) is
// INVALID_ARGUMENT "request: did not parse ..." (every method but Put takes its request as raw
// bytes and parses it here; a Put message that does not parse ends its stream, which
// KvCacheService names). Metrics (server/metrics.h) record each call's method, final code,
// latency and namespace.
//
// Threads: gRPC's callback API. No call holds a thread while it waits for its client: Put is a
// read reactor that asks for its next message only when the last one is handled, Get and
// GetPredictor write reactors with one message on the wire while the next one is made, and a Put
// waiting for memory (--put_wait_for_memory_seconds) is called back when it fits
// (PutLimits::Stream::ReserveWholeAsync). The work of every call (parsing, the store, encoding
// at a Put's commit, decoding a Get's blocks on their chain) runs on a pool of
// `handler_threads`, never on gRPC's own threads, whose callbacks only hand steps over; each
// call's steps run one at a time, in order. So open streams cost memory, not threads: a
// stalled client holds its Put's slot and bytes (until the idle deadline) but no thread.
//
// Limits of the streams (issue 18):
//   Put    one peer holds at most its share of the Put-stream slots (PutLimits): the peer is the
//          tenant when the call's token names one, else the client's host (gRPC's peer address
//          without its port, e.g. "ipv4:10.1.2.3").
//   Get, GetPredictor  a stream whose client reads nothing (a write outstanding) for
//          `get_idle_timeout` is cancelled (CANCELLED) and what it holds released: its store
//          snapshot, the payloads of the blocks not yet sent. A Get open longer than
//          `get_max_snapshot_age` ends ABORTED naming --get_max_snapshot_seconds after the
//          message on the wire: its RocksDB snapshot keeps every payload deleted or evicted since
//          it began on disk, so a slow reader cannot hold the --disk_bytes bound hostage (the
//          reader is cut, never the budget). With a disk budget the disk bound is also a space
//          rule: every ~50 ms the watchdog measures the data folder (KvStore::DataFolderBytes),
//          and while it is at `get_cut_folder_bytes` or more (2 x --disk_bytes + 2 MiB, a whole
//          --disk_bytes under the bound 3 x --disk_bytes + 2 MiB) it ends every Get holding a
//          snapshot, the oldest first (each snapshot keeps the payloads deleted or evicted since
//          it began; the spikes past the line, garbage collections relocating the live blobs, are
//          short, so one check must free them all), ABORTED naming the folder and the bound after
//          the message on the wire. Gets younger than 100 ms are left be. One watchdog thread
//          checks all three (when any is set).
//   Messages  a request larger than `max_message_bytes` is RESOURCE_EXHAUSTED naming its size
//          and the limit (a Put's names what to send instead: server/put_call.h).
//
// Thread-safe. `inner`, `auth`, `store` and `metrics` (may be null) must outlive it; the server
// must be shut down (every call done) before it is destroyed.
#ifndef KVTRIE_SERVER_GUARDED_SERVICE_H_
#define KVTRIE_SERVER_GUARDED_SERVICE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "codec/task_pool.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "server/auth.h"
#include "server/kvcache_service.h"
#include "server/metrics.h"
#include "trie/kv_store.h"

namespace kvtrie {

// kvtrie.v1.KVCache with every method on the callback API; raw (grpc::ByteBuffer) messages but
// for Put's requests.
using GuardedServiceBase = v1::KVCache::WithRawCallbackMethod_Lookup<
    v1::KVCache::WithCallbackMethod_Put<v1::KVCache::WithRawCallbackMethod_Get<
        v1::KVCache::WithRawCallbackMethod_Stats<v1::KVCache::WithRawCallbackMethod_Inspect<
            v1::KVCache::WithRawCallbackMethod_Delete<v1::KVCache::WithRawCallbackMethod_Pin<
                v1::KVCache::WithRawCallbackMethod_GetPredictor<v1::KVCache::Service>>>>>>>>;

struct GuardedServiceOptions {
  int handler_threads = 8;  // run the calls' work (see the top of this file); at least 1
  absl::Duration get_idle_timeout = absl::ZeroDuration();      // 0 = none
  absl::Duration get_max_snapshot_age = absl::ZeroDuration();  // 0 = none
  uint64_t max_message_bytes = 0;                              // 0 = none
  // The data folder's size from which Gets are cut (see the top of this file); 0 = none.
  uint64_t get_cut_folder_bytes = 0;
  uint64_t folder_bound_bytes = 0;  // the bound it protects (named in the Gets' status)
};

class GuardedService final : public GuardedServiceBase {
 public:
  GuardedService(KvCacheService* inner, const Authenticator* auth, KvStore* store, Metrics* metrics,
                 const GuardedServiceOptions& options);
  ~GuardedService() override;
  GuardedService(const GuardedService&) = delete;
  GuardedService& operator=(const GuardedService&) = delete;

  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerReadReactor<v1::PutRequest>* Put(grpc::CallbackServerContext* context,
                                               v1::PutResponse* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Get(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Inspect(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Pin(grpc::CallbackServerContext* context,
                                const grpc::ByteBuffer* request,
                                grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetPredictor(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;

  // Waits for the steps still queued and stops the handler threads (after the server's
  // Shutdown and Wait; before the store closes).
  void StopHandlers();

 private:
  // Per-namespace call counters, kept for the namespaces of authorized tenants.
  struct NamespaceCounters {
    std::atomic<uint64_t> lookups{0}, lookup_hits{0}, gets{0}, puts{0}, deletes{0};
    std::atomic<uint64_t> blocks_stored{0}, blocks_deduplicated{0};
    std::atomic<int64_t> put_streams{0};
  };
  class Strand;
  class PutReactor;
  class WriteReactor;
  class GetReactor;
  class PredictorReactor;

  // INVALID_ARGUMENT "request: did not parse ...".
  static grpc::Status NotParsed();
  // RESOURCE_EXHAUSTED when `request` is larger than max_message_bytes.
  grpc::Status CheckSize(const grpc::ByteBuffer& request) const;
  // The open write streams, for the watchdog: one is added at its first step and removed at its
  // OnDone, before it may be deleted.
  void AddWriter(WriteReactor* writer);
  void RemoveWriter(WriteReactor* writer);
  void WatchLoop();
  // The peer a Put stream is counted against (see the top of this file).
  std::string PeerOf(const grpc::CallbackServerContext& context) const;
  // A unary call: parses `request` as Req, runs `body(caller, &req, &resp)` under Guard on the
  // handler pool, serializes the response and finishes.
  template <typename Req, typename Resp, typename Body>
  grpc::ServerUnaryReactor* Unary(const char* method, grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                  Body body);
  // Authorizes, runs `body` with the resolved caller, records metrics. `body` returns the status.
  template <typename Body>
  grpc::Status Guard(const char* method, grpc::ServerContextBase* context,
                     const std::string& requested_ns, Body body);
  NamespaceCounters* CountersOf(const std::string& ns);
  // Put admission for `header` (already rewritten to caller.ns): quotas, streams in flight.
  grpc::Status AdmitPut(const Caller& caller, const v1::PutHeader& header);

  KvCacheService* const inner_;
  const Authenticator* const auth_;
  KvStore* const store_;
  Metrics* const metrics_;
  const GuardedServiceOptions options_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<NamespaceCounters>> counters_ ABSL_GUARDED_BY(mu_);
  absl::Mutex writers_mu_;
  // Every Get and GetPredictor reactor gRPC has not released (OnDone).
  absl::flat_hash_set<WriteReactor*> writers_ ABSL_GUARDED_BY(writers_mu_);
  bool stop_watch_ ABSL_GUARDED_BY(writers_mu_) = false;
  std::thread watchdog_;                // WatchLoop, when a Get limit or the folder rule is set
  std::unique_ptr<TaskPool> handlers_;  // the calls' work (StopHandlers resets it)
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_GUARDED_SERVICE_H_
