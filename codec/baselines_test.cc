#include "codec/baselines.h"

#include <cmath>
#include <random>
#include <vector>

#include "codec/block_codec.h"
#include "codec/lloyd_max.h"
#include "codec/rotation.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

// A block of i.i.d. N(0, sigma^2) fp16 values.
std::vector<uint8_t> GaussianBlock(const BlockGeometry& g, double sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(sigma));
  std::vector<float> x(g.num_elements());
  for (float& v : x) v = normal(rng);
  std::vector<uint8_t> block(g.num_bytes());
  FromFloat(g.dtype, x.data(), x.size(), block.data());
  return block;
}

double Mse(const BlockGeometry& g, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const std::vector<float> x = AsFloat(g, a), y = AsFloat(g, b);
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += (x[i] - y[i]) * static_cast<double>(x[i] - y[i]);
  return s / x.size();
}

std::vector<uint8_t> RoundTrip(const BlockGeometry& g, const std::vector<uint8_t>& block,
                               const EncodeOptions& o, EncodedBlock* e) {
  absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, o);
  EXPECT_TRUE(r.ok()) << r.status();
  *e = *r;
  std::vector<uint8_t> out(g.num_bytes());
  EXPECT_TRUE(DecodeBlock(r->bytes, absl::MakeSpan(out)).ok());
  return out;
}

TEST(LloydMax, GaussianCodebooksHaveTheTabulatedMse) {
  // Max (1960): 0.3634, 0.1175, 0.03454, 0.009497.
  EXPECT_NEAR(GaussianLloydMax(1).mse, 0.3634, 0.0005);
  EXPECT_NEAR(GaussianLloydMax(2).mse, 0.1175, 0.0005);
  EXPECT_NEAR(GaussianLloydMax(3).mse, 0.03454, 0.0002);
  EXPECT_NEAR(GaussianLloydMax(4).mse, 0.009497, 0.0001);
  EXPECT_NEAR(GaussianLloydMax(1).levels[1], std::sqrt(2 / M_PI), 1e-4);
  // And on samples.
  std::mt19937 rng(3);
  std::normal_distribution<double> normal;
  const LloydMaxQuantizer& q = GaussianLloydMax(3);
  double s = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = normal(rng), y = q.levels[q.Quantize(static_cast<float>(x))];
    s += (x - y) * (x - y);
  }
  EXPECT_NEAR(s / n, 0.0345, 0.001);
}

TEST(RandomizedHadamard, IsOrthonormalAndInvertible) {
  RandomizedHadamard r(8, 99);
  std::vector<float> v = {1, -2, 3, 0.5f, 0, 7, -1, 2}, w = v;
  double n0 = 0, n1 = 0;
  for (float x : v) n0 += x * x;
  r.Forward(w.data());
  for (float x : w) n1 += x * x;
  EXPECT_NEAR(n0, n1, 1e-4);
  r.Inverse(w.data());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], w[i], 1e-5);
}

TEST(Baselines, TurboQuant3BitReachesTheLloydMaxMseOnGaussianData) {
  // head_dim 128: the rotated, norm-scaled coordinates are close to N(0, 1).
  const BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .block_tokens = 64, .head_dim = 128};
  const std::vector<uint8_t> block = GaussianBlock(g, 0.7, 5);
  for (int bits : {2, 3, 4}) {
    EncodeOptions o{.encoding = Encoding::kTurboQuant};
    o.turboquant_bits = bits;
    EncodedBlock e;
    const std::vector<uint8_t> out = RoundTrip(g, block, o, &e);
    const double rel_mse = Mse(g, block, out) / (0.7 * 0.7);
    EXPECT_NEAR(rel_mse, GaussianLloydMax(bits).mse, 0.1 * GaussianLloydMax(bits).mse) << bits;
    EXPECT_NEAR(e.bits_per_component, bits + 16.0 / 128, 0.01);
  }
}

