// Tests of the envelope's content checksum and state fingerprint (envelope.h flags bits 2
// and 3, issue 30): every encoding writes the checksum of what its decoder returns, a forged
// block (payload or params changed, CRC-32C recomputed) is DATA_LOSS instead of wrong values, a
// block names the state it was coded against, and blocks without either still decode.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/predictor_state.h"
#include "codec/testing_blocks.h"
#include "codec/testing_mutate.h"
#include "gtest/gtest.h"
#include "xxhash.h"

namespace kvtrie {
namespace {

using testing::MutateFixCrc;
using testing::MutateWhere;

constexpr uint32_t kT = 16;

PredictionContext Context(const TokenBlocks& d, size_t b, const PredictorState* state) {
  PredictionContext ctx;
  ctx.learned = state;
  ctx.tokens = d.tokens[b];
  ctx.first_position = static_cast<uint32_t>(b * kT);
  ctx.previous_token = b ? d.tokens[b - 1].back() : -1;
  return ctx;
}

EncodeOptions Options(Encoding e, Profile p, double target = 0) {
  EncodeOptions o;
  o.encoding = e;
  o.profile = p;
  o.target_rel_rms = target;
  return o;
}

TEST(ContentChecksum, EveryEncodingWritesTheChecksumOfWhatItsDecoderReturns) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3"), story = LoadTokenBlocks("story_prompt");
  const auto state = LearnState({&gpl, &story}, 1);
  ASSERT_NE(state, nullptr);
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  ASSERT_GE(gen.real.blocks.size(), 4u);
  const EncodeOptions all[] = {
      Options(Encoding::kRaw, Profile::kCompact),
      Options(Encoding::kLossless, Profile::kCompact),
      Options(Encoding::kLossless, Profile::kFast),
      Options(Encoding::kResidual, Profile::kFast, 0.05),
      Options(Encoding::kResidual, Profile::kFast, 0.3),
      Options(Encoding::kResidual, Profile::kCompact, 0.1),
      Options(Encoding::kInt8, Profile::kCompact),
      Options(Encoding::kKivi2, Profile::kCompact),
      Options(Encoding::kTurboQuant, Profile::kCompact),
  };
  for (const EncodeOptions& base : all) {
    for (bool learned : {false, true}) {
      EncodeOptions o = base;
      o.learned_lossless = learned;
      for (size_t b = 0; b < 4; ++b) {
        const PredictionContext ctx = Context(gen, b, learned ? state.get() : nullptr);
        absl::StatusOr<EncodedBlock> e = EncodeBlock(g, gen.real.blocks[b], o, ctx);
        ASSERT_TRUE(e.ok()) << e.status();
        absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
        ASSERT_TRUE(h.ok()) << h.status();
        const std::string what =
            absl::StrCat(EncodingName(o.encoding), " profile ", static_cast<int>(o.profile),
                         " target ", o.target_rel_rms, " learned ", learned, " block ", b);
        ASSERT_TRUE(h->has_content_checksum) << what;
        std::vector<uint8_t> out(g.num_bytes());
        ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok()) << what;
        EXPECT_EQ(h->content_checksum, XXH3_64bits(out.data(), out.size())) << what;
        if (!IsLossyEncoding(o.encoding)) {
          EXPECT_EQ(out, gen.real.blocks[b]) << what;
        }
        EXPECT_EQ(h->predictor_fingerprint != 0, h->predictor_version != 0) << what;
        if (h->predictor_version != 0) {
          EXPECT_EQ(h->predictor_fingerprint, state->fingerprint()) << what;
        }
      }
    }
  }
}

// Issue 30 row 4: 206 of 212 payload mutants of LOSSLESS fast blocks decoded without error to
// other values. With the checksum every mutant that decodes is refused.
TEST(ContentChecksum, ForgedLosslessFastBlocksAreDataLossNeverOtherValues) {
  const RealBlocks r = LoadRealBlocks("genesis_1-3");
  const BlockGeometry& g = r.geometry;
  const EncodeOptions o = Options(Encoding::kLossless, Profile::kFast);
  EncodeOptions old = o;
  old.content_checksum = false;
  int silent_without = 0, refused_with = 0, mutants = 0;
  for (size_t b = 0; b < 2; ++b) {
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, r.blocks[b], o);
    absl::StatusOr<EncodedBlock> e_old = EncodeBlock(g, r.blocks[b], old);
    ASSERT_TRUE(e.ok() && e_old.ok());
    for (size_t i = 0; i < 100; ++i) {
      const size_t offset = 4 + i * 997;  // past the zstd frame length
      const std::string bad = MutateFixCrc(e->bytes, offset, 0x01);
      const std::string bad_old = MutateFixCrc(e_old->bytes, offset, 0x01);
      ASSERT_FALSE(bad.empty());
      ASSERT_TRUE(ParseBlock(bad).ok());  // the CRC is right: only the content can tell
      ++mutants;
      std::vector<uint8_t> out(g.num_bytes());
      if (DecodeBlock(bad_old, absl::MakeSpan(out)).ok() && out != r.blocks[b]) ++silent_without;
      absl::Status s = DecodeBlock(bad, absl::MakeSpan(out));
      ASSERT_FALSE(s.ok()) << "mutant " << i << " of block " << b << " decoded";
      EXPECT_TRUE(absl::IsDataLoss(s)) << s;
      refused_with += absl::StrContains(s.message(), "content checksum mismatch");
    }
  }
  EXPECT_GT(silent_without, mutants / 2);  // what the blocks of before let through
  EXPECT_GT(refused_with, mutants / 2);    // ... which the checksum now names
}

