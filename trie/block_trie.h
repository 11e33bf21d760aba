// trie/block_trie.h
//
// The radix trie of one (namespace, model): every node is one full block of `block_tokens` token
// ids, and its path from the root is the token prefix the block's KV belongs to. Children are
// found by a 64-bit hash of the block's token ids (XXH3) and confirmed by comparing the tokens,
// so a hash collision can never return another prefix's KV. Each node also carries its tokens'
// surprisal (bits) and its path surprisal -log2 P(prefix) (the paper's Layer 1 edge weights).
//
// Longest-prefix match costs one token comparison per block, plus one hash where a node has more
// than one child: O(tokens).
// Not thread-safe: the owner (ModelShard, trie/model_shard.h) serializes access. The hot payload
// copy and the eviction state of a node are not here: TierManager (trie/tier_manager.h) owns them.
// Source: radix tree over token blocks as in SGLang's RadixAttention and vLLM's prefix caching
// (hash of the block's tokens chained with its parent); Magarshak 2026 §1 for the surprisal.
#ifndef KVTRIE_TRIE_BLOCK_TRIE_H_
#define KVTRIE_TRIE_BLOCK_TRIE_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"
#include "codec/block_codec.h"

namespace kvtrie {

struct TrieNode {
  // Match's fast path, first so that it shares the node's first cache lines: the child when
  // there is exactly one, else nullptr, and a copy of this node's tokens when block_tokens <=
  // kInlineTokens (kept by BlockTrie). A chain of single children is walked by comparing tokens,
  // one node (no separate token buffer) per block, without hashing or probing `children`.
  static constexpr size_t kInlineTokens = 16;
  TrieNode* only_child = nullptr;
  uint32_t inline_tokens[kInlineTokens] = {};
  uint64_t id = 0;  // unique in its (namespace, model) trie; 0 for the root
  // Set while a delete or eviction of this node is being written: readers no longer match it.
  bool removing = false;

  TrieNode* parent = nullptr;
  uint32_t depth = 0;                 // in blocks; root = 0, its children 1
  std::vector<uint32_t> token_ids;    // block_tokens ids (empty for the root)
  std::vector<float> surprisal_bits;  // one per token, bits
  double path_surprisal_bits = 0;     // sum of surprisal from the root through this block

  // Storage of the block (set by the store).
  Encoding encoding = Encoding::kRaw;
  uint64_t bytes_logical = 0;  // dense bytes in the model dtype
  uint64_t bytes_stored = 0;   // encoded bytes
  float rel_rms_error_k = 0;   // achieved by the encoding (0 when bit-exact)
  float rel_rms_error_v = 0;
  uint64_t hits = 0;               // Gets that returned this node
  uint64_t reference_node_id = 0;  // the centroid this block is a residual of (0 = none)

  // Children by token hash; a bucket holds more than one node only on a hash collision.
  absl::flat_hash_map<uint64_t, absl::InlinedVector<TrieNode*, 1>> children;

  size_t num_children() const;

  // Token position of the block's first token.
  uint32_t token_offset() const { return (depth - 1) * static_cast<uint32_t>(token_ids.size()); }
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

  // The nodes of the longest stored prefix of `token_ids`, root's child first; at most
  // `max_blocks` (0 = no limit). Only full blocks of `token_ids` are considered.
  std::vector<TrieNode*> Match(absl::Span<const uint32_t> token_ids, size_t max_blocks = 0) const;
  // As Match without building the path: calls visit(node) for each matched node, root's child
  // first, and stops before the first for which it returns false. Returns the nodes visited.
  // One pass: each node is read once, while its cache lines are in (id and `removing` share the
  // first two with the tokens).
  template <typename Visit>
  size_t MatchVisit(absl::Span<const uint32_t> token_ids, size_t max_blocks, Visit visit) const;

  // The child of `parent` whose tokens equal `block` (block_tokens ids), or nullptr.
  TrieNode* FindChild(const TrieNode* parent, absl::Span<const uint32_t> block) const;

  // Adds a child of `parent` holding `block`. REQUIRES: FindChild(parent, block) == nullptr,
  // id != 0 and unused, block.size() == block_tokens, surprisal empty or block.size() values.
  TrieNode* AddChild(TrieNode* parent, uint64_t id, absl::Span<const uint32_t> block,
                     absl::Span<const float> surprisal_bits);

  // The node with `id`, or nullptr (the root has id 0 and is returned for 0).
  TrieNode* Find(uint64_t id);

  // Removes `node` (not the root) and its whole subtree; appends the removed nodes' ids,
  // children before parents, to `removed`.
  void RemoveSubtree(TrieNode* node, std::vector<uint64_t>* removed);

  // Calls fn(node) for every node except the root, parents before children.
  void ForEach(const std::function<void(const TrieNode&)>& fn) const;

 private:
  const uint32_t block_tokens_;
  const TokenHash hash_;
  TrieNode root_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<TrieNode>> by_id_;  // owns every non-root node
};

template <typename Visit>
size_t BlockTrie::MatchVisit(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                             Visit visit) const {
  size_t blocks = token_ids.size() / block_tokens_;
  if (max_blocks != 0 && max_blocks < blocks) blocks = max_blocks;
  const TrieNode* node = &root_;
  const uint32_t* tokens = token_ids.data();
  const size_t block_bytes = block_tokens_ * sizeof(uint32_t);
  const bool inline_tokens = block_tokens_ <= TrieNode::kInlineTokens;
  size_t b = 0;
  for (; b < blocks; ++b, tokens += block_tokens_) {
    TrieNode* child = node->only_child;
    if (child != nullptr) {
      // One child: its tokens decide; no other child could match.
      if (TrieNode* next = child->only_child) __builtin_prefetch(next);
      const uint32_t* have = inline_tokens ? child->inline_tokens : child->token_ids.data();
      if (std::memcmp(have, tokens, block_bytes) != 0) break;
    } else {
      child = FindChild(node, absl::MakeConstSpan(tokens, block_tokens_));
      if (child == nullptr) break;
    }
    if (!visit(child)) break;
    node = child;
  }
  return b;
}

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_BLOCK_TRIE_H_
