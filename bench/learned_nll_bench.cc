// bench/learned_nll_bench.cc
//
// ΔNLL vs bits/component with and without the learned predictor state (issue 11), in process (no
// server): the held-out dumps of bench/make_learned_dumps.sh, the state learned from the training
// dumps. Per test dump (one window each): the context is its first C tokens (C = min(384, a
// multiple of block_tokens leaving >= 32 tokens)), the continuation the next <= 128 tokens. The
// context KV is encoded block by block, decoded, loaded into the model (stories260K, real forward
// pass) and the continuation scored; the baseline loads the dump's own (fp16) KV the same way.
//
//   learned_nll_bench [--dumps=build/learned_dumps] [--model=GGUF] [--block_tokens=16]
//                     [--only="learned fast @0.173,before @0.173"]
//
// ΔNLL % = 100 * (sum of continuation surprisal from decoded KV - the same from the dump's KV) /
// the latter, pooled over every window; s.e. from the per-window ΔNLL spread.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/learned_data.h"
#include "bench/paper_eval.h"
#include "client/worker/llama_model.h"

namespace kvtrie {
namespace {

struct Row {
  std::string name;
  double bpc = 0, delta_pct = 0, se_pct = 0;
};

Row Evaluate(const worker::LlamaModel& model, const BlockGeometry& g,
             const std::vector<Window>& windows, const std::vector<double>& baseline,
             const std::string& name, Profile profile, double target, const PredictorState* state,
             KeyError key_error, uint32_t predictors, bool klt) {
  EncodeOptions o;
  o.predictors = predictors;
  o.klt = klt;
  o.key_error = key_error;
  o.encoding = Encoding::kResidual;
  o.profile = profile;
  o.target_rel_rms = target;
  double bytes = 0, comps = 0, sum = 0, base = 0;
  std::vector<double> per_window;
  for (size_t i = 0; i < windows.size(); ++i) {
    const Window& w = windows[i];
    std::vector<std::vector<uint8_t>> decoded;
    for (size_t b = 0; b < w.context / g.block_tokens; ++b) {
      const Block& blk = w.text->blocks[b];
      const PredictionContext ctx = ContextOf(blk, state);
      auto e = EncodeBlock(g, blk.kv, o, ctx);
      if (!e.ok()) std::exit(3);
      bytes += e->bytes.size();
      comps += g.num_elements();
      decoded.emplace_back(g.num_bytes());
      if (!DecodeBlock(e->bytes, absl::MakeSpan(decoded.back()), ctx).ok()) std::exit(3);
    }
    const double s = ScoreWith(model, w, PrefixOf(g, *w.text, w.context, &decoded));
    sum += s;
    base += baseline[i];
    per_window.push_back(100 * (s - baseline[i]) / baseline[i]);
  }
  Row r;
  r.name = name;
  r.bpc = 8 * bytes / comps;
  r.delta_pct = 100 * (sum - base) / base;
  double mean = 0, var = 0;
  for (double v : per_window) mean += v / per_window.size();
  for (double v : per_window) var += (v - mean) * (v - mean) / (per_window.size() - 1);
  r.se_pct = std::sqrt(var / per_window.size());
  return r;
}

std::string Flag(int argc, char** argv, const std::string& name, const std::string& def) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
  }
  return def;
}

