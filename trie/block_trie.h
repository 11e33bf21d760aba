// trie/block_trie.h
//
// The radix trie of one (namespace, model): every node is one full block of `block_tokens` token
// ids, and its path from the root is the token prefix the block's KV belongs to. Each node also
// carries its tokens' surprisal (bits) and its path surprisal -log2 P(prefix) (the paper's Layer 1
// edge weights).
//
// Layout (path compression): nodes stay one per block (ids, tiers and pins refer to them), and
// every node also belongs to exactly one TrieChain, a compressed edge: a maximal run of nodes
// n_1 -> n_2 -> ... -> n_k in which each but the last has exactly one child (the next), and n_1
// is a child of the root or of a node with two or more children. A chain keeps its nodes' token
// ids back to back (k * block_tokens uint32s), their ids and their node pointers in three
// contiguous arrays. So a chain ends at a leaf or at a branch, and the children of a branch (or
// of the root) are the heads of chains. Children are found by a 64-bit hash of the block's
// token ids (XXH3) and confirmed by comparing the tokens, so a hash collision can never return
// another prefix's KV; along a chain no hash is used: every token of the request is compared
// with the stored ones (memcmp over the chain's array).
//
// Complexity of a longest-prefix match of T tokens (B = T / block_tokens blocks) that passes
// through h branch points: one memcmp of T tokens (the memory bandwidth of reading 2 x 4T bytes)
// plus h hash probes; MatchIds copies the B ids from the chains' id arrays (no node is touched),
// MatchVisit touches each of the B nodes. AddChild is O(1) amortized, except when it makes a
// node with one child a branch: then its chain is split, moving the shorter side (O(min) of the
// two parts). RemoveSubtree is O(subtree) plus, when it leaves a branch with one child, a merge
// of two chains that moves the shorter one. Memory: 4 bytes per token + 16 per node beside the
// node itself.
//
// Not thread-safe: the owner (ModelShard, trie/model_shard.h) serializes access (concurrent
// const calls are safe). The hot payload copy and the eviction state of a node are not here:
// TierManager (trie/tier_manager.h) owns them.
// Source: radix tree over token blocks as in SGLang's RadixAttention and vLLM's prefix caching
// (hash of the block's tokens chained with its parent), path-compressed as in a PATRICIA /
// radix tree (Morrison 1968); Magarshak 2026 §1 for the surprisal.
#ifndef KVTRIE_TRIE_BLOCK_TRIE_H_
#define KVTRIE_TRIE_BLOCK_TRIE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "codec/block_codec.h"

namespace kvtrie {

struct TrieChain;

struct TrieNode {
  uint64_t id = 0;  // unique in its (namespace, model) trie; 0 for the root
  // Set while a delete or eviction of this node is being written: readers no longer match it.
  // Changed only through BlockTrie::SetRemoving (its chain counts them).
  bool removing = false;

  TrieNode* parent = nullptr;
  uint32_t depth = 0;                 // in blocks; root = 0, its children 1
  std::vector<uint32_t> token_ids;    // block_tokens ids (empty for the root)
  std::vector<float> surprisal_bits;  // one per token, bits
  double path_surprisal_bits = 0;     // sum of surprisal from the root through this block

  // The compressed edge holding this node (null for the root), kept by BlockTrie; the node's
  // slot in the chain's arrays is chain_pos - chain->base.
  TrieChain* chain = nullptr;
  int64_t chain_pos = 0;

  // Storage of the block (set by the store).
  Encoding encoding = Encoding::kRaw;
  uint64_t bytes_logical = 0;  // dense bytes in the model dtype
  uint64_t bytes_stored = 0;   // encoded bytes
  float rel_rms_error_k = 0;   // achieved by the encoding (0 when bit-exact)
  float rel_rms_error_v = 0;
  uint64_t hits = 0;                   // Gets that returned this node
  uint64_t reference_node_id = 0;      // the centroid this block is a residual of (0 = none)
  uint32_t predictor_version = 0;      // the learned state it is coded against (0 = none)
  bool error_client_reported = false;  // rel_rms_error_* were reported by its encoding client
  // Its reconstruction is not what its Put sent (a lossy encoding, the server's or the client's;
  // rel_rms_error_* say by how much), however it is coded now: the cluster pass and re-elections
  // code the exact reconstruction again, LOSSLESS, and keep this. What a Delete or an eviction
  // decides retain vs re-elect from (trie/cluster_policy.h), never from `encoding`.
  bool lossy = false;
  // A RESIDUAL block's error target as its Put asked, kept however it is re-coded (0 = none).
  float target_rel_rms = 0;
  // The cluster pass looks at it again once its groups are settled (ClusterPolicy's recheck_,
  // which holds exactly these nodes); persisted, so a restart does not forget it.
  bool recheck = false;
  // Stored without a near-duplicate search and not yet looked at by the cluster pass for a block
  // it repeats at any offset (ClusterPolicy::LookLaterLocked); persisted, cleared once looked at.
  bool offset_look = false;
  // Client-encoded and accepted without a decode (--verify_encoded_puts=structure, or outside
  // the sample): the first Put that would deduplicate onto it decodes it first, and it is dropped
  // if it does not decode (PutEncoder::ApplyPut). In memory only: recovery sets it again on every
  // client-encoded node that is not RAW.
  bool unverified = false;
  // Its prefix was deleted but near-duplicates are coded lossy against it (as their centroid, or
  // the parent of one): kept for them only, matched by no token lookup, never a candidate, never
  // evicted; removed with its last dependent (trie/cluster_policy.h, "Retained centroids"). Changed
  // only through BlockTrie::SetRetained.
  bool retained = false;
  // Token lookups stop before it (MatchIds; ModelShard::MatchLive).
  bool hidden() const { return removing || retained; }

