// trie/cluster_policy.h
//
// ClusterPolicy: how one ModelShard's near-duplicate clusters (trie/cluster_index.h) change after
// their blocks were stored: re-election when a centroid leaves (a Delete, an eviction), retained
// centroids (retain, revive, sweep), the background pass's per-group work (election, convergence,
// recheck; trie/cluster_pass.h runs the rounds), and the explicit re-encoding of one block
// against a centroid. It decides; every byte it changes goes through the shard's write protocol
// (ModelShard::ReplaceEncodingLocked, RemoveSubtrees), so the shard's rules hold for it too.
//
// Bit-exact moves. Every re-encoding here stores a block's exact current reconstruction again,
// losslessly (standalone or as a residual of another block): every value a reader gets, every
// descendant's prediction context and every kept Put parent stays the same, so the error target
// a block met still holds and nothing below it needs re-encoding. Each block is published alone
// (one RecordBatch): a crash leaves each one either old, its old centroid still stored, or new.
// A centroid is only re-encoded by the pass, never removed, so a read listed before still
// decodes.
//
// Re-election. Before a Delete or an eviction removes a subtree holding centroids of
// near-duplicates outside it, each such cluster elects a new centroid among its members outside
// (ReleaseDependentsLocked), and every member is re-encoded against it (or another candidate, or
// standalone). Reads listed before keep the reconstructions of the centroids that go
// (RetiredReferences).
//
// Retained centroids. Deleting a prefix whose blocks are the centroids of near-duplicates outside
// it re-elects a centroid among each cluster's members when they are all bit-exact (each
// member's exact reconstruction is coded losslessly again: bytes shrink). A cluster with a lossy
// member (TrieNode::lossy: its reconstruction is not what its Put sent, however it is coded now;
// a lossy block the pass re-coded LOSSLESS against a centroid is one, issue 33) keeps the
// deleted centroid instead: re-encoding a lossy member would add error to one
// that already used its target (its reconstruction must stay what it is), and coding the new
// centroid's reconstruction exactly costs ~5x its lossy bytes (issue 20: +205 % on
// tests/data/neardup). The centroid and its ancestors inside the deleted prefix stay, marked
// `retained` (TrieNode) in the same batch that deletes the rest: no lookup, Get, Pin or Delete
// matches them, no Put finds them as a candidate, eviction skips them, and the namespace's
// stored bytes count them. Each is removed (SweepRetainedLocked: after a Delete or eviction,
// every cluster-pass round, at recovery) once no block is coded against it and it has no child.
// A Put of the deleted prefix again revives them (ReviveRetainedLocked): the blocks are that
// prefix's KV within the target they were stored at, and deduplicate the Put's as any stored
// block does.
//
// Locks: the methods named ...Locked run with the shard's write_mu_ held (they are the shard's
// writers' steps) and take its mu_ themselves for memory work only; the others take write_mu_
// themselves. State: recheck_, guarded by the shard's mu_.
#ifndef KVTRIE_TRIE_CLUSTER_POLICY_H_
#define KVTRIE_TRIE_CLUSTER_POLICY_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "trie/cluster_index.h"
#include "trie/model_shard.h"
#include "trie/store_types.h"

namespace kvtrie {

// The reconstructions of the centroids (and their parents) that a Delete removed while reads that
// listed blocks coded against them were alive: one object per shard epoch. A read listed now holds
// the current one (BlockRead::retired); a Delete that removes centroids while it is held puts
// their reconstructions in it before the removal and then starts a new one, so they are freed
// with the last read that may need them (as RocksDB keeps a Version while an iterator holds it).
struct RetiredReferences {
  void Add(uint64_t node_id, std::vector<uint8_t> block) {
    absl::MutexLock lock(&mu);
    blocks.emplace(node_id, std::move(block));
  }
  // The reconstruction of `node_id`, or null.
  const std::vector<uint8_t>* Find(uint64_t node_id) {
    absl::MutexLock lock(&mu);
    auto it = blocks.find(node_id);
    return it == blocks.end() ? nullptr : &it->second;  // never erased while the object lives
  }
  bool empty() {
    absl::MutexLock lock(&mu);
    return blocks.empty();
  }

