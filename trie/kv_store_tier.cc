// KvStore's tiers: the hot payload copy in memory, reads of cold payloads, demotion, promotion,
// eviction for the disk budget, pins and the background thread. See trie/kv_store.h (top) for
// the contract and trie/tier_policy.h for the order.
#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "trie/kv_store.h"
#include "trie/store_records.pb.h"

namespace kvtrie {
namespace {

constexpr uint64_t kPinForever = std::numeric_limits<uint64_t>::max();

// Same key as kv_store.cc: the node id as 8 big-endian bytes.
std::string TierNodeKey(uint64_t id) {
  std::string k(8, '\0');
  for (int i = 0; i < 8; ++i) k[i] = static_cast<char>((id >> (56 - 8 * i)) & 0xff);
  return k;
}

}  // namespace

uint64_t KvStore::NowSeconds() const {
  if (options_.now_seconds) return options_.now_seconds();
  return static_cast<uint64_t>(absl::ToUnixSeconds(absl::Now()));
}

std::shared_ptr<const rocksdb::Snapshot> KvStore::SnapshotLocked() {
  rocksdb::DB* db = db_.get();
  return std::shared_ptr<const rocksdb::Snapshot>(
      db->GetSnapshot(), [db](const rocksdb::Snapshot* s) { db->ReleaseSnapshot(s); });
}

bool KvStore::Evictable(const TrieNode& n) const {
  return n.depth > 0 && n.children.empty() && n.tier.pinned_until == 0 && n.tier.dependents == 0;
}

void KvStore::TierAddLocked(Model* model, TrieNode* node,
                            std::shared_ptr<const std::string> encoded) {
  disk_bytes_ += node->bytes_stored;
  node->tier.refs = 1;
  const uint64_t budget = options_.memory_bytes;
  const bool hot = encoded && (budget == 0 || encoded->size() <= budget);
  if (hot) {
    if (budget != 0) DemoteLocked(encoded->size(), budget);
    hot_bytes_ += encoded->size();
    node->encoded = std::move(encoded);
  }
  hot_queue_.Access(node, model, hot);
  if (node->parent != nullptr && node->parent->depth > 0) {
    evict_queue_.SetMember(node->parent, model, false);  // no longer a leaf
  }
  evict_queue_.Access(node, model, Evictable(*node));
}

void KvStore::TierTouchLocked(Model* model, TrieNode* node) {
  ++node->tier.refs;
  hot_queue_.Access(node, model, node->tier.hot.member);
  evict_queue_.Access(node, model, node->tier.disk.member);
}

void KvStore::TouchPath(const std::string& ns, const std::string& model_id, uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  Model* m = FindModel(ns, model_id);
  for (TrieNode* n = m ? m->trie->Find(node_id) : nullptr; n != nullptr && n->depth > 0;
       n = n->parent) {
    TierTouchLocked(m, n);
  }
}

void KvStore::DemoteLocked(uint64_t incoming, uint64_t target) {
  while (hot_bytes_ + incoming > target && !hot_queue_.empty()) {
    TrieNode* n = hot_queue_.Pop().node;
    hot_bytes_ -= n->encoded->size();
    demoted_bytes_.fetch_add(n->encoded->size(), std::memory_order_relaxed);
    demotions_.fetch_add(1, std::memory_order_relaxed);
    n->encoded.reset();  // written through at Put: nothing to write
    n->tier.cold_reads = 0;
  }
}

absl::Status KvStore::MakeDiskRoomLocked(uint64_t incoming) {
  const uint64_t budget = options_.disk_bytes;
  if (budget == 0 || disk_bytes_ + incoming <= budget) return absl::OkStatus();
  ExpirePinsLocked();
  rocksdb::WriteBatch batch;
  while (disk_bytes_ + incoming > budget && incoming <= budget && !evict_queue_.empty()) {
    GdsfQueue::Entry e = evict_queue_.Pop();
    RemoveNodeLocked(static_cast<Model*>(e.owner), e.node, DropReason::kDisk, &batch);
  }
  if (batch.Count() > 0) {
    rocksdb::WriteOptions wo;
    wo.sync = options_.sync;
    rocksdb::Status s = db_->Write(wo, &batch);
    // The nodes are gone from memory either way; if the deletes did not reach the disk they come
    // back at the next start (over budget, then evicted again), never half.
    if (!s.ok()) spdlog::error("eviction: deleting {} records: {}", batch.Count(), s.ToString());
  }
  if (disk_bytes_ + incoming > budget) {
    puts_rejected_disk_full_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat(
        "disk_bytes: ", incoming, " more payload bytes do not fit in the disk budget of ", budget,
        " bytes (", disk_bytes_,
        " stored); what remains is pinned, depended on, or the Put is "
        "larger than the budget"));
  }
  return absl::OkStatus();
}

