#include "codec/predictor_state.h"

#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/decode_chain.h"
#include "codec/fast_residual.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

constexpr uint32_t kT = 16;

void Observe(PredictorLearner* learner, const TokenBlocks& d) {
  for (size_t b = 0; b < d.real.blocks.size(); ++b) {
    ASSERT_TRUE(learner
                    ->Observe(d.real.blocks[b], d.tokens[b], static_cast<uint32_t>(b * kT),
                              b ? d.tokens[b - 1].back() : -1)
                    .ok());
  }
}

// Learned from GPL-3 and story_prompt; tested on Genesis 1-3, which shares no text with them
// (sessions/ and neardup/ hold the GPL-3 preamble and Genesis passages, so neither is used).
std::shared_ptr<const PredictorState> TrainState(uint32_t version = 1,
                                                 LearnerOptions options = {}) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3"), story = LoadTokenBlocks("story_prompt");
  auto learner = PredictorLearner::Create(gpl.real.geometry, options);
  EXPECT_TRUE(learner.ok()) << learner.status();
  Observe(learner->get(), gpl);
  Observe(learner->get(), story);
  auto state = (*learner)->Fit(version);
  EXPECT_TRUE(state.ok()) << state.status();
  return *state;
}

EncodeOptions Residual(Profile profile, double target) {
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = profile;
  o.target_rel_rms = target;
  return o;
}

std::string Reseal(std::string bytes) {  // a valid CRC over edited bytes
  const uint32_t crc = Crc32c(absl::string_view(bytes).substr(0, bytes.size() - 4));
  std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
  return bytes;
}

TEST(PredictorStateTest, FitsDetectsRopeAndRoundTripsItsBytes) {
  const auto state = TrainState(7);
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->version(), 7u);
  EXPECT_EQ(state->rope_base(), 10000.0);  // stories260K: RoPE theta 10000
  EXPECT_EQ(state->tokens_learned(), 512u / kT * kT + 284u / kT * kT);
  EXPECT_GT(state->tokens_in_table(), 100u);
  EXPECT_GT(state->pairs_in_table(), 10u);  // from story_prompt, after the RoPE base is decided
  EXPECT_NE(state->Describe().find("v7"), std::string::npos);
  const std::string bytes = state->Serialize();
  auto parsed = PredictorState::Parse(bytes);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ((*parsed)->Serialize(), bytes);
  EXPECT_EQ((*parsed)->version(), 7u);
  EXPECT_EQ((*parsed)->tokens_in_table(), state->tokens_in_table());
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  std::vector<float> a(gen.real.geometry.num_elements()), b(a.size());
  state->PredictTokenMean(gen.tokens[3], 3 * kT, a.data());
  (*parsed)->PredictTokenMean(gen.tokens[3], 3 * kT, b.data());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

TEST(PredictorStateTest, LayerZeroIsExplainedByTheTokenAndPosition) {
  // Layer 0 depends only on (token, position): the rotated token mean explains nearly all of it
  // on a held-out text (its tokens that training saw), keys included.
  const auto state = TrainState();
  std::set<int32_t> seen;
  for (const char* dump : {"GPL-3", "story_prompt"}) {
    for (const auto& tokens : LoadTokenBlocks(dump).tokens)
      seen.insert(tokens.begin(), tokens.end());
  }
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  double err[2] = {0, 0}, energy[2] = {0, 0};
  std::vector<float> pred(g.num_elements());
  for (size_t b = 0; b < gen.real.blocks.size(); ++b) {
    state->PredictTokenMean(gen.tokens[b], static_cast<uint32_t>(b * kT), pred.data());
    const std::vector<float> x = AsFloat(g, gen.real.blocks[b]);
    for (size_t i = 0; i < g.layer_elements(); ++i) {  // layer 0
      const int kv = static_cast<int>(i / g.plane_elements());
      if (!seen.count(gen.tokens[b][(i / g.head_dim) % kT])) continue;
      err[kv] += (x[i] - pred[i]) * static_cast<double>(x[i] - pred[i]);
      energy[kv] += x[i] * static_cast<double>(x[i]);
    }
  }
  // Measured: both < 1e-5 (what is left is fp16 rounding and the model's float32 RoPE).
  std::printf("layer 0 unexplained: K %.5f V %.5f\n", err[0] / energy[0], err[1] / energy[1]);
  EXPECT_LT(err[0] / energy[0], 0.01) << "K";
  EXPECT_LT(err[1] / energy[1], 0.01) << "V";
}

