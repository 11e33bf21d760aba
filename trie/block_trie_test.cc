#include "trie/block_trie.h"

#include <numeric>
#include <random>
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
  // comparisons can tell the branches apart, along a chain and at a branch.
  BlockTrie trie(4, [](absl::Span<const uint32_t>) { return uint64_t{7}; });
  uint64_t id = 1;
  auto a = Tokens(16, 100);
  Insert(trie, a, &id);
  EXPECT_EQ(trie.num_chains(), 1u);
  EXPECT_EQ(trie.Match(a)[0]->chain, trie.Match(a)[3]->chain);
  auto b = a;
  b[9] = 1;  // shares blocks 0-1 with a, then branches
  TrieNode* b_leaf = Insert(trie, b, &id);
  EXPECT_EQ(trie.Match(a).size(), 4u);
  EXPECT_EQ(trie.Match(b).size(), 4u);
  EXPECT_EQ(trie.Match(b).back(), b_leaf);
  TrieNode* fork = trie.Match(a)[1];
  EXPECT_EQ(trie.num_chains(), 3u);  // blocks 0-1, a's 2-3, b's 2-3
  EXPECT_EQ(fork->chain->nodes.back(), fork);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
  // Remove a's branch: the fork has one child again and its chain continues into b's.
  std::vector<uint64_t> removed;
  trie.RemoveSubtree(trie.Match(a)[2], &removed);
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_EQ(trie.num_chains(), 1u);
  EXPECT_EQ(fork->chain, b_leaf->chain);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
  EXPECT_EQ(trie.Match(a).size(), 2u);
  EXPECT_EQ(trie.Match(b).size(), 4u);
  // A different block below a single child never matches it.
  auto c = b;
  c[15] = 0;
  EXPECT_EQ(trie.Match(c).size(), 3u);
  trie.RemoveSubtree(trie.Match(b)[2], &removed);
  EXPECT_EQ(fork->chain->nodes.back(), fork);  // a leaf now: the end of its chain
  EXPECT_EQ(trie.Match(b).size(), 2u);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
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

// The longest prefix found block by block through FindChild (hash + compare at every node, no
// chains): the reference the path-compressed walk must agree with.
std::vector<TrieNode*> SlowMatch(BlockTrie& trie, absl::Span<const uint32_t> tokens) {
  std::vector<TrieNode*> path;
  const TrieNode* at = trie.root();
  const uint32_t bt = trie.block_tokens();
  for (size_t b = 0; b < tokens.size() / bt; ++b) {
    TrieNode* c = trie.FindChild(at, tokens.subspan(b * bt, bt));
    if (c == nullptr) break;
    path.push_back(c);
    at = c;
  }
  return path;
}

std::vector<uint64_t> IdsOf(const std::vector<TrieNode*>& path) {
  std::vector<uint64_t> ids;
  for (const TrieNode* n : path) ids.push_back(n->id);
  return ids;
}

std::vector<uint64_t> MatchIds(const BlockTrie& trie, absl::Span<const uint32_t> tokens,
                               size_t max_blocks = 0) {
  std::vector<uint64_t> ids;
  const size_t n = trie.MatchIds(tokens, max_blocks, &ids);
  EXPECT_EQ(n, ids.size());
  return ids;
}

TEST(BlockTrieChains, DivergenceInsideACompressedEdgeSplitsIt) {
  // 10 blocks in one chain; then prefixes diverging after block 1 (the part above the branch
  // is the shorter: it moves) and after block 7 (the part below moves).
  for (size_t shared : {2u, 8u}) {
    BlockTrie trie(4);
    uint64_t id = 1;
    auto a = Tokens(40, 1000);
    Insert(trie, a, &id);
    ASSERT_EQ(trie.num_chains(), 1u);
    ASSERT_EQ(trie.root()->children.begin()->second.front()->chain->size(), 10u);
    const std::vector<uint64_t> a_ids = IdsOf(trie.Match(a));
    auto b = a;
    b[shared * 4 + 2] = 7;  // differs in the middle of block `shared`
    Insert(trie, b, &id);
    ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
    EXPECT_EQ(trie.num_chains(), 3u);
    const std::vector<TrieNode*> pa = trie.Match(a), pb = trie.Match(b);
    ASSERT_EQ(pa.size(), 10u);
    ASSERT_EQ(pb.size(), 10u);
    EXPECT_EQ(IdsOf(pa), a_ids);  // the nodes stayed; only the edge was cut
    EXPECT_EQ(pa[shared - 1], pb[shared - 1]);
    EXPECT_NE(pa[shared], pb[shared]);
    EXPECT_EQ(pa[0]->chain->size(), shared);
    EXPECT_EQ(pa[shared]->chain->size(), 10 - shared);
    EXPECT_EQ(pb[shared]->chain->size(), 10 - shared);
    EXPECT_EQ(MatchIds(trie, a), a_ids);
    EXPECT_EQ(MatchIds(trie, b), IdsOf(pb));
    // A third prefix diverging one block above the branch splits the upper chain again.
    auto c = a;
    c[(shared - 1) * 4] = 3;
    Insert(trie, c, &id);
    ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
    EXPECT_EQ(trie.num_chains(), shared == 1 ? 4u : 5u);
    EXPECT_EQ(IdsOf(trie.Match(a)), a_ids);
    EXPECT_EQ(trie.Match(c).size(), 10u);
  }
}