  absl::Mutex mu;
  // node id -> its reconstruction; node_hash_map: a found block stays where it is.
  absl::node_hash_map<uint64_t, std::vector<uint8_t>> blocks ABSL_GUARDED_BY(mu);
};

// The reconstructions one Delete keeps at most (dense bytes): past it, the blocks coded against the
// other centroids are listed again (ABORTED, the service retries) and end ABORTED if they went too.
inline constexpr uint64_t kMaxRetiredBytes = 64ull << 20;

class ClusterPolicy {
 public:
  // `shard` owns this object and outlives it.
  explicit ClusterPolicy(ModelShard* shard) : shard_(shard) {}
  ClusterPolicy(const ClusterPolicy&) = delete;
  ClusterPolicy& operator=(const ClusterPolicy&) = delete;

  // Re-encodes standalone node `node_id` (its exact reconstruction, losslessly: a lossless block
  // stays bit-exact, a lossy one keeps its error) as a residual of `centroid_id`, a standalone
  // node with the same tokens at the same depth, and publishes it in one batch when smaller than
  // what node_id stores now. Returns the payload bytes saved (0: not smaller, left as it was).
  // Errors: NOT_FOUND naming node_id or centroid_id; FAILED_PRECONDITION when node_id is not
  // standalone or is a centroid itself, centroid_id is not standalone, or their depths or tokens
  // differ; the store's write errors.
  absl::StatusOr<uint64_t> RecodeAgainstCentroid(uint64_t node_id, uint64_t centroid_id);
  // The background cluster pass's round on this shard (trie/cluster_pass.cc): visits the dirty
  // near-duplicate groups (ClusterIndex::DirtyGroups) and elects each group's centroid: the
  // member whose path is most probable (lowest path surprisal), then the most hit, then the
  // current centroid, the oldest; a lossy residual is not eligible. Then codes the others against
  // it (ConvergeGroup): each member's exact reconstruction, losslessly, kept when smaller; an
  // elected residual is first stored standalone, only when the group's bytes fall. At most about
  // `budget` encodings (a round's first group may pass it by its size); a group it could not
  // visit stays dirty. Sweeps retained centroids first. Returns the encodings spent; adds the
  // groups visited to *groups. Errors: the store's write errors.
  absl::StatusOr<uint32_t> RunClusterPass(uint32_t budget, uint64_t* groups);

