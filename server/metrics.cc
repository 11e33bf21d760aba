#include "server/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <exception>
#include <map>

#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {

constexpr char kOther[] = "other";

std::string NsValue(const std::string& ns) { return ns.empty() ? "(default)" : ns; }

prometheus::ClientMetric Sample(double value, bool counter,
                                std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  (counter ? m.counter.value : m.gauge.value) = value;
  return m;
}

}  // namespace

const char* StatusCodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  const int c = static_cast<int>(code);
  return c >= 0 && c < 17 ? kNames[c] : "UNKNOWN";
}

std::string NamespaceLabels::Label(const std::string& ns) {
  absl::MutexLock lock(&mu_);
  if (named_.count(ns)) return NsValue(ns);
  if (named_.size() < max_) {
    named_.insert(ns);
    return NsValue(ns);
  }
  return kOther;
}

std::vector<std::string> NamespaceLabels::Named() const {
  absl::MutexLock lock(&mu_);
  return {named_.begin(), named_.end()};
}

// Reads the store's numbers at each scrape (KvStore::Stats, its public API).
class Metrics::StoreCollector final : public prometheus::Collectable {
 public:
  StoreCollector(KvStore* store, const NamespaceLabels* labels) : store_(store), labels_(labels) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    struct Row {
      std::string label;
      StoreStats stats;
    };
    const StoreStats total = store_->Stats("");
    std::vector<Row> rows;
    StoreStats rest = total;  // "other": the total minus the named namespaces
    for (const std::string& ns : labels_->Named()) {
      StoreStats s = store_->Stats(ns);
      if (ns.empty()) {  // Stats("") is the whole server; the default namespace is not listed
        continue;
      }
      auto sub = [](uint64_t& a, uint64_t b) { a = a >= b ? a - b : 0; };
      sub(rest.nodes, s.nodes);
      sub(rest.bytes_logical, s.bytes_logical);
      sub(rest.bytes_stored, s.bytes_stored);
      sub(rest.hot_nodes, s.hot_nodes);
      sub(rest.hot_bytes, s.hot_bytes);
      sub(rest.cold_nodes, s.cold_nodes);
      sub(rest.cold_bytes, s.cold_bytes);
      sub(rest.pinned_nodes, s.pinned_nodes);
      sub(rest.cluster.centroids, s.cluster.centroids);
      sub(rest.cluster.residual_nodes, s.cluster.residual_nodes);
      sub(rest.lossy_nodes, s.lossy_nodes);
      sub(rest.lossy_recoded_nodes, s.lossy_recoded_nodes);
      sub(rest.retained_nodes, s.retained_nodes);
      sub(rest.retained_bytes, s.retained_bytes);
      rows.push_back({NsValue(ns), std::move(s)});
    }
    rows.push_back({kOther, rest});

