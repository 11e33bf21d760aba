// bench/learned_bench.cc
//
// What the learned predictor state (codec/predictor_state.h, issue 11) buys on held-out text:
// real stories260K KV dumps made by bench/make_learned_dumps.sh from the texts of bench/texts/
// (split into train / test BY TEXT, bench/texts/split.tsv). The state is learned from the
// training dumps only; every number is measured on the test dumps.
//
//   learned_bench [--dumps=build/learned_dumps] [--block_tokens=16] [--repeats=5] [--section=6]
//
// Tables (bits/component = 8 * encoded bytes / components, envelope included; the state itself
// is side data shared by the whole store and is reported separately):
//   1. bits/component at relative RMS targets 0.1 / 0.173 (the TQ3 error: rel MSE 0.03) / 0.316,
//      today's predictors vs with the learned state, both residual profiles, and the errors met;
//   2. learning curve: bits at 0.173 vs tokens learned (1k .. all);
//   3. encode / decode MB/s (fp16 input bytes per second, one thread, median of --repeats) with and
//      without the state, against memcpy in the same run;
//   4. per test text: mean surprisal (manifest surprisal_bits) vs bits at 0.173, both ways;
//   5. headroom: the held-out residual energy a ridge fit from lower planes would remove.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/learned_data.h"
#include "codec/block_codec.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/predictor_state.h"

