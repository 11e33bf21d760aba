#include "trie/cluster_index.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvtrie {
namespace {

// A small trie, block_tokens = 2, surprisal in bits per token:
//   root ─ a [1 2] (1, 2) ─ b [3 4] (0.5, 0.5) ─ c [5 6] (4, 4)
//                        └─ d [7 8] (2, 6)    ─ e [5 6] (1, 3)
// path: a 3, b 4, c 12, d 11, e 15.
struct SmallTrie {
  BlockTrie trie{2};
  TrieNode *a, *b, *c, *d, *e;
  SmallTrie() {
    a = trie.AddChild(trie.root(), 1, std::vector<uint32_t>{1, 2}, std::vector<float>{1, 2});
    b = trie.AddChild(a, 2, std::vector<uint32_t>{3, 4}, std::vector<float>{0.5, 0.5});
    c = trie.AddChild(b, 3, std::vector<uint32_t>{5, 6}, std::vector<float>{4, 4});
    d = trie.AddChild(a, 4, std::vector<uint32_t>{7, 8}, std::vector<float>{2, 6});
    e = trie.AddChild(d, 5, std::vector<uint32_t>{5, 6}, std::vector<float>{1, 3});
  }
};

TEST(TrieDistance, MatchesHandComputation) {
  SmallTrie t;
  EXPECT_DOUBLE_EQ(t.c->path_surprisal_bits, 12);
  EXPECT_DOUBLE_EQ(t.e->path_surprisal_bits, 15);
  EXPECT_EQ(LowestCommonAncestor(t.c, t.e), t.a);
  // c and e: 12 + 15 - 2 * 3 = 21 bits not shared.
  EXPECT_DOUBLE_EQ(TrieDistanceBits(t.c, t.e), 21);
  // b and d: 4 + 11 - 6 = 9.
  EXPECT_DOUBLE_EQ(TrieDistanceBits(t.b, t.d), 9);
  // An ancestor: c and a share a: 12 + 3 - 6 = 9 = the surprisal of b and c.
  EXPECT_DOUBLE_EQ(TrieDistanceBits(t.c, t.a), 9);
  EXPECT_DOUBLE_EQ(TrieDistanceBits(t.c, t.c), 0);
  // Nothing shared but the root: d and a fresh root child.
  TrieNode* f =
      t.trie.AddChild(t.trie.root(), 6, std::vector<uint32_t>{9, 9}, std::vector<float>{1, 1});
  EXPECT_EQ(LowestCommonAncestor(t.d, f), t.trie.root());
  EXPECT_DOUBLE_EQ(TrieDistanceBits(t.d, f), 11 + 2);
}

TEST(ClusterIndex, SameTokensSameDepthAreCandidatesGatedByDistance) {
  SmallTrie t;
  ClusterIndex index;
  t.trie.ForEach([&](const TrieNode& n) { index.Add(n); });
  // A new block [5 6] under d (anchor d, depth 3), path 11 + 10 = 21: c is a candidate at distance
  // 21 + 12 - 2 * 3 = 27; e has depth 3 too but is under d: distance 21 + 15 - 2 * 11 = 14.
  const std::vector<uint32_t> block = {5, 6};
  auto all = index.FindCandidates(&t.trie, t.d, 3, block, 21, 1e9, 10);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].node_id, t.e->id);  // nearest first
  EXPECT_DOUBLE_EQ(all[0].distance_bits, 14);
  EXPECT_EQ(all[1].node_id, t.c->id);
  EXPECT_DOUBLE_EQ(all[1].distance_bits, 27);
  auto gated = index.FindCandidates(&t.trie, t.d, 3, block, 21, 20, 10);
  ASSERT_EQ(gated.size(), 1u);
  EXPECT_EQ(gated[0].node_id, t.e->id);
  // Other depth or other tokens: nothing.
  EXPECT_TRUE(index.FindCandidates(&t.trie, t.d, 2, block, 21, 1e9, 10).empty());
  EXPECT_TRUE(
      index.FindCandidates(&t.trie, t.d, 3, std::vector<uint32_t>{5, 7}, 21, 1e9, 10).empty());
  ClusterStats s;
  index.AddStats(&t.trie, &s);
  EXPECT_EQ(s.near_dup_groups, 1u);  // {c, e}
  EXPECT_EQ(s.gated_by_distance, 1u);
  // Branch distance of e to c (21 bits) is in bucket [16, 32).
  EXPECT_EQ(s.branch_distance_histogram[HistogramBucket(21)], 1u);
  EXPECT_EQ(HistogramBucket(21), 5);
  uint64_t total = 0;
  for (uint64_t v : s.path_surprisal_histogram) total += v;
  EXPECT_EQ(total, 5u);
}

TEST(ClusterIndex, ResidualsAreNotCentroidsAndDependentsAreTracked) {
  SmallTrie t;
  ClusterIndex index;
  t.trie.ForEach([&](const TrieNode& n) { index.Add(n); });
  index.Remove(*t.e);
  t.e->reference_node_id = t.c->id;  // e is now a residual of c
  index.Add(*t.e);
  EXPECT_TRUE(index.HasDependents(t.c->id));
  EXPECT_EQ(index.Dependents(t.c->id), std::vector<uint64_t>{t.e->id});
  auto cands = index.FindCandidates(&t.trie, t.d, 3, std::vector<uint32_t>{5, 6}, 21, 1e9, 10);
  ASSERT_EQ(cands.size(), 1u);
  EXPECT_EQ(cands[0].node_id, t.c->id);
  ClusterStats s;
  index.AddStats(&t.trie, &s);
  EXPECT_EQ(s.centroids, 1u);
  EXPECT_EQ(s.residual_nodes, 1u);
  index.Remove(*t.e);
  EXPECT_FALSE(index.HasDependents(t.c->id));
}

TEST(ClusterIndex, PositionShiftedRepeatIsCountedAsSkipped) {
  BlockTrie trie(4);
  ClusterIndex index;
  TrieNode* a = trie.AddChild(trie.root(), 1, std::vector<uint32_t>{1, 2, 3, 4}, {});
  TrieNode* b = trie.AddChild(a, 2, std::vector<uint32_t>{10, 11, 12, 13}, {});
  index.Add(*a);
  index.Add(*b);
  // Another branch: [1 2 3 9] then [x 10 11 12]: the same text one token later.
  TrieNode* a2 = trie.AddChild(trie.root(), 3, std::vector<uint32_t>{1, 2, 3, 9}, {});
  index.Add(*a2);
  auto c = index.FindCandidates(&trie, a2, 2, std::vector<uint32_t>{9, 10, 11, 12}, 0, 1e9, 4);
  EXPECT_TRUE(c.empty());
  ClusterStats s;
  index.AddStats(&trie, &s);
  EXPECT_EQ(s.position_shifted_skipped, 1u);
}

}  // namespace
}  // namespace kvtrie
