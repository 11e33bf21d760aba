// trie/cluster_index.h
//
// The near-duplicate index of one (namespace, model) trie, and trie distance.
//
// Trie distance between nodes a and b (bits): path_surprisal(a) + path_surprisal(b)
// - 2 * path_surprisal(lca(a, b)) — the information of the two histories that is not shared. The
// paper's d_T(s, s') = -log2 P_M(s ∧ s') is the shared part, path_surprisal(lca).
//
// Near-duplicates: blocks with the same token ids at the same depth (so at the same positions) but
// a different history — a sentence that differed by a word and then continued identically. Every
// node is indexed by (depth, token ids); a new block's candidates are the indexed nodes that are
// stored standalone (a centroid is never itself a residual), whose trie distance to the new block
// is at most a limit (bits), nearest first. The store (kv_store_cluster.cc) encodes the block
// against each candidate and keeps the residual only when it is smaller than the standalone
// encoding; the chosen candidate becomes the block's centroid and the block its dependent.
// Choosing, per block, the candidate whose residual is smallest is an online
// medoid-by-residual-size; centroids are not re-elected when later members arrive.
//
// Position-shifted near-duplicates (tokens inserted or removed before repeated text, so the same
// tokens sit at other positions and keys after RoPE are rotated differently): when a new block has
// no aligned candidate, a window of its tokens that a stored node holds at another position
// detects one. The windows are an n-gram index (trie/ngram_index.h, flags --cluster_ngram_index,
// --cluster_ngram_tokens, --cluster_ngram_stride, --cluster_ngram_max_per_hash): windows of
// ngram_tokens (at most block_tokens / 2) sampled every ngram_stride offsets in each node, found at
// any shift (a clause, a sentence or whole blocks inserted or removed); beyond block_tokens / 2
// only a block that repeats all its tokens is one (a shorter repeat there is mostly a phrase the
// text repeats: trying it costs a centroid read and pins the centroid). Without it (the index
// off), half-block windows at every offset, at shifts within block_tokens / 2 only (as before
// issue 20). The stored path's tokens at the block's positions minus the shift span two
// consecutive nodes A -> B (parent, child), or exactly one node B when the shift is a multiple of
// block_tokens (token_shift 0, no parent); B becomes the candidate centroid (it must be
// standalone and within the distance limit), A its window's first tokens, and the codec predicts
// the block from them with B's keys turned by RoPE to the new positions
// (codec/reference_shift.h). Where A has no child that
// continues the window (the stored text ends there), A itself is the candidate with a tail
// window (its last tokens, then its last token repeated). Candidates are ranked by how many
// of the block's tokens the window repeats, then by distance. Stats: `position_shifted_coded`
// counts shifted blocks stored against a centroid; `position_shifted_skipped` those stored
// standalone: no usable window (its centroid itself a residual, over the distance limit, or the
// window before the first block), or a residual not smaller (also counted in
// residual_not_smaller).
//
// Namespaces: there is one index per (namespace, model) trie, so clusters never cross namespaces.
// Not thread-safe: the owner (ModelShard) serializes access under its mutex. It is the one owner
// of "dependents" (which nodes are coded against which centroid).
// Source: Magarshak 2026 §1 (layer 1, probabilistic prefix deduplication, d_T).
#ifndef KVTRIE_TRIE_CLUSTER_INDEX_H_
#define KVTRIE_TRIE_CLUSTER_INDEX_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/types/span.h"
#include "trie/block_trie.h"
#include "trie/ngram_index.h"