  // --- Steps of the shard's writers (Delete, Evict, Commit); the shard's write_mu_ held ---
  // Before a Delete removes node_id's subtree: when reads hold the current RetiredReferences,
  // puts in it the reconstructions of the subtree's centroids (and of their parents inside it).
  // Returns whether it added any (the Delete then starts a new epoch once the subtree is gone).
  bool RetireReferencesLocked(uint64_t node_id);
  // For every centroid inside the subtree of one of `roots` with members outside them all,
  // re-elects (ReelectLocked) a member outside them all, so the subtrees can go together (an
  // eviction of many leaves never elects one that goes). Every member's reconstruction stays
  // bit-exact. Counts the bytes replaced and written, the nodes re-encoded and the centroids
  // re-elected in *summary. With `retain` set, a centroid with a lossy member is not re-elected
  // but added to *retain ("Retained centroids" above). `erasing`: an erasing Delete that would
  // otherwise retain; the bytes written for the clusters with a lossy member are added to
  // summary->erase_bytes_rewritten.
  absl::Status ReleaseDependentsLocked(absl::Span<const uint64_t> roots, DeleteSummary* summary,
                                       absl::flat_hash_set<uint64_t>* retain = nullptr,
                                       bool erasing = false);
  // Deletes root_id's subtree but `retain` (centroids inside it) and their ancestors inside it,
  // which are marked retained, in one batch. Adds to the summary's nodes_deleted, bytes_freed and
  // nodes_retained. INTERNAL when a block that stays is still coded against one that would go.
  absl::Status RemoveRetainingLocked(uint64_t root_id, const absl::flat_hash_set<uint64_t>& retain,
                                     DeleteSummary* summary);
  // Removes the retained nodes that nothing is coded against and that have no child, until none
  // is left. Logs (and leaves for the next sweep) a failed write.
  void SweepRetainedLocked();
  // A Put whose block `first_block` (of token_ids) under parent_id is a retained node: marks it,
  // and the retained nodes below it along token_ids, visible again (written first). Returns
  // whether it revived any.
  absl::StatusOr<bool> ReviveRetainedLocked(uint64_t parent_id,
                                            absl::Span<const uint32_t> token_ids,
                                            uint32_t first_block);
  // A node that leaves memory is no longer looked at again. REQUIRES the shard's mu_.
  void ForgetLocked(uint64_t node_id) {
    recheck_.erase(node_id);
    unlooked_.erase(node_id);
  }
  // Any offset for blocks stored without a near-duplicate search (issue 33): a client-encoded or
  // fast-profile block arrives standalone, and only blocks at the same depth meet it in a group.
  // Such a block, standalone and LOSSLESS (LooksAtOffsets: a lossy one was never smaller), is
  // marked in its record (TrieNode::offset_look, written with the block) and queued
  // (LookLaterLocked, also at recovery); the pass, once its groups are settled, looks for a stored
  // block it repeats at any position offset (the n-gram index, as the compact Put path does)
  // among the blocks stored BEFORE it (so an inserted-into copy is coded against the text it
  // repeats, never the reverse), and codes it losslessly against the best when that is smaller
  // than what it stores; then clears the marks of a round's looks in one batch. A block in a group
  // of two or more is the group's (ConvergeGroup) and is not moved by a look. At most kMaxUnlooked
  // blocks are queued per shard (past it a marked block waits for a restart).
  bool LooksAtOffsets(const BlockGeometry& g, Encoding encoding) const;
  // REQUIRES the shard's mu_.
  void LookLaterLocked(uint64_t node_id);
  // The blocks queued for a look, ascending. Takes the shard's mu_.
  std::vector<uint64_t> PendingLooks();
  // Recovery: node_id's record says the pass looks at it again (TrieNode::recheck). REQUIRES the
  // shard's mu_.
  void RecheckLaterLocked(uint64_t node_id) { recheck_.insert(node_id); }
  // The nodes the pass will look at again (recheck_), ascending. Takes the shard's mu_.
  std::vector<uint64_t> PendingRechecks();

