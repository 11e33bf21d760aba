#include "codec/reference_shift.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/testing_blocks.h"

namespace kvtrie {
namespace {

// tests/data/neardup/n3 is n0 with "practical" (8 tokens) replaced by "useful" (4 tokens) at
// token 89: from there n3's token at position p is n0's at p + 4. n3's block b (positions
// [16b, 16b + 16), b >= 6) repeats n0's positions [16b + 4, 16b + 20): the last 12 tokens of n0's
// block b (A, the centroid's parent) and the first 4 of block b + 1 (B, the centroid), keys turned
// by -4 positions.
constexpr uint32_t kTokenShift = 12;
constexpr int32_t kRotation = -4;
constexpr size_t kFirstShifted = 6;

class ReferenceShiftTest : public ::testing::Test {
 protected:
  void SetUp() override {
    n0_ = LoadRealBlocks("neardup/n0");
    n3_ = LoadRealBlocks("neardup/n3");
    ASSERT_EQ(n0_.blocks.size(), n3_.blocks.size());
    ASSERT_GT(n0_.blocks.size(), kFirstShifted + 2);
  }
  const BlockGeometry& g() const { return n0_.geometry; }
  // Context and options of n3's block b coded against n0's window.
  PredictionContext Context(size_t b) const {
    PredictionContext ctx;
    ctx.reference = n0_.blocks[b + 1];
    ctx.reference_parent = n0_.blocks[b];
    return ctx;
  }
  static EncodeOptions Options(Encoding encoding) {
    EncodeOptions o;
    o.encoding = encoding;
    o.target_rel_rms = 0.1;
    o.reference_node_id = 42;
    o.reference_shift = {.enabled = true,
                         .token_shift = kTokenShift,
                         .rotation = kRotation,
                         .log_rope_base = -1,
                         .reference_parent_node_id = 41};
    return o;
  }
  RealBlocks n0_, n3_;
};

TEST_F(ReferenceShiftTest, DetectsStories260KsRopeBaseAndPairing) {
  for (size_t b = kFirstShifted; b + 1 < n0_.blocks.size(); b += 7) {
    ReferenceShift s = Options(Encoding::kResidual).reference_shift;
    internal::DetectShiftRope(g(), n3_.blocks[b], n0_.blocks[b + 1], n0_.blocks[b], &s);
    EXPECT_FLOAT_EQ(s.log_rope_base, static_cast<float>(std::log(10000.0))) << "block " << b;
    EXPECT_FALSE(s.half_split);
  }
}

TEST_F(ReferenceShiftTest, WindowMatchesLayerZeroKeysAfterTurning) {
  // Layer 0 depends only on token and position: the turned window equals n3's keys to about fp16
  // rounding; unturned it does not.
  const size_t b = 10;
  ReferenceShift s = Options(Encoding::kResidual).reference_shift;
  s.log_rope_base = static_cast<float>(std::log(10000.0));
  std::vector<uint8_t> window(g().num_bytes());
  ASSERT_TRUE(internal::BuildShiftedReference(g(), s, n0_.blocks[b + 1], n0_.blocks[b],
                                              absl::MakeSpan(window))
                  .ok());
  EXPECT_LT(RelRms(g(), n3_.blocks[b], window, /*kv=*/0, /*layer=*/0), 2e-3);
  EXPECT_LT(RelRms(g(), n3_.blocks[b], window, /*kv=*/1, /*layer=*/0), 1e-6);  // values copied
  s.log_rope_base = 0;
  ASSERT_TRUE(internal::BuildShiftedReference(g(), s, n0_.blocks[b + 1], n0_.blocks[b],
                                              absl::MakeSpan(window))
                  .ok());
  EXPECT_GT(RelRms(g(), n3_.blocks[b], window, /*kv=*/0, /*layer=*/0), 0.1);
}

TEST_F(ReferenceShiftTest, ResidualRoundTripsWithinTargetAndIsMuchSmaller) {
  size_t shifted_bytes = 0, aligned_bytes = 0, alone_bytes = 0;
  for (size_t b = kFirstShifted; b + 1 < n0_.blocks.size(); ++b) {
    const PredictionContext ctx = Context(b);
    auto e = EncodeBlock(g(), n3_.blocks[b], Options(Encoding::kResidual), ctx);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_LE(e->rel_rms_error_k, 0.1);
    EXPECT_LE(e->rel_rms_error_v, 0.1);
    auto h = ParseBlock(e->bytes);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_EQ(h->reference_node_id, 42u) << "block " << b << " did not use the window";
    ASSERT_TRUE(h->reference_shift.enabled);
    EXPECT_EQ(h->reference_shift.token_shift, kTokenShift);
    EXPECT_EQ(h->reference_shift.rotation, kRotation);
    EXPECT_EQ(h->reference_shift.reference_parent_node_id, 41u);
    EXPECT_GT(h->reference_shift.log_rope_base, 9.0f);
    std::vector<uint8_t> out(g().num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok());
    EXPECT_LE(RelRms(g(), n3_.blocks[b], out, 0), 0.1 + 1e-9) << "block " << b;
    EXPECT_LE(RelRms(g(), n3_.blocks[b], out, 1), 0.1 + 1e-9) << "block " << b;
    // The same block against the centroid at the same depth, unshifted (what was possible before).
    PredictionContext aligned_ctx;
    aligned_ctx.reference = n0_.blocks[b];
    EncodeOptions aligned = Options(Encoding::kResidual);
    aligned.reference_shift = {};
    auto a = EncodeBlock(g(), n3_.blocks[b], aligned, aligned_ctx);
    ASSERT_TRUE(a.ok());
    EncodeOptions o = Options(Encoding::kResidual);
    o.reference_node_id = 0;
    o.reference_shift = {};
    auto alone = EncodeBlock(g(), n3_.blocks[b], o);
    ASSERT_TRUE(alone.ok());
    shifted_bytes += e->bytes.size();
    aligned_bytes += a->bytes.size();
    alone_bytes += alone->bytes.size();
  }
  // Measured on tests/data at 0.1: shifted / standalone 0.042, unshifted / standalone 0.99.
  std::printf("residual 0.1: shifted %zu, unshifted centroid %zu, standalone %zu bytes\n",
              shifted_bytes, aligned_bytes, alone_bytes);
  EXPECT_LT(shifted_bytes, alone_bytes / 10);
  EXPECT_LT(shifted_bytes, aligned_bytes / 10);
}

TEST_F(ReferenceShiftTest, LosslessRoundTripsBitExactAndIsSmaller) {
  size_t shifted_bytes = 0, alone_bytes = 0;
  for (size_t b = kFirstShifted; b + 1 < n0_.blocks.size(); ++b) {
    const PredictionContext ctx = Context(b);
    auto e = EncodeBlock(g(), n3_.blocks[b], Options(Encoding::kLossless), ctx);
    ASSERT_TRUE(e.ok()) << e.status();
    std::vector<uint8_t> out(g().num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok());
    ASSERT_EQ(out, n3_.blocks[b]) << "block " << b;
    auto alone = EncodeBlock(g(), n3_.blocks[b], {.encoding = Encoding::kLossless});
    ASSERT_TRUE(alone.ok());
    shifted_bytes += e->bytes.size();
    alone_bytes += alone->bytes.size();
  }
  // Measured: 0.36 (layer 0 nearly free, deeper layers differ in low mantissa bits).
  std::printf("lossless: shifted %zu, standalone %zu bytes\n", shifted_bytes, alone_bytes);
  EXPECT_LT(shifted_bytes, alone_bytes / 2);
}

// n3's last block repeats n0's last 12 tokens; n0 stops there (a tail window of n0's block 31).
TEST_F(ReferenceShiftTest, TailWindowRoundTripsAndIsSmaller) {
  const size_t b = n0_.blocks.size() - 1;
  PredictionContext ctx;
  ctx.reference = n0_.blocks[b];
  for (Encoding enc : {Encoding::kResidual, Encoding::kLossless}) {
    EncodeOptions o = Options(enc);
    o.reference_shift.tail = true;
    o.reference_shift.reference_parent_node_id = 0;
    auto e = EncodeBlock(g(), n3_.blocks[b], o, ctx);
    ASSERT_TRUE(e.ok()) << e.status();
    auto h = ParseBlock(e->bytes);
    ASSERT_TRUE(h.ok());
    ASSERT_EQ(h->reference_node_id, 42u);
    EXPECT_TRUE(h->reference_shift.tail);
    std::vector<uint8_t> out(g().num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok());  // no parent needed
    o.reference_node_id = 0;
    o.reference_shift = {};
    auto alone = EncodeBlock(g(), n3_.blocks[b], o);
    ASSERT_TRUE(alone.ok());
    if (enc == Encoding::kLossless) {
      EXPECT_EQ(out, n3_.blocks[b]);
    } else {
      EXPECT_LE(RelRms(g(), n3_.blocks[b], out, 0), 0.1 + 1e-9);
      EXPECT_LE(RelRms(g(), n3_.blocks[b], out, 1), 0.1 + 1e-9);
    }
    std::printf("tail window %s: %zu bytes, standalone %zu\n",
                std::string(EncodingName(enc)).c_str(), e->bytes.size(), alone->bytes.size());
    EXPECT_LT(e->bytes.size(), alone->bytes.size());
  }
  // A tail with a parent id, or without token_shift, is refused.
  EncodeOptions o = Options(Encoding::kResidual);
  o.reference_shift.tail = true;
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g(), n3_.blocks[b], o, ctx).status()));
}

