// server/metrics.h
//
// Prometheus metrics of a kvtrie server, served in the text format on `/metrics` of their own
// HTTP port (prometheus-cpp's pull exposer, --metrics_listen). What is exported:
//   kvtrie_rpc_requests_total{method,code,namespace}        calls by final gRPC status code
//   kvtrie_rpc_duration_seconds{method,namespace}           latency histogram (100 us .. 30 s)
//   kvtrie_tokens_asked_total / kvtrie_tokens_matched_total{namespace}   Lookup and Get
//   kvtrie_hit_ratio{namespace}                             matched / asked since start
//   kvtrie_put_streams_in_flight{namespace}                 Put streams open now
//   kvtrie_put_blocks_total{namespace,disposition}          stored, deduplicated,
//   residual_of_centroid kvtrie_put_bytes_logical_total / kvtrie_put_bytes_stored_total{namespace}
//   kvtrie_quota_rejections_total{namespace,quota}          RESOURCE_EXHAUSTED by a quota
//   kvtrie_auth_failures_total{code}                        UNAUTHENTICATED / PERMISSION_DENIED
// and, read from KvStore::Stats() at each scrape:
//   kvtrie_nodes, kvtrie_bytes_logical, kvtrie_bytes_stored, kvtrie_centroids,
//   kvtrie_residual_nodes, kvtrie_lossy_nodes, kvtrie_lossy_recoded_nodes, kvtrie_retained_nodes,
//   kvtrie_retained_bytes, kvtrie_pinned_nodes,
//   kvtrie_predictor_versions,
//   kvtrie_predictor_state_bytes, kvtrie_blocks_on_learned, kvtrie_predictor_bytes_saved
//   {namespace}; kvtrie_tier_nodes and
//   kvtrie_tier_bytes{tier=hot|cold,namespace}; kvtrie_disk_bytes; kvtrie_tier_budget_bytes{tier};
//   kvtrie_demotions_total, kvtrie_promotions_total, kvtrie_cold_reads_total,
//   kvtrie_evictions_total{reason=disk|data_loss|deleted}, kvtrie_pins_expired_total,
//   kvtrie_puts_rejected_total{reason=disk_full}, kvtrie_predictor_fits_total,
//   kvtrie_predictor_observations_dropped_total, kvtrie_centroids_reelected_total
//   (server-wide counters of the store).
// Cardinality: at most `max_namespaces` namespace label values (the tokens file's namespaces
// first, then the first ones seen); the rest are counted under namespace="other". The empty
// namespace is labelled "(default)". Store gauges of "other" are the total minus the named ones.
// With a shard name (--shard_name, default $POD_NAME) every kvtrie_* sample also carries
// shard="NAME" (one server of several: README "Running more than one server").
//
// Thread-safe.
#ifndef KVTRIE_SERVER_METRICS_H_
#define KVTRIE_SERVER_METRICS_H_

#include <grpcpp/support/status.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvtrie/v1/kvtrie.pb.h"
#include "trie/kv_store.h"

namespace prometheus {
class Exposer;
}

namespace kvtrie {

// Maps namespaces to a bounded set of label values.
class NamespaceLabels {
 public:
  explicit NamespaceLabels(size_t max_namespaces) : max_(max_namespaces) {}
  // `ns` itself ("(default)" for "") while fewer than max_namespaces are named, else "other".
  std::string Label(const std::string& ns);
  std::vector<std::string> Named() const;  // the namespaces that have their own label

 private:
  const size_t max_;
  mutable absl::Mutex mu_;
  std::set<std::string> named_ ABSL_GUARDED_BY(mu_);
};

class Metrics {
 public:
  // `store` must outlive the Metrics.
  Metrics(KvStore* store, size_t max_namespaces);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves /metrics on `address` (HOST:PORT; port 0 picks one). Errors: UNAVAILABLE if it cannot
  // bind. Returns the bound port.
  absl::StatusOr<int> Listen(const std::string& address);

  // Adds shard="`name`" to every sample (--shard_name); call before Listen. Empty: no label.
  void SetShardName(const std::string& name);

  // Gives `namespaces` their own label first (the tokens file's), up to the cap.
  void NameNamespaces(const std::vector<std::string>& namespaces);

  // `ns` null: the call was refused before it had a namespace (labelled "other").
  void RecordCall(const char* method, const std::string* ns, grpc::StatusCode code, double seconds);
  void RecordMatch(const std::string& ns, uint64_t asked, uint64_t matched);
  void RecordPut(const std::string& ns, const v1::PutResponse& response);
  void RecordQuotaRejection(const std::string& ns, const char* quota);
  void RecordAuthFailure(grpc::StatusCode code);
  void AddPutStreams(const std::string& ns, int delta);

  prometheus::Registry& registry() { return *registry_; }

 private:
  class StoreCollector;
  class ShardLabelled;
  std::string shard_name_;  // set before Listen, then read-only
  std::vector<std::shared_ptr<prometheus::Collectable>> labelled_;  // registered by Listen
  NamespaceLabels labels_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StoreCollector> store_collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& durations_;
  prometheus::Family<prometheus::Counter>& tokens_asked_;
  prometheus::Family<prometheus::Counter>& tokens_matched_;
  prometheus::Family<prometheus::Gauge>& hit_ratio_;
  prometheus::Family<prometheus::Gauge>& put_streams_;
  prometheus::Family<prometheus::Counter>& put_blocks_;
  prometheus::Family<prometheus::Counter>& put_bytes_logical_;
  prometheus::Family<prometheus::Counter>& put_bytes_stored_;
  prometheus::Family<prometheus::Counter>& quota_rejections_;
  prometheus::Family<prometheus::Counter>& auth_failures_;
};

// The gRPC code's canonical name ("OK", "NOT_FOUND", ...).
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_METRICS_H_
