#include "codec/fast_residual.h"

#include <cmath>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/fast_residual_kernels.h"
#include "codec/rans_interleaved.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

EncodeOptions Fast(double target) {
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = Profile::kFast;
  o.target_rel_rms = target;
  return o;
}

// Llama-3-8B-shaped block [layers][2][8][16][128] tiled from the real values of `r`: each run of
// 8 channels comes from another layer, head and token offset of the dump, tokens stay in order.
std::vector<uint8_t> TiledBlock(const RealBlocks& r, const BlockGeometry& g, size_t b) {
  const BlockGeometry& s = r.geometry;
  std::vector<uint8_t> out(g.num_bytes());
  const size_t nb = r.blocks.size();
  auto* o = reinterpret_cast<uint16_t*>(out.data());
  for (size_t l = 0; l < g.num_layers; ++l)
    for (size_t kv = 0; kv < 2; ++kv)
      for (size_t h = 0; h < g.num_kv_heads; ++h)
        for (size_t t = 0; t < g.block_tokens; ++t)
          for (size_t d = 0; d < g.head_dim; ++d) {
            const size_t c = d / s.head_dim;
            const size_t sl = (l + c) % s.num_layers, sh = (h + 3 * c) % s.num_kv_heads;
            const size_t sb = (b + 5 * c) % nb;
            const auto* src = reinterpret_cast<const uint16_t*>(r.blocks[sb].data());
            *o++ = src[(((sl * 2 + kv) * s.num_kv_heads + sh) * s.block_tokens + t) * s.head_dim +
                       d % s.head_dim];
          }
  return out;
}

TEST(FastResidual, MeetsTheErrorTargetOnRealBlocksWithoutTheParent) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry& g = r.geometry;
  for (double target : {0.02, 0.05, 0.17}) {
    for (size_t b = 0; b < r.blocks.size(); b += 5) {
      absl::StatusOr<EncodedBlock> e = EncodeBlock(g, r.blocks[b], Fast(target));
      ASSERT_TRUE(e.ok()) << e.status();
      absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
      ASSERT_TRUE(h.ok());
      EXPECT_EQ(h->profile, Profile::kFast);
      EXPECT_EQ(h->params[1], 1);  // small blocks: one table per K/V beats one per plane
      std::vector<uint8_t> out(g.num_bytes());
      ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out)).ok());  // no context needed
      for (uint32_t l = 0; l < g.num_layers; ++l) {
        for (int kv = 0; kv < 2; ++kv) EXPECT_LE(RelRms(g, r.blocks[b], out, kv, l), target);
      }
      EXPECT_NEAR(e->rel_rms_error_k, RelRms(g, r.blocks[b], out, 0), 1e-9);
      EXPECT_NEAR(e->rel_rms_error_v, RelRms(g, r.blocks[b], out, 1), 1e-9);
      EXPECT_GT(RelRms(g, r.blocks[b], out, 0), 0.5 * target);  // not needlessly fine
      EXPECT_LT(e->bits_per_component, 8.0);
    }
  }
}

// KeyError::kMeanRemoved: each key plane's error relative to its energy around the per-(head,
// channel) block means meets the target (and is finer than the raw-energy definition).
TEST(FastResidual, MeanRemovedKeyErrorMeetsTheTargetAroundTheChannelMeans) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry& g = r.geometry;
  EncodeOptions o = Fast(0.17);
  o.key_error = KeyError::kMeanRemoved;
  for (size_t b = 0; b < r.blocks.size(); b += 7) {
    auto e = EncodeBlock(g, r.blocks[b], o);
    auto raw = EncodeBlock(g, r.blocks[b], Fast(0.17));
    ASSERT_TRUE(e.ok() && raw.ok()) << e.status();
    EXPECT_GT(e->bits_per_component, raw->bits_per_component);
    std::vector<uint8_t> out(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out)).ok());
    const std::vector<float> x = AsFloat(g, r.blocks[b]), y = AsFloat(g, out);
    const size_t T = g.block_tokens, D = g.head_dim, pe = g.plane_elements();
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      const size_t base = 2 * l * pe;  // the key plane
      double err = 0, centred = 0;
      for (size_t h = 0; h < g.num_kv_heads; ++h) {
        for (size_t d = 0; d < D; ++d) {
          double m = 0;
          for (size_t t = 0; t < T; ++t) m += x[base + (h * T + t) * D + d] / T;
          for (size_t t = 0; t < T; ++t) {
            const size_t i = base + (h * T + t) * D + d;
            err += (x[i] - y[i]) * static_cast<double>(x[i] - y[i]);
            centred += (x[i] - m) * (x[i] - m);
          }
        }
      }
      EXPECT_LE(std::sqrt(err / centred), 0.17 * 1.0001) << "block " << b << " layer " << l;
      EXPECT_LE(RelRms(g, r.blocks[b], out, 1, l), 0.17);  // values as before
    }
  }
  o.profile = Profile::kCompact;
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g, r.blocks[0], o).status()));
}