TEST_F(ReferenceShiftTest, DecodingNeedsTheCentroidsParent) {
  const size_t b = 12;
  auto e = EncodeBlock(g(), n3_.blocks[b], Options(Encoding::kResidual), Context(b));
  ASSERT_TRUE(e.ok());
  std::vector<uint8_t> out(g().num_bytes());
  PredictionContext only_centroid;
  only_centroid.reference = n0_.blocks[b + 1];
  absl::Status s = DecodeBlock(e->bytes, absl::MakeSpan(out), only_centroid);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("node 41"), absl::string_view::npos) << s;
  EXPECT_TRUE(absl::IsFailedPrecondition(DecodeBlock(e->bytes, absl::MakeSpan(out))));
}

TEST_F(ReferenceShiftTest, EncoderRefusesWhatItCannotCode) {
  const size_t b = 12;
  EncodeOptions o = Options(Encoding::kResidual);
  o.profile = Profile::kFast;
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g(), n3_.blocks[b], o, Context(b)).status()));
  o = Options(Encoding::kInt8);
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g(), n3_.blocks[b], o, Context(b)).status()));
  o = Options(Encoding::kResidual);
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g(), n3_.blocks[b], o).status()));
  o.reference_shift.token_shift = 16;  // == block_tokens
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g(), n3_.blocks[b], o, Context(b)).status()));
  o = Options(Encoding::kResidual);
  o.reference_shift.reference_parent_node_id = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g(), n3_.blocks[b], o, Context(b)).status()));
  o = Options(Encoding::kResidual);
  PredictionContext no_parent = Context(b);
  no_parent.reference_parent = {};
  EXPECT_TRUE(absl::IsInvalidArgument(EncodeBlock(g(), n3_.blocks[b], o, no_parent).status()));
}

