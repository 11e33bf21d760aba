// trie/tier_policy.h
//
// The order in which the tiered store gives up payloads: which hot payloads leave memory first
// (demotion to the cold tier, RocksDB) and which cold leaves leave the disk first (eviction).
//
// Both orders are GDSF (Greedy-Dual-Size-Frequency): an item's priority, set when it is stored or
// read, is
//     H = L + refs * cost / size_kib,      cost = 1 + depth (blocks a re-prefill attends over)
// where L is the queue's clock: the priority of the last item it gave up. Small, deep, often read
// nodes stay; a large, shallow, once-read node goes first; L ages nodes that stop being read.
// Scan resistance (as in SLRU / 2Q): an item referenced once (refs = 1: stored, never read or
// shared since) is in the probation segment and every probation item goes before any item
// referenced twice or more, so a one-off scan evicts other one-offs, never hot shared prefixes;
// within a segment the order is GDSF. Eviction takes leaves only (see TierManager): a parent
// outlives its children. Source: Cherkasova, "Improving WWW proxies performance with GDSF" (HP
// Labs, 1998).
//
// Not thread-safe: the owner (TierManager) serializes access under its mutex.
#ifndef KVTRIE_TRIE_TIER_POLICY_H_
#define KVTRIE_TRIE_TIER_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace kvtrie {

// An item's place in one GdsfQueue, kept by the caller at a stable address.
struct QueueSlot {
  double priority = 0;             // H at the last access
  bool protected_segment = false;  // refs >= 2 at the last access
  bool member = false;
};

// GDSF value of keeping an item (without the clock): refs * (1 + depth) / KiB stored.
double GdsfValue(uint64_t refs, uint32_t depth, uint64_t bytes_stored);

// Items ordered by GDSF priority, lowest first. An item is named by its slot, a tie-breaking
// `seq` unique in the queue, and an opaque pointer that Pop returns.
class GdsfQueue {
 public:
  GdsfQueue() = default;
  GdsfQueue(const GdsfQueue&) = delete;
  GdsfQueue& operator=(const GdsfQueue&) = delete;

  // An access (store or read) with `refs` references: the priority becomes clock + GdsfValue;
  // membership as given.
  void Access(QueueSlot* slot, uint64_t seq, void* item, uint64_t refs, uint32_t depth,
              uint64_t bytes_stored, bool member);
  // Makes the item a member or not, keeping the priority of its last access.
  void SetMember(QueueSlot* slot, uint64_t seq, void* item, bool member);
  // The lowest-priority member (nullptr when empty).
  void* Lowest() const;
  // Removes the lowest member and raises the clock to its priority (the "L" of GDSF).
  void* Pop();

  bool empty() const { return order_.empty(); }
  size_t size() const { return order_.size(); }
  double clock() const { return clock_; }

 private:
  double clock_ = 0;
  using Key = std::tuple<bool, double, uint64_t>;  // (protected, priority, seq)
  std::map<Key, std::pair<QueueSlot*, void*>> order_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_TIER_POLICY_H_
