// bench/lossless_bench.cc
//
// What a bit-exact coder could reach against the learned predictor state (issue 22, step 1:
// measure before building). Real stories260K KV dumps of bench/make_learned_dumps.sh, split into
// train / test BY TEXT (bench/texts/split.tsv); the state is learned from the training dumps only
// and every number is measured on the test dumps.
//
//   lossless_bench [--dumps=build/learned_dumps] [--block_tokens=16]
//
// The candidate symbol of element x with prediction p (a float) is
//   d = ord(x) - ord(round_to_dtype(p))  (mod 2^16)
// where ord maps a 16-bit pattern to a monotone integer (+0 -> 0, -0 -> -1, larger magnitudes
// further from 0): a bijection, so every bit pattern (NaN payloads, infinities, -0, subnormals)
// round-trips whatever p is. Predictors (all computable by a decoder of one block alone):
//   prev         x of the previous token of the block (same plane, head, channel); 0 for t = 0
//   state        PredictorState::Predict (token and pair means, keys rotated)
//   state+lin    state + PredictLinear from the exact residuals of the two planes below
//   state+lin+r  state+lin + 1/2 of the previous token's residual against state+lin
// Costs (bits per element; ratio = 16 / bits):
//   H(d|plane)       empirical entropy of d with one model per plane shared by every test block
//                    (a lower bound for a model shipped in the state)
//   H(d|plane,mag)   the same, with the model also conditioned on a predicted-magnitude bucket
//                    (the exponent of p against the plane's mean exponent: 4 buckets)
//   block 1 / block 4  REALIZABLE in a fast block decodable alone: d zigzagged into 28 tokens (z <
//                    16 itself, else 16 + bit length - 5 with bit length - 1 raw bits), one rANS
//                    table (irans::NormalizeCounts, its WriteTable bytes counted) per (block,
//                    plane) or per (block, plane, bucket), cost by irans::CostBits
//   best/plane       block 4 with the cheapest predictor per (block, plane), + 2 bits per plane
// against today's kLossless bytes (fast and compact; EncodeBlock, envelope included; candidates
// get the same envelope added). bf16: the same values rounded to bf16, a state learned from them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/learned_data.h"
#include "codec/block_codec.h"
#include "codec/fast_lossless.h"
#include "codec/predictor_state.h"
#include "codec/rans_interleaved.h"