    std::vector<prometheus::MetricFamily> out;
    auto family = [&](const char* name, const char* help, MetricType type) {
      out.push_back({name, help, type, {}});
      return &out.back().metric;
    };
    auto per_ns = [&](const char* name, const char* help, auto get) {
      auto* m = family(name, help, MetricType::Gauge);
      for (const Row& r : rows) {
        m->push_back(Sample(static_cast<double>(get(r.stats)), false, {{"namespace", r.label}}));
      }
    };
    per_ns("kvtrie_nodes", "Trie nodes (stored blocks).",
           [](const StoreStats& s) { return s.nodes; });
    per_ns("kvtrie_bytes_logical", "Dense KV bytes the stored nodes stand for.",
           [](const StoreStats& s) { return s.bytes_logical; });
    per_ns("kvtrie_bytes_stored", "Encoded payload bytes stored.",
           [](const StoreStats& s) { return s.bytes_stored; });
    per_ns("kvtrie_centroids", "Nodes that near-duplicates are coded against.",
           [](const StoreStats& s) { return s.cluster.centroids; });
    per_ns("kvtrie_residual_nodes", "Nodes stored as a residual of a centroid.",
           [](const StoreStats& s) { return s.cluster.residual_nodes; });
    per_ns("kvtrie_lossy_nodes",
           "Nodes whose reconstruction is not what their Put sent, however they are coded now.",
           [](const StoreStats& s) { return s.lossy_nodes; });
    per_ns("kvtrie_lossy_recoded_nodes",
           "Lossy nodes stored LOSSLESS now (their reconstruction, e.g. against a centroid).",
           [](const StoreStats& s) { return s.lossy_recoded_nodes; });
    per_ns("kvtrie_retained_nodes",
           "Nodes of deleted prefixes kept as the centroids of lossy near-duplicates.",
           [](const StoreStats& s) { return s.retained_nodes; });
    per_ns("kvtrie_retained_bytes", "Payload bytes of the retained nodes (in bytes_stored too).",
           [](const StoreStats& s) { return s.retained_bytes; });
    per_ns("kvtrie_pinned_nodes", "Nodes pinned against eviction.",
           [](const StoreStats& s) { return s.pinned_nodes; });
    per_ns("kvtrie_predictor_versions", "Learned predictor state versions kept.",
           [](const StoreStats& s) { return s.predictor_versions; });
    per_ns("kvtrie_predictor_state_bytes", "Serialized bytes of the learned predictor states kept.",
           [](const StoreStats& s) { return s.predictor_state_bytes; });
    per_ns("kvtrie_blocks_on_learned", "Stored blocks coded against a learned predictor state.",
           [](const StoreStats& s) { return s.blocks_on_learned; });
    per_ns("kvtrie_predictor_bytes_saved",
           "Estimated bytes the learned predictors saved on the blocks stored since start.",
           [](const StoreStats& s) { return s.predictor_bytes_saved; });
    {
      auto* nodes =
          family("kvtrie_tier_nodes", "Nodes whose payload is in the tier.", MetricType::Gauge);
      auto* bytes = family("kvtrie_tier_bytes",
                           "Payload bytes in the tier (hot = memory, cold = "
                           "only in RocksDB).",
                           MetricType::Gauge);
      for (const Row& r : rows) {
        nodes->push_back(
            Sample(r.stats.hot_nodes, false, {{"namespace", r.label}, {"tier", "hot"}}));
        nodes->push_back(
            Sample(r.stats.cold_nodes, false, {{"namespace", r.label}, {"tier", "cold"}}));
        bytes->push_back(
            Sample(r.stats.hot_bytes, false, {{"namespace", r.label}, {"tier", "hot"}}));
        bytes->push_back(
            Sample(r.stats.cold_bytes, false, {{"namespace", r.label}, {"tier", "cold"}}));
      }
    }
    family("kvtrie_disk_bytes", "Payload bytes in RocksDB (hot and cold; written through).",
           MetricType::Gauge)
        ->push_back(Sample(total.disk_bytes, false, {}));
    {
      auto* m =
          family("kvtrie_tier_budget_bytes", "Tier budgets (0 = unbounded).", MetricType::Gauge);
      m->push_back(Sample(total.memory_budget_bytes, false, {{"tier", "hot"}}));
      m->push_back(Sample(total.disk_budget_bytes, false, {{"tier", "cold"}}));
    }
    auto counter = [&](const char* name, const char* help, uint64_t v) {
      family(name, help, MetricType::Counter)->push_back(Sample(v, true, {}));
    };
    counter("kvtrie_demotions_total", "Payloads moved out of memory for the memory budget.",
            total.demotions);
    counter("kvtrie_promotions_total", "Cold payloads brought back into memory.", total.promotions);
    counter("kvtrie_cold_reads_total", "Payloads read from RocksDB.", total.cold_reads);
    counter("kvtrie_pins_expired_total", "Pins whose TTL ran out.", total.pins_expired);
    counter("kvtrie_centroids_reelected_total",
            "Centroids deleted or evicted whose members elected a new centroid among them.",
            total.centroids_reelected);
    counter("kvtrie_cluster_pass_recoded_total",
            "Standalone blocks the background cluster pass re-encoded as residuals of their "
            "group's centroid.",
            total.cluster_pass_recoded);
    counter("kvtrie_cluster_pass_bytes_saved_total",
            "Payload bytes the background cluster pass saved.", total.cluster_pass_bytes_saved);
    counter("kvtrie_cluster_pass_reelected_total",
            "Centroids the background cluster pass moved to the group's most probable member.",
            total.cluster_pass_reelected);
    counter("kvtrie_predictor_fits_total", "Learned predictor state versions published.",
            total.predictor_fits);
    counter("kvtrie_predictor_observations_dropped_total",
            "Committed blocks not learned from: not in their Put's sample (the learning queue's "
            "room, --learn_queue_bytes).",
            total.predictor_observations_dropped);
    {
      auto* m = family("kvtrie_evictions_total", "Nodes removed, by reason.", MetricType::Counter);
      m->push_back(Sample(total.evictions_disk, true, {{"reason", "disk"}}));
      m->push_back(Sample(total.evictions_data_loss, true, {{"reason", "data_loss"}}));
      m->push_back(Sample(total.evictions_deleted, true, {{"reason", "deleted"}}));
    }
    family("kvtrie_puts_rejected_total", "Puts refused by the store, by reason.",
           MetricType::Counter)
        ->push_back(Sample(total.puts_rejected_disk_full, true, {{"reason", "disk_full"}}));
    return out;
  }

 private:
  KvStore* const store_;
  const NamespaceLabels* const labels_;
};

