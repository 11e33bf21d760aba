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
  // Other depth or other tokens: no aligned candidate (the n-gram index, one-token windows here,
  // may find the tokens at another position: shifted candidates only).
  for (const auto& c : index.FindCandidates(&t.trie, t.d, 2, block, 21, 1e9, 10)) {
    EXPECT_TRUE(c.shifted);
  }
  for (const auto& c :
       index.FindCandidates(&t.trie, t.d, 3, std::vector<uint32_t>{5, 7}, 21, 1e9, 10)) {
    EXPECT_TRUE(c.shifted);
  }
  ClusterIndex half_block({.ngram_index = false});  // shifts within a block / 2 only: nothing
  t.trie.ForEach([&](const TrieNode& n) { half_block.Add(n); });
  EXPECT_TRUE(half_block.FindCandidates(&t.trie, t.d, 2, block, 21, 1e9, 10).empty());
  EXPECT_TRUE(
      half_block.FindCandidates(&t.trie, t.d, 3, std::vector<uint32_t>{5, 7}, 21, 1e9, 10).empty());
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

// Block tokens 4. Stored: a [1 2 3 4] -> b [5 6 7 8]. Branch a2 [9 1 2 3] repeats a's text one
// token later (its start, position -1, is before the first block: skipped); its child
// [4 5 6 7] repeats the end of a and the start of b one token later: a shifted candidate.
TEST(ClusterIndex, PositionShiftedRepeatIsAShiftedCandidateWhereAWindowIsStored) {
  BlockTrie trie(4);
  ClusterIndex index;
  TrieNode* a = trie.AddChild(trie.root(), 1, std::vector<uint32_t>{1, 2, 3, 4}, {});
  TrieNode* b = trie.AddChild(a, 2, std::vector<uint32_t>{5, 6, 7, 8}, {});
  index.Add(*a);
  index.Add(*b);
  auto c =
      index.FindCandidates(&trie, trie.root(), 1, std::vector<uint32_t>{9, 1, 2, 3}, 0, 1e9, 4);
  EXPECT_TRUE(c.empty());
  TrieNode* a2 = trie.AddChild(trie.root(), 3, std::vector<uint32_t>{9, 1, 2, 3}, {});
  index.Add(*a2);
  c = index.FindCandidates(&trie, a2, 2, std::vector<uint32_t>{4, 5, 6, 7}, 0, 1e9, 4);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_TRUE(c[0].shifted);
  EXPECT_EQ(c[0].node_id, b->id);  // the centroid: the window's end
  EXPECT_EQ(c[0].reference_parent_id, a->id);
  EXPECT_EQ(c[0].token_shift, 1u);  // token 0 from a's last token, tokens 1..3 from b's 0..2
  EXPECT_EQ(c[0].rotation, 1);      // one position later
  EXPECT_EQ(c[0].matched_tokens, 4u);
  // Nothing was clustered yet: the index only proposes; the skipped one is counted.
  ClusterStats s;
  index.AddStats(&trie, &s);
  EXPECT_EQ(s.position_shifted_skipped, 1u);
  EXPECT_EQ(s.position_shifted_coded, 0u);
  index.CountShifted(true);
  ClusterStats s2;
  index.AddStats(&trie, &s2);
  EXPECT_EQ(s2.position_shifted_coded, 1u);
}

// A token deleted: [6 7 8 9] at depth 2 repeats b's tokens 1..3 one position earlier and needs
// b's child to continue it; without one it is a tail window of b; a child that continues it but
// is itself a residual is no centroid (skipped).
TEST(ClusterIndex, ShiftedWindowNeedsAStandaloneContinuation) {
  BlockTrie trie(4);
  ClusterIndex index;
  TrieNode* a = trie.AddChild(trie.root(), 1, std::vector<uint32_t>{1, 2, 3, 4}, {});
  TrieNode* b = trie.AddChild(a, 2, std::vector<uint32_t>{5, 6, 7, 8}, {});
  TrieNode* x = trie.AddChild(trie.root(), 3, std::vector<uint32_t>{1, 2, 4, 5}, {});
  index.Add(*a);
  index.Add(*b);
  index.Add(*x);
  const std::vector<uint32_t> block{6, 7, 8, 9};
  // Nothing stored after b: a tail window, b's last 3 tokens (token 3 from b's last one).
  auto tail = index.FindCandidates(&trie, x, 2, block, 0, 1e9, 4);
  ASSERT_EQ(tail.size(), 1u);
  EXPECT_TRUE(tail[0].tail);
  EXPECT_EQ(tail[0].node_id, b->id);
  EXPECT_EQ(tail[0].reference_parent_id, 0u);
  EXPECT_EQ(tail[0].token_shift, 3u);
  EXPECT_EQ(tail[0].rotation, -1);
  EXPECT_EQ(tail[0].matched_tokens, 3u);
  TrieNode* c = trie.AddChild(b, 4, std::vector<uint32_t>{9, 10, 11, 12}, {});
  c->reference_node_id = 99;  // a residual: never a centroid
  index.Add(*c);
  EXPECT_TRUE(index.FindCandidates(&trie, x, 2, block, 0, 1e9, 4).empty());
  index.Remove(*c);
  c->reference_node_id = 0;
  index.Add(*c);
  auto cands = index.FindCandidates(&trie, x, 2, block, 0, 1e9, 4);
  ASSERT_EQ(cands.size(), 1u);
  EXPECT_FALSE(cands[0].tail);
  EXPECT_EQ(cands[0].node_id, c->id);
  EXPECT_EQ(cands[0].reference_parent_id, b->id);
  EXPECT_EQ(cands[0].token_shift, 3u);
  EXPECT_EQ(cands[0].rotation, -1);
  EXPECT_EQ(cands[0].matched_tokens, 4u);
  // Over the distance limit: gated, and skipped.
  EXPECT_TRUE(index.FindCandidates(&trie, x, 2, block, 1e6, 10, 4).empty());
  ClusterStats s;
  index.AddStats(&trie, &s);
  EXPECT_EQ(s.position_shifted_skipped, 2u);  // c a residual; over the distance limit
  EXPECT_GE(s.gated_by_distance, 1u);
}

