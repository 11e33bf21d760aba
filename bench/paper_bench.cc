// bench/paper_bench.cc
//
// The paper's claims (Magarshak 2026), measured (issue 20): one binary prints the tables of
// bench/paper.md. Everything is real stories260K KV from bench/make_learned_dumps.sh, split by
// text (the learned state sees only the training texts; every number is on held-out texts), and
// ΔNLL is a real forward pass of the reference model after the decoded KV (bench/paper_eval.h).
//   1. bits per token position against the text's per-token surprisal (Theorem 1), per target;
//   2. cost per token against position in the context (Corollary 5);
//   3. the paper's Layer-2 predictor (the expected KV over the model's top-20 next tokens) against
//      the learned token tables, bits at equal error;
//   4. surprisal-adaptive quantization (EncodeOptions::surprisal_step_strength) at matched bits;
//   5. a multi-session workload through a real store (bench/paper_workload.cc).
//
//   deploy/build.sh -j2 kvtrie-worker paper_bench && bench/make_learned_dumps.sh build &&
//   build/bench/paper_bench [--dumps=build/learned_dumps] [--model=GGUF] [--sections=12345]
//                           [--l2_context=128]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_flags.h"
#include "bench/paper_eval.h"
#include "client/worker/worker_ops.h"

namespace kvtrie {

int RunWorkload(const worker::LlamaModel& model, const BlockGeometry& g,
                const std::vector<Text>& train, const PredictorState* state,
                const std::string& texts_dir);

namespace {

using bench::Flag;

struct Data {
  const worker::LlamaModel* model = nullptr;
  BlockGeometry g;
  std::vector<Text> train, test;
  std::shared_ptr<const PredictorState> state;
  std::vector<Window> windows;  // context <= 384, for sections 1 and 4
};

EncodeOptions Options(Profile p, double target) {
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = p;
  o.target_rel_rms = target;
  return o;
}

// A BlockEncoder coding each block with `o`, against the learned state when `learned`, and with
// the block's surprisal (for surprisal_step_strength).
BlockEncoder Plain(const Data& d, EncodeOptions o, bool learned) {
  return [&d, o, learned](size_t, const Window& w, size_t b, PredictionContext* ctx) {
    const Block& blk = w.text->blocks[b];
    *ctx = ContextOf(blk, learned ? d.state.get() : nullptr);
    PredictionContext enc = *ctx;
    const size_t T = d.g.block_tokens;
    enc.surprisal_bits = absl::MakeConstSpan(w.text->dump.surprisal_bits).subspan(b * T, T);
    return MustEncode(d.g, blk.kv, o, enc);
  };
}

// ---- 1. Theorem 1: bits per token position vs per-token surprisal ----
void Section1(const Data& d) {
  const double per_token = static_cast<double>(d.g.num_elements()) / d.g.block_tokens;
  std::printf(
      "## 1. Bits per token position vs the text's surprisal (Theorem 1: 3.3-4.3 bits per "
      "position for fluent text)\n\n%zu held-out windows (context <= 384 tokens coded, <= 128 "
      "scored); a token position holds %.0f components (2 x %u layers x %u KV heads x %u). r = "
      "Pearson correlation over blocks of (block bits, block surprisal).\n\n",
      d.windows.size(), per_token, d.g.num_layers, d.g.num_kv_heads, d.g.head_dim);
  std::printf(
      "| coding | target rel RMS | bits/component | bits per position | surprisal bits/token | "
      "bits per position / surprisal | r | ΔNLL %% | s.e. %% |\n"
      "|---|---|---|---|---|---|---|---|---|\n");
  struct S {
    const char* name;
    double target;
    bool learned;
  };
  const S settings[] = {{"fast, no state", 0.1, false}, {"fast, no state", 0.173, false},
                        {"fast + learned", 0.1, true},  {"fast + learned", 0.173, true},
                        {"fast + learned", 0.3, true},  {"fast + learned", 0.5, true},
                        {"fast + learned", 0.7, true}};
  EvalResult at173;
  for (const S& s : settings) {
    const EvalResult r =
        Evaluate(*d.model, d.g, d.windows, Plain(d, Options(Profile::kFast, s.target), s.learned));
    std::vector<double> bits, surprisal;
    double sum_s = 0;
    for (const BlockCost& c : r.blocks) {
      bits.push_back(c.bits);
      surprisal.push_back(c.surprisal);
      sum_s += c.surprisal;
    }
    const double s_tok = sum_s / (r.blocks.size() * d.g.block_tokens);
    const double bpp = r.bits_per_component * per_token;
    std::printf("| %s | %.3f | %.3f | %.1f | %.2f | %.1f | %+.2f | %+.3f | %.3f |\n", s.name,
                s.target, r.bits_per_component, bpp, s_tok, bpp / s_tok, Pearson(bits, surprisal),
                r.delta_nll_pct, r.se_pct);
    std::fflush(stdout);
    if (s.learned && s.target == 0.173) at173 = r;
  }
  // Per text and per surprisal quartile of blocks, fast + learned at 0.173.
  std::printf(
      "\nPer held-out text, fast + learned @0.173 (the stories are the fluent text the model was "
      "trained on):\n\n| text | blocks | surprisal bits/token | bits per position |\n"
      "|---|---|---|---|\n");
  std::map<std::string, std::pair<double, double>> by_text;  // surprisal, bits
  std::map<std::string, int> count;
  size_t i = 0;
  for (const Window& w : d.windows) {
    for (size_t b = 0; b < w.context / d.g.block_tokens; ++b, ++i) {
      auto& e = by_text[TextOf(w.text->name)];
      e.first += at173.blocks[i].surprisal;
      e.second += at173.blocks[i].bits;
      ++count[TextOf(w.text->name)];
    }
  }
  for (const auto& [name, e] : by_text) {
    const double toks = count[name] * d.g.block_tokens;
    std::printf("| %s | %d | %.2f | %.1f |\n", name.c_str(), count[name], e.first / toks,
                e.second / toks);
  }
  std::vector<BlockCost> sorted = at173.blocks;
  std::sort(sorted.begin(), sorted.end(),
            [](const BlockCost& a, const BlockCost& b) { return a.surprisal < b.surprisal; });
  std::printf(
      "\nBlocks by surprisal quartile, fast + learned @0.173:\n\n| quartile | blocks | "
      "surprisal bits/token | bits per position |\n|---|---|---|---|\n");
  for (int q = 0; q < 4; ++q) {
    const size_t lo = sorted.size() * q / 4, hi = sorted.size() * (q + 1) / 4;
    double s = 0, bits = 0;
    for (size_t k = lo; k < hi; ++k) s += sorted[k].surprisal, bits += sorted[k].bits;
    const double toks = double(hi - lo) * d.g.block_tokens;
    std::printf("| %d | %zu | %.2f | %.1f |\n", q + 1, hi - lo, s / toks, bits / toks);
  }
  std::printf("\n");
}

// ---- 2. Corollary 5: cost per token vs position ----
void Section2(const Data& d) {
  std::vector<const Text*> full;
  for (const Text& t : d.test) {
    if (t.blocks.size() * d.g.block_tokens >= 512) full.push_back(&t);
  }
  std::printf(
      "## 2. Cost per token vs position in the context (Corollary 5: it should fall as context "
      "grows)\n\nThe %zu held-out dumps that fill all 512 positions (the same texts in every "
      "row), every block coded; bits/component per 64-position bucket.\n\n"
      "| positions | blocks | surprisal bits/token | fast, no state @0.173 | fast + learned "
      "@0.173 | fast + learned @0.5 | compact + learned @0.173 |\n|---|---|---|---|---|---|---|\n",
      full.size());
  const uint32_t bucket = 64;
  const struct {
    Profile p;
    double target;
    bool learned;
  } cols[] = {{Profile::kFast, 0.173, false},
              {Profile::kFast, 0.173, true},
              {Profile::kFast, 0.5, true},
              {Profile::kCompact, 0.173, true}};
  std::vector<std::vector<double>> bits(4, std::vector<double>(512 / bucket));
  std::vector<double> surprisal(512 / bucket), blocks(512 / bucket);
  for (const Text* t : full) {
    for (size_t b = 0; b * d.g.block_tokens < 512; ++b) {
      const Block& blk = t->blocks[b];
      const size_t k = blk.first_position / bucket;
      blocks[k] += 1;
      for (size_t j = 0; j < d.g.block_tokens; ++j) {
        surprisal[k] += t->dump.surprisal_bits[blk.first_position + j];
      }
      for (int c = 0; c < 4; ++c) {
        // The compact profile's parent predictor: the previous block's original stands in for
        // its reconstruction (a bench shortcut; the codec still meets the target).
        PredictionContext ctx = ContextOf(blk, cols[c].learned ? d.state.get() : nullptr);
        if (cols[c].p == Profile::kCompact && b > 0) ctx.parent = t->blocks[b - 1].kv;
        bits[c][k] +=
            8.0 * MustEncode(d.g, blk.kv, Options(cols[c].p, cols[c].target), ctx).bytes.size();
      }
    }
  }
  for (size_t k = 0; k < blocks.size(); ++k) {
    const double comps = blocks[k] * d.g.num_elements();
    std::printf("| %zu-%zu | %.0f | %.2f | %.3f | %.3f | %.3f | %.3f |\n", k * bucket,
                (k + 1) * bucket - 1, blocks[k], surprisal[k] / (blocks[k] * d.g.block_tokens),
                bits[0][k] / comps, bits[1][k] / comps, bits[2][k] / comps, bits[3][k] / comps);
  }
  std::printf("\n");
}

// ---- 3. The paper's Layer-2 predictor: expected KV over the top-20 next tokens ----
// For every context position t > 0 of `w`: the model's distribution after tokens [0, t), its 20
// most probable tokens renormalized, each run at position t on the true history (fp16 cache, as
// the dump), their K/V weighted; position 0 (BOS, always the same) gets its own KV. Returns the
// prediction in the dump layout (fp16 K and V) and adds the top-20 mass to *mass.
std::pair<std::vector<uint16_t>, std::vector<uint16_t>> ExpectedKv(const Data& d, const Window& w,
                                                                   double* mass) {
  const worker::LlamaConfig& cfg = d.model->config();
  const size_t n = w.context, L = cfg.num_layers, H = cfg.num_kv_heads, D = cfg.head_dim();
  std::vector<float> k(L * H * n * D), v(k.size());
  worker::Sequence seq(d.model, n + 1, DType::kFp16);
  const std::vector<uint32_t>& ids = w.text->dump.token_ids;
  auto put = [&](size_t t, size_t pos, double weight) {
    for (size_t l = 0; l < L; ++l) {
      for (size_t h = 0; h < H; ++h) {
        float* kk = &k[((l * H + h) * n + t) * D];
        float* vv = &v[((l * H + h) * n + t) * D];
        for (size_t c = 0; c < D; ++c) {
          kk[c] += static_cast<float>(weight * seq.k(l, h, pos)[c]);
          vv[c] += static_cast<float>(weight * seq.v(l, h, pos)[c]);
        }
      }
    }
  };
  if (!seq.Extend({ids[0]}).ok()) std::exit(2);
  put(0, 0, 1.0);
  for (size_t t = 1; t < n; ++t) {
    const std::vector<float> logits = seq.logits();
    std::vector<uint32_t> order(logits.size());
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
    std::partial_sort(order.begin(), order.begin() + 20, order.end(),
                      [&](uint32_t a, uint32_t b) { return logits[a] > logits[b]; });
    double z = 0, z20 = 0;
    std::vector<double> p(20);
    for (float x : logits) z += std::exp(double(x) - logits[order[0]]);
    for (int r = 0; r < 20; ++r)
      z20 += p[r] = std::exp(double(logits[order[r]]) - logits[order[0]]);
    *mass += z20 / z;
    for (int r = 0; r < 20; ++r) {
      if (!seq.Extend({order[r]}).ok()) std::exit(2);
      put(t, t, p[r] / z20);
      if (!seq.Truncate(t).ok()) std::exit(2);
    }
    if (!seq.RecomputeLastLogits().ok() || !seq.Extend({ids[t]}).ok()) std::exit(2);
  }
  std::pair<std::vector<uint16_t>, std::vector<uint16_t>> out;
  for (float x : k) out.first.push_back(FloatToHalf(x));
  for (float x : v) out.second.push_back(FloatToHalf(x));
  return out;
}

// ||x - pred|| / ||x|| of K and V, accumulated over blocks (block layout, fp16 x, float pred).
struct PredError {
  double ek = 0, xk = 0, ev = 0, xv = 0;
  void Add(const BlockGeometry& g, absl::Span<const uint8_t> x, const float* pred) {
    const size_t plane = size_t(g.num_kv_heads) * g.block_tokens * g.head_dim;
    const uint16_t* h = reinterpret_cast<const uint16_t*>(x.data());
    for (size_t i = 0; i < g.num_elements(); ++i) {
      const double a = HalfToFloat(h[i]), e = a - pred[i];
      const bool key = (i / plane) % 2 == 0;
      (key ? ek : ev) += e * e;
      (key ? xk : xv) += a * a;
    }
  }
};

void Section3(const Data& d, size_t l2_context) {
  std::vector<Window> windows;
  for (const Window& w0 : d.windows) {
    Window w = w0;
    w.context = std::min(w.context, l2_context);
    w.end = std::min(w.text->dump.num_tokens(), w.context + 128);
    w.baseline_bits = ScoreWith(*d.model, w, PrefixOf(d.g, *w.text, w.context, nullptr));
    windows.push_back(w);
  }
  // The expected KV of every window, in block layout.
  std::vector<std::vector<std::vector<uint8_t>>> expected(windows.size());
  double mass = 0, positions = 0;
  PredError err_ext, err_learned;
  std::vector<float> pred(d.g.num_elements());
  for (size_t i = 0; i < windows.size(); ++i) {
    const Window& w = windows[i];
    auto [k, v] = ExpectedKv(d, w, &mass);
    positions += w.context - 1;
    for (size_t b = 0; b < w.context / d.g.block_tokens; ++b) {
      expected[i].emplace_back(d.g.num_bytes());
      GatherBlock(d.g, w.context, reinterpret_cast<const uint8_t*>(k.data()),
                  reinterpret_cast<const uint8_t*>(v.data()), b, absl::MakeSpan(expected[i][b]));
      const uint16_t* e = reinterpret_cast<const uint16_t*>(expected[i][b].data());
      for (size_t j = 0; j < pred.size(); ++j) pred[j] = HalfToFloat(e[j]);
      const Block& blk = w.text->blocks[b];
      err_ext.Add(d.g, blk.kv, pred.data());
      d.state->Predict(blk.tokens, blk.first_position, blk.previous_token, pred.data());
      err_learned.Add(d.g, blk.kv, pred.data());
    }
  }
  std::printf(
      "## 3. The paper's Layer-2 predictor (expected KV over the model's top-20 next tokens) vs "
      "the learned token tables\n\n%zu held-out windows, context %zu tokens coded (%.0f positions "
      "predicted; the top 20 tokens hold %.1f %% of the model's probability on average), <= 128 "
      "scored. Compact profile (the only one with the external predictor), same error target in "
      "every row: bits at equal error.\n\nPrediction error alone (||x - prediction|| / ||x||, "
      "pooled): top-20 expected KV: K %.3f, V %.3f; learned token / pair means: K %.3f, V %.3f.\n\n"
      "| predictors | target rel RMS | bits/component | relK / relV met | ΔNLL %% | s.e. %% |\n"
      "|---|---|---|---|---|---|\n",
      windows.size(), l2_context, positions, 100 * mass / positions,
      std::sqrt(err_ext.ek / err_ext.xk), std::sqrt(err_ext.ev / err_ext.xv),
      std::sqrt(err_learned.ek / err_learned.xk), std::sqrt(err_learned.ev / err_learned.xv));
  constexpr uint32_t kExt = 1u << static_cast<int>(Predictor::kExternal);
  constexpr uint32_t kLearned = 1u << static_cast<int>(Predictor::kTokenMean);
  constexpr uint32_t kToday =
      kAllPredictors & ~kExt & ~kLearned & ~(1u << static_cast<int>(Predictor::kTokenMeanLinear));
  const struct {
    const char* name;
    uint32_t predictors;
  } rows[] = {{"today's (no state)", kToday},
              {"paper L2: top-20 expected KV only", kExt},
              {"learned token tables only", kLearned},
              {"top-20 expected KV + today's", kExt | kToday},
              {"learned + today's (the default)", kLearned | kToday},
              {"all: expected KV + learned + today's", kAllPredictors}};
  for (double target : {0.173, 0.3}) {
    for (const auto& row : rows) {
      EncodeOptions o = Options(Profile::kCompact, target);
      o.predictors = row.predictors;
      const bool learned = row.predictors & kLearned;
      const BlockEncoder enc = [&](size_t wi, const Window& w, size_t b, PredictionContext* ctx) {
        const Block& blk = w.text->blocks[b];
        *ctx = ContextOf(blk, learned ? d.state.get() : nullptr);
        if (row.predictors & kExt) ctx->external = expected[wi][b];
        if (b > 0) ctx->parent = w.text->blocks[b - 1].kv;  // the original (bench shortcut)
        return MustEncode(d.g, blk.kv, o, *ctx);
      };
      const EvalResult r = Evaluate(*d.model, d.g, windows, enc);
      std::printf("| %s | %.3f | %.3f | %.3f / %.3f | %+.3f | %.3f |\n", row.name, target,
                  r.bits_per_component, r.rel_k, r.rel_v, r.delta_nll_pct, r.se_pct);
      std::fflush(stdout);
    }
  }
  std::printf("\n");
}

// ---- 4. Surprisal-adaptive quantization ----
void Section4(const Data& d) {
  std::printf(
      "## 4. Surprisal-adaptive quantization (EncodeOptions::surprisal_step_strength, compact "
      "profile + learned state)\n\nThe windows of section 1. \"off at these bits\": ΔNLL of "
      "strength 0 interpolated (linear in log bits) at the row's bits.\n\n"
      "| strength | target rel RMS | bits/component | bits vs off, same target | ΔNLL %% | s.e. "
      "%% | off at these bits: ΔNLL %% |\n|---|---|---|---|---|---|---|\n");
  const double targets[] = {0.1, 0.173, 0.3, 0.5};
  std::vector<std::pair<double, double>> off;  // (bits, ΔNLL) of strength 0, by target
  for (double a : {0.0, 0.5, 1.0, 2.0}) {
    for (size_t ti = 0; ti < 4; ++ti) {
      EncodeOptions o = Options(Profile::kCompact, targets[ti]);
      o.surprisal_step_strength = a;
      const BlockEncoder enc = Plain(d, o, true);
      const EvalResult r = Evaluate(*d.model, d.g, d.windows, enc);
      if (a == 0) off.emplace_back(r.bits_per_component, r.delta_nll_pct);
      std::string matched = "-";
      if (a > 0) {
        auto sorted = off;
        std::sort(sorted.begin(), sorted.end());
        for (size_t j = 0; j + 1 < sorted.size(); ++j) {
          const double x0 = std::log(sorted[j].first), x1 = std::log(sorted[j + 1].first);
          const double x = std::log(r.bits_per_component);
          if (x >= x0 && x <= x1) {
            const double f = (x - x0) / (x1 - x0);
            char buf[32];
            std::snprintf(buf, sizeof(buf), "%+.3f",
                          sorted[j].second + f * (sorted[j + 1].second - sorted[j].second));
            matched = buf;
          }
        }
      }
      const double bits_vs = 100 * (r.bits_per_component / off[ti].first - 1);
      std::printf("| %.1f | %.3f | %.3f | %+.1f %% | %+.3f | %.3f | %s |\n", a, targets[ti],
                  r.bits_per_component, bits_vs, r.delta_nll_pct, r.se_pct, matched.c_str());
      std::fflush(stdout);
    }
  }
  std::printf("\n");
}

int Main(int argc, char** argv) {
  const std::string dir = Flag(argc, argv, "dumps", "build/learned_dumps");
  const std::string model_path =
      Flag(argc, argv, "model", worker::DefaultModelPath(KVTRIE_SOURCE_DIR));
  const std::string sections = Flag(argc, argv, "sections", "12345");
  const size_t l2_context = std::stoul(Flag(argc, argv, "l2_context", "128"));
  auto model = worker::LlamaModel::Load(model_path);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  Data d;
  d.model = model->get();
  d.train = LoadDir(dir + "/train", 16, &d.g);
  d.test = LoadDir(dir + "/test", 16, &d.g);
  if (d.train.empty() || d.test.empty()) {
    std::fprintf(stderr, "no dumps under %s (bench/make_learned_dumps.sh)\n", dir.c_str());
    return 1;
  }
  uint64_t learned = 0;
  d.state = Learn(d.g, d.train, UINT64_MAX, &learned);
  if (!d.state) return 1;
  d.windows = MakeWindows(*d.model, d.g, d.test, 384);
  double base = 0;
  size_t scored = 0;
  for (const Window& w : d.windows) base += w.baseline_bits, scored += w.end - w.context;
  std::printf(
      "# paper_bench: %zu training dumps, %zu held-out dumps (split by text); state %s; "
      "baseline NLL %.3f bits/token over %zu scored tokens\n\n",
      d.train.size(), d.test.size(), d.state->Describe().c_str(), base / scored, scored);
  if (sections.find('1') != std::string::npos) Section1(d);
  if (sections.find('2') != std::string::npos) Section2(d);
  if (sections.find('3') != std::string::npos) Section3(d, l2_context);
  if (sections.find('4') != std::string::npos) Section4(d);
  if (sections.find('5') != std::string::npos) {
    return RunWorkload(*d.model, d.g, d.train, d.state.get(),
                       std::string(KVTRIE_SOURCE_DIR) + "/bench/texts");
  }
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
