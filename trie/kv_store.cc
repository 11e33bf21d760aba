#include "trie/kv_store.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <map>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "trie/cluster_pass.h"
#include "trie/cluster_policy.h"
#include "trie/kv_store_testing.h"
#include "trie/model_shard.h"
#include "trie/record_store.h"
#include "trie/shard_learning.h"
#include "trie/tier_manager.h"

namespace kvtrie {

class KvStore::Impl {
 public:
  explicit Impl(const StoreOptions& options) : options_(options) {}
  ~Impl() {
    if (cluster_pass_) cluster_pass_->Stop();  // its rounds use the shards
    if (tiers_) tiers_->StopBackground();
    if (learn_queue_) learn_queue_->Stop();  // its jobs use the shards
    shards_.clear();
    tiers_.reset();
    records_.reset();  // flushes and closes RocksDB
  }

  absl::Status Open();
  // The shard of (ns, model_id), or null.
  ModelShard* Find(const std::string& ns, const std::string& model_id);
  // The shard of (ns, model.model_id), created (uncommitted) if missing.
  ModelShard* FindOrCreate(const std::string& ns, const ModelInfo& model);
  // The shards of `ns`; all of them when `ns` is empty and `all_if_empty`.
  std::vector<ModelShard*> ShardsOf(const std::string& ns, bool all_if_empty = true);
  StoreStats StatsOf(const std::string& ns, bool all_if_empty);
  // Evicts leaves of any shard until `incoming` more bytes fit. Holds no lock across shards.
  absl::Status MakeDiskRoom(uint64_t incoming);
  // Collects blob garbage when the folder holds much more than the payloads (the files of
  // evicted payloads), so the folder stays within RecordStore::FolderBound.
  void CollectGarbageIfNeeded() {
    if (!gc_mu_.TryLock()) return;  // another thread is collecting
    absl::Cleanup unlock = [this] { gc_mu_.Unlock(); };
    const uint64_t usage = records_->DiskUsage(), payload = tiers_->stored_bytes();
    if (usage > payload + options_.disk_bytes / 4) {
      if (absl::Status s = records_->CollectGarbage(); !s.ok()) spdlog::error("{}", s.ToString());
    }
  }

  const StoreOptions options_;
  RecoveryStats recovery_;
  std::unique_ptr<RecordStore> records_;
  std::unique_ptr<TierManager> tiers_;
  std::unique_ptr<LearnQueue> learn_queue_;    // null when learning is off
  std::unique_ptr<TaskPool> codec_pool_;       // Put encodes; outlives every PutSession
  std::unique_ptr<ClusterPass> cluster_pass_;  // the background cluster pass (its own thread)
  ShardContext context_;
  absl::Mutex gc_mu_;  // one CollectGarbageIfNeeded at a time
  std::atomic<uint64_t> evicted_since_check_{0};
  std::atomic<uint64_t> lookups_unrouted_{0}, gets_unrouted_{0};  // for no stored model