  // Children by token hash; a bucket holds more than one node only on a hash collision.
  absl::flat_hash_map<uint64_t, absl::InlinedVector<TrieNode*, 1>> children;

  size_t num_children() const;

  // Token position of the block's first token.
  uint32_t token_offset() const { return (depth - 1) * static_cast<uint32_t>(token_ids.size()); }
};

// A compressed edge (see the layout above). Slot i (0 = the head, nearest the root) holds
// nodes[i], ids[i] == nodes[i]->id and tokens[i * block_tokens, (i + 1) * block_tokens) ==
// nodes[i]->token_ids. A node's slot is node->chain_pos - base, so moving the slots of a chain
// (a split or merge at its front) changes `base`, not the nodes.
struct TrieChain {
  int64_t base = 0;
  std::vector<uint32_t> tokens;
  std::vector<uint64_t> ids;
  std::vector<TrieNode*> nodes;
  size_t removing = 0;  // nodes hidden() (`removing` or `retained` set): lookups stop there

  size_t size() const { return nodes.size(); }
  size_t SlotOf(const TrieNode* n) const { return static_cast<size_t>(n->chain_pos - base); }
};

class BlockTrie {
 public:
  // Hash of one block's token ids. The default is XXH3-64 of the ids as little-endian uint32.
  using TokenHash = std::function<uint64_t(absl::Span<const uint32_t>)>;
  static uint64_t DefaultTokenHash(absl::Span<const uint32_t> token_ids);

  explicit BlockTrie(uint32_t block_tokens, TokenHash hash = DefaultTokenHash);
  BlockTrie(const BlockTrie&) = delete;
  BlockTrie& operator=(const BlockTrie&) = delete;

  uint32_t block_tokens() const { return block_tokens_; }
  TrieNode* root() { return &root_; }
  const TrieNode* root() const { return &root_; }
  size_t num_nodes() const { return by_id_.size(); }
  size_t num_chains() const { return chains_.size(); }

  // The nodes of the longest stored prefix of `token_ids`, root's child first; at most
  // `max_blocks` (0 = no limit). Only full blocks of `token_ids` are considered.
  std::vector<TrieNode*> Match(absl::Span<const uint32_t> token_ids, size_t max_blocks = 0) const;
  // As Match without building the path: calls visit(node) for each matched node, root's child
  // first, and stops before the first for which it returns false. Returns the nodes visited.
  template <typename Visit>
  size_t MatchVisit(absl::Span<const uint32_t> token_ids, size_t max_blocks, Visit visit) const;
  // Appends to `ids` the ids of the longest stored prefix of `token_ids` that has no hidden() node
  // (as Match, stopping before the first such node), copied from the chains' id
  // arrays without touching the nodes. Returns the number appended.
  size_t MatchIds(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                  std::vector<uint64_t>* ids) const;

  // The child of `parent` whose tokens equal `block` (block_tokens ids), or nullptr.
  TrieNode* FindChild(const TrieNode* parent, absl::Span<const uint32_t> block) const;

  // Adds a child of `parent` holding `block`. REQUIRES: FindChild(parent, block) == nullptr,
  // id != 0 and unused, block.size() == block_tokens, surprisal empty or block.size() values.
  TrieNode* AddChild(TrieNode* parent, uint64_t id, absl::Span<const uint32_t> block,
                     absl::Span<const float> surprisal_bits);

  // Set node->removing / node->retained (not the root), keeping its chain's count.
  void SetRemoving(TrieNode* node, bool removing);
  void SetRetained(TrieNode* node, bool retained);

  // The node with `id`, or nullptr (the root has id 0 and is returned for 0).
  TrieNode* Find(uint64_t id);