namespace kvtrie {

// Server options of the near-duplicate index (flags --near_dup_clusters,
// --cluster_max_distance_bits, --cluster_position_shifted, --cluster_ngram_*,
// --cluster_retain_deleted_centroids).
struct NearDupOptions {
  bool enabled = true;
  // Candidates farther than this trie distance (bits) are not tried. Two branches that differ by
  // one word and then continue identically drift apart by about twice the surprisal of what
  // follows (~10 bits per token on tests/data), so this bounds how far after a divergence
  // near-duplicates are still clustered.
  double max_distance_bits = 16384;
  uint32_t max_candidates = 2;  // candidates encoded per new block, nearest first
  // Code position-shifted near-duplicates against their centroid at the offset (see below);
  // false stores them standalone (counted as skipped), as before.
  bool position_shifted = true;
  // Find position-shifted near-duplicates at any shift through an n-gram index (see above);
  // false: half-block windows at shifts within block_tokens / 2 only.
  bool ngram_index = true;
  uint32_t ngram_tokens = 8;        // window length (at most block_tokens / 2 is used)
  uint32_t ngram_stride = 4;        // a node's windows are indexed every ngram_stride offsets
  uint32_t ngram_max_per_hash = 8;  // entries kept per n-gram hash, oldest (0 = no cap)
  // Delete of a centroid with a lossy member: keep it, unnamed, until its last member goes
  // (trie/cluster_policy.h, "Retained centroids": the namespace's bytes stay as they were). false:
  // the members elect a new centroid and every one is stored again bit-exact, lossless (the deleted
  // KV leaves the store at once; +205 % bytes on tests/data/neardup at target 0.1).
  bool retain_lossy_centroids = true;
};

// Log2 histogram over bits: bucket 0 = [0, 1), bucket i >= 1 = [2^(i-1), 2^i), the last bucket is
// open-ended.
inline constexpr int kHistogramBuckets = 24;
double HistogramUpperBits(int bucket);  // exclusive upper bound; +inf for the last
int HistogramBucket(double bits);

struct ClusterStats {
  uint64_t centroids = 0;        // standalone nodes with at least one dependent
  uint64_t residual_nodes = 0;   // nodes stored as a residual of a centroid
  uint64_t near_dup_groups = 0;  // (depth, tokens) groups holding more than one node
  // Counters since start (the Puts' encoding decisions).
  uint64_t candidates_tried = 0;      // (block, candidate) encodings tried
  uint64_t gated_by_distance = 0;     // candidates skipped: trie distance over the limit
  uint64_t residual_not_smaller = 0;  // blocks with candidates stored standalone (smaller)
  // New blocks that are position-shifted near-duplicates: stored against a centroid at the
  // offset, and stored standalone (see above for why).
  uint64_t position_shifted_coded = 0;
  uint64_t position_shifted_skipped = 0;
  uint64_t ngram_entries = 0;  // (node, offset) entries of the n-gram index (its memory bound)
  // Histograms (HistogramBucket): path surprisal of every node; trie distance of every node in a
  // near-duplicate group to the group's oldest node (the branch distances).
  uint64_t path_surprisal_histogram[kHistogramBuckets] = {};
  uint64_t branch_distance_histogram[kHistogramBuckets] = {};
  void Merge(const ClusterStats& o);
};

// The lowest common ancestor of a and b (the root if none other). REQUIRES: same trie.
const TrieNode* LowestCommonAncestor(const TrieNode* a, const TrieNode* b);
// Trie distance in bits (see above). REQUIRES: same trie.
double TrieDistanceBits(const TrieNode* a, const TrieNode* b);

class ClusterIndex {
 public:
  struct Candidate {
    uint64_t node_id = 0;
    double distance_bits = 0;
    // Position-shifted (codec/reference_shift.h): the window's first token_shift tokens are
    // reference_parent_id's last ones (node_id's parent; 0 when token_shift is 0: the window is
    // node_id, a whole number of blocks away), the rest node_id's first ones; keys
    // turn by `rotation` positions; matched_tokens of the block's tokens equal the window's.
    bool shifted = false;
    uint32_t token_shift = 0;
    int32_t rotation = 0;
    uint64_t reference_parent_id = 0;
    uint32_t matched_tokens = 0;
    // The window's end is not stored: node_id holds its start (reference_parent_id is 0).
    bool tail = false;
  };