Metrics::Metrics(KvStore* store, size_t max_namespaces)
    : labels_(max_namespaces),
      registry_(std::make_shared<prometheus::Registry>()),
      store_collector_(std::make_shared<StoreCollector>(store, &labels_)),
      requests_(prometheus::BuildCounter()
                    .Name("kvtrie_rpc_requests_total")
                    .Help("kvtrie.v1.KVCache calls, by method and final status code.")
                    .Register(*registry_)),
      durations_(prometheus::BuildHistogram()
                     .Name("kvtrie_rpc_duration_seconds")
                     .Help("kvtrie.v1.KVCache call latency, from the call's start to its status.")
                     .Register(*registry_)),
      tokens_asked_(prometheus::BuildCounter()
                        .Name("kvtrie_tokens_asked_total")
                        .Help("Token ids sent to Lookup and Get.")
                        .Register(*registry_)),
      tokens_matched_(prometheus::BuildCounter()
                          .Name("kvtrie_tokens_matched_total")
                          .Help("Tokens of a stored prefix that Lookup and Get matched.")
                          .Register(*registry_)),
      hit_ratio_(prometheus::BuildGauge()
                     .Name("kvtrie_hit_ratio")
                     .Help("Tokens matched / tokens asked since start (Lookup and Get).")
                     .Register(*registry_)),
      put_streams_(prometheus::BuildGauge()
                       .Name("kvtrie_put_streams_in_flight")
                       .Help("Put streams open now.")
                       .Register(*registry_)),
      put_blocks_(prometheus::BuildCounter()
                      .Name("kvtrie_put_blocks_total")
                      .Help("Blocks of committed Puts, by disposition.")
                      .Register(*registry_)),
      put_bytes_logical_(prometheus::BuildCounter()
                             .Name("kvtrie_put_bytes_logical_total")
                             .Help("Dense KV bytes of committed Puts' blocks.")
                             .Register(*registry_)),
      put_bytes_stored_(prometheus::BuildCounter()
                            .Name("kvtrie_put_bytes_stored_total")
                            .Help("Encoded bytes newly stored by committed Puts.")
                            .Register(*registry_)),
      quota_rejections_(prometheus::BuildCounter()
                            .Name("kvtrie_quota_rejections_total")
                            .Help("Calls answered RESOURCE_EXHAUSTED by a namespace quota.")
                            .Register(*registry_)),
      auth_failures_(prometheus::BuildCounter()
                         .Name("kvtrie_auth_failures_total")
                         .Help("Calls refused by authentication or authorization.")
                         .Register(*registry_)) {
  // Zero from the start, so rate() over them works before the first refusal.
  for (grpc::StatusCode c :
       {grpc::StatusCode::UNAUTHENTICATED, grpc::StatusCode::PERMISSION_DENIED}) {
    auth_failures_.Add({{"code", StatusCodeName(c)}});
  }
}

Metrics::~Metrics() = default;

