#include "codec/block_geometry.h"

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(BlockGeometry, SizesFollowTheBlockLayout) {
  BlockGeometry g{.num_layers = 5, .num_kv_heads = 4, .block_tokens = 16, .head_dim = 8};
  EXPECT_EQ(g.plane_elements(), 4u * 16 * 8);
  EXPECT_EQ(g.num_elements(), 5u * 2 * 4 * 16 * 8);
  EXPECT_EQ(g.num_bytes(), 5u * 2 * 4 * 16 * 8 * 2);
  EXPECT_EQ(g.layer_range_bytes(1, 3), 2u * 2 * 4 * 16 * 8 * 2);
  EXPECT_TRUE(g.Validate().ok());
}

TEST(BlockGeometry, ValidateNamesTheField) {
  BlockGeometry g{.num_layers = 5, .num_kv_heads = 4, .block_tokens = 16, .head_dim = 0};
  absl::Status s = g.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("head_dim"), absl::string_view::npos) << s;
  g.head_dim = 8;
  g.dtype = static_cast<DType>(9);
  EXPECT_NE(g.Validate().message().find("dtype"), absl::string_view::npos);
}

TEST(BlockGeometry, HugeBlocksAreRejectedBeforeTheirSizeOverflows) {
  // 65312 * 2 * 55813 * 26543 * 47663 * 2 bytes wraps to 16000 in 64 bits.
  BlockGeometry g{
      .num_layers = 65312, .num_kv_heads = 55813, .block_tokens = 26543, .head_dim = 47663};
  absl::Status s = g.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("exceeds the limit"), absl::string_view::npos) << s;
  g = {.num_layers = 126, .num_kv_heads = 8, .block_tokens = 16, .head_dim = 128};
  EXPECT_TRUE(g.Validate().ok());  // Llama-3.1-405B
}

TEST(Fp16, EveryHalfSurvivesARoundTripThroughFloat) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(Fp16, RoundsToNearestEven) {
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 1.0f / 2048)), 1.0f);  // tie -> even (1.0)
  EXPECT_EQ(HalfToFloat(FloatToHalf(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);                                  // overflow to +inf
  EXPECT_EQ(HalfToFloat(FloatToHalf(5.96e-8f)), std::ldexp(1.0f, -24));  // smallest subnormal
}

TEST(Bf16, EveryBf16SurvivesARoundTripThroughFloat) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), b);
  }
}

}  // namespace
}  // namespace kvtrie