TEST(ContentChecksum, ForgedResidualFastParamsAreDataLoss) {
  const RealBlocks r = LoadRealBlocks("genesis_1-3");
  const BlockGeometry& g = r.geometry;
  absl::StatusOr<EncodedBlock> e =
      EncodeBlock(g, r.blocks[1], Options(Encoding::kResidual, Profile::kFast, 0.1));
  ASSERT_TRUE(e.ok()) << e.status();
  // Byte 6 of the params is the first plane's step (bf16, low byte): a different step decodes
  // without any structural error.
  const std::string bad = MutateFixCrc(e->bytes, 6, 0x01, MutateWhere::kParams);
  std::vector<uint8_t> out(g.num_bytes());
  absl::Status s = DecodeBlock(bad, absl::MakeSpan(out));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "content checksum mismatch")) << s;
}

TEST(ContentChecksum, BlocksWithoutChecksumOrFingerprintDecodeAsBefore) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3"), story = LoadTokenBlocks("story_prompt");
  const auto state = LearnState({&gpl, &story}, 1);
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  for (Encoding enc : {Encoding::kLossless, Encoding::kResidual}) {
    EncodeOptions o = Options(enc, Profile::kFast, enc == Encoding::kResidual ? 0.1 : 0);
    o.learned_lossless = true;
    EncodeOptions old = o;
    old.content_checksum = false;
    const PredictionContext ctx = Context(gen, 2, state.get());
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, gen.real.blocks[2], o, ctx);
    absl::StatusOr<EncodedBlock> e_old = EncodeBlock(g, gen.real.blocks[2], old, ctx);
    ASSERT_TRUE(e.ok() && e_old.ok());
    absl::StatusOr<BlockHeader> h_old = ParseBlock(e_old->bytes);
    ASSERT_TRUE(h_old.ok());
    EXPECT_FALSE(h_old->has_content_checksum);
    EXPECT_EQ(h_old->predictor_fingerprint, 0u);
    EXPECT_EQ(static_cast<uint8_t>(e_old->bytes[7]) & 0x0c, 0);  // bits 2 and 3 clear
    // The same block, 8 (+ 8 with a state) bytes longer.
    EXPECT_EQ(e->bytes.size(), e_old->bytes.size() + (h_old->predictor_version ? 16 : 8));
    std::vector<uint8_t> a(g.num_bytes()), b(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(a), ctx).ok());
    ASSERT_TRUE(DecodeBlock(e_old->bytes, absl::MakeSpan(b), ctx).ok());
    EXPECT_EQ(a, b);
  }
}

// Issue 30 row 2: a block names its state by fingerprint, not only by the per-namespace version.
TEST(StateFingerprint, ABlockRefusesAnotherStateOfTheSameVersion) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3"), story = LoadTokenBlocks("story_prompt");
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const auto a = LearnState({&gpl, &story}, 1);
  const auto b = LearnState({&gen}, 1);  // another namespace's version 1
  ASSERT_NE(a->fingerprint(), b->fingerprint());
  // The fingerprint is of the bytes: it survives Serialize and Parse.
  absl::StatusOr<std::shared_ptr<const PredictorState>> a2 = PredictorState::Parse(a->Serialize());
  ASSERT_TRUE(a2.ok());
  EXPECT_EQ((*a2)->fingerprint(), a->fingerprint());
  const BlockGeometry& g = gen.real.geometry;
  absl::StatusOr<EncodedBlock> e =
      EncodeBlock(g, gen.real.blocks[3], Options(Encoding::kResidual, Profile::kFast, 0.1),
                  Context(gen, 3, a.get()));
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_EQ(e->predictor_version, 1u);
  std::vector<uint8_t> out(g.num_bytes());
  EXPECT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), Context(gen, 3, a2->get())).ok());
  absl::Status s = DecodeBlock(e->bytes, absl::MakeSpan(out), Context(gen, 3, b.get()));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "fingerprint")) << s;
}

}  // namespace
}  // namespace kvtrie
