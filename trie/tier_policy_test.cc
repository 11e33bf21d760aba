#include "trie/tier_policy.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

// Hand-made items: root -> a -> {b, c}, root -> d; sizes, depths and refs set by hand.
struct Item {
  uint64_t id;
  uint32_t depth;
  uint64_t bytes;
  uint64_t refs;
  QueueSlot slot;
};

class GdsfQueueTest : public testing::Test {
 protected:
  void Access(Item* i, bool member) {
    queue_.Access(&i->slot, i->id, i, i->refs, i->depth, i->bytes, member);
  }
  uint64_t PopId() { return static_cast<Item*>(queue_.Pop())->id; }
  GdsfQueue queue_;
};

TEST_F(GdsfQueueTest, OnceReferencedGoFirstThenLargeShallowAndRarelyRead) {
  Item a{1, 1, 8192, 3}, b{2, 2, 8192, 1}, c{3, 2, 8192, 2}, d{4, 1, 65536, 2}, e{5, 1, 1024, 1};
  for (Item* n : {&b, &c, &d, &e}) Access(n, true);
  Access(&a, false);  // not a leaf: not a candidate
  std::vector<uint64_t> order;
  while (!queue_.empty()) order.push_back(PopId());
  // Probation (refs 1) first, by value refs*(1+depth)/KiB: b (3/8) before e (2/1). Then the
  // protected ones: d (2*2/64) before c (2*3/8).
  EXPECT_EQ(order, (std::vector<uint64_t>{2, 5, 4, 3}));
  EXPECT_GT(queue_.clock(), 0);
}

TEST_F(GdsfQueueTest, TheClockAgesNodesThatAreNotReadAgain) {
  Item old_hot{1, 1, 8192, 3};  // read more than the others, long ago
  Access(&old_hot, true);
  // Many generations of other twice-read items go through the queue and raise the clock.
  std::vector<Item> others;
  others.reserve(20);
  for (uint64_t id = 10; id < 30; ++id) {
    others.push_back({id, 1, 8192, 2});
    Access(&others.back(), true);
    if (queue_.Lowest() != &old_hot) queue_.Pop();
  }
  EXPECT_EQ(queue_.Lowest(), &old_hot);  // never read again: now the first to go
  Access(&old_hot, true);                // read: back at the current clock
  EXPECT_NE(queue_.Lowest(), &old_hot);
}

TEST_F(GdsfQueueTest, NonMembersKeepTheirPriorityAndAreNeverPopped) {
  Item pinned{1, 1, 1 << 20, 1}, other{2, 1, 1024, 5};
  Access(&pinned, true);
  Access(&other, true);
  queue_.SetMember(&pinned.slot, pinned.id, &pinned, false);  // e.g. pinned
  EXPECT_EQ(queue_.Pop(), &other);
  EXPECT_TRUE(queue_.empty());
  queue_.SetMember(&pinned.slot, pinned.id, &pinned, true);  // unpinned
  EXPECT_EQ(queue_.Pop(), &pinned);
}

}  // namespace
}  // namespace kvtrie