// Rewrites params byte `at` of the prefix (or the envelope flags when at < 0) and fixes the CRC.
std::string Patch(std::string bytes, int at, uint8_t value) {
  // 24-byte fixed header + u64 content checksum (flags bit 2) + u32 params_len
  constexpr size_t kParamsStart = 36;
  bytes[at < 0 ? 7 : kParamsStart + at] = static_cast<char>(value);
  const uint32_t crc = Crc32c(absl::string_view(bytes).substr(0, bytes.size() - 4));
  for (int i = 0; i < 4; ++i) bytes[bytes.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  return bytes;
}

TEST_F(ReferenceShiftTest, MalformedPrefixIsDataLoss) {
  const size_t b = 12;
  const PredictionContext ctx = Context(b);
  for (Encoding enc : {Encoding::kResidual, Encoding::kLossless}) {
    auto e = EncodeBlock(g(), n3_.blocks[b], Options(enc), ctx);
    ASSERT_TRUE(e.ok());
    std::vector<uint8_t> out(g().num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok());
    // The prefix: flags 0x02 (base 10000), token_shift 12, rotation ZigZag(-4) = 7, parent 41.
    const std::string prefix = e->bytes.substr(36, 4);  // after the content checksum
    ASSERT_EQ(prefix, std::string("\x02\x0c\x07\x29", 4));
    const struct {
      int at;
      uint8_t value;
      const char* what;
    } cases[] = {
        {0, 0x0a, "unknown flag bit 3"},
        {0, 0x82, "unknown flag bit 7"},
        {1, 16, "token_shift == block_tokens"},
        {1, 0x8c, "token_shift 908 (continued)"},
        {3, 0, "token_shift 12 without a parent id"},
    };
    for (const auto& c : cases) {
      absl::Status s = DecodeBlock(Patch(e->bytes, c.at, c.value), absl::MakeSpan(out), ctx);
      EXPECT_TRUE(absl::IsDataLoss(s)) << EncodingName(enc) << " " << c.what << ": " << s;
    }
    // The flag on an envelope without a reference id, or on a raw block.
    std::string no_ref = e->bytes;
    for (int i = 16; i < 24; ++i) no_ref[i] = 0;
    no_ref = Patch(no_ref, -1, 0x80);
    EXPECT_TRUE(absl::IsDataLoss(ParseBlock(no_ref).status()));
    auto raw = EncodeBlock(g(), n3_.blocks[b], {.encoding = Encoding::kRaw});
    ASSERT_TRUE(raw.ok());
    EXPECT_TRUE(absl::IsDataLoss(ParseBlock(Patch(raw->bytes, -1, 0x80)).status()));
  }
  // A lossless block whose remaining params are not the centroid mode.
  auto e = EncodeBlock(g(), n3_.blocks[b], Options(Encoding::kLossless), ctx);
  ASSERT_TRUE(e.ok());
  std::vector<uint8_t> out(g().num_bytes());
  EXPECT_TRUE(absl::IsDataLoss(DecodeBlock(Patch(e->bytes, 4, 2), absl::MakeSpan(out), ctx)));
}

TEST(ReferenceShift, PrefixRoundTripsAndRefusesMalformedBytes) {
  const BlockGeometry g{5, 4, 16, 8, DType::kFp16};
  for (const ReferenceShift& s :
       {ReferenceShift{.enabled = true,
       .token_shift = 12,
       .rotation = -4,
       .log_rope_base = kLogRopeBase10000,
       .reference_parent_node_id = 41},
        ReferenceShift{
            .enabled = true, .token_shift = 0, .rotation = kMaxShiftRotation, .log_rope_base = 0},
        ReferenceShift{.enabled = true,
        .token_shift = 15,
        .rotation = -kMaxShiftRotation,
        .log_rope_base = 11.5f,
        .half_split = true,
        .reference_parent_node_id = ~0ull},
        ReferenceShift{.enabled = true,
        .token_shift = 1,
        .rotation = 1,
        .log_rope_base = kLogRopeBase500000,
        .reference_parent_node_id = 1}}) {
    ASSERT_TRUE(internal::CheckReferenceShift(g, s).ok());
    std::string bytes;
    internal::AppendReferenceShift(s, &bytes);
    bytes += "rest";
    absl::string_view p = bytes;
    auto parsed = internal::ParseReferenceShift(g, &p);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(p, "rest");
    EXPECT_EQ(parsed->token_shift, s.token_shift);
    EXPECT_EQ(parsed->rotation, s.rotation);
    EXPECT_EQ(parsed->log_rope_base, s.log_rope_base);
    EXPECT_EQ(parsed->half_split, s.half_split);
    EXPECT_EQ(parsed->reference_parent_node_id, s.reference_parent_node_id);
    for (size_t cut = 0; cut + 4 < bytes.size(); ++cut) {  // every truncation
      absl::string_view t = absl::string_view(bytes).substr(0, cut);
      EXPECT_TRUE(absl::IsDataLoss(internal::ParseReferenceShift(g, &t).status())) << cut;
    }
  }
  auto parse = [&](const std::string& bytes) {
    absl::string_view p = bytes;
    return internal::ParseReferenceShift(g, &p).status();
  };
  const std::string f32_nan("\x06\x01\x02\x00\x00\xc0\x7f\x01", 8);
  const std::string f32_neg("\x06\x01\x02\x00\x00\x80\xbf\x01", 8);   // -1
  const std::string f32_big("\x06\x01\x02\x00\x00\x48\x42\x01", 8);   // 50 > 40
  const std::string f32_zero("\x06\x01\x02\x00\x00\x00\x00\x01", 8);  // 0 has its code
  for (const std::string& bad : {f32_nan, f32_neg, f32_big, f32_zero}) {
    EXPECT_TRUE(absl::IsDataLoss(parse(bad)));
  }
  EXPECT_TRUE(absl::IsDataLoss(parse(std::string("\x02\x01\x82\x80\x08\x01", 6))))
      << "rotation 2^16 + 1";
  EXPECT_TRUE(absl::IsDataLoss(parse(std::string("\x02\x00\x02\x05", 4))))
      << "a parent id with token_shift 0";
  EXPECT_TRUE(
      absl::IsDataLoss(parse(std::string("\x02\x01\x02\x80\x80\x80\x80\x80\x80"
                                         "\x80\x80\x80\x80\x01",
                                         14))))
      << "an 11-byte varint";
  const std::string half_split("\x03\x00\x02\x00", 4);
  EXPECT_TRUE(parse(half_split).ok());
  const BlockGeometry odd{5, 4, 16, 7, DType::kFp16};
  absl::string_view p = half_split;
  EXPECT_TRUE(absl::IsDataLoss(internal::ParseReferenceShift(odd, &p).status()))
      << "half_split pairing needs an even head_dim";
}

TEST(ReferenceShift, TurnIsExactAtZeroAndInvertsOnRealKeys) {
  const RealBlocks n0 = LoadRealBlocks("neardup/n0");
  const BlockGeometry& g = n0.geometry;
  const std::vector<uint8_t>& ref = n0.blocks[9];
  std::vector<uint8_t> there(g.num_bytes()), back(g.num_bytes());
  ReferenceShift s{.enabled = true, .token_shift = 0, .rotation = 0, .log_rope_base = 9.21f};
  ASSERT_TRUE(internal::BuildShiftedReference(g, s, ref, {}, absl::MakeSpan(there)).ok());
  EXPECT_EQ(there, ref);  // no shift, no turn: a copy
  for (bool half : {false, true}) {
    for (int32_t r : {1, -7, 300, 65536}) {
      s.rotation = r;
      s.half_split = half;
      ASSERT_TRUE(internal::BuildShiftedReference(g, s, ref, {}, absl::MakeSpan(there)).ok());
      s.rotation = -r;
      ASSERT_TRUE(internal::BuildShiftedReference(g, s, there, {}, absl::MakeSpan(back)).ok());
      EXPECT_LT(RelRms(g, ref, back, 0), 2e-3) << "rotation " << r << " half " << half;
      EXPECT_EQ(RelRms(g, ref, back, 1), 0) << "values are never turned";
      EXPECT_GT(RelRms(g, ref, there, 0), 1e-3) << "rotation " << r;
    }
  }
}

TEST(ReferenceShift, DeterministicCosSinMatchesLibm) {
  // The window's turn against std::cos / std::sin on a unit vector per channel pair.
  const BlockGeometry g{1, 1, 1, 8, DType::kFp32};
  for (int32_t r : {1, -4, 1000, -65536}) {
    std::vector<float> x(16, 0.0f);  // K then V, one token
    for (int i = 0; i < 4; ++i) x[2 * i] = 1.0f;
    std::vector<uint8_t> in(g.num_bytes()), out(g.num_bytes());
    std::memcpy(in.data(), x.data(), in.size());
    const float log_base = static_cast<float>(std::log(10000.0));
    ReferenceShift s{.enabled = true, .rotation = r, .log_rope_base = log_base};
    ASSERT_TRUE(internal::BuildShiftedReference(g, s, in, {}, absl::MakeSpan(out)).ok());
    std::vector<float> y(16);
    std::memcpy(y.data(), out.data(), out.size());
    for (int i = 0; i < 4; ++i) {
      const double a = r * std::exp(-2.0 * i / 8 * static_cast<double>(log_base));
      EXPECT_NEAR(y[2 * i], std::cos(a), 1e-6) << "r " << r << " pair " << i;
      EXPECT_NEAR(y[2 * i + 1], std::sin(a), 1e-6) << "r " << r << " pair " << i;
    }
  }
}

}  // namespace
}  // namespace kvtrie
