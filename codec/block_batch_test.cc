#include "codec/block_batch.h"

#include <string>
#include <vector>

#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

std::vector<absl::Span<const uint8_t>> Spans(const std::vector<std::vector<uint8_t>>& v) {
  return {v.begin(), v.end()};
}

TEST(BlockBatch, ParallelDecodeEqualsOneByOneForEveryEncoding) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry& g = r.geometry;
  ThreadPool pool(2);
  for (Profile profile : {Profile::kFast, Profile::kCompact}) {
    for (Encoding enc : {Encoding::kResidual, Encoding::kLossless, Encoding::kRaw}) {
      EncodeOptions o;
      o.encoding = enc;
      o.profile = profile;
      o.target_rel_rms = 0.05;
      absl::StatusOr<std::vector<EncodedBlock>> e = EncodeBlocks(g, Spans(r.blocks), o, &pool);
      ASSERT_TRUE(e.ok()) << e.status();
      std::vector<absl::string_view> blocks;
      for (const EncodedBlock& b : *e) blocks.push_back(b.bytes);
      std::vector<std::vector<uint8_t>> out(blocks.size(), std::vector<uint8_t>(g.num_bytes()));
      std::vector<absl::Span<uint8_t>> outs(out.begin(), out.end());
      ASSERT_TRUE(DecodeBlocks(blocks, outs, false, &pool).ok());
      for (size_t i = 0; i < blocks.size(); ++i) {
        std::vector<uint8_t> one(g.num_bytes());
        ASSERT_TRUE(DecodeBlock(blocks[i], absl::MakeSpan(one)).ok());
        ASSERT_EQ(one, out[i]) << i;
      }
    }
  }
}

TEST(BlockBatch, CompactBlocksChainedToTheirParentDecodeInOrder) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry& g = r.geometry;
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.target_rel_rms = 0.05;
  std::vector<std::string> bytes;
  std::vector<std::vector<uint8_t>> want;
  for (size_t b = 0; b < r.blocks.size(); ++b) {
    PredictionContext c;
    if (b > 0) c.parent = want.back();
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, r.blocks[b], o, c);
    ASSERT_TRUE(e.ok());
    bytes.push_back(e->bytes);
    want.emplace_back(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(want.back()), c).ok());
  }
  std::vector<absl::string_view> blocks(bytes.begin(), bytes.end());
  std::vector<std::vector<uint8_t>> out(blocks.size(), std::vector<uint8_t>(g.num_bytes()));
  std::vector<absl::Span<uint8_t>> outs(out.begin(), out.end());
  ThreadPool pool(2);
  ASSERT_TRUE(DecodeBlocks(blocks, outs, true, &pool).ok());
  EXPECT_EQ(out, want);
  // Without the chain, a block that used its parent cannot decode: FAILED_PRECONDITION, by index.
  const absl::Status s = DecodeBlocks(blocks, outs, false, &pool);
  if (!s.ok()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("block "), std::string::npos);
  }
  // A corrupt block is reported with its index.
  std::string bad = bytes[3];
  bad[bad.size() / 2] ^= 1;
  blocks[3] = bad;
  const absl::Status c = DecodeBlocks(blocks, outs, true, nullptr);
  EXPECT_EQ(c.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(c.message().find("block 3: "), std::string::npos);
}

}  // namespace
}  // namespace kvtrie
