// NaN, infinities and the largest finite values through every encoding (issue 12, item 1): the
// lossy encodings reject a non-finite element naming it, never return a value the caller did not
// send, and saturate rather than overflow at the dtype's range; raw and lossless are bit-exact.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "codec/block_codec.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

constexpr Encoding kLossy[] = {Encoding::kResidual, Encoding::kInt8, Encoding::kKivi2,
                               Encoding::kTurboQuant};
constexpr DType kDTypes[] = {DType::kFp16, DType::kBf16, DType::kFp32};

BlockGeometry Geometry(DType dtype) { return {2, 2, 4, 8, dtype}; }

EncodeOptions Options(Encoding e) {
  EncodeOptions o;
  o.encoding = e;
  o.target_rel_rms = 0.05;
  return o;
}

// A block of N(0, 1) values with element `index` set to `value`.
std::vector<uint8_t> Block(const BlockGeometry& g, size_t index, float value) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(g.num_elements());
  for (float& v : x) v = normal(rng);
  x[index] = value;
  std::vector<uint8_t> block(g.num_bytes());
  FromFloat(g.dtype, x.data(), x.size(), block.data());
  return block;
}

// Element index of (layer 1, V, head 0, token 2, channel 3) in block layout.
size_t Index(const BlockGeometry& g) {
  return (((1 * 2 + 1) * g.num_kv_heads + 0) * g.block_tokens + 2) * g.head_dim + 3;
}

TEST(NonFinite, LossyEncodingsRejectNaNAndInfNamingTheElement) {
  for (DType dtype : kDTypes) {
    const BlockGeometry g = Geometry(dtype);
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      const std::vector<uint8_t> block = Block(g, Index(g), bad);
      for (Encoding e : kLossy) {
        SCOPED_TRACE(std::string(EncodingName(e)) + " dtype " + std::to_string(int(dtype)));
        absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, Options(e));
        ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
        EXPECT_NE(r.status().message().find("kv: layer 1 V head 0 token 2 channel 3 is "),
                  absl::string_view::npos)
            << r.status();
        EXPECT_NE(r.status().message().find(std::isnan(bad) ? "NaN" : "infinite"),
                  absl::string_view::npos)
            << r.status();
      }
    }
  }
}

TEST(NonFinite, RawAndLosslessKeepEveryBitPattern) {
  for (DType dtype : kDTypes) {
    const BlockGeometry g = Geometry(dtype);
    std::vector<uint8_t> block = Block(g, Index(g), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> x = AsFloat(g, block);
    x[0] = std::numeric_limits<float>::infinity();
    x[1] = -std::numeric_limits<float>::infinity();
    x[2] = -0.0f;
    x[3] = std::numeric_limits<float>::denorm_min();
    FromFloat(g.dtype, x.data(), x.size(), block.data());
    for (Encoding e : {Encoding::kRaw, Encoding::kLossless}) {
      absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, Options(e));
      ASSERT_TRUE(r.ok()) << r.status();
      std::vector<uint8_t> out(g.num_bytes());
      ASSERT_TRUE(DecodeBlock(r->bytes, absl::MakeSpan(out)).ok());
      EXPECT_EQ(out, block) << EncodingName(e);
    }
  }
}

// Every element of `block` set to +-`magnitude` (alternating signs), through every lossy encoding:
// each decoded value is finite, has the input's sign and is within the encoding's error of it.
// `may_refuse(e)`: encoding `e` may refuse the block as outside its range instead.
template <typename MayRefuse>
void ExpectFiniteAtTheRange(DType dtype, float magnitude, MayRefuse may_refuse) {
  const BlockGeometry g = Geometry(dtype);
  std::vector<float> x(g.num_elements());
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 == 0 ? -1.0f : 1.0f) * magnitude;
  std::vector<uint8_t> block(g.num_bytes());
  FromFloat(g.dtype, x.data(), x.size(), block.data());
  x = AsFloat(g, block);
  for (Encoding e : kLossy) {
    SCOPED_TRACE(EncodingName(e));
    absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, Options(e));
    if (may_refuse(e) && !r.ok()) {
      // Its arithmetic overflows at this magnitude: refused, never stored as Inf or NaN.
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_NE(r.status().message().find("outside the range"), absl::string_view::npos);
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.status();
    std::vector<uint8_t> out(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(r->bytes, absl::MakeSpan(out)).ok());
    const std::vector<float> y = AsFloat(g, out);
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << "element " << i << " of " << x[i] << " decoded " << y[i];
      ASSERT_LE(std::fabs(y[i]), std::fabs(x[i])) << "element " << i;
      // Within half the magnitude (3-bit TurboQuant: within the magnitude).
      const double tolerance = e == Encoding::kTurboQuant ? 1.0 : 0.5;
      ASSERT_LE(std::fabs(y[i] - x[i]), tolerance * std::fabs(x[i])) << "element " << i;
    }
    EXPECT_TRUE(std::isfinite(r->max_abs_error));
  }
}

TEST(NonFinite, Fp16LargestFiniteValuesStayFinite) {
  // int8 used to return Inf for all of them. Only TurboQuant may refuse (its fp16 vector norm).
  ExpectFiniteAtTheRange(DType::kFp16, 65504.0f,
                         [](Encoding e) { return e == Encoding::kTurboQuant; });
}

TEST(NonFinite, Bf16LargestFiniteValuesStayFinite) {
  // At 3.4e38 the float arithmetic of the residual coder and of the fp16 scales overflows: each
  // encoding either returns finite values or refuses the block.
  ExpectFiniteAtTheRange(DType::kBf16, Bf16ToFloat(0x7f7f), [](Encoding) { return true; });
}

// An fp32 value whose int8 / kivi2 fp16 scale would overflow: rejected, never stored as Inf.
TEST(NonFinite, ValuesAnEncodingCannotRepresentAreRejected) {
  const BlockGeometry g = Geometry(DType::kFp32);
  const std::vector<uint8_t> block = Block(g, Index(g), 1e30f);
  for (Encoding e : {Encoding::kInt8, Encoding::kKivi2}) {
    absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, Options(e));
    if (r.ok()) {  // an encoding that can represent it must decode it to finite values
      std::vector<uint8_t> out(g.num_bytes());
      ASSERT_TRUE(DecodeBlock(r->bytes, absl::MakeSpan(out)).ok());
      for (float v : AsFloat(g, out)) ASSERT_TRUE(std::isfinite(v)) << EncodingName(e);
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_NE(r.status().message().find("outside the range"), absl::string_view::npos)
          << r.status();
    }
  }
}

TEST(NonFinite, CheckFiniteNamesLayersFromLayerBegin) {
  const BlockGeometry g = Geometry(DType::kFp16);
  const std::vector<uint8_t> block = Block(g, Index(g), std::numeric_limits<float>::infinity());
  const size_t layer = g.layer_range_bytes(0, 1);
  // Layer 1 of the block sent alone, as layer range [1, 2).
  absl::Status s = CheckFinite(g, 1, absl::MakeConstSpan(block).subspan(layer));
  EXPECT_EQ(s.message(), "layer 1 V head 0 token 2 channel 3 is infinite");
  EXPECT_TRUE(CheckFinite(g, 0, absl::MakeConstSpan(block).subspan(0, layer)).ok());
}

}  // namespace
}  // namespace kvtrie
