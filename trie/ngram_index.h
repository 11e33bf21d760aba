// trie/ngram_index.h
//
// An index of token n-gram hashes over the nodes of one (namespace, model) trie: the hash of a
// window of `window` consecutive token ids inside a node -> (node id, offset of the window in the
// node). It finds the stored text a new block repeats at any position shift (ClusterIndex, the
// position-shifted near-duplicates of trie/cluster_index.h): a query hashes the block's windows at
// every offset; a hit says the block's token o repeats the node's token `offset`.
//
// Memory is bounded two ways. Sampling: a node of T tokens indexes its windows at offsets 0,
// k, 2k, ... (<= T - window), so (T - window) / k + 1 entries per node, with k the largest stride
// <= options.stride for which every T consecutive tokens of a stored path (two consecutive nodes)
// hold a whole sampled window (k <= T - window + 1 and the last sampled offset >= window - 1);
// the query side tries every offset, so a block that repeats T stored tokens is found at any
// shift (T = 16, window 8: k = 4, 3 entries per node). Cap: a hash holds at most
// max_per_hash entries, the oldest (later nodes with the same n-gram are not indexed; a frequent
// n-gram is a weak hint anyway). Entries are 12 bytes plus the hash map's overhead.
//
// Hashes are xxHash3 (BlockTrie::DefaultTokenHash) of the window's token ids; a hit is a hint
// only: callers compare the tokens (a collision returns another window).
// Not thread-safe: the owner (ClusterIndex, under ModelShard's mutex) serializes access.
#ifndef KVTRIE_TRIE_NGRAM_INDEX_H_
#define KVTRIE_TRIE_NGRAM_INDEX_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace kvtrie {

struct NgramIndexOptions {
  // Tokens per window. A node of T tokens uses min(window, T / 2) (at least 1), and so does a
  // query of a block of T tokens.
  uint32_t window = 8;
  uint32_t stride = 4;        // offsets indexed per node: multiples of at most stride (see above)
  uint32_t max_per_hash = 8;  // entries kept per hash (0 = no cap)
};

class NgramIndex {
 public:
  struct Hit {
    uint64_t node_id = 0;
    uint32_t offset = 0;  // the window starts at the node's token `offset`
  };

  explicit NgramIndex(const NgramIndexOptions& options = {});

  // The window length and the sampling stride used for nodes / blocks of `block_tokens` tokens.
  uint32_t WindowFor(size_t block_tokens) const;
  uint32_t StrideFor(size_t block_tokens) const;

  // Indexes the sampled windows of node `node_id` holding `tokens`. Adding a node twice indexes
  // it twice (callers Remove first).
  void Add(uint64_t node_id, absl::Span<const uint32_t> tokens);
  // Forgets node `node_id`'s windows (`tokens` as it was added with).
  void Remove(uint64_t node_id, absl::Span<const uint32_t> tokens);

  // The indexed windows whose hash equals that of `window` (tokens unchecked), oldest first.
  absl::Span<const Hit> Lookup(absl::Span<const uint32_t> window) const;

  size_t num_entries() const { return num_entries_; }
  size_t num_hashes() const { return map_.size(); }

  static uint64_t Hash(absl::Span<const uint32_t> window);

 private:
  NgramIndexOptions options_;
  absl::flat_hash_map<uint64_t, std::vector<Hit>> map_;  // window hash -> hits, oldest first
  size_t num_entries_ = 0;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_NGRAM_INDEX_H_