 private:
  using ShardKey = std::pair<std::string, std::string>;  // (namespace, model_id)
  absl::Mutex shards_mu_;                                // taken alone, only to find or add a shard
  std::map<ShardKey, std::unique_ptr<ModelShard>> shards_ ABSL_GUARDED_BY(shards_mu_);
  uint64_t next_shard_id_ ABSL_GUARDED_BY(shards_mu_) = 1;
};

absl::Status KvStore::Impl::Open() {
  RecordStore::Options ro;
  ro.data_dir = options_.data_dir;
  ro.sync = options_.sync;
  ro.memtable_bytes = options_.memtable_bytes;
  ro.disk_bytes = options_.disk_bytes;
  ro.env = options_.env;
  absl::StatusOr<std::unique_ptr<RecordStore>> records = RecordStore::Open(ro);
  if (!records.ok()) return records.status();
  records_ = *std::move(records);
  TierManager::Options to;
  to.memory_bytes = options_.memory_bytes;
  to.disk_bytes = options_.disk_bytes;
  to.promote_after_cold_reads = options_.promote_after_cold_reads;
  to.now_seconds = options_.now_seconds;
  tiers_ = std::make_unique<TierManager>(to);
  context_.options = &options_;
  context_.records = records_.get();
  context_.tiers = tiers_.get();
  context_.make_disk_room = [this](uint64_t incoming) { return MakeDiskRoom(incoming); };
  if (options_.predictors.learn) {
    learn_queue_ = std::make_unique<LearnQueue>(options_.predictors.queue_bytes);
    context_.learn_queue = learn_queue_.get();
  }
  if (options_.codec_threads > 0) {
    codec_pool_ = std::make_unique<TaskPool>(options_.codec_threads);
    context_.codec_pool = codec_pool_.get();
  }

  // Recovery: models, then nodes in key order (a shard's parents before their children).
  absl::flat_hash_map<uint64_t, ModelShard*> by_id;
  {
    absl::MutexLock lock(&shards_mu_);
    absl::Status s = records_->ForEachModel(
        [&](uint64_t shard_id, const std::string& ns, const ModelInfo& model) {
          auto shard = std::make_unique<ModelShard>(&context_, ns, model, shard_id, true);
          by_id[shard_id] = shard.get();
          shards_[ShardKey(ns, model.model_id)] = std::move(shard);
          next_shard_id_ = std::max(next_shard_id_, shard_id + 1);
          ++recovery_.models;
          return absl::OkStatus();
        });
    if (!s.ok()) return s;
  }
  // Learned predictor states before the nodes that depend on them. One that cannot be read or
  // parsed stays listed with its error: DATA_LOSS for its dependents only.
  RecordBatch drop(records_.get());
  if (absl::Status s = records_->ForEachPredictor([&](uint64_t shard_id, uint32_t version,
                                                      absl::StatusOr<PredictorMeta> meta) {
        auto it = by_id.find(shard_id);
        if (it == by_id.end()) {  // its model is gone
          drop.DeletePredictor(shard_id, version);
          return;
        }
        PredictorMeta m = meta.ok() ? *meta : PredictorMeta{};
        m.version = version;
        absl::StatusOr<std::shared_ptr<const PredictorState>> state = absl::DataLossError("unread");
        if (!meta.ok()) {
          state = meta.status();
        } else {
          absl::StatusOr<std::string> bytes = records_->ReadPredictor(shard_id, version);
          if (!bytes.ok()) {
            state = bytes.status();
          } else {
            state = PredictorState::Parse(*bytes);
          }
        }
        ++recovery_.predictor_versions;
        if (!state.ok()) ++recovery_.predictor_versions_unreadable;
        it->second->learning().RecoverPredictor(m, std::move(state));
      });
      !s.ok()) {
    return s;
  }
  recovery_.payloads_verified = options_.verify_payloads_on_open;
  absl::Status s =
      records_->ForEachNode(options_.verify_payloads_on_open, [&](uint64_t shard_id, uint64_t id,
                                                                  absl::StatusOr<NodeMeta> meta,
                                                                  const std::string* payload) {
        auto it = by_id.find(shard_id);
        if (it == by_id.end()) {
          ++recovery_.dropped_missing_parent;  // its model is gone
          drop.DeleteNode(shard_id, id);
          return;
        }
        it->second->Recover(id, std::move(meta), payload, options_.verify_payloads_on_open,
                            &recovery_, &drop);
      });
  if (!s.ok()) return s;
  for (auto& [id, shard] : by_id) shard->FinishRecovery(&recovery_, &drop);
  if (auto st = records_->Write(drop); !st.ok()) return st;
  if (recovery_.dropped_missing_parent + recovery_.dropped_bad_payload > 0) {
    spdlog::warn("recovery: dropped {} nodes with a missing parent and {} with a bad payload",
                 recovery_.dropped_missing_parent, recovery_.dropped_bad_payload);
  }
  for (auto& [id, shard] : by_id)
    shard->learning().FreeUnusedPredictors();  // versions nothing needs
  // Created even when off (interval 0): tests run its rounds (KvStoreTestPeer::RunClusterPass).
  cluster_pass_ = std::make_unique<ClusterPass>(
      ClusterPass::Options{.interval_ms = options_.cluster_pass_interval_ms,
                           .blocks_per_round = options_.cluster_pass_blocks_per_round},
      [this] {
        if (!records_->health().ok()) return std::vector<ModelShard*>();  // refuses writes
        return ShardsOf("", true);
      });
  cluster_pass_->Start();
  if (options_.background) {
    tiers_->StartBackground([this] {
      if (!records_->health().ok()) return;
      // Value-log segments at most half live are rewritten, with or without a disk budget.
      if (absl::Status s = records_->CollectValueLog(RecordStore::kValueLogGcRatio); !s.ok()) {
        spdlog::error("value log GC: {}", s.ToString());
      }
      if (options_.disk_bytes == 0) return;
      CollectGarbageIfNeeded();
      if (absl::Status s = MakeDiskRoom(0); !s.ok() && !absl::IsResourceExhausted(s)) {
        spdlog::error("background eviction: {}", s.ToString());
      }
    });
  }
  return absl::OkStatus();
}

ModelShard* KvStore::Impl::Find(const std::string& ns, const std::string& model_id) {
  absl::MutexLock lock(&shards_mu_);
  auto it = shards_.find(ShardKey(ns, model_id));
  return it == shards_.end() ? nullptr : it->second.get();
}

ModelShard* KvStore::Impl::FindOrCreate(const std::string& ns, const ModelInfo& model) {
  absl::MutexLock lock(&shards_mu_);
  std::unique_ptr<ModelShard>& shard = shards_[ShardKey(ns, model.model_id)];
  if (!shard) shard = std::make_unique<ModelShard>(&context_, ns, model, next_shard_id_++, false);
  return shard.get();
}

std::vector<ModelShard*> KvStore::Impl::ShardsOf(const std::string& ns, bool all_if_empty) {
  absl::MutexLock lock(&shards_mu_);
  std::vector<ModelShard*> out;
  const bool all = ns.empty() && all_if_empty;
  for (auto it = all ? shards_.begin() : shards_.lower_bound(ShardKey(ns, ""));
       it != shards_.end() && (all || it->first.first == ns); ++it) {
    out.push_back(it->second.get());
  }
  return out;
}

absl::Status KvStore::Impl::MakeDiskRoom(uint64_t incoming) {
  for (int round = 0; round < 64; ++round) {
    const uint64_t excess = tiers_->DiskExcess(incoming);
    if (excess == 0) return absl::OkStatus();
    std::vector<TierManager::NodeRef> victims = tiers_->PopVictims(excess);
    if (victims.empty()) break;
    std::map<const void*, std::vector<uint64_t>> by_shard;
    for (const auto& [owner, id] : victims) by_shard[owner].push_back(id);
    for (auto& [owner, ids] : by_shard) {
      // Owners are this store's shards, which live as long as the store.
      auto* shard = const_cast<ModelShard*>(static_cast<const ModelShard*>(owner));
      absl::StatusOr<uint64_t> freed = shard->Evict(ids);
      if (!freed.ok()) return freed.status();
      // Writers check for garbage too (not only the 100 ms pass), every disk_bytes / 16 evicted,
      // so the folder's bound does not depend on how fast they write.
      if (evicted_since_check_.fetch_add(*freed) + *freed > options_.disk_bytes / 16) {
        evicted_since_check_ = 0;
        CollectGarbageIfNeeded();
      }
    }
  }
  if (tiers_->DiskExcess(incoming) == 0) return absl::OkStatus();
  return absl::ResourceExhaustedError("disk_bytes: pins and dependents hold the disk budget");
}

// ---------------------------------------------------------------------------------------------
// KvStore

KvStore::KvStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvStore::~KvStore() = default;

absl::StatusOr<std::unique_ptr<KvStore>> KvStore::Open(const StoreOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  if (absl::Status s = impl->Open(); !s.ok()) return s;
  return std::unique_ptr<KvStore>(new KvStore(std::move(impl)));
}

const RecoveryStats& KvStore::recovery() const { return impl_->recovery_; }

absl::Status KvStore::health() const { return impl_->records_->health(); }

MatchResult KvStore::Lookup(const std::string& ns, const std::string& model_id,
                            absl::Span<const uint32_t> token_ids) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) {
    impl_->lookups_unrouted_.fetch_add(1, std::memory_order_relaxed);
    return {};
  }
  return shard->Lookup(token_ids);
}