TEST(PredictorStateTest, HeldOutRoundTripWithinTargetAndSmaller) {
  const auto state = TrainState(3);
  // The decoder gets a state parsed from bytes, as a client would.
  auto parsed = PredictorState::Parse(state->Serialize());
  ASSERT_TRUE(parsed.ok());
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  for (Profile profile : {Profile::kFast, Profile::kCompact}) {
    for (double target : {0.05, 0.173}) {
      double bits_plain = 0, bits_learned = 0;
      uint32_t learned_heads = 0;
      for (size_t b = 0; b < gen.real.blocks.size(); ++b) {
        const EncodeOptions o = Residual(profile, target);
        PredictionContext ctx;
        ctx.learned = state.get();
        ctx.tokens = gen.tokens[b];
        ctx.first_position = static_cast<uint32_t>(b * kT);
        ctx.previous_token = b ? gen.tokens[b - 1].back() : -1;
        ctx.previous_token = b ? gen.tokens[b - 1].back() : -1;
        auto plain = EncodeBlock(g, gen.real.blocks[b], o);
        auto learned = EncodeBlock(g, gen.real.blocks[b], o, ctx);
        ASSERT_TRUE(plain.ok() && learned.ok()) << learned.status();
        bits_plain += plain->bits_per_component;
        bits_learned += learned->bits_per_component;
        const int tm = static_cast<int>(Predictor::kTokenMean);
        const uint32_t heads = learned->predictor_count[0][tm] + learned->predictor_count[1][tm];
        learned_heads += heads;
        auto h = ParseBlock(learned->bytes);
        ASSERT_TRUE(h.ok());
        EXPECT_EQ(h->predictor_version, heads > 0 ? 3u : 0u);
        EXPECT_EQ(ParseBlock(plain->bytes)->predictor_version, 0u);
        std::vector<uint8_t> out(g.num_bytes());
        PredictionContext dctx = ctx;
        dctx.learned = parsed->get();
        ASSERT_TRUE(DecodeBlock(learned->bytes, absl::MakeSpan(out), dctx).ok());
        EXPECT_LE(RelRms(g, gen.real.blocks[b], out, 0), target * 1.0001);
        EXPECT_LE(RelRms(g, gen.real.blocks[b], out, 1), target * 1.0001);
        EXPECT_NEAR(RelRms(g, gen.real.blocks[b], out, 0), learned->rel_rms_error_k, 1e-6);
      }
      EXPECT_GT(learned_heads, 0u);
      std::printf("profile %d target %.3f: %.3f -> %.3f bits/component\n",
                  static_cast<int>(profile), target, bits_plain / gen.real.blocks.size(),
                  bits_learned / gen.real.blocks.size());
      // Measured: fast 0.05 -> ~0.75x, 0.173 -> ~0.6x of the bits without the state.
      EXPECT_LT(bits_learned, 0.9 * bits_plain)
          << "profile " << static_cast<int>(profile) << " target " << target;
    }
  }
}