 private:
  // Elects among `members` (of centroid_id, which goes; ascending ids) the one whose path is most
  // probable (lowest path surprisal), then most hit, then with most dependents (preferring those
  // at centroid_id's own position over position-shifted ones), re-encodes it standalone, then
  // each other member against it (or another candidate outside `leaving`, or standalone,
  // whichever is smallest). Each member is published alone.
  absl::Status ReelectLocked(uint64_t centroid_id, const std::vector<uint64_t>& members,
                             const absl::flat_hash_set<uint64_t>& leaving, DeleteSummary* summary);
  // Re-encodes node_id's exact reconstruction losslessly: standalone when centroid_id is 0, else
  // as a residual of centroid_id or of another candidate not in `leaving` when smaller than
  // standalone. *replaced: false when the node went meanwhile.
  absl::Status RecodeMemberLocked(uint64_t node_id, uint64_t centroid_id,
                                  const absl::flat_hash_set<uint64_t>& leaving,
                                  DeleteSummary* summary, bool* replaced);
  // The candidates the Put path would find now for the stored block `n` (aligned, else at a
  // position offset), never n or below it, nor one in `leaving` (or its parent). REQUIRES mu_.
  std::vector<ClusterIndex::Candidate> StoredCandidatesLocked(
      const TrieNode& n, const absl::flat_hash_set<uint64_t>& leaving);
  // Re-encodes node_id's exact reconstruction, losslessly, against the best of `candidates` when
  // that is smaller than the `current` bytes it stores (RecheckLocked, RecodeAgainstCentroid).
  // Returns the payload bytes saved (0: none was smaller); ABORTED when the node is gone.
  absl::StatusOr<uint64_t> RecodeIfSmallerLocked(
      uint64_t node_id, const BlockGeometry& g, uint64_t current,
      const std::vector<ClusterIndex::Candidate>& candidates);
  // RecodeIfSmallerLocked for the pass: counts what it saved (and, `standalone`, one more block
  // re-encoded as a residual) in the shard's Stats; 0 when the node went meanwhile.
  absl::StatusOr<uint64_t> RecodeAndCountLocked(
      uint64_t node_id, const BlockGeometry& g, uint64_t current,
      const std::vector<ClusterIndex::Candidate>& candidates, bool standalone);
  // The exact reconstruction of node_id (what a re-encoding stores again, bit-exact). ABORTED
  // when it is gone; drops what fails its own check.
  absl::Status ReconstructExactLocked(uint64_t node_id, const BlockGeometry& g,
                                      std::vector<uint8_t>* recon);
  // --- The pass's per-group work (cluster_policy_pass.cc); these take write_mu_ themselves ---
  // One group of RunClusterPass; *done: every member visited (the group can be settled).
  absl::StatusOr<uint32_t> SettleClusterGroup(const std::vector<uint64_t>& ids, uint32_t budget,
                                              bool* done);
  // Codes `members` (of one group) against `elected`, each when smaller than what it stores now
  // (its exact reconstruction, losslessly). When `elected` is itself a residual (lossless) it is
  // first re-encoded standalone, and only when the group's bytes fall overall, or to swap with
  // the block alone in its group it is coded against at an offset (that block then goes to
  // recheck_); each change is published alone. Members that are centroids follow once their
  // dependents moved; the dependents they had outside the group go to recheck_. Returns the
  // encodings spent.
  absl::StatusOr<uint32_t> ConvergeGroup(uint64_t elected, const std::vector<uint64_t>& members);
  // A lossless block without dependents that a cluster move left standalone (a swap in
  // ConvergeGroup) or coded against the best window it found then: its exact reconstruction
  // coded against the candidates the Put path finds now (aligned, or at any position offset),
  // kept when smaller. Returns the encodings spent. REQUIRES write_mu_.
  absl::StatusOr<uint32_t> RecheckLocked(uint64_t node_id);
  // The pass's look at node_id (a queued block, LookLaterLocked): RecodeIfSmallerLocked against
  // the candidates older than it, when it is still standalone, without dependents and alone in
  // its group. Returns the encodings spent. REQUIRES write_mu_.
  absl::StatusOr<uint32_t> LookAtOffsetsLocked(uint64_t node_id);
  // Clears the offset_look mark of `ids` (one batch, records only) and takes them out of the
  // queue. REQUIRES write_mu_. Errors: the store's write errors (they stay queued).
  absl::Status ClearOffsetLooksLocked(const std::vector<uint64_t>& ids);
  // Adds node_id to recheck_ (`on`) or takes it out, and writes its record's `recheck` so a
  // restart finds it again (record only, when it changes). A node gone meanwhile is only taken
  // out. REQUIRES write_mu_. Errors: the store's write errors.
  absl::Status MarkRecheckLocked(uint64_t node_id, bool on);

  ModelShard* const shard_;
  // Blocks a cluster move left for the pass to look at again (RecheckLocked): the nodes marked
  // TrieNode::recheck (persisted in their records, so found again at recovery). Guarded by the
  // shard's mu_.
  absl::flat_hash_set<uint64_t> recheck_;
  // Blocks queued for a look at any offset (LookLaterLocked): nodes marked TrieNode::offset_look
  // (at most kMaxUnlooked of them). Guarded by the shard's mu_.
  absl::flat_hash_set<uint64_t> unlooked_;
};

// The most blocks queued for a look at any offset per shard (8 bytes each).
inline constexpr size_t kMaxUnlooked = size_t{1} << 20;

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_CLUSTER_POLICY_H_