absl::StatusOr<std::unique_ptr<PutSession>> KvStore::BeginPut(const std::string& ns,
                                                              const ModelInfo& model,
                                                              std::vector<uint32_t> token_ids,
                                                              std::vector<float> surprisal_bits,
                                                              const EncodeOptions& encode) {
  if (model.model_id.empty()) return absl::InvalidArgumentError("model.model_id: required");
  if (auto s = model.geometry.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model.", s.message()));
  }
  if (!surprisal_bits.empty() && surprisal_bits.size() != token_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("surprisal_bits: ", surprisal_bits.size(),
                                                   " values for ", token_ids.size(),
                                                   " token_ids (send one per token, or none)"));
  }
  if (surprisal_bits.empty()) surprisal_bits.assign(token_ids.size(), 0.0f);
  for (size_t i = 0; i < surprisal_bits.size(); ++i) {
    if (!(surprisal_bits[i] >= 0) || std::isinf(surprisal_bits[i])) {
      return absl::InvalidArgumentError(absl::StrCat("surprisal_bits: value ", i, " is ",
                                                     surprisal_bits[i],
                                                     "; bits must be finite and >= 0"));
    }
  }
  if (absl::Status h = health(); !h.ok()) return h;
  // A new model is written with its first blocks (ModelShard::Commit): a Put that fails or is cut
  // short leaves no model record behind to pin a wrong geometry.
  ModelShard* shard = impl_->FindOrCreate(ns, model);
  if (auto s = shard->CheckModel(model); !s.ok()) return s;
  return std::make_unique<PutSession>(shard, &impl_->context_, model, std::move(token_ids),
                                      std::move(surprisal_bits), encode);
}

