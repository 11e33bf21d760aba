// trie/tier_manager.h
//
// TierManager: the budgets of the tiered store and what keeps them — the hot payload copies in
// memory (bounded by memory_bytes), the payload bytes on disk and the reservations of writes in
// flight (bounded by disk_bytes), both GDSF queues (trie/tier_policy.h), pins, and the
// background thread. It does no I/O.
//
// A node is named by (owner, node id); the owner is its ModelShard, opaque here. The shard
// registers a node when it is published (Add) and forgets it before it leaves (Remove); it says
// whether the node is structurally evictable (a leaf; a centroid's members re-elect before it
// goes, SetEvictable); a pinned node is never evictable.
//
// Memory bound: every way a hot copy appears (Add, a promotion after promote_after_cold_reads
// cold reads, Replace) first demotes the lowest-GDSF hot copies (a pointer drop; payloads are
// written through, so nothing is written) until it fits: hot bytes never exceed memory_bytes.
// The background pass keeps them under 90% of it so writers rarely pay for that.
// Disk bound: a writer reserves its bytes first (Reserve; false when they do not fit) and the
// caller evicts PopVictims() (lowest-GDSF evictable leaves) through their shards to make room.
// What counts: payload bytes + reservations; the rest of the data folder is bounded by the
// RecordStore (trie/record_store.h states the bound).
//
// Lock order: ModelShard::write_mu_ -> ModelShard::mu_ -> TierManager::mu_ ->
// RecordStore::error_mu_. TierManager calls nothing while holding mu_; the background thread
// runs the disk pass callback without it.
// Thread-safe.
#ifndef KVTRIE_TRIE_TIER_MANAGER_H_
#define KVTRIE_TRIE_TIER_MANAGER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "trie/tier_policy.h"

namespace kvtrie {

class TierManager {
 public:
  using Owner = const void*;
  using NodeRef = std::pair<Owner, uint64_t>;
  static constexpr uint64_t kPinForever = ~uint64_t{0};

  struct Options {
    uint64_t memory_bytes = 0;  // 0 = unbounded
    uint64_t disk_bytes = 0;    // payload bytes (0 = unbounded)
    uint32_t promote_after_cold_reads = 2;
    std::function<uint64_t()> now_seconds;  // unix seconds
  };

  // Per owner, kept as they change; summed by the caller for a namespace or the server.
  struct Counters {
    uint64_t hot_nodes = 0, hot_bytes = 0, nodes = 0, disk_bytes = 0, pinned_nodes = 0;
    uint64_t demotions = 0, demoted_bytes = 0, promotions = 0, cold_reads = 0, cold_read_bytes = 0,
             pins_expired = 0, puts_rejected_disk_full = 0;
    void Add(const Counters& o);
  };

  explicit TierManager(Options options);
  ~TierManager();  // stops the background thread
  TierManager(const TierManager&) = delete;
  TierManager& operator=(const TierManager&) = delete;

  // Starts the background pass (every 100 ms: demote to 90%, expire pins, then `disk_pass`,
  // which runs without any TierManager lock).
  void StartBackground(std::function<void()> disk_pass);
  void StopBackground();
  // One pass of memory demotion and pin expiry now.
  void Maintain();

  // A published node of `bytes` payload bytes; hot when `payload` is set (demoting others to
  // make room), cold otherwise.
  void Add(NodeRef n, uint32_t depth, uint64_t bytes, std::shared_ptr<const std::string> payload,
           bool evictable, uint64_t pinned_until);
  void Remove(NodeRef n);
  // A Get returned it or a Put deduplicated against it.
  void Touch(NodeRef n);
  // The hot copy, or null; *generation (when given): the node's payload generation (Replace bumps
  // it), for ColdRead.
  std::shared_ptr<const std::string> HotCopy(NodeRef n, uint64_t* generation = nullptr) const;
  // A payload read from disk: counted; promoted when read often enough and still the node's
  // (`generation` as HotCopy gave it when the read was listed, and no Replace since).
  void ColdRead(NodeRef n, const std::shared_ptr<const std::string>& payload, uint64_t generation);
  // A new encoding of a stored node: disk bytes follow; a hot copy is swapped (making room).
  void Replace(NodeRef n, std::shared_ptr<const std::string> payload);
  void SetEvictable(NodeRef n, bool evictable);

  // Pins: `until` in unix seconds, kPinForever, or 0 to unpin. Returns the previous value.
  uint64_t SetPin(NodeRef n, uint64_t until);
  uint64_t PinnedUntil(NodeRef n) const;

  // Disk: reserves `bytes` for a write if stored + reserved + bytes fits the budget.
  bool Reserve(uint64_t bytes);
  void Unreserve(uint64_t bytes);
  // Disk bytes held beside the payloads (learned predictor states, trie/predictor_registry.h):
  // counted against the budget as stored payloads are, never evicted here.
  void AddSideBytes(uint64_t bytes);
  void RemoveSideBytes(uint64_t bytes);
  // Bytes over the budget if `incoming` more were stored (0 when it fits or unbounded).
  uint64_t DiskExcess(uint64_t incoming) const;
  // Pops evictable leaves, lowest GDSF first, until their bytes cover `bytes` (or none is
  // left). A victim the owner cannot evict any more is given back with SetEvictable.
  std::vector<NodeRef> PopVictims(uint64_t bytes);
  void CountRejected(Owner owner);

  Counters CountersOf(Owner owner) const;
  uint64_t stored_bytes() const;

 private:
  struct Entry {
    uint64_t seq = 0;
    Owner owner = nullptr;
    uint32_t depth = 0;
    uint64_t bytes = 0;
    uint64_t refs = 1;
    std::shared_ptr<const std::string> hot;
    QueueSlot hot_slot, disk_slot;
    uint64_t pinned_until = 0;
    bool evictable = false;  // as the owner says; pins come on top
    uint32_t cold_reads = 0;
    uint64_t generation = 0;  // bumped by Replace: a payload read before it is not the node's
    Counters* counters = nullptr;
    NodeRef ref;
  };
  Entry* Find(NodeRef n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CanEvict(const Entry& e) const { return e.evictable && e.pinned_until == 0; }
  void MakeHot(Entry* e, std::shared_ptr<const std::string> payload)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Demote(uint64_t incoming, uint64_t target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpirePins() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t Now() const;

  const Options options_;
  mutable absl::Mutex mu_;
  absl::node_hash_map<NodeRef, Entry> entries_ ABSL_GUARDED_BY(mu_);  // every stored node
  absl::node_hash_map<Owner, Counters> counters_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<NodeRef, Entry*> pinned_ ABSL_GUARDED_BY(mu_);
  GdsfQueue hot_queue_ ABSL_GUARDED_BY(mu_);    // hot copies, demotion order
  GdsfQueue evict_queue_ ABSL_GUARDED_BY(mu_);  // evictable leaves
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t hot_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t disk_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // payload bytes stored
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;    // bytes of writes in flight
  uint64_t side_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // AddSideBytes
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<std::thread> background_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_TIER_MANAGER_H_
