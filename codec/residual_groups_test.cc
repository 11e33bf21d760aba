// Step groups of the residual encoding (EncodeOptions::step_groups, params flag 32): round trips
// within the target, corrupt blocks, and plane-step blocks unchanged.
#include <random>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

constexpr uint8_t kFlagGroupScales = 32;  // residual_codec.cc

uint8_t ParamsFlags(const std::string& bytes) {
  const absl::StatusOr<BlockHeader> h = ParseBlock(bytes);
  EXPECT_TRUE(h.ok() && h->params.size() >= 2);
  return h.ok() && h->params.size() >= 2 ? static_cast<uint8_t>(h->params[1]) : 0;
}

EncodeOptions Grouped(double target) {
  EncodeOptions o{.encoding = Encoding::kResidual, .target_rel_rms = target};
  o.step_groups = StepGroups::kChannelKeysTokenValues;
  return o;
}

struct GroupCase {
  const char* dump;
  double target;
  bool rotate, surprisal;
};

class ResidualStepGroups : public testing::TestWithParam<GroupCase> {};

TEST_P(ResidualStepGroups, RoundTripsRealDumpsWithinTheTargetPerPlane) {
  const GroupCase& gc = GetParam();
  const RealBlocks r = LoadRealBlocks(gc.dump);
  const BlockGeometry& g = r.geometry;
  ASSERT_GT(r.blocks.size(), 2u);
  for (size_t i = 1; i < r.blocks.size(); i += 5) {
    PredictionContext c;
    c.parent = r.blocks[i - 1];
    if (gc.surprisal) c.surprisal_bits = r.surprisal[i];
    EncodeOptions o = Grouped(gc.target);
    o.rotate = gc.rotate;
    o.surprisal_step_strength = gc.surprisal ? 1.0 : 0.0;
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, r.blocks[i], o, c);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_TRUE(ParamsFlags(e->bytes) & kFlagGroupScales);
    std::vector<uint8_t> decoded(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(decoded), c).ok());
    for (int l = 0; l < static_cast<int>(g.num_layers); ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        EXPECT_LE(RelRms(g, r.blocks[i], decoded, kv, l), gc.target)
            << "block " << i << " layer " << l << " kv " << kv;
      }
    }
    // The reported errors are those of the decoded block, and the search used the budget.
    EXPECT_NEAR(e->rel_rms_error_k, RelRms(g, r.blocks[i], decoded, 0), 1e-9);
    EXPECT_NEAR(e->rel_rms_error_v, RelRms(g, r.blocks[i], decoded, 1), 1e-9);
    EXPECT_GT(e->rel_rms_error_k, 0.5 * gc.target);
    EXPECT_GT(e->rel_rms_error_v, 0.5 * gc.target);
  }
}

INSTANTIATE_TEST_SUITE_P(Dumps, ResidualStepGroups,
                         testing::Values(GroupCase{"GPL-3", 0.05, false, false},
                                         GroupCase{"genesis_1-3", 0.2, false, false},
                                         GroupCase{"story_prompt", 0.01, false, false},
                                         GroupCase{"sessions/s0", 0.1, true, false},
                                         GroupCase{"neardup/n0", 0.05, false, true}));

TEST(ResidualStepGroups, PlaneStepIsTheDefaultAndItsBlocksAreUnchanged) {
  const RealBlocks r = LoadRealBlocks("story_prompt");
  const BlockGeometry& g = r.geometry;
  EXPECT_EQ(EncodeOptions().step_groups, StepGroups::kPlane);
  for (size_t i = 0; i < r.blocks.size(); i += 4) {
    EncodeOptions plane{.encoding = Encoding::kResidual, .target_rel_rms = 0.05};
    const std::string def = EncodeBlock(g, r.blocks[i], plane)->bytes;
    plane.step_groups = StepGroups::kPlane;
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, r.blocks[i], plane);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->bytes, def);
    EXPECT_FALSE(ParamsFlags(e->bytes) & kFlagGroupScales);
    std::vector<uint8_t> decoded(g.num_bytes());
    ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(decoded)).ok());
    EXPECT_NEAR(e->rel_rms_error_k, RelRms(g, r.blocks[i], decoded, 0), 1e-9);
    EXPECT_NEAR(e->rel_rms_error_v, RelRms(g, r.blocks[i], decoded, 1), 1e-9);
    // The grouped block of the same data is a different stream.
    EXPECT_NE(EncodeBlock(g, r.blocks[i], Grouped(0.05))->bytes, e->bytes);
  }
}