// Planes whose quantized residual is all zero (keys under the learned state) are flagged in the
// params and carry no step, bit count, table or symbols; they decode to the prediction itself.
TEST(PredictorStateTest, AllZeroPlanesAreFlaggedAndDecodeToThePrediction) {
  // Without linear weights, so that every learned head predicts the token mean itself (linear
  // blocks: learned_linear_test.cc).
  LearnerOptions no_linear;
  no_linear.fit_linear = false;
  const auto state = TrainState(2, no_linear);
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  ASSERT_EQ(g.dtype, DType::kFp16);
  const size_t planes = 2 * g.num_layers;
  const size_t pe = static_cast<size_t>(g.num_kv_heads) * kT * g.head_dim;
  size_t zero_planes = 0, flagged_blocks = 0, checked_planes = 0, all_learned_blocks = 0;
  std::string zero_params, zero_payload;
  PredictionContext zero_ctx;
  for (double target : {0.173, 0.3}) {
    for (size_t b = 0; b < gen.real.blocks.size(); ++b) {
      PredictionContext ctx;
      ctx.learned = state.get();
      ctx.tokens = gen.tokens[b];
      ctx.first_position = static_cast<uint32_t>(b * kT);
      ctx.previous_token = b ? gen.tokens[b - 1].back() : -1;
      internal::FastOutput f;
      ASSERT_TRUE(internal::EncodeFastResidual(g, gen.real.blocks[b],
                                               Residual(Profile::kFast, target), ctx, &f)
                      .ok());
      std::vector<uint8_t> out(g.num_bytes());
      ASSERT_TRUE(
          internal::DecodeFastResidual(g, f.params, f.payload, absl::MakeSpan(out), ctx).ok());
      EXPECT_LE(RelRms(g, gen.real.blocks[b], out, 0), target * 1.0001);
      EXPECT_LE(RelRms(g, gen.real.blocks[b], out, 1), target * 1.0001);
      // Flags bit 2: every head learned, no predictor bytes.
      const bool all_learned = static_cast<uint8_t>(f.params[1]) & 4;
      all_learned_blocks += all_learned;
      EXPECT_EQ(all_learned,
                f.predictor_count[0][static_cast<int>(Predictor::kTokenMean)] +
                        f.predictor_count[1][static_cast<int>(Predictor::kTokenMean)] ==
                    2u * g.num_kv_heads * g.num_layers);
      if (all_learned) {  // ... which needs the state
        EXPECT_EQ(internal::DecodeFastResidual(g, f.params, f.payload, absl::MakeSpan(out)).code(),
                  absl::StatusCode::kDataLoss);
      }
      if (!(static_cast<uint8_t>(f.params[1]) & 2)) continue;
      ++flagged_blocks;
      if (zero_params.empty()) zero_params = f.params, zero_payload = f.payload, zero_ctx = ctx;
      std::vector<float> pred(g.num_elements());
      state->Predict(ctx.tokens, ctx.first_position, ctx.previous_token, pred.data());
      for (size_t pl = 0; pl < planes; ++pl) {
        if (!((static_cast<uint8_t>(f.params[6 + pl / 8]) >> (pl % 8)) & 1)) continue;
        ++zero_planes;
        // Every head of this block chose the learned predictor: x' is the prediction in fp16.
        if (f.predictor_count[pl % 2][static_cast<int>(Predictor::kTokenMean)] !=
            g.num_kv_heads * g.num_layers) {
          continue;
        }
        ++checked_planes;
        for (size_t i = 0; i < pe; ++i) {
          uint16_t h;
          std::memcpy(&h, out.data() + 2 * (pl * pe + i), 2);
          ASSERT_EQ(HalfToFloat(h), HalfToFloat(FloatToHalf(pred[pl * pe + i])))
              << "plane " << pl << " element " << i;
        }
      }
    }
  }
  std::printf("%zu blocks with all-zero planes, %zu planes (%zu checked against the prediction)\n",
              flagged_blocks, zero_planes, checked_planes);
  EXPECT_GT(flagged_blocks, gen.real.blocks.size() / 2);
  EXPECT_GT(checked_planes, 0u);
  EXPECT_GT(all_learned_blocks, 0u);
  ASSERT_FALSE(zero_params.empty());
  // A bit past the last plane is DATA_LOSS; clearing a zero plane's bit or cutting the params
  // never crashes.
  std::vector<uint8_t> out(g.num_bytes());
  std::string p = zero_params;
  p[6 + (planes - 1) / 8] |= static_cast<char>(0x80);
  if (planes % 8 != 0) {
    EXPECT_EQ(
        internal::DecodeFastResidual(g, p, zero_payload, absl::MakeSpan(out), zero_ctx).code(),
        absl::StatusCode::kDataLoss);
  }
  for (size_t pl = 0; pl < planes; ++pl) {
    p = zero_params;
    p[6 + pl / 8] ^= static_cast<char>(1 << (pl % 8));
    (void)internal::DecodeFastResidual(g, p, zero_payload, absl::MakeSpan(out), zero_ctx);
  }
  for (size_t cut = 0; cut < zero_params.size(); ++cut) {
    EXPECT_FALSE(internal::DecodeFastResidual(g, zero_params.substr(0, cut), zero_payload,
                                              absl::MakeSpan(out), zero_ctx)
                     .ok());
  }
}