namespace kvtrie {
namespace {

constexpr int kCands = 4;
const char* const kCandNames[kCands] = {"prev", "state", "state+lin", "state+lin+r"};
constexpr int kBuckets = 4;
constexpr int kTokens = 28;

inline int32_t Ord(uint16_t h) { return (h & 0x8000) ? -1 - (h & 0x7fff) : h; }

inline uint16_t RoundTo(DType dt, float f) {
  return dt == DType::kBf16 ? FloatToBf16(f) : FloatToHalf(f);
}

inline int Token(uint32_t z, int* raw_bits) {
  if (z < 16) {
    *raw_bits = 0;
    return static_cast<int>(z);
  }
  const int nb = 32 - __builtin_clz(z);
  *raw_bits = nb - 1;
  return 16 + nb - 5;
}

double Entropy(const std::vector<uint32_t>& h) {
  double n = 0, s = 0;
  for (uint32_t c : h) n += c;
  for (uint32_t c : h)
    if (c) s -= c * std::log2(c / n);
  return s;
}

struct Costs {
  // Shared-model histograms: [cand][plane][bucket][65536].
  std::vector<std::vector<uint32_t>> hist;
  double block1[kCands] = {}, block4[kCands] = {}, best = 0, raw[kCands] = {};
  // Token counts per (cand, plane, bucket): [cand][plane][bucket][kTokens] (shared tables).
  std::vector<uint32_t> tok;
  double elements = 0;
  size_t planes = 0;
  uint32_t* Tok(int c, size_t pl, int b) {
    return &tok[((c * planes + pl) * kBuckets + b) * kTokens];
  }
  void Init(size_t p) {
    planes = p;
    hist.assign(kCands * p * kBuckets, std::vector<uint32_t>(65536, 0));
    tok.assign(kCands * p * kBuckets * kTokens, 0);
  }
  std::vector<uint32_t>& H(int c, size_t pl, int b) {
    return hist[(c * planes + pl) * kBuckets + b];
  }
};

// Bits of one realizable table-coded group of symbols: its rANS bits and its table's bytes; a
// group with one symbol only costs a 2-byte "constant" table.
double TableBits(const uint32_t* counts) {
  int nonzero = 0, last = 0;
  for (int i = 0; i < kTokens; ++i)
    if (counts[i]) ++nonzero, last = i;
  if (nonzero == 0) return 0;
  if (nonzero == 1) return 16;
  const irans::Table t = irans::NormalizeCounts(counts, last + 1);
  std::string tb;
  irans::WriteTable(t, &tb);
  return irans::CostBits(t, counts, last + 1) + 8.0 * tb.size();
}

// Per-block, per-plane costs of every candidate; adds to `costs`.
void CodeBlock(const BlockGeometry& g, const Block& b, const PredictorState* s, Costs* costs) {
  const size_t L = g.num_layers, H = g.num_kv_heads, T = g.block_tokens, D = g.head_dim;
  const size_t P = 2 * L, plane_n = H * T * D;
  std::vector<float> x(g.num_elements()), st(g.num_elements()), res(g.num_elements());
  ToFloat(g.dtype, b.kv.data(), x.size(), x.data());
  const uint16_t* xh = reinterpret_cast<const uint16_t*>(b.kv.data());
  if (s) {
    s->Predict(b.tokens, b.first_position, b.previous_token, st.data());
    for (size_t i = 0; i < x.size(); ++i) res[i] = x[i] - st[i];
  }
  std::vector<float> pred(plane_n);
  std::vector<uint16_t> ph(plane_n);
  for (size_t pl = 0; pl < P; ++pl) {
    const size_t base = pl * plane_n;
    double best = 1e300;
    for (int c = 0; c < kCands; ++c) {
      if (c > 0 && !s) continue;
      for (size_t h = 0; h < H; ++h) {
        for (size_t t = 0; t < T; ++t) {
          for (size_t d = 0; d < D; ++d) {
            const size_t i = (h * T + t) * D + d;
            pred[i] = c == 0 ? (t ? x[base + i - D] : 0.f) : st[base + i];
          }
        }
      }
      if (c >= 2 && s->HasLinear(pl)) {
        s->PredictLinear(pl, b.first_position, T, res.data() + base - plane_n,
                         pl >= 2 ? res.data() + base - 2 * plane_n : nullptr, pred.data());
      }
      if (c == 3) {
        // Half of the previous token's residual against state+lin (decoder has x and pred).
        for (size_t h = 0; h < H; ++h)
          for (size_t t = T - 1; t >= 1; --t)
            for (size_t d = 0; d < D; ++d) {
              const size_t i = (h * T + t) * D + d;
              pred[i] += 0.5f * (x[base + i - D] - pred[i - D]);
            }
      }
      double mean_e = 0;
      for (size_t i = 0; i < plane_n; ++i) {
        ph[i] = RoundTo(g.dtype, pred[i]);
        mean_e += std::ilogb(std::max(std::fabs(pred[i]), 1e-8f));
      }
      const int m = static_cast<int>(std::floor(mean_e / plane_n));
      uint32_t tok1[kTokens] = {}, tok4[kBuckets][kTokens] = {};
      double raw = 0;
      for (size_t i = 0; i < plane_n; ++i) {
        const uint16_t dd = static_cast<uint16_t>(Ord(xh[base + i]) - Ord(ph[i]));
        const int e = std::ilogb(std::max(std::fabs(pred[i]), 1e-8f));
        const int bk = e < m - 2 ? 0 : e < m ? 1 : e < m + 2 ? 2 : 3;
        ++costs->H(c, pl, bk)[dd];
        const int16_t sd = static_cast<int16_t>(dd);
        const uint32_t z = sd >= 0 ? 2u * sd : 2u * static_cast<uint32_t>(-(int32_t)sd) - 1;
        int rb = 0;
        const int tk = Token(z, &rb);
        raw += rb;
        ++tok1[tk];
        ++tok4[bk][tk];
        ++costs->Tok(c, pl, bk)[tk];
      }
      const double c1 = TableBits(tok1) + raw;
      double c4 = raw;
      for (int k = 0; k < kBuckets; ++k) c4 += TableBits(tok4[k]);
      c4 = std::min(c4, c1) + 1;  // one flag bit: bucketed or not
      costs->raw[c] += raw;
      costs->block1[c] += c1;
      costs->block4[c] += c4;
      best = std::min(best, c4);
    }
    costs->best += best + 2;
  }
  costs->elements += g.num_elements();
}

// Bits of `test`'s tokens with tables fitted on `train` (the tables a state would ship: counts
// + 1/2, one per (plane, bucket)), raw bits included.
double SharedTableBits(const Costs& train, const Costs& test, int c) {
  double bits = test.raw[c];
  Costs& tr = const_cast<Costs&>(train);
  Costs& te = const_cast<Costs&>(test);
  for (size_t pl = 0; pl < test.planes; ++pl) {
    for (int bk = 0; bk < kBuckets; ++bk) {
      const uint32_t* q = tr.Tok(c, pl, bk);
      const uint32_t* n = te.Tok(c, pl, bk);
      double tot = 0;
      for (int i = 0; i < kTokens; ++i) tot += q[i] + 0.5;
      for (int i = 0; i < kTokens; ++i) bits -= n[i] * std::log2((q[i] + 0.5) / tot);
    }
  }
  return bits;
}

struct Today {
  double fast = 0, compact = 0, envelope = 0;
};

Today TodayBytes(const BlockGeometry& g, const std::vector<Block>& blocks) {
  Today t;
  for (const Block& b : blocks) {
    EncodeOptions o;
    o.encoding = Encoding::kLossless;
    o.profile = Profile::kFast;
    auto f = EncodeBlock(g, b.kv, o, PredictionContext{});
    o.profile = Profile::kCompact;
    auto c = EncodeBlock(g, b.kv, o, PredictionContext{});
    if (!f.ok() || !c.ok()) {
      std::fprintf(stderr, "encode failed\n");
      std::exit(1);
    }
    std::string payload;
    CompressFastLossless(g, b.kv, &payload);
    t.fast += 8.0 * f->bytes.size();
    t.compact += 8.0 * c->bytes.size();
    t.envelope += 8.0 * (f->bytes.size() - payload.size());
  }
  return t;
}

// The prediction a decoder must compute before any symbol (Predict + PredictLinear from the
// exact residuals, plus the dtype rounding): fp16-input MB/s on one thread, median of 3 passes
// over `blocks` (with or without the linear step). An upper bound on a decoder's speed against the
// state.
double PredictMBs(const BlockGeometry& g, const std::vector<Block>& blocks, const PredictorState& s,
                  bool linear) {
  const size_t plane_n = g.num_kv_heads * g.block_tokens * g.head_dim, P = 2 * g.num_layers;
  std::vector<float> x(g.num_elements()), st(g.num_elements()), res(g.num_elements());
  std::vector<uint16_t> ph(g.num_elements());
  std::vector<double> v;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const Block& b : blocks) {
      ToFloat(g.dtype, b.kv.data(), x.size(), x.data());
      s.Predict(b.tokens, b.first_position, b.previous_token, st.data());
      for (size_t i = 0; i < x.size(); ++i) res[i] = x[i] - st[i];
      for (size_t pl = 1; linear && pl < P; ++pl) {
        s.PredictLinear(pl, b.first_position, g.block_tokens, res.data() + (pl - 1) * plane_n,
                        pl >= 2 ? res.data() + (pl - 2) * plane_n : nullptr,
                        st.data() + pl * plane_n);
      }
      FromFloat(g.dtype, st.data(), st.size(), ph.data());
      asm volatile("" : : "r"(ph.data()) : "memory");
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    v.push_back(blocks.size() * g.num_bytes() / 1e6 / sec);
  }
  std::sort(v.begin(), v.end());
  return v[1];
}

// The codec itself (EncodeBlock / DecodeBlock, fast LOSSLESS, issue 22): bytes against the state
// and without it per test text and pooled, every block checked bit-exact, and encode / decode
// MB/s (one thread, median of 3 passes over every test block).
void CodecSection(const BlockGeometry& g, const std::vector<Text>& test,
                  const PredictorState& state) {
  const std::string dt(DTypeName(g.dtype));
  EncodeOptions o;
  o.encoding = Encoding::kLossless;
  o.profile = Profile::kFast;
  o.learned_lossless = true;
  std::printf(
      "codec (fast LOSSLESS, EncodeBlock / DecodeBlock, every block bit-exact), ratio vs "
      "%s:\n\n| text | blocks | no state | with state | blocks on the state |\n"
      "|---|---|---|---|---|\n",
      dt.c_str());
  std::map<std::string, std::vector<const Block*>> by_text;
  for (const Text& t : test)
    for (const Block& b : t.blocks) by_text[TextOf(t.name)].push_back(&b);
  by_text["(pooled)"];
  for (const Text& t : test)
    for (const Block& b : t.blocks) by_text["(pooled)"].push_back(&b);
  std::vector<uint8_t> out(g.num_bytes());
  for (const auto& [name, blocks] : by_text) {
    double with = 0, without = 0, on_state = 0;
    for (const Block* b : blocks) {
      for (int w = 0; w < 2; ++w) {
        const PredictionContext ctx = ContextOf(*b, w ? &state : nullptr);
        auto e = EncodeBlock(g, b->kv, o, ctx);
        if (!e.ok() || !DecodeBlock(e->bytes, absl::MakeSpan(out), ctx).ok() || out != b->kv) {
          std::fprintf(stderr, "codec: not bit-exact\n");
          std::exit(1);
        }
        (w ? with : without) += e->bytes.size();
        if (w) on_state += e->predictor_version != 0;
      }
    }
    const double logical = static_cast<double>(blocks.size()) * g.num_bytes();
    std::printf("| %s | %zu | %.3fx | %.3fx | %.0f |\n", name.c_str(), blocks.size(),
                logical / without, logical / with, on_state);
  }
  std::vector<const Block*> all = by_text["(pooled)"];
  const double mb = all.size() * g.num_bytes() / 1e6;
  std::printf("\n| path | encode MB/s | decode MB/s |\n|---|---|---|\n");
  for (int w = 1; w >= 0; --w) {
    std::vector<double> enc, dec;
    std::vector<std::string> bytes(all.size());
    for (int r = 0; r < 3; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < all.size(); ++i)
        bytes[i] = EncodeBlock(g, all[i]->kv, o, ContextOf(*all[i], w ? &state : nullptr))->bytes;
      const auto t1 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < all.size(); ++i) {
        if (!DecodeBlock(bytes[i], absl::MakeSpan(out), ContextOf(*all[i], w ? &state : nullptr))
                 .ok()) {
          std::exit(1);
        }
      }
      const auto t2 = std::chrono::steady_clock::now();
      enc.push_back(mb / std::chrono::duration<double>(t1 - t0).count());
      dec.push_back(mb / std::chrono::duration<double>(t2 - t1).count());
    }
    std::sort(enc.begin(), enc.end());
    std::sort(dec.begin(), dec.end());
    std::printf("| %s | %.0f [%.0f-%.0f] | %.0f [%.0f-%.0f] |\n", w ? "with the state" : "no state",
                enc[1], enc[0], enc[2], dec[1], dec[0], dec[2]);
  }
  std::printf("\n");
}

