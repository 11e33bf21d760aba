#include "trie/tier_policy.h"

#include <vector>

#include "gtest/gtest.h"
#include "trie/block_trie.h"

namespace kvtrie {
namespace {

// A hand-built trie: root -> a -> {b, c}, root -> d; sizes, depths and refs set by hand.
class GdsfQueueTest : public testing::Test {
 protected:
  TrieNode* Add(TrieNode* parent, uint64_t id, uint64_t bytes, uint64_t refs) {
    std::vector<uint32_t> tokens(4, static_cast<uint32_t>(id));
    TrieNode* n = trie_.AddChild(parent, id, tokens, {});
    n->bytes_stored = bytes;
    n->tier.refs = refs;
    return n;
  }
  BlockTrie trie_{4};
  GdsfQueue queue_{&TierState::disk};
};

TEST_F(GdsfQueueTest, OnceReferencedGoFirstThenLargeShallowAndRarelyRead) {
  TrieNode* a = Add(trie_.root(), 1, 8192, 3);
  TrieNode* b = Add(a, 2, 8192, 1);              // deep, once: probation
  TrieNode* c = Add(a, 3, 8192, 2);              // deep, twice
  TrieNode* d = Add(trie_.root(), 4, 65536, 2);  // shallow and large, twice
  TrieNode* e = Add(trie_.root(), 5, 1024, 1);   // small, once
  for (TrieNode* n : {b, c, d, e}) queue_.Access(n, nullptr, true);
  queue_.Access(a, nullptr, false);  // not a leaf: not a candidate
  std::vector<uint64_t> order;
  while (!queue_.empty()) order.push_back(queue_.Pop().node->id);
  // Probation (refs 1) first, by value refs*(1+depth)/KiB: b (3/8) before e (2/1). Then the
  // protected ones: d (2*2/64) before c (2*3/8).
  EXPECT_EQ(order, (std::vector<uint64_t>{2, 5, 4, 3}));
  EXPECT_GT(queue_.clock(), 0);
}

TEST_F(GdsfQueueTest, TheClockAgesNodesThatAreNotReadAgain) {
  TrieNode* old_hot = Add(trie_.root(), 1, 8192, 3);  // read more than the others, long ago
  queue_.Access(old_hot, nullptr, true);
  // Many generations of other twice-read nodes go through the queue and raise the clock.
  for (uint64_t id = 10; id < 30; ++id) {
    TrieNode* n = Add(trie_.root(), id, 8192, 2);
    queue_.Access(n, nullptr, true);
    if (queue_.Lowest().node != old_hot) queue_.Pop();
  }
  EXPECT_EQ(queue_.Lowest().node, old_hot);  // never read again: now the first to go
  queue_.Access(old_hot, nullptr, true);     // read: back at the current clock
  EXPECT_NE(queue_.Lowest().node, old_hot);
}

TEST_F(GdsfQueueTest, NonMembersKeepTheirPriorityAndAreNeverPopped) {
  TrieNode* pinned = Add(trie_.root(), 1, 1 << 20, 1);
  TrieNode* other = Add(trie_.root(), 2, 1024, 5);
  queue_.Access(pinned, nullptr, true);
  queue_.Access(other, nullptr, true);
  queue_.SetMember(pinned, nullptr, false);  // e.g. pinned
  EXPECT_EQ(queue_.Pop().node, other);
  EXPECT_TRUE(queue_.empty());
  queue_.SetMember(pinned, nullptr, true);  // unpinned
  EXPECT_EQ(queue_.Pop().node, pinned);
}

}  // namespace
}  // namespace kvtrie