TEST(Baselines, Int8ErrorIsAQuarterStepSquaredOverThree) {
  const BlockGeometry g{.num_layers = 2, .num_kv_heads = 2, .block_tokens = 64, .head_dim = 64};
  const std::vector<uint8_t> block = GaussianBlock(g, 1.0, 6);
  EncodedBlock e;
  const std::vector<uint8_t> out = RoundTrip(g, block, {.encoding = Encoding::kInt8}, &e);
  // Uniform rounding error: step^2 / 12 with step = max|x| / 127 per vector.
  const std::vector<float> x = AsFloat(g, block);
  double expected = 0;
  for (size_t v = 0; v < x.size(); v += g.head_dim) {
    float m = 0;
    for (size_t d = 0; d < g.head_dim; ++d) m = std::max(m, std::fabs(x[v + d]));
    expected += g.head_dim * (m / 127.0) * (m / 127.0) / 12.0;
  }
  expected /= x.size();
  EXPECT_NEAR(Mse(g, block, out), expected, 0.15 * expected);
  // + the envelope's content checksum (8 bytes, issue 30)
  EXPECT_NEAR(e.bits_per_component, 8 + 16.0 / 64 + 64.0 / g.num_elements(), 0.01);
}

TEST(Baselines, Kivi2ErrorMatchesAFourLevelUniformQuantizer) {
  // Uniform data in [0, 1): per group range ~1, step ~1/3, MSE ~ step^2 / 12 = 1/108.
  const BlockGeometry g{.num_layers = 1, .num_kv_heads = 2, .block_tokens = 128, .head_dim = 128};
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> x(g.num_elements());
  for (float& v : x) v = u(rng);
  std::vector<uint8_t> block(g.num_bytes());
  FromFloat(g.dtype, x.data(), x.size(), block.data());
  EncodedBlock e;
  const std::vector<uint8_t> out = RoundTrip(g, block, {.encoding = Encoding::kKivi2}, &e);
  EXPECT_NEAR(Mse(g, block, out), 1.0 / 108, 0.1 / 108);
  // K: 2 + 32 / 128 bits, V: 2 + 32 / 128 bits.
  EXPECT_NEAR(e.bits_per_component, 2.25, 0.01);
}

TEST(Baselines, RealBlocksDecodeToWhatTheEncoderReported) {
  const RealBlocks r = LoadRealBlocks("sessions/s1");
  const BlockGeometry& g = r.geometry;
  for (Encoding enc : {Encoding::kInt8, Encoding::kKivi2, Encoding::kTurboQuant}) {
    for (size_t i = 0; i < r.blocks.size(); i += 9) {
      EncodedBlock e;
      const std::vector<uint8_t> out = RoundTrip(g, r.blocks[i], {.encoding = enc}, &e);
      EXPECT_NEAR(e.rel_rms_error_k, RelRms(g, r.blocks[i], out, 0), 1e-9);
      EXPECT_NEAR(e.rel_rms_error_v, RelRms(g, r.blocks[i], out, 1), 1e-9);
      EXPECT_GT(e.rel_rms_error_k, 0);
    }
  }
}

TEST(Baselines, TurboQuantRejectsBadBitsAndUnrotatableHeads) {
  const BlockGeometry g{.num_layers = 1, .num_kv_heads = 1, .block_tokens = 4, .head_dim = 12};
  std::vector<uint8_t> block(g.num_bytes());
  EXPECT_EQ(EncodeBlock(g, block, {.encoding = Encoding::kTurboQuant}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const BlockGeometry g8{.num_layers = 1, .num_kv_heads = 1, .block_tokens = 4, .head_dim = 8};
  EncodeOptions o{.encoding = Encoding::kTurboQuant};
  o.turboquant_bits = 9;
  EXPECT_EQ(EncodeBlock(g8, std::vector<uint8_t>(g8.num_bytes()), o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtrie
