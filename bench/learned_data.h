// bench/learned_data.h
//
// The learned benches' data (learned_bench.cc, learned_nll_bench.cc): the dumps that
// bench/make_learned_dumps.sh writes, cut into blocks with their token ids and positions, and a
// PredictorState learned from the training ones.
#ifndef KVTRIE_BENCH_LEARNED_DATA_H_
#define KVTRIE_BENCH_LEARNED_DATA_H_

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/predictor_state.h"

namespace kvtrie {

struct Block {
  std::vector<uint8_t> kv;
  std::vector<int32_t> tokens;
  uint32_t first_position = 0;
  int32_t previous_token = -1;
};

struct Text {
  std::string name;  // dump folder name, "<text>.<window>"
  double mean_surprisal = 0;
  std::vector<Block> blocks;
  KvDump dump;  // the whole dump (k, v, token ids)
};

inline std::string TextOf(const std::string& dump) { return dump.substr(0, dump.rfind('.')); }

inline std::vector<Text> LoadDir(const std::string& dir, uint32_t T, BlockGeometry* g) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_directory()) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  std::vector<Text> out;
  for (const std::string& name : names) {
    absl::StatusOr<KvDump> d = ReadKvDump(dir + "/" + name);
    if (!d.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(), d.status().ToString().c_str());
      continue;
    }
    *g = BlockGeometry{d->num_layers, d->num_kv_heads, T, d->head_dim, d->dtype};
    Text t;
    t.name = name;
    double s = 0;
    for (size_t i = 1; i < d->num_tokens(); ++i) s += d->surprisal_bits[i];
    t.mean_surprisal = d->num_tokens() > 1 ? s / (d->num_tokens() - 1) : 0;
    for (size_t b = 0; b < d->num_tokens() / T; ++b) {
      Block blk;
      blk.kv.resize(g->num_bytes());
      GatherBlock(*g, d->num_tokens(), d->k.data(), d->v.data(), b, absl::MakeSpan(blk.kv));
      blk.tokens.assign(d->token_ids.begin() + b * T, d->token_ids.begin() + (b + 1) * T);
      blk.first_position = static_cast<uint32_t>(b * T);
      blk.previous_token = b ? static_cast<int32_t>(d->token_ids[b * T - 1]) : -1;
      t.blocks.push_back(std::move(blk));
    }
    t.dump = *std::move(d);
    out.push_back(std::move(t));
  }
  return out;
}

inline std::shared_ptr<const PredictorState> Learn(const BlockGeometry& g,
                                                   const std::vector<Text>& train,
                                                   uint64_t max_tokens, uint64_t* learned) {
  auto learner = PredictorLearner::Create(g, {});
  if (!learner.ok()) return nullptr;
  // Round-robin over texts, so that a small budget still sees many texts.
  uint64_t n = 0;
  for (size_t round = 0; n < max_tokens; ++round) {
    bool any = false;
    for (const Text& t : train) {
      if (round >= t.blocks.size() || n >= max_tokens) continue;
      const Block& b = t.blocks[round];
      any = true;
      if (!(*learner)->Observe(b.kv, b.tokens, b.first_position, b.previous_token).ok()) continue;
      n += b.tokens.size();
    }
    if (!any) break;
  }
  *learned = (*learner)->tokens_observed();
  auto state = (*learner)->Fit(1);
  return state.ok() ? *state : nullptr;
}

inline PredictionContext ContextOf(const Block& b, const PredictorState* state) {
  PredictionContext c;
  c.learned = state;
  if (state != nullptr) {
    c.tokens = b.tokens;
    c.first_position = b.first_position;
    c.previous_token = b.previous_token;
  }
  return c;
}

}  // namespace kvtrie

#endif  // KVTRIE_BENCH_LEARNED_DATA_H_
