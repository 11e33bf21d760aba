// Blocks that decode alone (codec/decode_alone.h): fast-profile blocks coded against a learned
// state (real stories260K KV of Genesis 1-3, the state learned from GPL-3 and story_prompt: no
// shared text) decode from the state, their tokens, position and previous token, in any order,
// bit-identical to the decode chain; compact-profile blocks never decode alone.
#include "codec/decode_alone.h"

#include <memory>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/decode_chain.h"
#include "codec/predictor_state.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

constexpr uint32_t kT = 16;

// Learned from GPL-3 and story_prompt.
std::shared_ptr<const PredictorState> TrainState(uint32_t version) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3"), story = LoadTokenBlocks("story_prompt");
  return LearnState({&gpl, &story}, version);
}

AloneContext Alone(const TokenBlocks& d, size_t b, const PredictorState* state) {
  return {.state = state,
          .tokens = d.tokens[b],
          .first_position = static_cast<uint32_t>(b * kT),
          .previous_token = b ? d.tokens[b - 1].back() : -1};
}

TEST(DecodeAlone, LearnedFastBlocksDecodeInAnyOrderAsOnTheChain) {
  const auto state = TrainState(3);
  ASSERT_GT(state->linear_bytes(), 0u);  // the cross-layer predictor (code 4) is in play
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  ASSERT_GE(gen.real.blocks.size(), 8u);
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = Profile::kFast;
  o.target_rel_rms = 0.05;
  std::vector<std::string> enc;
  uint32_t linear_heads = 0;
  for (size_t b = 0; b < gen.real.blocks.size(); ++b) {
    PredictionContext ctx;
    ctx.learned = state.get();
    ctx.tokens = gen.tokens[b];
    ctx.first_position = static_cast<uint32_t>(b * kT);
    ctx.previous_token = b ? gen.tokens[b - 1].back() : -1;
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, gen.real.blocks[b], o, ctx);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_EQ(e->predictor_version, 3u) << "block " << b;
    linear_heads += e->predictor_count[0][static_cast<int>(Predictor::kTokenMeanLinear)] +
                    e->predictor_count[1][static_cast<int>(Predictor::kTokenMeanLinear)];
    absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
    ASSERT_TRUE(h.ok());
    EXPECT_TRUE(DecodesAlone(*h)) << "block " << b;
    enc.push_back(std::move(e->bytes));
  }
  EXPECT_GT(linear_heads, 0u);  // some heads read the planes before them in the same block

  // The chain, in order, with the parent kept: the reference.
  DecodeChain chain(g, nullptr);
  chain.AddPredictor(state);
  std::vector<std::vector<uint8_t>> want(enc.size(), std::vector<uint8_t>(g.num_bytes()));
  for (size_t b = 0; b < enc.size(); ++b) {
    ASSERT_TRUE(chain.Next(enc[b], 0, absl::MakeSpan(want[b]), gen.tokens[b]).ok());
  }
  // Alone, last block first: bit-identical.
  for (size_t b = enc.size(); b-- > 0;) {
    std::vector<uint8_t> got(g.num_bytes(), 0xAB);
    ASSERT_TRUE(DecodeAlone(enc[b], Alone(gen, b, state.get()), absl::MakeSpan(got)).ok());
    EXPECT_EQ(got, want[b]) << "block " << b;
    std::vector<uint8_t> verified(g.num_bytes());
    ASSERT_TRUE(
        DecodeAlone(enc[b], Alone(gen, b, state.get()), absl::MakeSpan(verified), true).ok());
    EXPECT_EQ(verified, want[b]) << "block " << b;
  }
  // The state and the tokens are read: without them the block names what it needs.
  std::vector<uint8_t> out(g.num_bytes());
  absl::Status s = DecodeAlone(enc[1], {}, absl::MakeSpan(out));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("version 3"), std::string::npos) << s;
  AloneContext no_tokens = Alone(gen, 1, state.get());
  no_tokens.tokens = {};
  s = DecodeAlone(enc[1], no_tokens, absl::MakeSpan(out));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("tokens"), std::string::npos) << s;
  // Another block's tokens and position predict something else, which the content checksum
  // refuses (issue 30; a block without it decodes to those other values).
  s = DecodeAlone(enc[1], Alone(gen, 2, state.get()), absl::MakeSpan(out));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("content checksum mismatch"), std::string::npos) << s;
}

TEST(DecodeAlone, CompactBlocksNeverDecodeAloneAndStatelessFastOnesDo) {
  const RealBlocks s0 = LoadRealBlocks("sessions/s0");
  const BlockGeometry& g = s0.geometry;
  ASSERT_GE(s0.blocks.size(), 3u);
  std::vector<uint8_t> parent(g.num_bytes());
  ASSERT_TRUE(DecodeBlock(EncodeBlock(g, s0.blocks[0], {.encoding = Encoding::kRaw})->bytes,
                          absl::MakeSpan(parent))
                  .ok());
  // Compact, predicted from its parent.
  EncodeOptions compact;
  compact.encoding = Encoding::kResidual;
  compact.target_rel_rms = 0.1;
  compact.predictors = 1u << static_cast<int>(Predictor::kParent);
  PredictionContext with_parent;
  with_parent.parent = parent;
  absl::StatusOr<EncodedBlock> c = EncodeBlock(g, s0.blocks[1], compact, with_parent);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_GT(c->predictor_count[0][static_cast<int>(Predictor::kParent)], 0u);
  EXPECT_FALSE(DecodesAlone(*ParseBlock(c->bytes)));
  std::vector<uint8_t> out(g.num_bytes());
  absl::Status s = DecodeAlone(c->bytes, {}, absl::MakeSpan(out));
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("DecodeChain"), std::string::npos) << s;
  // Centroid-coded (compact): not alone either.
  compact.predictors = 1u << static_cast<int>(Predictor::kCentroid);
  compact.reference_node_id = 42;
  PredictionContext with_ref;
  with_ref.reference = parent;
  absl::StatusOr<EncodedBlock> r = EncodeBlock(g, s0.blocks[2], compact, with_ref);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(ParseBlock(r->bytes)->reference_node_id, 42u);
  EXPECT_FALSE(DecodesAlone(*ParseBlock(r->bytes)));
  EXPECT_TRUE(absl::IsFailedPrecondition(DecodeAlone(r->bytes, {}, absl::MakeSpan(out))));
  // Fast without a state, and fast lossless: alone, as DecodeBlock decodes them.
  for (Encoding e : {Encoding::kResidual, Encoding::kLossless}) {
    EncodeOptions fast;
    fast.encoding = e;
    fast.profile = Profile::kFast;
    fast.target_rel_rms = 0.1;
    absl::StatusOr<EncodedBlock> f = EncodeBlock(g, s0.blocks[1], fast, with_parent);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(DecodesAlone(*ParseBlock(f->bytes)));
    std::vector<uint8_t> want(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(f->bytes, absl::MakeSpan(want)).ok());
    ASSERT_TRUE(DecodeAlone(f->bytes, {}, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, want);
  }
  // A corrupt block is DATA_LOSS (the CRC), unless the caller says it verified it.
  std::string bad = c->bytes;
  bad[bad.size() / 2] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(DecodeAlone(bad, {}, absl::MakeSpan(out))));
}

}  // namespace
}  // namespace kvtrie
