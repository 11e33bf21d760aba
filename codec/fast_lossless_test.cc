#include "codec/fast_lossless.h"

#include <cstring>
#include <random>
#include <vector>

#include "codec/block_codec.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

EncodeOptions FastLossless() {
  EncodeOptions o;
  o.encoding = Encoding::kLossless;
  o.profile = Profile::kFast;
  return o;
}

TEST(FastLossless, RealBlocksRoundTripBitExactAndCompress) {
  const RealBlocks r = LoadRealBlocks("genesis_1-3");
  size_t in = 0, stored = 0;
  for (const auto& block : r.blocks) {
    absl::StatusOr<EncodedBlock> e = EncodeBlock(r.geometry, block, FastLossless());
    ASSERT_TRUE(e.ok()) << e.status();
    std::vector<uint8_t> out(block.size());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out)).ok());
    ASSERT_EQ(out, block);
    in += block.size();
    stored += e->bytes.size();
  }
  EXPECT_LT(stored, in);
}

TEST(FastLossless, EveryBitPatternRoundTripsInEveryDtype) {
  std::mt19937 rng(5);
  for (DType dt : {DType::kFp16, DType::kBf16, DType::kFp32}) {
    const BlockGeometry g{2, 2, 16, 8, dt};
    std::vector<uint8_t> block(g.num_bytes());
    for (auto& b : block) b = static_cast<uint8_t>(rng());
    // Special values at the start: NaN with payloads, +-inf, -0, the smallest subnormal.
    const uint16_t half[] = {0x7e01, 0xfc00, 0x7c00, 0x8000, 0x0001, 0x7d55};
    const uint16_t bf[] = {0x7fc1, 0xff80, 0x7f80, 0x8000, 0x0001, 0x7f81};
    const uint32_t f32[] = {0x7fc00001, 0xff800000, 0x7f800000, 0x80000000, 0x00000001, 0x7f800001};
    if (dt == DType::kFp16) std::memcpy(block.data(), half, sizeof(half));
    if (dt == DType::kBf16) std::memcpy(block.data(), bf, sizeof(bf));
    if (dt == DType::kFp32) std::memcpy(block.data(), f32, sizeof(f32));
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, block, FastLossless());
    ASSERT_TRUE(e.ok()) << e.status();
    std::vector<uint8_t> out(block.size());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, block) << DTypeName(dt);
  }
}

TEST(FastLossless, MalformedPayloadIsDataLoss) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  std::string payload;
  CompressFastLossless(r.geometry, r.blocks[0], &payload);
  std::vector<uint8_t> out(r.geometry.num_bytes());
  ASSERT_TRUE(DecompressFastLossless(r.geometry, payload, absl::MakeSpan(out)).ok());
  EXPECT_EQ(
      DecompressFastLossless(r.geometry, payload.substr(0, payload.size() - 1), absl::MakeSpan(out))
          .code(),
      absl::StatusCode::kDataLoss);
  std::string bad = payload;
  bad[0] ^= 1;
  EXPECT_EQ(DecompressFastLossless(r.geometry, bad, absl::MakeSpan(out)).code(),
            absl::StatusCode::kDataLoss);
  // Inside an envelope, the CRC-32C catches what zstd might not.
  absl::StatusOr<EncodedBlock> e = EncodeBlock(r.geometry, r.blocks[0], FastLossless());
  ASSERT_TRUE(e.ok());
  std::string env = e->bytes;
  env[env.size() / 2] ^= 0x55;
  EXPECT_EQ(DecodeBlock(env, absl::MakeSpan(out)).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace kvtrie