  // Removes `node` (not the root) and its whole subtree; appends the removed nodes' ids,
  // children before parents, to `removed`.
  void RemoveSubtree(TrieNode* node, std::vector<uint64_t>* removed);

  // Calls fn(node) for every node except the root, parents before children.
  void ForEach(const std::function<void(const TrieNode&)>& fn) const;

  // INTERNAL naming the first broken invariant of the chains (maximal, heads as described
  // above, arrays equal to their nodes, slots, removing counts); for tests. O(nodes).
  absl::Status CheckChains() const;

 private:
  // Blocks [0, n) that are equal in `stored` and `wanted` (block_tokens ids each), from the
  // first: memcmp over chunks, then block by block inside the chunk that differs.
  size_t CommonBlocks(const uint32_t* stored, const uint32_t* wanted, size_t n) const;
  // How many slots of `chain`, from its head, equal the next blocks of `tokens` (at most
  // blocks_left); the head's block is taken as equal (FindChild compared it).
  size_t MatchChain(const TrieChain& chain, const uint32_t* tokens, size_t blocks_left) const;
  // The one walk of MatchVisit and MatchIds: per chain met, on_chain(chain, k) with the k of its
  // blocks that match returns how many of them it takes (<= k); a chain not taken whole ends the
  // walk. Returns the blocks taken.
  template <typename OnChain>
  size_t WalkChains(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                    OnChain on_chain) const;

  TrieChain* NewChain();
  void DeleteChain(TrieChain* chain);
  // Appends node (tokens, id) as the last slot of `chain`.
  void Append(TrieChain* chain, TrieNode* node);
  // Moves slots [from, to) of `src` to the end of `dst`, re-pointing their nodes.
  void MoveSlots(TrieChain* src, size_t from, size_t to, TrieChain* dst);
  // Splits node's chain after node: the slots after it become a chain of their own.
  void SplitAfter(TrieNode* node);
  // `tail` is the last slot of its chain and has exactly one child, `head`: one chain again.
  void Merge(TrieNode* tail, TrieNode* head);

  const uint32_t block_tokens_;
  const TokenHash hash_;
  TrieNode root_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<TrieNode>> by_id_;  // owns every non-root node
  absl::flat_hash_map<const TrieChain*, std::unique_ptr<TrieChain>> chains_;  // owns the chains
};

inline size_t BlockTrie::CommonBlocks(const uint32_t* stored, const uint32_t* wanted,
                                      size_t n) const {
  // 16 KiB per memcmp: a mismatch costs at most one chunk compared twice.
  const size_t chunk = std::max<size_t>(1, 4096 / block_tokens_);
  const size_t block_bytes = block_tokens_ * sizeof(uint32_t);
  size_t i = 0;
  while (i < n) {
    const size_t m = std::min(chunk, n - i);
    const size_t at = i * block_tokens_;
    if (std::memcmp(stored + at, wanted + at, m * block_bytes) == 0) {
      i += m;
      continue;
    }
    for (;; ++i) {
      const size_t t = i * block_tokens_;
      if (std::memcmp(stored + t, wanted + t, block_bytes) != 0) return i;
    }
  }
  return n;
}

inline size_t BlockTrie::MatchChain(const TrieChain& chain, const uint32_t* tokens,
                                    size_t blocks_left) const {
  const size_t avail = std::min(chain.size(), blocks_left);
  if (avail <= 1) return avail;
  return 1 + CommonBlocks(chain.tokens.data() + block_tokens_, tokens + block_tokens_, avail - 1);
}

template <typename OnChain>
size_t BlockTrie::WalkChains(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                             OnChain on_chain) const {
  size_t blocks = token_ids.size() / block_tokens_;
  if (max_blocks != 0 && max_blocks < blocks) blocks = max_blocks;
  const TrieNode* node = &root_;
  size_t b = 0;
  while (b < blocks) {
    const uint32_t* tokens = token_ids.data() + b * block_tokens_;
    const TrieNode* head = FindChild(node, absl::MakeConstSpan(tokens, block_tokens_));
    if (head == nullptr) break;
    const TrieChain& chain = *head->chain;  // head is its first slot
    const size_t taken = on_chain(chain, MatchChain(chain, tokens, blocks - b));
    b += taken;
    if (taken < chain.size()) break;  // a mismatch inside the chain, or the walk stopped there
    node = chain.nodes.back();
  }
  return b;
}

template <typename Visit>
size_t BlockTrie::MatchVisit(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                             Visit visit) const {
  return WalkChains(token_ids, max_blocks, [&](const TrieChain& chain, size_t k) {
    for (size_t i = 0; i < k; ++i) {
      if (!visit(chain.nodes[i])) return i;
    }
    return k;
  });
}

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_BLOCK_TRIE_H_