TEST(BlockTrieChains, PrefixEndingInsideAnEdgeMatchesUpToIt) {
  BlockTrie trie(4);
  uint64_t id = 1;
  auto a = Tokens(64, 5);
  Insert(trie, a, &id);
  const std::vector<uint64_t> all = IdsOf(trie.Match(a));
  ASSERT_EQ(all.size(), 16u);
  auto span = absl::MakeConstSpan(a);
  // Ends after 6 blocks, after 6 blocks and 3 tokens (a partial block never matches), and
  // at max_blocks inside the edge.
  EXPECT_EQ(MatchIds(trie, span.subspan(0, 24)),
            std::vector<uint64_t>(all.begin(), all.begin() + 6));
  EXPECT_EQ(MatchIds(trie, span.subspan(0, 27)),
            std::vector<uint64_t>(all.begin(), all.begin() + 6));
  EXPECT_EQ(trie.Match(span.subspan(0, 27)).size(), 6u);
  EXPECT_EQ(MatchIds(trie, a, 9), std::vector<uint64_t>(all.begin(), all.begin() + 9));
  EXPECT_EQ(trie.Match(a, 9).size(), 9u);
  // A mismatch in the last token of block 11 (inside the edge) stops there.
  auto b = a;
  b[47] = 0;
  EXPECT_EQ(MatchIds(trie, b), std::vector<uint64_t>(all.begin(), all.begin() + 11));
  // Longer than the edge: the stored prefix, no more.
  auto longer = a;
  longer.insert(longer.end(), {1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_EQ(MatchIds(trie, longer), all);
  // Only the first block differs.
  auto first = a;
  first[0] = 1;
  EXPECT_TRUE(MatchIds(trie, first).empty());
}

TEST(BlockTrieChains, RemovingInsideAChainTruncatesItAndBranchesMerge) {
  BlockTrie trie(2);
  uint64_t id = 1;
  auto a = Tokens(40, 0);  // 20 blocks
  Insert(trie, a, &id);
  // Delete (evict) the subtree at block 12: the chain ends at block 11.
  std::vector<uint64_t> removed;
  trie.RemoveSubtree(trie.Match(a)[12], &removed);
  EXPECT_EQ(removed.size(), 8u);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
  EXPECT_EQ(trie.num_chains(), 1u);
  EXPECT_EQ(MatchIds(trie, a).size(), 12u);
  // The truncated chain grows again from its new last node.
  Insert(trie, a, &id);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
  EXPECT_EQ(trie.num_chains(), 1u);
  EXPECT_EQ(MatchIds(trie, a).size(), 20u);
  // Branches at block 3 (upper chain of 3, lower ones of 17 and 2) and removal of each side:
  // the survivor merges with the upper chain, moving whichever is shorter.
  for (bool remove_long : {false, true}) {
    auto b = a;
    b[7] = 99;     // block 3 differs
    b.resize(10);  // b's own part: blocks 3-4
    Insert(trie, b, &id);
    ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
    EXPECT_EQ(trie.num_chains(), 3u);
    TrieNode* fork = trie.Match(a)[2];
    std::vector<uint64_t> survivor = IdsOf(trie.Match(remove_long ? b : a));
    trie.RemoveSubtree(trie.Match(remove_long ? a : b)[3], &removed);
    ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
    EXPECT_EQ(trie.num_chains(), 1u);
    EXPECT_EQ(fork->chain->size(), survivor.size());
    EXPECT_EQ(MatchIds(trie, remove_long ? b : a), survivor);
    EXPECT_EQ(MatchIds(trie, remove_long ? a : b).size(), 3u);
    if (remove_long) break;
  }
  // The root's children are heads of chains of their own: no merge across the root.
  auto c = Tokens(8, 500);
  Insert(trie, c, &id);
  EXPECT_EQ(trie.num_chains(), 2u);
  trie.RemoveSubtree(trie.Match(c)[0], &removed);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
  EXPECT_EQ(trie.num_chains(), 1u);
}

TEST(BlockTrieChains, NodesBeingRemovedStopMatchIdsInsideAChain) {
  BlockTrie trie(4);
  uint64_t id = 1;
  auto a = Tokens(80, 9);  // 20 blocks, one chain
  Insert(trie, a, &id);
  const std::vector<TrieNode*> path = trie.Match(a);
  trie.SetRemoving(path[13], true);
  trie.SetRemoving(path[13], true);  // idempotent: counted once
  trie.SetRemoving(path[17], true);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
  EXPECT_EQ(path[0]->chain->removing, 2u);
  const std::vector<uint64_t> ids = IdsOf(path);
  EXPECT_EQ(MatchIds(trie, a), std::vector<uint64_t>(ids.begin(), ids.begin() + 13));
  EXPECT_EQ(trie.Match(a).size(), 20u);  // Match does not look at `removing`
  trie.SetRemoving(path[13], false);
  EXPECT_EQ(MatchIds(trie, a).size(), 17u);
  // A split moves the marks with their nodes.
  auto b = a;
  b[4 * 15] = 1;
  Insert(trie, b, &id);
  ASSERT_TRUE(trie.CheckChains().ok()) << trie.CheckChains();
  EXPECT_EQ(path[0]->chain->removing, 0u);
  EXPECT_EQ(path[17]->chain->removing, 1u);
  EXPECT_EQ(MatchIds(trie, a).size(), 17u);
  EXPECT_EQ(MatchIds(trie, b).size(), 20u);
  trie.SetRemoving(path[17], false);
  EXPECT_EQ(MatchIds(trie, a).size(), 20u);
}

TEST(BlockTrieChains, RandomAddsAndRemovesAgreeWithTheBlockByBlockWalk) {
  // Many prefixes sharing parts of a few documents, removals of random subtrees, random
  // `removing` marks; after every step the chains are checked and every lookup agrees with
  // the hash-per-block walk. A rebuild from the nodes (parents first, as recovery after a
  // restart adds them) gives the same matches and the same chains.
  std::mt19937 rng(7);
  for (uint32_t bt : {1u, 3u, 16u}) {
    BlockTrie trie(bt);
    uint64_t id = 1;
    std::vector<std::vector<uint32_t>> docs;
    for (int d = 0; d < 4; ++d) {
      std::vector<uint32_t> t(bt * 40);
      for (auto& x : t) x = rng() % 5;  // a tiny vocabulary: many equal blocks
      docs.push_back(t);
    }
    std::vector<std::vector<uint32_t>> queries;
    for (int step = 0; step < 300; ++step) {
      std::vector<uint32_t> q = docs[rng() % docs.size()];
      q.resize(bt * (1 + rng() % 40) + rng() % bt);
      if (rng() % 2) q[rng() % q.size()] = 5 + rng() % 3;  // diverge somewhere
      queries.push_back(q);
      const int op = rng() % 10;
      if (op < 6) {
        Insert(trie, q, &id);
      } else if (op < 8) {
        const std::vector<TrieNode*> p = SlowMatch(trie, q);
        if (!p.empty()) {
          std::vector<uint64_t> removed;
          trie.RemoveSubtree(p[rng() % p.size()], &removed);
        }
      } else {
        const std::vector<TrieNode*> p = SlowMatch(trie, q);
        if (!p.empty()) trie.SetRemoving(p[rng() % p.size()], op == 8);
      }
      ASSERT_TRUE(trie.CheckChains().ok()) << "step " << step << ": " << trie.CheckChains();
      for (size_t i = queries.size() > 20 ? queries.size() - 20 : 0; i < queries.size(); ++i) {
        const std::vector<TrieNode*> slow = SlowMatch(trie, queries[i]);
        ASSERT_EQ(trie.Match(queries[i]), slow) << "step " << step;
        std::vector<uint64_t> live;
        for (const TrieNode* n : slow) {
          if (n->removing) break;
          live.push_back(n->id);
        }
        ASSERT_EQ(MatchIds(trie, queries[i]), live) << "step " << step;
        const size_t cap = 1 + rng() % 40;
        ASSERT_EQ(trie.Match(queries[i], cap).size(), std::min(cap, slow.size()));
      }
    }
    BlockTrie rebuilt(bt);
    trie.ForEach([&](const TrieNode& n) {
      TrieNode* parent = rebuilt.Find(n.parent->id);
      ASSERT_NE(parent, nullptr);
      rebuilt.AddChild(parent, n.id, n.token_ids, n.surprisal_bits);
    });
    ASSERT_TRUE(rebuilt.CheckChains().ok()) << rebuilt.CheckChains();
    EXPECT_EQ(rebuilt.num_nodes(), trie.num_nodes());
    EXPECT_EQ(rebuilt.num_chains(), trie.num_chains());
    for (const auto& q : queries) EXPECT_EQ(IdsOf(rebuilt.Match(q)), IdsOf(trie.Match(q)));
  }
}

}  // namespace
}  // namespace kvtrie