absl::StatusOr<GetResult> KvStore::Get(const std::string& ns, const std::string& model_id,
                                       absl::Span<const uint32_t> token_ids, size_t max_blocks) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) {
    impl_->gets_unrouted_.fetch_add(1, std::memory_order_relaxed);
    return GetResult{};
  }
  return shard->Get(token_ids, max_blocks);
}

absl::StatusOr<std::unique_ptr<BlockReader>> KvStore::NewReader(
    const std::string& ns, const std::string& model_id, absl::Span<const uint32_t> token_ids,
    size_t max_blocks, BlockReader::Mode mode, ThreadPool* pool, bool through_retained) {
  ModelShard* shard = impl_->Find(ns, model_id);
  GetResult listing;
  if (shard == nullptr) {
    impl_->gets_unrouted_.fetch_add(1, std::memory_order_relaxed);
  } else {
    listing = shard->Get(token_ids, max_blocks, through_retained);
  }
  return std::make_unique<BlockReader>(shard, std::move(listing),
                                       std::vector<uint32_t>(token_ids.begin(), token_ids.end()),
                                       max_blocks, mode, pool, through_retained);
}

absl::StatusOr<std::shared_ptr<const std::string>> KvStore::ReadPayload(const std::string& ns,
                                                                        const std::string& model_id,
                                                                        const BlockRead& block) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) return absl::NotFoundError(absl::StrCat("model_id: '", model_id, "'"));
  return shard->ReadPayload(block);
}