TEST(PredictorStateTest, CompactRotatedBlocksUseTheStateToo) {
  // The compact profile's Hadamard rotation: the prediction is rotated into the coded domain.
  const auto state = TrainState(2);
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  EncodeOptions o = Residual(Profile::kCompact, 0.1);
  o.rotate = true;
  double plain = 0, learned = 0;
  for (size_t b = 0; b < gen.real.blocks.size(); b += 4) {
    PredictionContext ctx;
    ctx.learned = state.get();
    ctx.tokens = gen.tokens[b];
    ctx.first_position = static_cast<uint32_t>(b * kT);
    ctx.previous_token = b ? gen.tokens[b - 1].back() : -1;
    auto e = EncodeBlock(g, gen.real.blocks[b], o, ctx);
    auto p = EncodeBlock(g, gen.real.blocks[b], o);
    ASSERT_TRUE(e.ok() && p.ok()) << e.status();
    learned += e->bits_per_component;
    plain += p->bits_per_component;
    std::vector<uint8_t> out(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok());
    EXPECT_LE(RelRms(g, gen.real.blocks[b], out, 0), 0.1 * 1.0001);
    EXPECT_LE(RelRms(g, gen.real.blocks[b], out, 1), 0.1 * 1.0001);
  }
  EXPECT_LT(learned, 0.9 * plain);
}

TEST(PredictorStateTest, MissingOrOtherStateIsFailedPreconditionNamingTheVersion) {
  const auto state = TrainState(5);
  const auto other = TrainState(6);
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  for (Profile profile : {Profile::kFast, Profile::kCompact}) {
    PredictionContext ctx;
    ctx.learned = state.get();
    ctx.tokens = gen.tokens[0];
    auto e = EncodeBlock(g, gen.real.blocks[0], Residual(profile, 0.1), ctx);
    ASSERT_TRUE(e.ok());
    ASSERT_EQ(ParseBlock(e->bytes)->predictor_version, 5u);
    std::vector<uint8_t> out(g.num_bytes());
    PredictionContext none;
    none.tokens = gen.tokens[0];
    absl::Status s = DecodeBlock(e->bytes, absl::MakeSpan(out), none);
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_NE(s.message().find("version 5"), std::string::npos) << s;
    PredictionContext wrong = ctx;
    wrong.learned = other.get();
    s = DecodeBlock(e->bytes, absl::MakeSpan(out), wrong);
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_NE(s.message().find("version 5"), std::string::npos) << s;
    PredictionContext no_tokens = ctx;
    no_tokens.tokens = {};
    s = DecodeBlock(e->bytes, absl::MakeSpan(out), no_tokens);
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok());
  }
}