std::string Flag(int argc, char** argv, const std::string& name, const std::string& def) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
  }
  return def;
}

std::vector<Text> ToBf16(std::vector<Text> texts, BlockGeometry* g) {
  for (Text& t : texts) {
    for (Block& b : t.blocks) {
      uint16_t* h = reinterpret_cast<uint16_t*>(b.kv.data());
      for (size_t i = 0; i < b.kv.size() / 2; ++i) h[i] = FloatToBf16(HalfToFloat(h[i]));
    }
  }
  g->dtype = DType::kBf16;
  return texts;
}

void Run(const BlockGeometry& g, const std::vector<Text>& train, const std::vector<Text>& test) {
  const std::string dt(DTypeName(g.dtype));
  uint64_t learned = 0;
  const auto state = Learn(g, train, UINT64_MAX, &learned);
  if (!state) std::exit(1);
  std::printf("## %s\n\nstate (learned from the training texts' %s blocks): %s\n\n", dt.c_str(),
              dt.c_str(), state->Describe().c_str());
  const size_t P = 2 * g.num_layers;
  std::vector<Block> all;
  for (const Text& t : test) all.insert(all.end(), t.blocks.begin(), t.blocks.end());
  const Today today = TodayBytes(g, all);
  CodecSection(g, test, *state);
  std::printf(
      "prediction alone (one thread, median of 3, MB/s of %s): Predict + rounding %.0f, "
      "+ PredictLinear %.0f\n\n",
      dt.c_str(), PredictMBs(g, all, *state, false), PredictMBs(g, all, *state, true));
  for (int with_state = 0; with_state < 2; ++with_state) {
    Costs c, ctrain;
    c.Init(P);
    ctrain.Init(P);
    for (const Block& b : all) CodeBlock(g, b, with_state ? state.get() : nullptr, &c);
    for (const Text& t : train)
      for (const Block& b : t.blocks) CodeBlock(g, b, with_state ? state.get() : nullptr, &ctrain);
    const double n = c.elements, env = today.envelope;
    std::printf("### %s, %s\n\n", dt.c_str(), with_state ? "with the state" : "without a state");
    std::printf(
        "| predictor | H(d\\|plane) | H(d\\|plane,mag) | block 1 table | block 4 tables | ratio "
        "(block 4) | state tables | ratio (state tables) |\n|---|---|---|---|---|---|---|---|\n");
    for (int k = 0; k < kCands; ++k) {
      if (k > 0 && !with_state) continue;
      double h1 = 0, h4 = 0;
      for (size_t pl = 0; pl < P; ++pl) {
        std::vector<uint32_t> m(65536, 0);
        for (int bk = 0; bk < kBuckets; ++bk) {
          const auto& hh = c.H(k, pl, bk);
          h4 += Entropy(hh);
          for (size_t i = 0; i < m.size(); ++i) m[i] += hh[i];
        }
        h1 += Entropy(m);
      }
      const double st = SharedTableBits(ctrain, c, k) + env;
      std::printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3fx | %.3f | %.3fx |\n", kCandNames[k],
                  h1 / n, h4 / n, (c.block1[k] + env) / n, (c.block4[k] + env) / n,
                  16.0 * n / (c.block4[k] + env), st / n, 16.0 * n / st);
    }
    std::printf("| best per (block, plane) | | | | %.3f | %.3fx |\n", (c.best + env) / n,
                16.0 * n / (c.best + env));
    std::printf("| today fast lossless | | | | %.3f | %.3fx |\n", today.fast / n,
                16.0 * n / today.fast);
    std::printf("| today compact lossless | | | | %.3f | %.3fx |\n\n", today.compact / n,
                16.0 * n / today.compact);
    if (!with_state) continue;
    // Per plane (shared-model entropy, bits / element) and per test text (realizable best).
    std::printf("per plane, H(d|plane,mag) bits/element: prev vs state+lin\n\n| plane |");
    for (size_t pl = 0; pl < P; ++pl) std::printf(" %c%zu |", pl % 2 ? 'V' : 'K', pl / 2);
    std::printf("\n|---|");
    for (size_t pl = 0; pl < P; ++pl) std::printf("---|");
    for (int k : {0, 2}) {
      std::printf("\n| %s |", kCandNames[k]);
      for (size_t pl = 0; pl < P; ++pl) {
        double h = 0;
        for (int bk = 0; bk < kBuckets; ++bk) h += Entropy(c.H(k, pl, bk));
        std::printf(" %.2f |", h / (n / P));
      }
    }
    std::printf("\n\n");
  }
  // Per test text: realizable best per (block, plane), with and without the state, vs today.
  std::printf("per test text (ratio vs %s: best per (block, plane), block 4 tables)\n\n",
              dt.c_str());
  std::printf("| text | blocks | no state | with state | today fast |\n|---|---|---|---|---|\n");
  std::map<std::string, std::vector<Block>> by_text;
  for (const Text& t : test)
    by_text[TextOf(t.name)].insert(by_text[TextOf(t.name)].end(), t.blocks.begin(), t.blocks.end());
  for (const auto& [name, blocks] : by_text) {
    double r[2];
    const Today td = TodayBytes(g, blocks);
    for (int w = 0; w < 2; ++w) {
      Costs c;
      c.Init(P);
      for (const Block& b : blocks) CodeBlock(g, b, w ? state.get() : nullptr, &c);
      r[w] = 16.0 * c.elements / (c.best + td.envelope);
    }
    std::printf("| %s | %zu | %.3fx | %.3fx | %.3fx |\n", name.c_str(), blocks.size(), r[0], r[1],
                16.0 * blocks.size() * g.num_elements() / td.fast);
  }
  std::printf("\n");
}

int Main(int argc, char** argv) {
  const std::string dir = Flag(argc, argv, "dumps", "build/learned_dumps");
  const uint32_t T = std::stoi(Flag(argc, argv, "block_tokens", "16"));
  BlockGeometry g;
  const std::vector<Text> train = LoadDir(dir + "/train", T, &g);
  const std::vector<Text> test = LoadDir(dir + "/test", T, &g);
  if (train.empty() || test.empty() || g.dtype != DType::kFp16) {
    std::fprintf(stderr, "no fp16 dumps under %s (run bench/make_learned_dumps.sh)\n", dir.c_str());
    return 1;
  }
  std::printf("# lossless_bench: %s, block_tokens %u, %s\n\n", dir.c_str(), T,
              g.DebugString().c_str());
  Run(g, train, test);
  BlockGeometry gb = g;
  const std::vector<Text> train_b = ToBf16(train, &gb);
  const std::vector<Text> test_b = ToBf16(test, &gb);
  Run(gb, train_b, test_b);
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