absl::Status KvStore::ReadAndDecodeBlock(const std::string& ns, const std::string& model_id,
                                         const BlockRead& block, DecodeChain* chain,
                                         absl::Span<uint8_t> out) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) return absl::NotFoundError(absl::StrCat("model_id: '", model_id, "'"));
  return shard->ReadAndDecodeBlock(block, chain, out);
}

namespace {
absl::Status NoModel(const std::string& ns, const std::string& model_id) {
  return absl::NotFoundError(
      absl::StrCat("model_id: '", model_id, "' has no KV in namespace '", ns, "'"));
}
}  // namespace

absl::StatusOr<DeleteSummary> KvStore::Delete(const std::string& ns, const std::string& model_id,
                                              absl::Span<const uint32_t> token_ids, bool erase) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) return NoModel(ns, model_id);
  erase |= impl_->options_.delete_erases;
  absl::StatusOr<DeleteSummary> summary = shard->Delete(token_ids, erase);
  if (!summary.ok() || !erase) return summary;
  // With no shard lock held: the deleted records' bytes leave the WAL, SST and blob files.
  if (absl::Status s = impl_->records_->Compact(); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("deleted, but not yet erased from disk: ", s.message()));
  }
  summary->compacted = true;
  return summary;
}

uint64_t KvStore::DataFolderBytes() const {
  uint64_t total = 0;
  std::error_code ec;
  for (std::filesystem::recursive_directory_iterator it(impl_->options_.data_dir, ec), end;
       !ec && it != end; it.increment(ec)) {
    std::error_code size_ec;  // a file deleted meanwhile counts 0
    if (!it->is_regular_file(size_ec)) continue;
    const uintmax_t size = it->file_size(size_ec);
    if (!size_ec) total += size;
  }
  return total;
}

absl::StatusOr<uint64_t> KvStore::Pin(const std::string& ns, const std::string& model_id,
                                      absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                                      bool unpin, bool extend_only) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) return NoModel(ns, model_id);
  return shard->Pin(token_ids, ttl_seconds, unpin, extend_only);
}

absl::StatusOr<std::vector<uint32_t>> KvStore::PathTokens(const std::string& ns,
                                                          const std::string& model_id,
                                                          uint64_t node_id) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) return NoModel(ns, model_id);
  return shard->PathTokens(node_id);
}

absl::StatusOr<InspectResult> KvStore::Inspect(const std::string& ns, const std::string& model_id,
                                               uint64_t node_id) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) return NoModel(ns, model_id);
  return shard->Inspect(node_id);
}

absl::StatusOr<double> KvStore::TrieDistance(const std::string& ns, const std::string& model_id,
                                             uint64_t a, uint64_t b) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr) return NoModel(ns, model_id);
  return shard->TrieDistance(a, b);
}

absl::StatusOr<std::string> KvStore::GetPredictor(const std::string& ns,
                                                  const std::string& model_id, uint32_t version) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr || !shard->committed()) return NoModel(ns, model_id);
  return shard->learning().SerializedPredictor(version);
}

absl::StatusOr<std::vector<PredictorVersionView>> KvStore::PredictorVersions(
    const std::string& ns, const std::string& model_id) {
  ModelShard* shard = impl_->Find(ns, model_id);
  if (shard == nullptr || !shard->committed()) return NoModel(ns, model_id);
  return shard->learning().PredictorVersions();
}

StoreStats KvStore::Stats(const std::string& ns) { return impl_->StatsOf(ns, true); }

StoreStats KvStore::NamespaceStats(const std::string& ns) { return impl_->StatsOf(ns, false); }