  explicit ClusterIndex(const NearDupOptions& options = {});

  // Indexes `node` (already in the trie, reference_node_id set: a dependent of that centroid).
  void Add(const TrieNode& node);
  // Forgets `node` and its dependency edges (call before it leaves the trie).
  void Remove(const TrieNode& node);

  // Candidates for a new block of `block` token ids at `depth`, child of the chain whose deepest
  // stored node is `anchor` (the root if the prefix is new), whose path surprisal will be
  // `path_bits`: standalone nodes with the same tokens at the same depth, trie distance <=
  // max_distance_bits, nearest first, at most max_candidates. Without any, the position-shifted
  // candidates (shifted = true, best first, at most max_candidates). Counts gated ones, and a
  // shifted near-duplicate without a usable candidate as skipped. `self`: a stored block looking
  // for a centroid of its own (the cluster pass), never its own candidate (0 = a new block).
  std::vector<Candidate> FindCandidates(BlockTrie* trie, const TrieNode* anchor, uint32_t depth,
                                        absl::Span<const uint32_t> block, double path_bits,
                                        double max_distance_bits, size_t max_candidates,
                                        uint64_t self = 0);

  bool HasDependents(uint64_t node_id) const { return dependents_.contains(node_id); }
  // The nodes stored as residuals of `node_id`.
  std::vector<uint64_t> Dependents(uint64_t node_id) const;
  size_t NumDependents(uint64_t node_id) const;
  // Nodes in `node`'s group (the same tokens at the same depth, itself included).
  size_t GroupSize(const TrieNode& node) const;

  // The background pass (trie/cluster_pass.h): the (depth, tokens) groups of two or more nodes
  // that gained a node (or a node's encoding changed) since the pass last settled them, at most
  // `max`, each as (group key, its node ids). After a recovery every such group is dirty (nodes
  // are added back one by one), so a crashed pass resumes. SettleGroup marks a group clean when
  // its nodes are still exactly `ids` (a Put that added one meanwhile leaves it dirty).
  std::vector<std::pair<uint64_t, std::vector<uint64_t>>> DirtyGroups(size_t max) const;
  void SettleGroup(uint64_t key, std::vector<uint64_t> ids);
  size_t NumDirtyGroups() const { return dirty_groups_.size(); }

  void CountTried(uint64_t n) { counters_.candidates_tried += n; }
  void CountNotSmaller() { ++counters_.residual_not_smaller; }
  void CountShifted(bool coded) {
    ++(coded ? counters_.position_shifted_coded : counters_.position_shifted_skipped);
  }

  // Adds this index's numbers and histograms to `out`: O(near-duplicate groups), no walk of the
  // trie (counters are kept as nodes are added and removed).
  void AddStats(BlockTrie* trie, ClusterStats* out) const;

 private:
  static uint64_t GroupKey(uint32_t depth, absl::Span<const uint32_t> block);

  // (depth, tokens) -> every node with them (standalone or not), oldest first.
  absl::flat_hash_map<uint64_t, std::vector<uint64_t>> groups_;
  // Token windows -> (node, offset), for detecting position-shifted near-duplicates.
  bool any_shift_;  // NearDupOptions::ngram_index: shifts beyond block_tokens / 2 are searched
  NgramIndex windows_;
  absl::flat_hash_map<uint64_t, absl::flat_hash_set<uint64_t>> dependents_;  // centroid -> members
  absl::flat_hash_set<uint64_t> multi_groups_;  // groups_ keys holding two or more nodes
  absl::flat_hash_set<uint64_t> dirty_groups_;  // multi_groups_ the background pass must visit
  uint64_t path_surprisal_histogram_[kHistogramBuckets] = {};  // over indexed nodes
  ClusterStats counters_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_CLUSTER_INDEX_H_