TEST(PredictorStateTest, MalformedBytesAreDataLoss) {
  const auto state = TrainState();
  const std::string bytes = state->Serialize();
  ASSERT_GT(state->pairs_in_table(), 1u);
  const size_t V = 5 * 2 * 4 * 8;
  const size_t pairs_at =
      32 + state->tokens_in_table() * 8 + (state->tokens_in_table() + 1) * 2 * V;
  for (size_t i = 0; i < bytes.size(); i += 1 + bytes.size() / 300) {
    std::string bad = bytes;
    bad[i] ^= 0x10;
    auto p = PredictorState::Parse(bad);
    EXPECT_TRUE(absl::IsDataLoss(p.status())) << "byte " << i << ": " << p.status();
  }
  for (size_t cut : {size_t{0}, size_t{3}, size_t{35}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_TRUE(absl::IsDataLoss(PredictorState::Parse(bytes.substr(0, cut)).status())) << cut;
  }
  // Fields that a valid CRC does not make right.
  auto edited = [&](size_t at, std::string with) {
    std::string b = bytes;
    b.replace(at, with.size(), with);
    return PredictorState::Parse(Reseal(b)).status();
  };
  EXPECT_TRUE(absl::IsDataLoss(edited(4, "\x03"))) << "format";
  EXPECT_TRUE(absl::IsDataLoss(edited(4, bytes[4] == 2 ? "\x01" : "\x02"))) << "format";
  EXPECT_TRUE(absl::IsDataLoss(edited(5, "\x09"))) << "dtype";
  EXPECT_TRUE(absl::IsDataLoss(edited(6, "\x03"))) << "rope";
  EXPECT_TRUE(absl::IsDataLoss(edited(8, std::string(4, '\0')))) << "version 0";
  EXPECT_TRUE(absl::IsDataLoss(edited(12, std::string(2, '\0')))) << "layers 0";
  EXPECT_TRUE(absl::IsDataLoss(edited(14, "\x05"))) << "heads";
  EXPECT_TRUE(absl::IsDataLoss(edited(28, "\xff\xff\xff\x7f"))) << "entries";
  EXPECT_TRUE(absl::IsDataLoss(edited(32, "\xff\xff\xff\x7f"))) << "id order";
  EXPECT_TRUE(absl::IsDataLoss(edited(bytes.size() - 6, std::string("\x00\x7c", 2))))
      << "infinite mean";
  EXPECT_TRUE(absl::IsDataLoss(edited(pairs_at, "\xff\xff\xff\x0f"))) << "pair count";
  EXPECT_TRUE(absl::IsDataLoss(edited(pairs_at + 4, "\xff\xff\xff\x7f"))) << "pair order";
  EXPECT_TRUE(absl::IsDataLoss(edited(pairs_at + 8, "\xff\xff\xff\xff"))) << "pair token id";
  EXPECT_TRUE(PredictorState::Parse(Reseal(bytes)).ok());
}

TEST(PredictorStateTest, MemoryCapIsHonoured) {
  const auto full = TrainState();
  LearnerOptions small;
  small.max_bytes = 200 << 10;
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3"), story = LoadTokenBlocks("story_prompt");
  auto learner = PredictorLearner::Create(gpl.real.geometry, small);
  ASSERT_TRUE(learner.ok());
  Observe(learner->get(), gpl);
  Observe(learner->get(), story);
  EXPECT_LE((*learner)->memory_bytes(), small.max_bytes);
  EXPECT_EQ((*learner)->tokens_observed(), full->tokens_learned());
  auto state = (*learner)->Fit(1);
  ASSERT_TRUE(state.ok());
  EXPECT_LE((*learner)->memory_bytes() + (*state)->memory_bytes(), small.max_bytes);
  EXPECT_GT((*state)->tokens_in_table(), 0u);
  EXPECT_LT((*state)->tokens_in_table(), full->tokens_in_table());
}

TEST(PredictorStateTest, UnrotatedKeysAreDetected) {
  // Values (never rotated) given as keys too: the learner must not de-rotate them.
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3");
  const BlockGeometry& g = gpl.real.geometry;
  auto learner = PredictorLearner::Create(g, {});
  ASSERT_TRUE(learner.ok());
  const size_t pb = g.plane_elements() * 2;  // fp16 plane bytes
  for (size_t b = 0; b < gpl.real.blocks.size(); ++b) {
    std::vector<uint8_t> kv = gpl.real.blocks[b];
    for (size_t l = 0; l < g.num_layers; ++l) {
      std::memcpy(kv.data() + (2 * l) * pb, kv.data() + (2 * l + 1) * pb, pb);
    }
    ASSERT_TRUE((*learner)->Observe(kv, gpl.tokens[b], static_cast<uint32_t>(b * kT), -1).ok());
  }
  auto state = (*learner)->Fit(1);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ((*state)->rope_base(), 0.0);
}

TEST(PredictorStateTest, BadObserveAndFitArguments) {
  const TokenBlocks gpl = LoadTokenBlocks("GPL-3");
  auto learner = PredictorLearner::Create(gpl.real.geometry, {});
  ASSERT_TRUE(learner.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*learner)->Fit(1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument((*learner)->Observe(
      absl::MakeConstSpan(gpl.real.blocks[0]).subspan(1), gpl.tokens[0], 0, -1)));
  EXPECT_TRUE(absl::IsInvalidArgument((*learner)->Observe(
      gpl.real.blocks[0], absl::MakeConstSpan(gpl.tokens[0]).subspan(1), 0, -1)));
  std::vector<int32_t> negative = gpl.tokens[0];
  negative[2] = -4;
  EXPECT_TRUE(absl::IsInvalidArgument((*learner)->Observe(gpl.real.blocks[0], negative, 0, -1)));
  ASSERT_TRUE((*learner)->Observe(gpl.real.blocks[0], gpl.tokens[0], 0, -1).ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*learner)->Fit(0).status()));
  EXPECT_TRUE((*learner)->Fit(1).ok());
}