StoreStats KvStore::Impl::StatsOf(const std::string& ns, bool all_if_empty) {
  StoreStats s;
  std::string last_ns;
  for (ModelShard* shard : ShardsOf(ns, all_if_empty)) {
    const uint64_t models = s.models;
    shard->AddStats(&s);
    if (s.models != models && (s.namespaces == 0 || shard->ns() != last_ns)) {
      ++s.namespaces;  // shards come ordered by namespace
      last_ns = shard->ns();
    }
  }
  if (ns.empty() && all_if_empty) {  // calls that found no model count for the server only
    s.lookups += lookups_unrouted_.load(std::memory_order_relaxed);
    s.gets += gets_unrouted_.load(std::memory_order_relaxed);
  }
  s.memory_budget_bytes = options_.memory_bytes;
  s.disk_budget_bytes = options_.disk_bytes;
  if (cluster_pass_) s.cluster_pass_rounds = cluster_pass_->rounds();
  return s;
}

}  // namespace kvtrie

// ---------------------------------------------------------------------------------------------
// KvStoreTestPeer (trie/kv_store_testing.h)

namespace kvtrie {

void KvStoreTestPeer::RunTierMaintenance(KvStore* store) {
  store->impl_->tiers_->Maintain();
  if (store->impl_->options_.disk_bytes != 0) store->impl_->MakeDiskRoom(0).IgnoreError();
}

bool KvStoreTestPeer::HasDependents(KvStore* store, const std::string& ns,
                                    const std::string& model_id, uint64_t node_id) {
  ModelShard* shard = store->impl_->Find(ns, model_id);
  return shard != nullptr && shard->HasDependents(node_id);
}

uint64_t KvStoreTestPeer::DiskUsage(KvStore* store) { return store->impl_->records_->DiskUsage(); }

void KvStoreTestPeer::DrainLearning(KvStore* store) {
  if (store->impl_->learn_queue_) store->impl_->learn_queue_->Drain();
}

void KvStoreTestPeer::SetDeleteHook(KvStore* store, std::function<void()> hook) {
  store->impl_->context_.delete_hook_for_test = std::move(hook);
}

void KvStoreTestPeer::SetReplaceHook(KvStore* store, std::function<void()> hook) {
  store->impl_->context_.replace_hook_for_test = std::move(hook);
}

void KvStoreTestPeer::FreeUnusedPredictors(KvStore* store, const std::string& ns,
                                           const std::string& model_id) {
  if (ModelShard* shard = store->impl_->Find(ns, model_id))
    shard->learning().FreeUnusedPredictors();
}

absl::StatusOr<uint64_t> KvStoreTestPeer::Evict(KvStore* store, const std::string& ns,
                                                const std::string& model_id,
                                                const std::vector<uint64_t>& node_ids) {
  ModelShard* shard = store->impl_->Find(ns, model_id);
  if (shard == nullptr) return absl::NotFoundError("model_id: no such model");
  return shard->Evict(node_ids);
}

ClusterPassRound KvStoreTestPeer::RunClusterPass(KvStore* store) {
  const ClusterPass::Round r = store->impl_->cluster_pass_->RunRound();
  return {.groups = r.groups, .encodings = r.encodings};
}

absl::StatusOr<uint64_t> KvStoreTestPeer::RecodeAgainstCentroid(KvStore* store,
                                                                const std::string& ns,
                                                                const std::string& model_id,
                                                                uint64_t node_id,
                                                                uint64_t centroid_id) {
  ModelShard* shard = store->impl_->Find(ns, model_id);
  if (shard == nullptr) return absl::NotFoundError("model_id: no such model");
  return shard->cluster_policy().RecodeAgainstCentroid(node_id, centroid_id);
}

std::vector<uint64_t> KvStoreTestPeer::PendingRechecks(KvStore* store, const std::string& ns,
                                                       const std::string& model_id) {
  ModelShard* shard = store->impl_->Find(ns, model_id);
  return shard == nullptr ? std::vector<uint64_t>{} : shard->cluster_policy().PendingRechecks();
}

}  // namespace kvtrie
