// codec/testing_blocks.h
//
// Test helper: the real KV dumps of tests/data cut into blocks (block layout of block_geometry.h),
// for the codec's unit tests. Not part of the library.
#ifndef KVTRIE_CODEC_TESTING_BLOCKS_H_
#define KVTRIE_CODEC_TESTING_BLOCKS_H_

#include <memory>
#include <string>
#include <vector>

#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/predictor_state.h"
#include "gtest/gtest.h"

namespace kvtrie {

struct RealBlocks {
  BlockGeometry geometry;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<std::vector<float>> surprisal;  // per block, block_tokens values
};

// Every full block of `dump` (a folder under tests/data) with `block_tokens` tokens each.
inline RealBlocks LoadRealBlocks(const std::string& dump, uint32_t block_tokens = 16) {
  RealBlocks r;
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + dump);
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return r;
  r.geometry = BlockGeometry{d->num_layers, d->num_kv_heads, block_tokens, d->head_dim, d->dtype};
  for (size_t b = 0; b < d->num_tokens() / block_tokens; ++b) {
    r.blocks.emplace_back(r.geometry.num_bytes());
    GatherBlock(r.geometry, d->num_tokens(), d->k.data(), d->v.data(), b,
                absl::MakeSpan(r.blocks.back()));
    r.surprisal.emplace_back(d->surprisal_bits.begin() + b * block_tokens,
                             d->surprisal_bits.begin() + (b + 1) * block_tokens);
  }
  return r;
}

// A dump's full blocks (LoadRealBlocks) with each block's token ids, for the learned
// predictors' tests.
struct TokenBlocks {
  RealBlocks real;
  std::vector<std::vector<int32_t>> tokens;
};

inline TokenBlocks LoadTokenBlocks(const std::string& dump, uint32_t block_tokens = 16) {
  TokenBlocks r;
  r.real = LoadRealBlocks(dump, block_tokens);
  absl::StatusOr<KvDump> m = ReadKvManifest(std::string(KVTRIE_TESTDATA_DIR) + "/" + dump);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return r;
  for (size_t b = 0; b < r.real.blocks.size(); ++b) {
    r.tokens.emplace_back(m->token_ids.begin() + b * block_tokens,
                          m->token_ids.begin() + (b + 1) * block_tokens);
  }
  return r;
}

// A predictor state `version` learned (default LearnerOptions) from every block of `dumps`, each
// a text from its first token (the geometry is the first dump's).
inline std::shared_ptr<const PredictorState> LearnState(
    const std::vector<const TokenBlocks*>& dumps, uint32_t version) {
  auto learner = PredictorLearner::Create(dumps[0]->real.geometry, LearnerOptions{});
  EXPECT_TRUE(learner.ok()) << learner.status();
  if (!learner.ok()) return nullptr;
  for (const TokenBlocks* d : dumps) {
    const uint32_t bt = d->real.geometry.block_tokens;
    for (size_t b = 0; b < d->real.blocks.size(); ++b) {
      EXPECT_TRUE((*learner)
                      ->Observe(d->real.blocks[b], d->tokens[b], static_cast<uint32_t>(b * bt),
                                b ? d->tokens[b - 1].back() : -1)
                      .ok());
    }
  }
  auto state = (*learner)->Fit(version);
  EXPECT_TRUE(state.ok()) << state.status();
  return state.ok() ? *state : nullptr;
}

inline std::vector<float> AsFloat(const BlockGeometry& g, const std::vector<uint8_t>& block) {
  std::vector<float> f(g.num_elements());
  ToFloat(g.dtype, block.data(), f.size(), f.data());
  return f;
}

// ||x - y|| / ||x|| over the K (kv = 0) or V (kv = 1) plane of `layer` (-1: of every layer).
inline double RelRms(const BlockGeometry& g, const std::vector<uint8_t>& a,
                     const std::vector<uint8_t>& b, int kv, int layer = -1) {
  const std::vector<float> x = AsFloat(g, a), y = AsFloat(g, b);
  double err = 0, energy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t plane = i / g.plane_elements();
    if (static_cast<int>(plane % 2) != kv) continue;
    if (layer >= 0 && static_cast<int>(plane / 2) != layer) continue;
    err += (x[i] - y[i]) * static_cast<double>(x[i] - y[i]);
    energy += x[i] * static_cast<double>(x[i]);
  }
  return std::sqrt(err / energy);
}

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_TESTING_BLOCKS_H_
