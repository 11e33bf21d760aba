// One-byte dtypes (fp8_e4m3, fp8_e5m2, uint8; issue 32 row 3): vLLM's --kv-cache-dtype fp8 caches
// are stored bit-exact. RAW and LOSSLESS (both profiles, and against a centroid) round-trip every
// byte pattern, NaN codes included; every lossy encoding, a learned or shifted prediction, is
// refused with INVALID_ARGUMENT naming the dtype; a forged envelope that claims a lossy encoding
// of such a dtype is DATA_LOSS, never decoded.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/block_verify.h"
#include "codec/crc32c.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

constexpr DType kByteDTypes[] = {DType::kFp8E4m3, DType::kFp8E5m2, DType::kUint8};

BlockGeometry Geometry(DType dtype) { return {3, 2, 16, 8, dtype}; }

// Every byte value at least once (NaN codes 0x7f / 0xff of E4M3, E5M2's infinities and NaNs),
// then bytes shaped like a KV cache: small magnitudes, a per-channel offset.
std::vector<uint8_t> Block(const BlockGeometry& g, uint32_t seed) {
  std::vector<uint8_t> b(g.num_bytes());
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(b.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = normal(rng) + 0.5f * static_cast<float>(i % 8);
  FromFloat(g.dtype, x.data(), x.size(), b.data());
  for (size_t i = 0; i < 256 && i < b.size(); ++i) b[i * 3 % b.size()] = static_cast<uint8_t>(i);
  return b;
}

TEST(ByteDType, SizesNamesAndValidation) {
  for (DType d : kByteDTypes) {
    EXPECT_EQ(DTypeBytes(d), 1u);
    EXPECT_TRUE(IsByteDType(d));
    EXPECT_TRUE(IsValidDType(static_cast<uint32_t>(d)));
    const BlockGeometry g = Geometry(d);
    EXPECT_TRUE(g.Validate().ok());
    EXPECT_EQ(g.num_bytes(), g.num_elements());
  }
  EXPECT_FALSE(IsByteDType(DType::kFp16));
  EXPECT_FALSE(IsValidDType(7));
  EXPECT_EQ(DTypeName(DType::kFp8E4m3), "fp8_e4m3");
  EXPECT_EQ(DTypeName(DType::kFp8E5m2), "fp8_e5m2");
  EXPECT_EQ(DTypeName(DType::kUint8), "uint8");
}

TEST(ByteDType, Fp8DecodesAsTheOcpFormats) {
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);        // exponent 7 = bias
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);      // the largest finite E4M3
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), 1.0f / 512);  // the smallest subnormal: 2^-9
  EXPECT_EQ(Fp8E4m3ToFloat(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7f)));
  EXPECT_EQ(Fp8E5m2ToFloat(0x3c), 1.0f);
  EXPECT_EQ(Fp8E5m2ToFloat(0x7b), 57344.0f);
  EXPECT_TRUE(std::isinf(Fp8E5m2ToFloat(0x7c)));
  // FromFloat finds the nearest code (and round-trips every finite one).
  for (DType d : {DType::kFp8E4m3, DType::kFp8E5m2}) {
    for (int c = 0; c < 256; ++c) {
      const uint8_t b = static_cast<uint8_t>(c);
      float f;
      ToFloat(d, &b, 1, &f);
      if (!std::isfinite(f)) continue;
      uint8_t back = 0;
      FromFloat(d, &f, 1, &back);
      float g;
      ToFloat(d, &back, 1, &g);
      EXPECT_EQ(f, g) << DTypeName(d) << " code " << c;
    }
  }
}

TEST(ByteDType, RawAndLosslessRoundTripBitExact) {
  for (DType d : kByteDTypes) {
    const BlockGeometry g = Geometry(d);
    const std::vector<uint8_t> block = Block(g, 11);
    for (Encoding e : {Encoding::kRaw, Encoding::kLossless}) {
      for (Profile p : {Profile::kCompact, Profile::kFast}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(d), " ", EncodingName(e), " profile ", int(p)));
        EncodeOptions o;
        o.encoding = e;
        o.profile = p;
        absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, o);
        ASSERT_TRUE(r.ok()) << r.status();
        std::vector<uint8_t> out(g.num_bytes(), 0xaa);
        ASSERT_TRUE(DecodeBlock(r->bytes, absl::MakeSpan(out)).ok());
        EXPECT_EQ(out, block);
        if (e == Encoding::kRaw || p == Profile::kFast) {  // what a Put may send encoded
          absl::StatusOr<BlockHeader> h = VerifyEncodedBlock(g, r->bytes);
          ASSERT_TRUE(h.ok()) << h.status();
          EXPECT_EQ(h->geometry.dtype, d);
        }
        if (e == Encoding::kLossless) {
          // zstd of a skewed byte distribution: smaller than the bytes.
          EXPECT_LT(r->bytes.size(), block.size());
        }
      }
    }
  }
}