// Any shift (the n-gram index, NearDupOptions::ngram_index). Block tokens 4 (windows of 2).
// Stored: a [1 2 3 4] -> b [5 6 7 8] -> c [9 10 11 12]; another branch x -> y, and a new block at
// depth 3 (positions 8..11) that repeats the stored text 3 positions later (positions 5..8: the
// end of b and the start of c), or 4 later (b exactly: token_shift 0, no parent). Before the
// n-gram index (ngram_index = false) shifts beyond 2 were not searched.
TEST(ClusterIndex, AnyShiftIsFoundThroughTheNgramIndex) {
  BlockTrie trie(4);
  ClusterIndex index;
  ClusterIndex half_block({.ngram_index = false});
  TrieNode* a = trie.AddChild(trie.root(), 1, std::vector<uint32_t>{1, 2, 3, 4}, {});
  TrieNode* b = trie.AddChild(a, 2, std::vector<uint32_t>{5, 6, 7, 8}, {});
  TrieNode* c = trie.AddChild(b, 3, std::vector<uint32_t>{9, 10, 11, 12}, {});
  TrieNode* x = trie.AddChild(trie.root(), 4, std::vector<uint32_t>{20, 21, 22, 23}, {});
  TrieNode* y = trie.AddChild(x, 5, std::vector<uint32_t>{24, 25, 26, 27}, {});
  for (TrieNode* n : {a, b, c, x, y}) {
    index.Add(*n);
    half_block.Add(*n);
  }
  const std::vector<uint32_t> later3{6, 7, 8, 9};
  auto cands = index.FindCandidates(&trie, y, 3, later3, 0, 1e9, 4);
  ASSERT_EQ(cands.size(), 1u);
  EXPECT_TRUE(cands[0].shifted);
  EXPECT_FALSE(cands[0].tail);
  EXPECT_EQ(cands[0].node_id, c->id);
  EXPECT_EQ(cands[0].reference_parent_id, b->id);
  EXPECT_EQ(cands[0].token_shift, 3u);
  EXPECT_EQ(cands[0].rotation, 3);
  EXPECT_EQ(cands[0].matched_tokens, 4u);
  EXPECT_TRUE(half_block.FindCandidates(&trie, y, 3, later3, 0, 1e9, 4).empty());

  const std::vector<uint32_t> later4{5, 6, 7, 8};
  cands = index.FindCandidates(&trie, y, 3, later4, 0, 1e9, 4);
  ASSERT_EQ(cands.size(), 1u);
  EXPECT_EQ(cands[0].node_id, b->id);
  EXPECT_EQ(cands[0].reference_parent_id, 0u);
  EXPECT_EQ(cands[0].token_shift, 0u);
  EXPECT_EQ(cands[0].rotation, 4);
  EXPECT_EQ(cands[0].matched_tokens, 4u);
  EXPECT_TRUE(half_block.FindCandidates(&trie, y, 3, later4, 0, 1e9, 4).empty());

  // The index forgets removed nodes; entries are bounded by the sampling (stride 2 here).
  ClusterStats s;
  index.AddStats(&trie, &s);
  EXPECT_EQ(s.ngram_entries, 5u * 2);
  index.Remove(*c);
  ClusterStats after;
  index.AddStats(&trie, &after);
  EXPECT_EQ(after.ngram_entries, 4u * 2);
}

}  // namespace
}  // namespace kvtrie
