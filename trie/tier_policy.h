// trie/tier_policy.h
//
// The order in which the tiered store gives up payloads: which hot payloads leave memory first
// (demotion to the cold tier, RocksDB) and which cold leaves leave the disk first (eviction).
//
// Both orders are GDSF (Greedy-Dual-Size-Frequency): a node's priority, set when it is stored or
// read, is
//     H = L + refs * cost / size_kib,      cost = 1 + depth (blocks a re-prefill attends over)
// where L is the queue's clock: the priority of the last node it gave up. Small, deep, often read
// nodes stay; a large, shallow, once-read node goes first; L ages nodes that stop being read.
// Scan resistance (as in SLRU / 2Q): a node referenced once (refs = 1: stored, never read or
// shared since) is in the probation segment and every probation node goes before any node
// referenced twice or more, so a one-off scan evicts other one-offs, never hot shared prefixes;
// within a segment the order is GDSF. Eviction takes leaves only (see KvStore): a parent outlives
// its children. Source: Cherkasova, "Improving WWW proxies performance with GDSF" (HP Labs, 1998).
//
// Not thread-safe: the owner (KvStore) serializes access.
#ifndef KVTRIE_TRIE_TIER_POLICY_H_
#define KVTRIE_TRIE_TIER_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>

namespace kvtrie {

struct TrieNode;

// A node's place in one GdsfQueue (kept in the node, see TrieNode::tier).
struct QueueSlot {
  double priority = 0;             // H at the last access
  bool protected_segment = false;  // refs >= 2 at the last access
  bool member = false;
};

// Per-node state of the tiered store (TrieNode::tier).
struct TierState {
  QueueSlot hot;  // in the hot tier's demotion queue (a member iff the payload is in memory)
  QueueSlot
      disk;  // in the eviction queue (a member iff evictable: a leaf, unpinned, no dependents)
  uint64_t refs = 0;          // Puts that deduplicated against it and Gets that returned it, + 1
  uint64_t pinned_until = 0;  // unix seconds; 0 = not pinned, UINT64_MAX = until unpinned
  uint32_t dependents = 0;    // nodes coded against this one (centroid hook): it is kept for them
  uint32_t cold_reads = 0;    // reads from RocksDB since it was last hot (promotion policy)
};

// GDSF value of keeping `node` (without the clock): refs * (1 + depth) / KiB stored.
double GdsfValue(const TrieNode& node);

// Nodes ordered by GDSF priority, lowest first. Each entry carries an opaque owner (the trie's
// model) so the caller can find where a victim lives.
class GdsfQueue {
 public:
  struct Entry {
    TrieNode* node = nullptr;
    void* owner = nullptr;
  };
  explicit GdsfQueue(QueueSlot TierState::*slot) : slot_(slot) {}
  GdsfQueue(const GdsfQueue&) = delete;
  GdsfQueue& operator=(const GdsfQueue&) = delete;

  // An access (store or read): the priority becomes clock + GdsfValue; membership as given.
  void Access(TrieNode* node, void* owner, bool member);
  // Makes `node` a member or not, keeping the priority of its last access.
  void SetMember(TrieNode* node, void* owner, bool member);
  // The lowest-priority member (node == nullptr when empty).
  Entry Lowest() const;
  // Removes the lowest member and raises the clock to its priority (the "L" of GDSF).
  Entry Pop();

  bool empty() const { return order_.empty(); }
  size_t size() const { return order_.size(); }
  double clock() const { return clock_; }

 private:
  QueueSlot TierState::*const slot_;
  double clock_ = 0;
  using Key = std::tuple<bool, double, uint64_t>;  // (protected, priority, node id)
  std::map<Key, Entry> order_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_TIER_POLICY_H_