TEST(PredictorStateTest, DecodeChainFetchesTheStateOnceAndTracksPositions) {
  const auto state = TrainState(4);
  const TokenBlocks gen = LoadTokenBlocks("genesis_1-3");
  const BlockGeometry& g = gen.real.geometry;
  std::vector<std::string> encoded;
  for (size_t b = 0; b < gen.real.blocks.size(); ++b) {
    PredictionContext ctx;
    ctx.learned = state.get();
    ctx.tokens = gen.tokens[b];
    ctx.first_position = static_cast<uint32_t>(b * kT);
    ctx.previous_token = b ? gen.tokens[b - 1].back() : -1;
    auto e = EncodeBlock(g, gen.real.blocks[b], Residual(Profile::kFast, 0.1), ctx);
    ASSERT_TRUE(e.ok());
    encoded.push_back(e->bytes);
  }
  const std::string state_bytes = state->Serialize();
  int fetches = 0;
  auto fetch = [&](uint32_t version) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
    ++fetches;
    if (version != 4) return absl::NotFoundError("no such version");
    return PredictorState::Parse(state_bytes);
  };
  DecodeChain chain(g, nullptr, fetch);
  std::vector<std::vector<uint8_t>> decoded(encoded.size(), std::vector<uint8_t>(g.num_bytes()));
  for (size_t b = 0; b < encoded.size(); ++b) {
    ASSERT_TRUE(chain.Next(encoded[b], 0, absl::MakeSpan(decoded[b]), gen.tokens[b]).ok()) << b;
    PredictionContext ctx;
    ctx.learned = state.get();
    ctx.tokens = gen.tokens[b];
    ctx.first_position = static_cast<uint32_t>(b * kT);
    ctx.previous_token = b ? gen.tokens[b - 1].back() : -1;
    std::vector<uint8_t> direct(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(encoded[b], absl::MakeSpan(direct), ctx).ok());
    EXPECT_EQ(decoded[b], direct) << b;
  }
  EXPECT_EQ(fetches, 1);
  EXPECT_EQ(chain.first_position(), encoded.size() * kT);
  EXPECT_EQ(chain.previous_token(), gen.tokens.back().back());
  // From the middle of the path.
  DecodeChain mid(g, nullptr, fetch);
  mid.StartAt(10 * kT, gen.tokens[9].back());
  std::vector<uint8_t> out(g.num_bytes());
  ASSERT_TRUE(mid.Next(encoded[10], 0, absl::MakeSpan(out), gen.tokens[10]).ok());
  EXPECT_EQ(out, decoded[10]);
  // Without tokens or a fetcher: FAILED_PRECONDITION naming the version.
  DecodeChain blind(g, nullptr);
  absl::Status s = blind.Next(encoded[0], 0, absl::MakeSpan(out), gen.tokens[0]);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("version 4"), std::string::npos) << s;
  // The fetcher's error is passed on; a corrupt block is DATA_LOSS before any fetch.
  DecodeChain failing(g, nullptr,
                      [](uint32_t) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
                        return absl::UnavailableError("down");
                      });
  EXPECT_TRUE(absl::IsUnavailable(failing.Next(encoded[0], 0, absl::MakeSpan(out), gen.tokens[0])));
  std::string corrupt = encoded[0];
  corrupt[40] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(failing.Next(corrupt, 0, absl::MakeSpan(out), gen.tokens[0])));
}

}  // namespace
}  // namespace kvtrie
