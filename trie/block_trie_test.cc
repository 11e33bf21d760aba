#include "trie/block_trie.h"

#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

std::vector<uint32_t> Tokens(size_t n, uint32_t start) {
  std::vector<uint32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

// Adds the full blocks of `tokens` below the root, reusing stored ones; returns the leaf.
TrieNode* Insert(BlockTrie& trie, absl::Span<const uint32_t> tokens, uint64_t* next_id) {
  TrieNode* at = trie.root();
  const uint32_t bt = trie.block_tokens();
  for (size_t b = 0; b < tokens.size() / bt; ++b) {
    auto block = tokens.subspan(b * bt, bt);
    TrieNode* child = trie.FindChild(at, block);
    at = child ? child : trie.AddChild(at, (*next_id)++, block, {});
  }
  return at;
}

TEST(BlockTrie, MatchReturnsTheLongestStoredBlockAlignedPrefix) {
  BlockTrie trie(4);
  uint64_t id = 1;
  auto a = Tokens(12, 100);
  Insert(trie, a, &id);
  EXPECT_EQ(trie.Match(a).size(), 3u);
  // Same first 6 tokens, then different: only the first full block matches.
  auto b = a;
  b[6] = 7;
  EXPECT_EQ(trie.Match(b).size(), 1u);
  // A partial trailing block never matches.
  EXPECT_EQ(trie.Match(absl::MakeSpan(a).subspan(0, 7)).size(), 1u);
  EXPECT_EQ(trie.Match(Tokens(12, 0)).size(), 0u);
  EXPECT_EQ(trie.Match(a, /*max_blocks=*/2).size(), 2u);
}

TEST(BlockTrie, SingleChildWalkFollowsAddsAndRemovals) {
  // Constant hash: every lookup that goes through `children` collides, so only token
  // comparisons can tell the branches apart, on the single-child walk and off it.
  BlockTrie trie(4, [](absl::Span<const uint32_t>) { return uint64_t{7}; });
  uint64_t id = 1;
  auto a = Tokens(16, 100);
  Insert(trie, a, &id);
  EXPECT_EQ(trie.root()->only_child, trie.Match(a)[0]);
  auto b = a;
  b[9] = 1;  // shares blocks 0-1 with a, then branches
  TrieNode* b_leaf = Insert(trie, b, &id);
  EXPECT_EQ(trie.Match(a).size(), 4u);
  EXPECT_EQ(trie.Match(b).size(), 4u);
  EXPECT_EQ(trie.Match(b).back(), b_leaf);
  TrieNode* fork = trie.Match(a)[1];
  EXPECT_EQ(fork->only_child, nullptr);  // two children
  // Remove a's branch: the fork has one child again and the walk takes it.
  std::vector<uint64_t> removed;
  trie.RemoveSubtree(trie.Match(a)[2], &removed);
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_EQ(fork->only_child, trie.Match(b)[2]);
  EXPECT_EQ(trie.Match(a).size(), 2u);
  EXPECT_EQ(trie.Match(b).size(), 4u);
  // A different block below a single child never matches it.
  auto c = b;
  c[15] = 0;
  EXPECT_EQ(trie.Match(c).size(), 3u);
  trie.RemoveSubtree(trie.Match(b)[2], &removed);
  EXPECT_EQ(fork->only_child, nullptr);  // no children
  EXPECT_EQ(trie.Match(b).size(), 2u);
}

TEST(BlockTrie, SharedPrefixIsStoredOnce) {
  BlockTrie trie(4);
  uint64_t id = 1;
  auto a = Tokens(16, 0);
  auto b = a;
  b[13] = 999;  // differs in the last block
  Insert(trie, a, &id);
  Insert(trie, b, &id);
  EXPECT_EQ(trie.num_nodes(), 5u);  // 3 shared + 2 leaves
  EXPECT_EQ(trie.Match(b).size(), 4u);
}

TEST(BlockTrie, HashCollisionNeverReturnsAnotherPrefix) {
  // Every block hashes to the same value: children share one bucket and only the token
  // comparison tells them apart.
  BlockTrie trie(4, [](absl::Span<const uint32_t>) { return uint64_t{42}; });
  uint64_t id = 1;
  auto a = Tokens(8, 0);
  auto b = Tokens(8, 50);
  TrieNode* leaf_a = Insert(trie, a, &id);
  EXPECT_EQ(trie.Match(b).size(), 0u);  // same hash, other tokens: no match
  TrieNode* leaf_b = Insert(trie, b, &id);
  EXPECT_NE(leaf_a, leaf_b);
  EXPECT_EQ(trie.root()->num_children(), 2u);
  ASSERT_EQ(trie.Match(a).size(), 2u);
  EXPECT_EQ(trie.Match(a).back(), leaf_a);
  EXPECT_EQ(trie.Match(b).back(), leaf_b);
  std::vector<uint64_t> removed;
  trie.RemoveSubtree(trie.Match(a).front(), &removed);
  EXPECT_EQ(trie.Match(a).size(), 0u);
  EXPECT_EQ(trie.Match(b).back(), leaf_b);  // the colliding sibling survives
}

TEST(BlockTrie, PathSurprisalSumsFromTheRoot) {
  BlockTrie trie(2);
  std::vector<uint32_t> t = {1, 2, 3, 4};
  TrieNode* n1 = trie.AddChild(trie.root(), 1, absl::MakeSpan(t).subspan(0, 2),
                               std::vector<float>{0.0f, 1.5f});
  TrieNode* n2 =
      trie.AddChild(n1, 2, absl::MakeSpan(t).subspan(2, 2), std::vector<float>{2.0f, 0.25f});
  EXPECT_DOUBLE_EQ(n1->path_surprisal_bits, 1.5);
  EXPECT_DOUBLE_EQ(n2->path_surprisal_bits, 3.75);
  EXPECT_EQ(n2->depth, 2u);
  EXPECT_EQ(n2->token_offset(), 2u);
}

TEST(BlockTrie, RemoveSubtreeRemovesDescendantsChildrenFirst) {
  BlockTrie trie(2);
  uint64_t id = 1;
  auto a = Tokens(6, 0);
  auto b = a;
  b[5] = 77;
  Insert(trie, a, &id);
  Insert(trie, b, &id);
  std::vector<uint64_t> removed;
  trie.RemoveSubtree(trie.Match(a)[1], &removed);
  EXPECT_EQ(removed.size(), 3u);
  EXPECT_EQ(removed.back(), trie.Match(a).empty() ? 0u : 2u);
  EXPECT_EQ(trie.num_nodes(), 1u);
  EXPECT_EQ(trie.Find(removed.front()), nullptr);
}

}  // namespace
}  // namespace kvtrie