int Main(int argc, char** argv) {
  const std::string dir = Flag(argc, argv, "dumps", "build/learned_dumps");
  const std::string model_path =
      Flag(argc, argv, "model", "../shared/data/stories260K/stories260K.gguf");
  const uint32_t T = std::stoi(Flag(argc, argv, "block_tokens", "16"));
  auto model = worker::LlamaModel::Load(model_path);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  BlockGeometry g;
  const std::vector<Text> train = LoadDir(dir + "/train", T, &g);
  const std::vector<Text> test = LoadDir(dir + "/test", T, &g);
  uint64_t learned = 0;
  const auto state = Learn(g, train, UINT64_MAX, &learned);
  if (!state) return 1;
  std::vector<Window> windows;
  std::vector<double> baseline;
  size_t scored = 0;
  for (const Text& t : test) {
    const size_t n = t.dump.num_tokens();
    if (n < 32 + T) continue;
    Window w;
    w.text = &t;
    w.context = std::min<size_t>(384, (n - 32) / T * T);
    w.end = std::min(n, w.context + 128);
    windows.push_back(w);
    baseline.push_back(ScoreWith(**model, w, PrefixOf(g, t, w.context, nullptr)));
    scored += w.end - w.context;
  }
  double base_sum = 0;
  for (double b : baseline) base_sum += b;
  std::printf(
      "# learned_nll_bench: %zu held-out windows, %zu scored tokens, baseline NLL %.3f "
      "bits/token; state %s\n\n",
      windows.size(), scored, base_sum / scored, state->Describe().c_str());
  std::printf(
      "| setting | bits/component | ratio vs fp16 | ΔNLL %% | s.e. %% |\n|---|---|---|---|---|\n");
  struct S {
    const char* name;
    Profile p;
    double target;
    bool learned;
    KeyError key_error = KeyError::kRaw;
    uint32_t predictors = kAllPredictors;
    bool klt = true;
  };
  constexpr uint32_t kNoLinear =
      kAllPredictors & ~(1u << static_cast<int>(Predictor::kTokenMeanLinear));
  const S settings[] = {
      {"today fast", Profile::kFast, 0.05, false},
      {"today fast", Profile::kFast, 0.1, false},
      {"today fast", Profile::kFast, 0.173, false},
      {"today compact", Profile::kCompact, 0.173, false},
      {"learned fast", Profile::kFast, 0.1, true},
      {"learned fast", Profile::kFast, 0.173, true},
      {"learned fast", Profile::kFast, 0.3, true},
      {"learned fast", Profile::kFast, 0.5, true},
      {"learned compact", Profile::kCompact, 0.173, true},
      {"learned compact", Profile::kCompact, 0.3, true},
      {"today fast, keys mean-removed", Profile::kFast, 0.1, false, KeyError::kMeanRemoved},
      {"today fast, keys mean-removed", Profile::kFast, 0.173, false, KeyError::kMeanRemoved},
      {"today fast, keys mean-removed", Profile::kFast, 0.3, false, KeyError::kMeanRemoved},
      {"learned fast, keys mean-removed", Profile::kFast, 0.173, true, KeyError::kMeanRemoved},
      {"learned fast, keys mean-removed", Profile::kFast, 0.3, true, KeyError::kMeanRemoved},
      {"learned fast", Profile::kFast, 0.7, true},
      // The cross-layer linear predictor masked off (what main coded with the same state).
      {"learned fast, before (no linear, no KLT)", Profile::kFast, 0.173, true, KeyError::kRaw,
       kNoLinear, false},
      {"learned fast, before (no linear, no KLT)", Profile::kFast, 0.3, true, KeyError::kRaw,
       kNoLinear, false},
  };
  // --only=A,B: only the settings whose label ("name @target", e.g. "learned fast @0.173")
  // contains one of the comma-separated substrings.
  const std::string only = Flag(argc, argv, "only", "");
  for (const S& s : settings) {
    char label[160];
    std::snprintf(label, sizeof(label), "%s @%.3f", s.name, s.target);
    bool wanted = only.empty();
    for (size_t at = 0; !wanted && at <= only.size();) {
      size_t comma = only.find(',', at);
      if (comma == std::string::npos) comma = only.size();
      wanted = std::string(label).find(only.substr(at, comma - at)) != std::string::npos;
      at = comma + 1;
    }
    if (!wanted) continue;
    const Row r = Evaluate(**model, g, windows, baseline, s.name, s.p, s.target,
                           s.learned ? state.get() : nullptr, s.key_error, s.predictors, s.klt);
    std::printf("| %s @%.3f | %.3f | %.1fx | %+.3f | %.3f |\n", s.name, s.target, r.bpc,
                16.0 / r.bpc, r.delta_pct, r.se_pct);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