TEST(FastResidual, LlamaShapedBlockRoundTripsOnSimdAndScalarPaths) {
  const RealBlocks r = LoadRealBlocks("genesis_1-3");
  const BlockGeometry g{4, 8, 16, 128, DType::kFp16};
  const std::vector<uint8_t> block = TiledBlock(r, g, 3);
  absl::StatusOr<EncodedBlock> e = EncodeBlock(g, block, Fast(0.05));
  ASSERT_TRUE(e.ok()) << e.status();
  std::vector<uint8_t> out(g.num_bytes());
  ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out)).ok());
  for (int kv = 0; kv < 2; ++kv) EXPECT_LE(RelRms(g, block, out, kv), 0.05);
  absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(static_cast<uint8_t>(h->params[2]), 32);  // 32 lanes
  // Re-encoding the decoded block is deterministic and decoding is too.
  std::vector<uint8_t> again(g.num_bytes());
  ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(again)).ok());
  EXPECT_EQ(again, out);
}

TEST(FastResidual, ScalarAndSimdPathsAgreeBitForBit) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry g{2, 8, 16, 128, DType::kFp16};
  const std::vector<uint8_t> block = TiledBlock(r, g, 7);
  for (double target : {0.01, 0.1}) {  // 0.01: many bucket symbols
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, block, Fast(target));
    ASSERT_TRUE(e.ok()) << e.status();
    std::vector<uint8_t> simd(g.num_bytes()), scalar(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(simd)).ok());
    irans::SetSimdForTesting(false);
    const absl::Status s = DecodeBlock(e->bytes, absl::MakeSpan(scalar));
    absl::StatusOr<EncodedBlock> e2 = EncodeBlock(g, block, Fast(target));  // scalar encoder
    irans::SetSimdForTesting(true);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(simd, scalar);
    ASSERT_TRUE(e2.ok());
    std::vector<uint8_t> out(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e2->bytes, absl::MakeSpan(out)).ok());
    for (int kv = 0; kv < 2; ++kv) {
      EXPECT_LE(RelRms(g, block, simd, kv), target);
      EXPECT_LE(RelRms(g, block, out, kv), target);
    }
  }
}

TEST(FastResidual, RejectsOptionsItDoesNotHave) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  EncodeOptions o = Fast(0.05);
  o.rotate = true;
  EXPECT_EQ(EncodeBlock(r.geometry, r.blocks[0], o).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeBlock(r.geometry, r.blocks[0], Fast(0)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FastResidual, NonFiniteValuesAreRejectedLikeTheCompactProfile) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  std::vector<uint8_t> block = r.blocks[1];
  block[10] = 0x00;
  block[11] = 0x7c;  // +inf
  absl::StatusOr<EncodedBlock> e = EncodeBlock(r.geometry, block, Fast(0.05));
  ASSERT_FALSE(e.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(e.status())) << e.status();
  EXPECT_NE(e.status().message().find("kv:"), absl::string_view::npos) << e.status();
}

// Planes whose quantized residual is all zero carry no symbols (params flags bit 1); a block of
// only such planes has no rANS segments at all.
TEST(FastResidual, AllZeroPlanesRoundTripWithoutAState) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry& g = r.geometry;
  const size_t planes = 2 * g.num_layers, pe = g.num_bytes() / planes;  // bytes per plane
  std::vector<uint8_t> kv = r.blocks[2];
  for (size_t pl = 0; pl < planes; ++pl)
    if (pl != 3) std::fill(kv.begin() + pl * pe, kv.begin() + (pl + 1) * pe, 0);
  internal::FastOutput f;
  ASSERT_TRUE(internal::EncodeFastResidual(g, kv, Fast(0.05), {}, &f).ok());
  EXPECT_EQ(static_cast<uint8_t>(f.params[1]) & 6, 2);  // zero planes, not all learned
  std::vector<uint8_t> out(g.num_bytes(), 0xff);
  ASSERT_TRUE(internal::DecodeFastResidual(g, f.params, f.payload, absl::MakeSpan(out)).ok());
  for (size_t pl = 0; pl < planes; ++pl) {
    if (pl == 3) continue;
    for (size_t i = pl * pe; i < (pl + 1) * pe; ++i) ASSERT_EQ(out[i], 0) << "plane " << pl;
  }
  EXPECT_LE(RelRms(g, kv, out, 1), 0.05 * 1.0001);  // plane 3 is a V plane
  internal::FastOutput dense;
  ASSERT_TRUE(internal::EncodeFastResidual(g, r.blocks[2], Fast(0.05), {}, &dense).ok());
  EXPECT_LT(f.params.size() + f.payload.size(), (dense.params.size() + dense.payload.size()) / 5);

  const std::vector<uint8_t> zeros(g.num_bytes(), 0);
  ASSERT_TRUE(internal::EncodeFastResidual(g, zeros, Fast(0.05), {}, &f).ok());
  EXPECT_EQ(f.payload.size(), 0u);  // no segments, no bucket bits
  std::fill(out.begin(), out.end(), 0xff);
  ASSERT_TRUE(internal::DecodeFastResidual(g, f.params, f.payload, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, zeros);
  EXPECT_EQ(internal::DecodeFastResidual(g, f.params, "x", absl::MakeSpan(out)).code(),
            absl::StatusCode::kDataLoss);
  std::string p = f.params;
  p[6] = 0;  // claims every plane is coded: the tables and bit counts are missing
  EXPECT_EQ(internal::DecodeFastResidual(g, p, f.payload, absl::MakeSpan(out)).code(),
            absl::StatusCode::kDataLoss);
}