void KvStore::ExpirePinsLocked() {
  const uint64_t now = NowSeconds();
  for (auto it = pinned_.begin(); it != pinned_.end();) {
    auto [model, node] = it->second;
    if (node->tier.pinned_until != kPinForever && node->tier.pinned_until <= now) {
      node->tier.pinned_until = 0;
      evict_queue_.SetMember(node, model, Evictable(*node));
      pins_expired_.fetch_add(1, std::memory_order_relaxed);
      pinned_.erase(it++);
    } else {
      ++it;
    }
  }
}

void KvStore::MaintainLocked() {
  if (options_.memory_bytes != 0) DemoteLocked(0, options_.memory_bytes / 10 * 9);
  ExpirePinsLocked();
  if (options_.disk_bytes != 0 && disk_bytes_ > options_.disk_bytes) {
    MakeDiskRoomLocked(0).IgnoreError();
  }
}

void KvStore::RunTierMaintenance() {
  absl::MutexLock lock(&mu_);
  MaintainLocked();
}

void KvStore::BackgroundLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(100));
    if (!stop_) MaintainLocked();
  }
}

uint64_t KvStore::RemoveNodeLocked(Model* model, TrieNode* node, DropReason reason,
                                   rocksdb::WriteBatch* batch) {
  std::vector<TrieNode*> order = {node};
  for (size_t i = 0; i < order.size(); ++i) {
    for (const auto& [h, bucket] : order[i]->children) {
      order.insert(order.end(), bucket.begin(), bucket.end());
    }
  }
  uint64_t stored = 0;
  for (TrieNode* n : order) {
    ClusterRemoveLocked(model, *n);  // near-duplicate index and dependency edges
    hot_queue_.SetMember(n, model, false);
    evict_queue_.SetMember(n, model, false);
    if (n->encoded) hot_bytes_ -= n->encoded->size();
    disk_bytes_ -= n->bytes_stored;
    stored += n->bytes_stored;
    model->bytes_logical -= n->bytes_logical;
    model->bytes_stored -= n->bytes_stored;
    pinned_.erase(n->id);
  }
  TrieNode* parent = node->parent;
  std::vector<uint64_t> removed;
  model->trie->RemoveSubtree(node, &removed);
  for (uint64_t id : removed) {
    batch->Delete(cf_nodes_, TierNodeKey(id));
    batch->Delete(cf_payloads_, TierNodeKey(id));
  }
  if (parent != nullptr && parent->depth > 0) {
    evict_queue_.SetMember(parent, model, Evictable(*parent));
  }
  switch (reason) {
    case DropReason::kDeleted:
      evictions_deleted_.fetch_add(removed.size(), std::memory_order_relaxed);
      break;
    case DropReason::kDataLoss:
      evictions_data_loss_.fetch_add(removed.size(), std::memory_order_relaxed);
      break;
    case DropReason::kDisk:
      evictions_disk_.fetch_add(removed.size(), std::memory_order_relaxed);
      evicted_bytes_.fetch_add(stored, std::memory_order_relaxed);
      break;
  }
  return removed.size();
}

absl::StatusOr<std::shared_ptr<const std::string>> KvStore::Payload(const std::string& ns,
                                                                    const std::string& model_id,
                                                                    const BlockRead& block) {
  if (block.encoded) return block.encoded;
  rocksdb::ReadOptions ro;
  ro.snapshot = block.snapshot.get();
  ro.verify_checksums = true;
  std::string value;
  rocksdb::Status s = db_->Get(ro, cf_payloads_, TierNodeKey(block.node_id), &value);
  absl::Status bad;
  if (s.IsNotFound()) {
    bad = absl::DataLossError("payload missing");
  } else if (s.IsCorruption()) {
    bad = absl::DataLossError(s.ToString());
  } else if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("payload of node ", block.node_id, ": ", s.ToString()));
  } else if (absl::StatusOr<BlockHeader> h = ParseBlock(value); !h.ok()) {
    bad = h.status();
  }
  if (!bad.ok()) {
    spdlog::error("node {} of '{}'/'{}': cold payload unreadable, dropping it and its subtree: {}",
                  block.node_id, ns, model_id, std::string(bad.message()));
    absl::MutexLock lock(&mu_);
    Model* m = FindModel(ns, model_id);
    if (TrieNode* n = m ? m->trie->Find(block.node_id) : nullptr; n != nullptr) {
      DropNodeLocked(m, n, DropReason::kDataLoss);
    }
    return absl::DataLossError(absl::StrCat("node ", block.node_id, ": ", bad.message(),
                                            "; the node and its subtree were dropped"));
  }
  cold_reads_.fetch_add(1, std::memory_order_relaxed);
  cold_read_bytes_.fetch_add(value.size(), std::memory_order_relaxed);
  auto payload = std::make_shared<const std::string>(std::move(value));
  // Promotion: only a node read again while cold comes back, so a one-off scan of cold prefixes
  // does not push hot ones out of memory.
  absl::MutexLock lock(&mu_);
  Model* m = FindModel(ns, model_id);
  TrieNode* n = m ? m->trie->Find(block.node_id) : nullptr;
  const uint64_t budget = options_.memory_bytes;
  if (n != nullptr && !n->encoded && ++n->tier.cold_reads >= options_.promote_after_cold_reads &&
      (budget == 0 || payload->size() <= budget)) {
    if (budget != 0) DemoteLocked(payload->size(), budget);
    n->encoded = payload;
    hot_bytes_ += payload->size();
    hot_queue_.SetMember(n, m, true);
    n->tier.cold_reads = 0;
    promotions_.fetch_add(1, std::memory_order_relaxed);
  }
  return payload;
}

absl::Status KvStore::AddDependents(uint64_t node_id, int delta) {
  absl::MutexLock lock(&mu_);
  for (auto& [key, m] : models_) {
    TrieNode* n = m.trie->Find(node_id);
    if (n == nullptr || n->depth == 0) continue;
    n->tier.dependents = static_cast<uint32_t>(
        std::max<int64_t>(0, static_cast<int64_t>(n->tier.dependents) + delta));
    evict_queue_.SetMember(n, &m, Evictable(*n));
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("node_id: ", node_id, " is not stored"));
}

absl::Status KvStore::WritePinLocked(Model* model, TrieNode* node) {
  const std::string key = TierNodeKey(node->id);
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), cf_nodes_, key, &value);
  internal::NodeRecord r;
  if (!s.ok() || !r.ParseFromString(value)) {
    return absl::InternalError(absl::StrCat("pin: node record ", node->id, ": ", s.ToString()));
  }
  r.set_pinned_until(node->tier.pinned_until);
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  s = db_->Put(wo, cf_nodes_, key, r.SerializeAsString());
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("pin: ", s.ToString()));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> KvStore::Pin(const std::string& ns, const std::string& model_id,
                                      absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                                      bool unpin) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Model*> found = FindModelOrNotFound(ns, model_id);
  if (!found.ok()) return found.status();
  Model* m = *found;
  const uint32_t bt = m->info.geometry.block_tokens;
  if (token_ids.size() < bt) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_ids: ", token_ids.size(), " tokens hold no full block of ", bt));
  }
  std::vector<TrieNode*> path = m->trie->Match(token_ids);  // full blocks; a tail is ignored
  if (path.size() != token_ids.size() / bt) {
    return absl::NotFoundError(absl::StrCat("token_ids: only ", path.size() * bt, " of ",
                                            token_ids.size(), " tokens are stored"));
  }
  TrieNode* n = path.back();
  if (unpin) {
    n->tier.pinned_until = 0;
    pinned_.erase(n->id);
  } else {
    n->tier.pinned_until = ttl_seconds == 0 ? kPinForever : NowSeconds() + ttl_seconds;
    pinned_[n->id] = {m, n};
  }
  evict_queue_.SetMember(n, m, Evictable(*n));
  if (auto s = WritePinLocked(m, n); !s.ok()) return s;
  return n->id;
}

}  // namespace kvtrie