TEST(ByteDType, LosslessAgainstACentroidIsBitExact) {
  const BlockGeometry g = Geometry(DType::kFp8E4m3);
  const std::vector<uint8_t> reference = Block(g, 1);
  std::vector<uint8_t> block = reference;
  for (size_t i = 0; i < block.size(); i += 7) block[i] ^= 0x01;
  EncodeOptions o;
  o.encoding = Encoding::kLossless;
  o.reference_node_id = 42;
  PredictionContext ctx;
  ctx.reference = reference;
  absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, o, ctx);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint8_t> out(g.num_bytes());
  ASSERT_TRUE(DecodeBlock(r->bytes, absl::MakeSpan(out), ctx).ok());
  EXPECT_EQ(out, block);
}

TEST(ByteDType, LossyEncodingsAreRefusedNamingTheDType) {
  for (DType d : kByteDTypes) {
    const BlockGeometry g = Geometry(d);
    const std::vector<uint8_t> block = Block(g, 3);
    for (Encoding e :
         {Encoding::kResidual, Encoding::kInt8, Encoding::kKivi2, Encoding::kTurboQuant}) {
      for (Profile p : {Profile::kCompact, Profile::kFast}) {
        EncodeOptions o;
        o.encoding = e;
        o.profile = p;
        o.target_rel_rms = 0.05;
        absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, o);
        ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
            << DTypeName(d) << " " << EncodingName(e) << ": " << r.status();
        EXPECT_EQ(r.status().message(),
                  absl::StrCat("dtype: ", DTypeName(d),
                               " blocks can be stored RAW or LOSSLESS only (encoding ",
                               EncodingName(e), " is lossy)"));
      }
    }
    EncodeOptions shifted;
    shifted.encoding = Encoding::kLossless;
    shifted.reference_node_id = 1;
    shifted.reference_shift.enabled = true;
    PredictionContext ctx;
    ctx.reference = block;
    absl::StatusOr<EncodedBlock> r = EncodeBlock(g, block, shifted, ctx);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(absl::StartsWith(r.status().message(), "reference_shift: ")) << r.status();
  }
}

// A well-formed envelope (CRC and lengths right) around a real INT8 / RESIDUAL payload of an fp16
// block of the same shape, relabelled as fp8: decoding it would be float coding of bytes.
TEST(ByteDType, AForgedLossyEnvelopeIsDataLossNeverDecoded) {
  for (Encoding e : {Encoding::kInt8, Encoding::kResidual}) {
    const BlockGeometry fp16 = Geometry(DType::kFp16);
    std::vector<uint8_t> block(fp16.num_bytes());
    std::vector<float> x(fp16.num_elements());
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>(i % 97);
    FromFloat(DType::kFp16, x.data(), x.size(), block.data());
    EncodeOptions o;
    o.encoding = e;
    o.target_rel_rms = 0.05;
    o.content_checksum = false;
    absl::StatusOr<EncodedBlock> real = EncodeBlock(fp16, block, o);
    ASSERT_TRUE(real.ok()) << real.status();
    absl::StatusOr<BlockHeader> h = ParseBlock(real->bytes);
    ASSERT_TRUE(h.ok());
    for (DType d : kByteDTypes) {
      const BlockGeometry g = Geometry(d);
      const std::string forged =
          internal::WriteEnvelope(e, g, 0, h->params, h->payload, h->profile);
      std::vector<uint8_t> out(g.num_bytes());
      absl::Status s = DecodeBlock(forged, absl::MakeSpan(out));
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_NE(s.message().find("RAW or LOSSLESS only"), absl::string_view::npos) << s;
      // The server's check of a client-encoded block (INVALID_ARGUMENT: the Put is at fault).
      absl::Status v = VerifyEncodedBlock(g, forged).status();
      EXPECT_EQ(v.code(), absl::StatusCode::kInvalidArgument) << v;
      EXPECT_NE(v.message().find("RAW or LOSSLESS only"), absl::string_view::npos) << v;
      // Byte 6 is the dtype: relabelling the real fp16 block (CRC fixed up) is refused too.
      std::string relabelled = real->bytes;
      relabelled[6] = static_cast<char>(d);
      const uint32_t crc = Crc32c(absl::string_view(relabelled).substr(0, relabelled.size() - 4));
      std::memcpy(relabelled.data() + relabelled.size() - 4, &crc, 4);
      EXPECT_EQ(ParseBlock(relabelled).status().code(), absl::StatusCode::kDataLoss);
    }
  }
}

}  // namespace
}  // namespace kvtrie