namespace kvtrie {
namespace {

using Clock = std::chrono::steady_clock;

struct Result {
  double bpc = 0, rel_k = 0, rel_v = 0;
  double learned_share = 0;  // share of (layer, K/V, head) groups that chose a learned predictor
  double linear_share = 0;   // ... that chose kTokenMeanLinear
  double saved_share = 0;    // EncodedBlock::learned_bytes_saved / (bytes + saved)
};

constexpr uint32_t kNoLinear =
    kAllPredictors & ~(1u << static_cast<int>(Predictor::kTokenMeanLinear));

// Bits and errors over `texts` (errors: pooled over every block).
Result Measure(const BlockGeometry& g, const std::vector<Text>& texts, Profile profile,
               double target, const PredictorState* state, uint32_t predictors = kAllPredictors,
               bool klt = true) {
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = profile;
  o.target_rel_rms = target;
  o.predictors = predictors;
  o.klt = klt;
  double bytes = 0, comps = 0, ek = 0, ev = 0, groups = 0, learned = 0, linear = 0, saved = 0;
  for (const Text& t : texts) {
    for (const Block& b : t.blocks) {
      auto e = EncodeBlock(g, b.kv, o, ContextOf(b, state));
      if (!e.ok()) {
        std::fprintf(stderr, "encode: %s\n", e.status().ToString().c_str());
        std::exit(1);
      }
      bytes += e->bytes.size();
      saved += e->learned_bytes_saved;
      comps += g.num_elements();
      ek += e->rel_rms_error_k * e->rel_rms_error_k;
      ev += e->rel_rms_error_v * e->rel_rms_error_v;
      for (int kv = 0; kv < 2; ++kv) {
        for (int p = 0; p < kNumPredictors; ++p) groups += e->predictor_count[kv][p];
        learned += e->predictor_count[kv][static_cast<int>(Predictor::kTokenMean)];
        linear += e->predictor_count[kv][static_cast<int>(Predictor::kTokenMeanLinear)];
      }
    }
  }
  size_t nb = 0;
  for (const Text& t : texts) nb += t.blocks.size();
  Result r;
  r.bpc = 8 * bytes / comps;
  r.rel_k = std::sqrt(ek / nb);
  r.rel_v = std::sqrt(ev / nb);
  r.learned_share = groups > 0 ? (learned + linear) / groups : 0;
  r.linear_share = groups > 0 ? linear / groups : 0;
  r.saved_share = saved / (bytes + saved);
  return r;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Encode and decode MB/s (fp16 input bytes), median of `repeats` passes over every test block.
void Throughput(const BlockGeometry& g, const std::vector<Text>& texts, Profile profile,
                const PredictorState* state, int repeats, double* enc_mbs, double* dec_mbs,
                uint32_t predictors = kAllPredictors, bool klt = true) {
  EncodeOptions o;
  o.encoding = Encoding::kResidual;
  o.profile = profile;
  o.target_rel_rms = 0.173;
  o.predictors = predictors;
  o.klt = klt;
  std::vector<std::string> encoded;
  std::vector<const Block*> blocks;
  for (const Text& t : texts)
    for (const Block& b : t.blocks) blocks.push_back(&b);
  std::vector<double> enc, dec;
  std::vector<uint8_t> out(g.num_bytes());
  const double mb = blocks.size() * g.num_bytes() / 1e6;
  for (int r = 0; r < repeats; ++r) {
    encoded.clear();
    auto t0 = Clock::now();
    for (const Block* b : blocks)
      encoded.push_back(EncodeBlock(g, b->kv, o, ContextOf(*b, state))->bytes);
    auto t1 = Clock::now();
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (!DecodeBlock(encoded[i], absl::MakeSpan(out), ContextOf(*blocks[i], state)).ok()) {
        std::fprintf(stderr, "decode failed\n");
        std::exit(1);
      }
    }
    auto t2 = Clock::now();
    enc.push_back(mb / std::chrono::duration<double>(t1 - t0).count());
    dec.push_back(mb / std::chrono::duration<double>(t2 - t1).count());
  }
  *enc_mbs = Median(enc);
  *dec_mbs = Median(dec);
}

double MemcpyMBs(const BlockGeometry& g, const std::vector<Text>& texts, int repeats) {
  std::vector<double> v;
  std::vector<uint8_t> out(g.num_bytes());
  size_t n = 0;
  for (int r = 0; r < repeats; ++r) {
    n = 0;
    auto t0 = Clock::now();
    for (int k = 0; k < 20; ++k) {
      for (const Text& t : texts) {
        for (const Block& b : t.blocks) {
          std::memcpy(out.data(), b.kv.data(), b.kv.size());
          asm volatile("" : : "r"(out.data()) : "memory");
          ++n;
        }
      }
    }
    v.push_back(n * g.num_bytes() / 1e6 / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(v);
}

// Residual rows (x - learned prediction) of every plane, one M = kv_heads * head_dim vector per
// token: rows[plane][token of `texts`].
std::vector<std::vector<std::vector<double>>> Residuals(const BlockGeometry& g,
                                                        const std::vector<Text>& texts,
                                                        const PredictorState& s) {
  const size_t L = g.num_layers, H = g.num_kv_heads, T = g.block_tokens, D = g.head_dim;
  std::vector<std::vector<std::vector<double>>> rows(2 * L);
  std::vector<float> p(g.num_elements()), x(g.num_elements());
  for (const Text& t : texts) {
    for (const Block& b : t.blocks) {
      s.Predict(b.tokens, b.first_position, b.previous_token, p.data());
      ToFloat(g.dtype, b.kv.data(), x.size(), x.data());
      for (size_t pl = 0; pl < 2 * L; ++pl) {
        for (size_t tt = 0; tt < T; ++tt) {
          std::vector<double> r(H * D);
          for (size_t h = 0; h < H; ++h) {
            for (size_t d = 0; d < D; ++d) {
              const size_t i = ((pl * H + h) * T + tt) * D + d;
              r[h * D + d] = x[i] - p[i];
            }
          }
          rows[pl].push_back(std::move(r));
        }
      }
    }
  }
  return rows;
}

// X = A^-1 B (A n x n, B n x m), Gauss-Jordan with partial pivoting.
std::vector<double> Solve(std::vector<double> A, std::vector<double> B, size_t n, size_t m) {
  for (size_t c = 0; c < n; ++c) {
    size_t piv = c;
    for (size_t r = c; r < n; ++r)
      if (std::fabs(A[r * n + c]) > std::fabs(A[piv * n + c])) piv = r;
    for (size_t k = 0; k < n; ++k) std::swap(A[c * n + k], A[piv * n + k]);
    for (size_t k = 0; k < m; ++k) std::swap(B[c * m + k], B[piv * m + k]);
    for (size_t r = 0; r < n; ++r) {
      if (r == c || A[c * n + c] == 0) continue;
      const double f = A[r * n + c] / A[c * n + c];
      for (size_t k = 0; k < n; ++k) A[r * n + k] -= f * A[c * n + k];
      for (size_t k = 0; k < m; ++k) B[r * m + k] -= f * B[c * m + k];
    }
  }
  for (size_t r = 0; r < n; ++r)
    for (size_t k = 0; k < m; ++k)
      B[r * m + k] = A[r * n + r] != 0 ? B[r * m + k] / A[r * n + r] : 0;
  return B;
}

// Share of the held-out residual energy of plane `y` left after a ridge-fitted linear prediction
// from the residuals of planes `xs` (fitted on `train`, ridge = `ridge` x the mean feature energy).
double LinearKept(const std::vector<std::vector<std::vector<double>>>& train,
                  const std::vector<std::vector<std::vector<double>>>& test, size_t y,
                  const std::vector<size_t>& xs, double ridge) {
  const size_t M = train[y][0].size(), n = M * xs.size();
  std::vector<double> A(n * n, 0), B(n * M, 0), f(n);
  auto features = [&](const std::vector<std::vector<std::vector<double>>>& r, size_t i) {
    for (size_t k = 0; k < xs.size(); ++k)
      std::copy(r[xs[k]][i].begin(), r[xs[k]][i].end(), f.begin() + k * M);
  };
  for (size_t i = 0; i < train[y].size(); ++i) {
    features(train, i);
    for (size_t a = 0; a < n; ++a) {
      for (size_t b = 0; b < n; ++b) A[a * n + b] += f[a] * f[b];
      for (size_t b = 0; b < M; ++b) B[a * M + b] += f[a] * train[y][i][b];
    }
  }
  double tr = 0;
  for (size_t a = 0; a < n; ++a) tr += A[a * n + a];
  for (size_t a = 0; a < n; ++a) A[a * n + a] += ridge * tr / n + 1e-12;
  const std::vector<double> W = Solve(A, B, n, M);
  double before = 0, after = 0;
  for (size_t i = 0; i < test[y].size(); ++i) {
    features(test, i);
    for (size_t b = 0; b < M; ++b) {
      double pr = 0;
      for (size_t a = 0; a < n; ++a) pr += f[a] * W[a * M + b];
      const double e = test[y][i][b] - pr;
      before += test[y][i][b] * test[y][i][b];
      after += e * e;
    }
  }
  return before > 0 ? after / before : 0;
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
  const uint32_t T = std::stoi(Flag(argc, argv, "block_tokens", "16"));
  const int repeats = std::stoi(Flag(argc, argv, "repeats", "5"));
  BlockGeometry g;
  const std::vector<Text> train = LoadDir(dir + "/train", T, &g);
  const std::vector<Text> test = LoadDir(dir + "/test", T, &g);
  if (train.empty() || test.empty()) {
    std::fprintf(stderr, "no dumps under %s (run bench/make_learned_dumps.sh)\n", dir.c_str());
    return 1;
  }
  size_t train_tokens = 0, test_tokens = 0;
  std::map<std::string, int> train_texts, test_texts;
  for (const Text& t : train) train_tokens += t.blocks.size() * T, ++train_texts[TextOf(t.name)];
  for (const Text& t : test) test_tokens += t.blocks.size() * T, ++test_texts[TextOf(t.name)];
  for (const auto& [name, n] : test_texts) {
    if (train_texts.count(name)) std::fprintf(stderr, "WARNING: %s is in both\n", name.c_str());
  }
  std::printf("# learned_bench: %s, block_tokens %u\n", dir.c_str(), T);
  std::printf(
      "train: %zu texts, %zu dumps, %zu tokens in full blocks; test: %zu texts, %zu dumps, "
      "%zu tokens\n\n",
      train_texts.size(), train.size(), train_tokens, test_texts.size(), test.size(), test_tokens);
  uint64_t learned = 0;
  const auto state = Learn(g, train, UINT64_MAX, &learned);
  if (!state) return 1;
  std::printf("state: %s; serialized %zu bytes\n\n", state->Describe().c_str(),
              state->Serialize().size());

  // Section 6 (the cross-layer linear predictors and the KLT); --section=6 runs only it.
  auto section6 = [&] {
    std::printf(
        "\n## 6. Cross-layer linear predictors and the KLT, fast profile, same state\n\n"
        "before: the state's token / pair means only (kTokenMeanLinear masked off, no KLT, what\n"
        "main coded); + linear: the ridge-fitted prediction from the two planes below may be\n"
        "chosen per plane / head; + KLT: a plane's learned heads may also be coded in the state's\n"
        "basis. saved: the encoder's estimate of what the learned predictors saved against the\n"
        "best non-learned predictor (EncodedBlock::learned_bytes_saved), share of that cost.\n\n");
    std::printf(
        "| target rel RMS | before | + linear | + linear + KLT | change | relK / relV | linear "
        "share of heads | saved |\n|---|---|---|---|---|---|---|---|\n");
    for (double target : {0.1, 0.173, 0.316}) {
      const Result a = Measure(g, test, Profile::kFast, target, state.get(), kNoLinear, false);
      const Result b = Measure(g, test, Profile::kFast, target, state.get(), kAllPredictors, false);
      const Result c = Measure(g, test, Profile::kFast, target, state.get());
      std::printf("| %.3f | %.3f | %.3f | %.3f | %+.1f %% | %.3f / %.3f | %.0f %% | %.0f %% |\n",
                  target, a.bpc, b.bpc, c.bpc, 100 * (c.bpc / a.bpc - 1), c.rel_k, c.rel_v,
                  100 * c.linear_share, 100 * c.saved_share);
    }
    std::printf("\n| fast, 0.173, median of %d | encode MB/s | decode MB/s |\n|---|---|---|\n",
                repeats);
    struct Config {
      const char* name;
      bool state;
      uint32_t mask;
      bool klt;
    };
    const Config configs[] = {{"no state", false, kAllPredictors, true},
                              {"learned (before)", true, kNoLinear, false},
                              {"learned + linear", true, kAllPredictors, false},
                              {"learned + linear + KLT", true, kAllPredictors, true}};
    for (int round = 0; round < 2; ++round) {  // interleaved: the machine is shared
      for (const Config& c : configs) {
        double e = 0, d = 0;
        Throughput(g, test, Profile::kFast, c.state ? state.get() : nullptr, repeats, &e, &d,
                   c.mask, c.klt);
        std::printf("| %s (round %d) | %.1f | %.1f |\n", c.name, round + 1, e, d);
      }
    }
  };
  if (Flag(argc, argv, "section", "") == "6") {
    section6();
    return 0;
  }
  std::printf("## 1. Held-out bits/component vs target (relK, relV: pooled errors met)\n\n");
  std::printf(
      "| profile | target rel RMS | today's predictors | with learned state | ratio | "
      "relK / relV (learned) | learned share of heads |\n|---|---|---|---|---|---|---|\n");
  for (Profile p : {Profile::kFast, Profile::kCompact}) {
    for (double target : {0.1, 0.173, 0.316}) {
      const Result a = Measure(g, test, p, target, nullptr);
      const Result b = Measure(g, test, p, target, state.get());
      std::printf("| %s | %.3f | %.3f | %.3f | %.2fx | %.3f / %.3f | %.0f %% |\n",
                  p == Profile::kFast ? "fast" : "compact", target, a.bpc, b.bpc, a.bpc / b.bpc,
                  b.rel_k, b.rel_v, 100 * b.learned_share);
    }
  }

  std::printf("\n## 2. Learning curve: held-out bits/component at 0.173 vs tokens learned\n\n");
  std::printf("| tokens learned | tokens in table | fast | compact |\n|---|---|---|---|\n");
  {
    const Result f0 = Measure(g, test, Profile::kFast, 0.173, nullptr);
    const Result c0 = Measure(g, test, Profile::kCompact, 0.173, nullptr);
    std::printf("| 0 (today's predictors) | 0 | %.3f | %.3f |\n", f0.bpc, c0.bpc);
  }
  for (uint64_t budget : {1000, 2000, 5000, 10000, 20000, 50000, 100000}) {
    uint64_t n = 0;
    const auto s = Learn(g, train, budget, &n);
    const Result f = Measure(g, test, Profile::kFast, 0.173, s.get());
    const Result c = Measure(g, test, Profile::kCompact, 0.173, s.get());
    std::printf("| %llu | %u | %.3f | %.3f |\n", static_cast<unsigned long long>(n),
                s->tokens_in_table(), f.bpc, c.bpc);
    if (n < budget) break;  // every training token used
  }

  std::printf("\n## 3. Throughput at 0.173, one thread, MB/s of fp16 input (median of %d)\n\n",
              repeats);
  std::printf("| profile | state | encode MB/s | decode MB/s |\n|---|---|---|---|\n");
  for (Profile p : {Profile::kFast, Profile::kCompact}) {
    for (const PredictorState* s : {static_cast<const PredictorState*>(nullptr), state.get()}) {
      double e = 0, d = 0;
      Throughput(g, test, p, s, repeats, &e, &d);
      std::printf("| %s | %s | %.1f | %.1f |\n", p == Profile::kFast ? "fast" : "compact",
                  s ? "learned" : "none", e, d);
    }
  }
  std::printf("| memcpy | | %.0f | |\n", MemcpyMBs(g, test, repeats));

  std::printf(
      "\n## 4. Per test text: mean surprisal vs held-out bits/component at 0.173 (fast)\n\n");
  std::printf(
      "| text | dumps | tokens | mean surprisal (bits/token) | today's | learned |\n"
      "|---|---|---|---|---|---|\n");
  std::map<std::string, std::vector<Text>> by_text;
  for (const Text& t : test) by_text[TextOf(t.name)].push_back(t);
  for (const auto& [name, texts] : by_text) {
    double s = 0;
    size_t tokens = 0;
    for (const Text& t : texts) {
      s += t.mean_surprisal * t.blocks.size();
      tokens += t.blocks.size() * T;
    }
    s /= tokens / T;
    const Result a = Measure(g, texts, Profile::kFast, 0.173, nullptr);
    const Result b = Measure(g, texts, Profile::kFast, 0.173, state.get());
    std::printf("| %s | %zu | %zu | %.2f | %.3f | %.3f |\n", name.c_str(), texts.size(), tokens, s,
                a.bpc, b.bpc);
  }

  section6();
  std::printf(
      "\n## 5. Headroom: cross-layer linear prediction of the learned residual (open loop)\n\n"
      "Share of the held-out residual energy (x - learned prediction) of V_l left after a ridge\n"
      "fit (on the training residuals) from the residual of V_{l-1} and / or K_l. Not a codec\n"
      "predictor: the decoder has no K_l residual (keys quantize to zero) and sees V_{l-1} with\n"
      "quantization noise, which ridge 0.3 stands in for.\n\n");
  std::printf("| layer | ridge | from V_{l-1} | from K_l | from both |\n|---|---|---|---|---|\n");
  const auto rtr = Residuals(g, train, *state), rte = Residuals(g, test, *state);
  for (double ridge : {1e-3, 0.3}) {
    for (size_t l = 2; l < g.num_layers; ++l) {  // V_0 is predicted exactly: nothing to regress
      const size_t y = 2 * l + 1, v_below = 2 * (l - 1) + 1, k_same = 2 * l;
      std::printf("| %zu | %g | %.3f | %.3f | %.3f |\n", l, ridge,
                  LinearKept(rtr, rte, y, {v_below}, ridge),
                  LinearKept(rtr, rte, y, {k_same}, ridge),
                  LinearKept(rtr, rte, y, {v_below, k_same}, ridge));
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