// Corrupts the grouped blocks' params and payload with a valid CRC, and toggles flag 32 on blocks
// with and without group scales (the decoder then reads residuals as scale codes or the reverse):
// always DATA_LOSS or a decoded block, never a crash.
TEST(ResidualStepGroups, CorruptBlocksAreDataLossAndNeverCrash) {
  const RealBlocks r = LoadRealBlocks("GPL-3");
  const BlockGeometry& g = r.geometry;
  std::mt19937 rng(11);
  std::vector<uint8_t> out(g.num_bytes());
  int rejected = 0, total = 0;
  auto check = [&](const std::string& params, const std::string& payload) {
    const std::string bad = internal::WriteEnvelope(Encoding::kResidual, g, 0, params, payload);
    const absl::Status s = DecodeBlock(bad, absl::MakeSpan(out));
    ++total;
    if (s.ok()) return;
    ++rejected;
    // A corrupted predictor id may name a context that was not passed; anything else: DATA_LOSS.
    if (s.code() != absl::StatusCode::kFailedPrecondition) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    }
  };
  for (size_t b = 3; b < r.blocks.size(); b += 9) {
    for (bool grouped : {true, false}) {
      EncodeOptions o = Grouped(0.1);
      if (!grouped) o.step_groups = StepGroups::kPlane;
      const std::string good = EncodeBlock(g, r.blocks[b], o)->bytes;
      const BlockHeader h = *ParseBlock(good);
      const std::string params(h.params), payload(h.payload);
      std::string toggled = params;
      toggled[1] = static_cast<char>(toggled[1] ^ kFlagGroupScales);
      check(toggled, payload);
      std::string no_choices = toggled;  // flag 32 needs flag 16
      no_choices[1] = static_cast<char>((no_choices[1] | kFlagGroupScales) & ~16);
      check(no_choices, payload);
      if (!grouped) continue;
      for (int trial = 0; trial < 60; ++trial) {
        std::string p = params, q = payload;
        std::string& victim = trial % 3 == 0 ? p : q;
        switch (trial % 4) {
          case 0:
            victim[rng() % victim.size()] ^= static_cast<char>(1 << (rng() % 8));
            break;
          case 1:
            victim.resize(rng() % victim.size());
            break;
          case 2:
            victim[rng() % victim.size()] = static_cast<char>(rng());
            break;
          default:
            victim.push_back(static_cast<char>(rng()));
            break;
        }
        check(p, q);
      }
    }
  }
  EXPECT_GT(rejected, total / 2);
}

TEST(ResidualStepGroups, BitsBudgetIsMetWithGroups) {
  const RealBlocks r = LoadRealBlocks("genesis_1-3");
  const BlockGeometry& g = r.geometry;
  EncodeOptions o{.encoding = Encoding::kResidual, .target_bits_per_component = 3.0};
  o.step_groups = StepGroups::kChannelKeysTokenValues;
  absl::StatusOr<EncodedBlock> e = EncodeBlock(g, r.blocks[4], o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_LE(e->bits_per_component, 3.0);
  EXPECT_TRUE(ParamsFlags(e->bytes) & kFlagGroupScales);
  std::vector<uint8_t> decoded(g.num_bytes());
  ASSERT_TRUE(DecodeBlock(e->bytes, absl::MakeSpan(decoded)).ok());
  EXPECT_NEAR(e->rel_rms_error_k, RelRms(g, r.blocks[4], decoded, 0), 1e-9);
}

}  // namespace
}  // namespace kvtrie