// Every sample of `inner` with shard="NAME" added (--shard_name): one scrape config over all the
// StatefulSet's pods keeps them apart, and a dashboard sums or splits by shard.
class Metrics::ShardLabelled : public prometheus::Collectable {
 public:
  ShardLabelled(std::shared_ptr<prometheus::Collectable> inner, std::string shard)
      : inner_(std::move(inner)), shard_(std::move(shard)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families = inner_->Collect();
    for (prometheus::MetricFamily& f : families) {
      for (prometheus::ClientMetric& m : f.metric) m.label.push_back({"shard", shard_});
    }
    return families;
  }

 private:
  const std::shared_ptr<prometheus::Collectable> inner_;
  const std::string shard_;
};

void Metrics::SetShardName(const std::string& name) { shard_name_ = name; }

absl::StatusOr<int> Metrics::Listen(const std::string& address) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: cannot serve on ", address, ": ", e.what()));
  }
  if (shard_name_.empty()) {
    exposer_->RegisterCollectable(registry_);
    exposer_->RegisterCollectable(store_collector_);
  } else {
    for (std::shared_ptr<prometheus::Collectable> c :
         std::initializer_list<std::shared_ptr<prometheus::Collectable>>{registry_,
                                                                         store_collector_}) {
      // The exposer holds a weak_ptr: labelled_ keeps the wrappers alive.
      labelled_.push_back(std::make_shared<ShardLabelled>(std::move(c), shard_name_));
      exposer_->RegisterCollectable(labelled_.back());
    }
  }
  const std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError("--metrics_listen: no port bound");
  return ports.front();
}

void Metrics::NameNamespaces(const std::vector<std::string>& namespaces) {
  for (const std::string& ns : namespaces) labels_.Label(ns);
}

void Metrics::RecordCall(const char* method, const std::string* ns, grpc::StatusCode code,
                         double seconds) {
  const std::string label = ns == nullptr ? std::string(kOther) : labels_.Label(*ns);
  requests_.Add({{"method", method}, {"code", StatusCodeName(code)}, {"namespace", label}})
      .Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
  durations_.Add({{"method", method}, {"namespace", label}}, kBuckets).Observe(seconds);
}

void Metrics::RecordMatch(const std::string& ns, uint64_t asked, uint64_t matched) {
  const std::string label = labels_.Label(ns);
  prometheus::Counter& a = tokens_asked_.Add({{"namespace", label}});
  prometheus::Counter& m = tokens_matched_.Add({{"namespace", label}});
  a.Increment(static_cast<double>(asked));
  m.Increment(static_cast<double>(matched));
  if (a.Value() > 0) hit_ratio_.Add({{"namespace", label}}).Set(m.Value() / a.Value());
}

void Metrics::RecordPut(const std::string& ns, const v1::PutResponse& response) {
  const std::string label = labels_.Label(ns);
  uint64_t logical = 0, stored = 0;
  std::map<std::string, uint64_t> by;
  for (const v1::BlockResult& b : response.blocks()) {
    logical += b.bytes_logical();
    stored += b.bytes_stored();
    by[b.disposition() == v1::BLOCK_STORED                 ? "stored"
       : b.disposition() == v1::BLOCK_RESIDUAL_OF_CENTROID ? "residual_of_centroid"
                                                           : "deduplicated"]++;
  }
  for (const auto& [disposition, n] : by) {
    put_blocks_.Add({{"namespace", label}, {"disposition", disposition}})
        .Increment(static_cast<double>(n));
  }
  put_bytes_logical_.Add({{"namespace", label}}).Increment(static_cast<double>(logical));
  put_bytes_stored_.Add({{"namespace", label}}).Increment(static_cast<double>(stored));
}

void Metrics::RecordQuotaRejection(const std::string& ns, const char* quota) {
  quota_rejections_.Add({{"namespace", labels_.Label(ns)}, {"quota", quota}}).Increment();
}

void Metrics::RecordAuthFailure(grpc::StatusCode code) {
  auth_failures_.Add({{"code", StatusCodeName(code)}}).Increment();
}

void Metrics::AddPutStreams(const std::string& ns, int delta) {
  put_streams_.Add({{"namespace", labels_.Label(ns)}}).Increment(delta);
}

}  // namespace kvtrie
