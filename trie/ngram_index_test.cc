#include "trie/ngram_index.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace kvtrie {
namespace {

std::vector<uint32_t> Iota(uint32_t first, size_t n) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(NgramIndex, IndexesSampledOffsetsAndFindsThem) {
  NgramIndex index({.window = 8, .stride = 4, .max_per_hash = 8});
  const std::vector<uint32_t> node = Iota(100, 16);
  index.Add(7, node);
  EXPECT_EQ(index.WindowFor(16), 8u);
  EXPECT_EQ(index.StrideFor(16), 4u);
  EXPECT_EQ(index.StrideFor(4), 2u);   // window 2: stride 4 would miss repeats at odd shifts
  EXPECT_EQ(index.num_entries(), 3u);  // offsets 0, 4, 8
  for (uint32_t o : {0u, 4u, 8u}) {
    absl::Span<const NgramIndex::Hit> hits = index.Lookup(absl::MakeSpan(node).subspan(o, 8));
    ASSERT_EQ(hits.size(), 1u) << o;
    EXPECT_EQ(hits[0].node_id, 7u);
    EXPECT_EQ(hits[0].offset, o);
  }
  // Offsets between the samples are not indexed.
  EXPECT_TRUE(index.Lookup(absl::MakeSpan(node).subspan(2, 8)).empty());
  index.Remove(7, node);
  EXPECT_EQ(index.num_entries(), 0u);
  EXPECT_EQ(index.num_hashes(), 0u);
  EXPECT_TRUE(index.Lookup(absl::MakeSpan(node).subspan(0, 8)).empty());
}

// The coverage the header promises: with T = 16, window 8, stride 4, any 16 consecutive tokens of
// a stored path (two consecutive nodes), at any shift, hold a window the index has, found by
// trying every offset of the block.
TEST(NgramIndex, EveryBlockOfRepeatedTextHoldsAnIndexedWindowAtAnyShift) {
  NgramIndex index({.window = 8, .stride = 4, .max_per_hash = 8});
  const std::vector<uint32_t> path = Iota(1000, 64);  // four nodes of 16 tokens
  for (uint64_t n = 0; n < 4; ++n) {
    index.Add(n + 1, absl::MakeSpan(path).subspan(n * 16, 16));
  }
  for (size_t start = 0; start + 16 <= path.size(); ++start) {
    const absl::Span<const uint32_t> block = absl::MakeSpan(path).subspan(start, 16);
    bool found = false;
    for (size_t o = 0; o + 8 <= 16 && !found; ++o) {
      for (const NgramIndex::Hit& h : index.Lookup(block.subspan(o, 8))) {
        // The hit locates the block's token o on the path: node (id - 1) * 16 + offset.
        EXPECT_EQ((h.node_id - 1) * 16 + h.offset, start + o);
        found = true;
      }
    }
    EXPECT_TRUE(found) << "block at path position " << start;
  }
}

TEST(NgramIndex, CapsEntriesPerHashKeepingTheOldest) {
  NgramIndex index({.window = 4, .stride = 4, .max_per_hash = 2});
  const std::vector<uint32_t> node = {5, 5, 5, 5, 5, 5, 5, 5};  // one n-gram at offsets 0 and 4
  index.Add(1, node);
  index.Add(2, node);
  index.Add(3, node);
  EXPECT_EQ(index.num_entries(), 2u);
  absl::Span<const NgramIndex::Hit> hits = index.Lookup(absl::MakeSpan(node).subspan(0, 4));
  ASSERT_EQ(hits.size(), 2u);
  EXPECT_EQ(hits[0].node_id, 1u);
  EXPECT_EQ(hits[0].offset, 0u);
  EXPECT_EQ(hits[1].node_id, 1u);
  EXPECT_EQ(hits[1].offset, 4u);
  index.Remove(3, node);  // never indexed: nothing to forget
  EXPECT_EQ(index.num_entries(), 2u);
  index.Remove(1, node);
  EXPECT_EQ(index.num_entries(), 0u);
}

TEST(NgramIndex, WindowIsAtMostHalfABlock) {
  NgramIndex index({.window = 8, .stride = 1, .max_per_hash = 0});
  EXPECT_EQ(index.WindowFor(16), 8u);
  EXPECT_EQ(index.WindowFor(4), 2u);
  EXPECT_EQ(index.WindowFor(1), 1u);
  index.Add(1, std::vector<uint32_t>{1, 2, 3, 4});  // window 2 at offsets 0..2
  EXPECT_EQ(index.num_entries(), 3u);
}

}  // namespace
}  // namespace kvtrie