TEST(FastResidual, MalformedParamsAndPayloadAreDataLoss) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry& g = r.geometry;
  internal::FastOutput f;
  ASSERT_TRUE(internal::EncodeFastResidual(g, r.blocks[2], Fast(0.05), {}, &f).ok());
  std::vector<uint8_t> out(g.num_bytes());
  ASSERT_TRUE(internal::DecodeFastResidual(g, f.params, f.payload, absl::MakeSpan(out)).ok());
  int rejected = 0, tried = 0;
  for (size_t i = 0; i < f.params.size(); i += 3, ++tried) {
    std::string p = f.params;
    p[i] ^= 0x41;
    rejected += !internal::DecodeFastResidual(g, p, f.payload, absl::MakeSpan(out)).ok();
  }
  for (size_t i = 0; i < f.payload.size(); i += 7, ++tried) {
    std::string p = f.payload;
    p[i] ^= 0x41;
    rejected += !internal::DecodeFastResidual(g, f.params, p, absl::MakeSpan(out)).ok();
  }
  EXPECT_GT(rejected, tried / 2);  // the rest decode to other values, never crash
  for (size_t cut = 1; cut < f.payload.size(); cut += f.payload.size() / 7) {
    EXPECT_EQ(
        internal::DecodeFastResidual(g, f.params, f.payload.substr(0, cut), absl::MakeSpan(out))
            .code(),
        absl::StatusCode::kDataLoss);
  }
}

// The encoder's SIMD kernels (AVX2 where D % 8 == 0 and n >= 32, scalar otherwise) give exactly
// the reference loops' results, so the predictor choices and bytes do not depend on the path.
TEST(FastResidual, EncoderKernelsMatchTheReferenceLoopsBitForBit) {
  using namespace internal::fast;  // NOLINT
  for (size_t D : {8, 12, 128}) {
    const size_t T = 16, he = T * D;
    std::vector<float> x(he), mean(D), learned(he), linear(he);
    uint32_t seed = 7;
    auto next = [&] {
      seed = seed * 1664525u + 1013904223u;
      return static_cast<float>(static_cast<int32_t>(seed >> 8) - (1 << 23)) / (1 << 20);
    };
    for (float& v : x) v = next();
    for (float& v : mean) v = next();
    for (float& v : learned) v = next();
    for (float& v : linear) v = next();
    std::vector<float> acc(5 * D), sums(D, 0.5f), ref_sums(D, 0.5f), ref(5 * D, 0.0f);
    ChannelSums(x.data(), T, D, sums.data());
    HeadL1(x.data(), mean.data(), learned.data(), linear.data(), T, D, acc.data());
    for (size_t t = 0; t < T; ++t) {
      for (size_t d = 0; d < D; ++d) {
        const float v = x[t * D + d];
        ref_sums[d] += v;
        ref[d] += std::fabs(v);
        ref[D + d] += std::fabs(v - mean[d]);
        ref[2 * D + d] += std::fabs(v - (t ? x[(t - 1) * D + d] : 0.0f));
        ref[3 * D + d] += std::fabs(v - learned[t * D + d]);
        ref[4 * D + d] += std::fabs(v - linear[t * D + d]);
      }
    }
    EXPECT_EQ(sums, ref_sums) << "D " << D;
    EXPECT_EQ(acc, ref) << "D " << D;
  }
  // Symbols and their histogram, with every value class (direct, bucket, negative) and a tail.
  const size_t n = 32 * 300 + 13;  // > 255 steps of 32: the byte counters fold
  std::vector<int32_t> q(n);
  for (size_t i = 0; i < n; ++i) q[i] = static_cast<int32_t>((i * 2654435761u) % 41) - 20;
  std::vector<uint8_t> sym(n);
  MapSymbols(q.data(), n, sym.data());
  uint32_t counts[irans::kMaxSymbols], ref_counts[irans::kMaxSymbols] = {};
  HistogramDirect(sym.data(), n, counts);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t z = (static_cast<uint32_t>(q[i]) << 1) ^ static_cast<uint32_t>(q[i] >> 31);
    const uint8_t want = z < static_cast<uint32_t>(kDirect) ? static_cast<uint8_t>(z) : kNoSymbol;
    ASSERT_EQ(sym[i], want) << "element " << i;
    if (want != kNoSymbol) ++ref_counts[want];
  }
  for (int k = 0; k < irans::kMaxSymbols; ++k)
    EXPECT_EQ(counts[k], ref_counts[k]) << "symbol " << k;
}

}  // namespace
}  // namespace kvtrie
