// bench/codec_bench.cc
//
// Bits versus error of every block encoding on the real KV dumps of tests/data, side by side:
// kvtrie's residual coding (swept over error targets, with and without rotation, surprisal-
// adaptive steps, parent and centroid contexts) and the per-vector baselines (int8, KIVI 2-bit,
// TurboQuant-style b-bit), plus raw and lossless.
//
//   codec_bench [--data_dir=DIR] [--out_dir=DIR] [--block_tokens=16] [--repeats=1] [--headline]
//               [--step_groups]
//
// First prints the headline: bits per component at the TurboQuant 3-bit error (and the ratio to
// TurboQuant's own bits) and encode / decode MB/s as ratios to memcpy and the raw envelope run in
// the same process; --headline stops there. --repeats=R times every block R times, keeping the
// best. Then step groups on vs off (EncodeOptions::step_groups); --step_groups stops there.
//
// Prints a table, and writes DIR/codec_bench.csv (one row per dump and setting) and
// DIR/codec_bench.svg (bits per component versus relative RMS error, all dumps together).
//
// Metrics (over the full blocks of each dump; a partial tail block is left out):
//   bpc          8 * encoded bytes / components, envelope and params included
//   ratio        16 / bpc (versus fp16)
//   relK, relV   ||K - K'|| / ||K|| and the same for V, over every layer and head of the dump
//   max_abs      max |x - x'|
//   attn_tv      attention-score error: for every layer, KV head and query token i >= 16 (every
//                4th), the query is the stored (original) key of token i, and the scores are
//                p_j = softmax_j(q . K_j / sqrt(head_dim)) over keys j <= i (causal, the token
//                itself included) with the original keys K versus p'_j with reconstructed keys K'.
//                attn_tv is the mean total variation 0.5 * sum_j |p_j - p'_j| over those queries.
//   enc/dec MB/s fp16 bytes of input per second of one thread, encode / decode of all blocks.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"

namespace kvtrie {
namespace {

using Clock = std::chrono::steady_clock;

struct Dump {
  std::string name;
  KvDump kv;
  BlockGeometry g;
  size_t num_blocks = 0;
  std::vector<std::vector<uint8_t>> blocks;
};

// One method and setting, e.g. {"kvtrie", "e=0.05"}.
struct Setting {
  std::string method, label;
  EncodeOptions options;
  bool chain_parent = false;   // context.parent = the previous block's reconstruction
  bool use_surprisal = false;  // context.surprisal_bits from the manifest
  bool centroid = false;       // neardup n1..n3 only: reference = n0's reconstruction
  bool external = false;       // the per-block tensors RunDump gets go to context.external
};

struct Result {
  double bits = 0, components = 0, err[2] = {0, 0}, energy[2] = {0, 0}, max_abs = 0;
  double attn_tv = 0;
  double enc_s = 0, dec_s = 0, bytes_in = 0;
  int count = 0;  // dumps added up; attn_tv sums their attention errors
  bool ok = true;
  double attn_mean() const { return count ? attn_tv / count : 0; }
  double bpc() const { return bits / components; }
  double rel(int kv) const { return std::sqrt(err[kv] / energy[kv]); }
  double rel_all() const { return std::sqrt((err[0] + err[1]) / (energy[0] + energy[1])); }
  void Add(const Result& o) {
    bits += o.bits;
    components += o.components;
    for (int i = 0; i < 2; ++i) err[i] += o.err[i], energy[i] += o.energy[i];
    max_abs = std::max(max_abs, o.max_abs);
    attn_tv += o.attn_tv;
    count += o.count;
    enc_s += o.enc_s;
    dec_s += o.dec_s;
    bytes_in += o.bytes_in;
  }
};

// Mean total variation between attention distributions with original and reconstructed keys.
double AttentionTv(const Dump& d, const std::vector<float>& k, const std::vector<float>& k2) {
  const size_t T = d.num_blocks * d.g.block_tokens, N = d.kv.num_tokens(), D = d.g.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  double tv = 0;
  size_t count = 0;
  std::vector<double> s(T), s2(T);
  for (size_t lh = 0; lh < d.g.num_layers * d.g.num_kv_heads; ++lh) {
    const float* kr = k.data() + lh * N * D;
    const float* kq = k2.data() + lh * N * D;
    for (size_t i = 16; i < T; i += 4) {
      const float* q = kr + i * D;
      double m = -INFINITY, m2 = -INFINITY;
      for (size_t j = 0; j <= i; ++j) {
        double a = 0, b = 0;
        for (size_t c = 0; c < D; ++c) a += q[c] * kr[j * D + c], b += q[c] * kq[j * D + c];
        s[j] = a * scale;
        s2[j] = b * scale;
        m = std::max(m, s[j]);
        m2 = std::max(m2, s2[j]);
      }
      double z = 0, z2 = 0;
      for (size_t j = 0; j <= i; ++j)
        z += s[j] = std::exp(s[j] - m), z2 += s2[j] = std::exp(s2[j] - m2);
      double t = 0;
      for (size_t j = 0; j <= i; ++j) t += std::fabs(s[j] / z - s2[j] / z2);
      tv += 0.5 * t;
      ++count;
    }
  }
  return count ? tv / count : 0;
}

// Timing repeats: every block is encoded and decoded this many times and the best time of each is
// kept (2 shared cores make single timings noisy).
int g_repeats = 1;

Result RunDump(const Dump& d, const Setting& st, const std::vector<std::vector<uint8_t>>* centroid,
               std::vector<std::vector<uint8_t>>* decoded_out = nullptr) {
  Result r;
  const BlockGeometry& g = d.g;
  std::vector<std::vector<uint8_t>> decoded(d.num_blocks, std::vector<uint8_t>(g.num_bytes()));
  std::vector<std::string> encoded(d.num_blocks);
  for (size_t b = 0; b < d.num_blocks; ++b) {
    PredictionContext c;
    if (st.chain_parent && b > 0) c.parent = decoded[b - 1];
    if (st.use_surprisal) {
      c.surprisal_bits =
          absl::MakeConstSpan(d.kv.surprisal_bits).subspan(b * g.block_tokens, g.block_tokens);
    }
    if (centroid && st.external) {
      c.external = (*centroid)[b];
    } else if (centroid) {
      c.reference = (*centroid)[b];
    }
    double best_enc = INFINITY, best_dec = INFINITY;
    absl::StatusOr<EncodedBlock> e;
    for (int rep = 0; rep < g_repeats; ++rep) {
      const auto t0 = Clock::now();
      e = EncodeBlock(g, d.blocks[b], st.options, c);
      const auto t1 = Clock::now();
      if (!e.ok()) {
        std::fprintf(stderr, "%s %s %s: %s\n", d.name.c_str(), st.method.c_str(), st.label.c_str(),
                     std::string(e.status().message()).c_str());
        r.ok = false;
        return r;
      }
      absl::Status s = DecodeBlock(e->bytes, absl::MakeSpan(decoded[b]), c);
      const auto t2 = Clock::now();
      if (!s.ok()) {
        std::fprintf(stderr, "decode %s: %s\n", d.name.c_str(), std::string(s.message()).c_str());
        r.ok = false;
        return r;
      }
      best_enc = std::min(best_enc, std::chrono::duration<double>(t1 - t0).count());
      best_dec = std::min(best_dec, std::chrono::duration<double>(t2 - t1).count());
    }
    r.enc_s += best_enc;
    r.dec_s += best_dec;
    r.bits += 8.0 * e->bytes.size();
    r.components += g.num_elements();
    r.bytes_in += g.num_bytes();
  }
  // Errors and attention on the sequence layout.
  const size_t N = d.kv.num_tokens(), n = d.kv.k.size() / 2;
  std::vector<uint8_t> k2(d.kv.k), v2(d.kv.v);
  for (size_t b = 0; b < d.num_blocks; ++b) ScatterBlock(g, N, decoded[b], b, k2.data(), v2.data());
  std::vector<float> k(n), v(n), kf(n), vf(n);
  ToFloat(g.dtype, d.kv.k.data(), n, k.data());
  ToFloat(g.dtype, d.kv.v.data(), n, v.data());
  ToFloat(g.dtype, k2.data(), n, kf.data());
  ToFloat(g.dtype, v2.data(), n, vf.data());
  const size_t T = d.num_blocks * g.block_tokens, D = g.head_dim;
  for (size_t i = 0; i < n; ++i) {
    if ((i / D) % N >= T) continue;  // the tail outside full blocks is not coded
    for (int kv = 0; kv < 2; ++kv) {
      const double x = kv ? v[i] : k[i], y = kv ? vf[i] : kf[i];
      r.err[kv] += (x - y) * (x - y);
      r.energy[kv] += x * x;
      r.max_abs = std::max(r.max_abs, std::fabs(x - y));
    }
  }
  r.attn_tv = AttentionTv(d, k, kf);
  r.count = 1;
  if (decoded_out) *decoded_out = std::move(decoded);
  return r;
}

std::vector<Setting> Settings(double tq3_error) {
  std::vector<Setting> s;
  s.push_back({"raw", "fp16", {.encoding = Encoding::kRaw}});
  s.push_back({"lossless", "bit-exact", {.encoding = Encoding::kLossless}});
  s.push_back({"int8", "per token", {.encoding = Encoding::kInt8}});
  s.push_back({"kivi2", "g=T/D", {.encoding = Encoding::kKivi2}});
  for (int b = 1; b <= 4; ++b) {
    EncodeOptions o{.encoding = Encoding::kTurboQuant};
    o.turboquant_bits = b;
    s.push_back({"turboquant", "b=" + std::to_string(b), o});
  }
  for (double e : {0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4}) {
    char label[32];
    std::snprintf(label, sizeof label, "e=%.2f", e);
    EncodeOptions o{.encoding = Encoding::kResidual, .target_rel_rms = e};
    s.push_back({"kvtrie", label, o, /*chain_parent=*/true});
    EncodeOptions none = o;
    none.predictors = 1u << static_cast<int>(Predictor::kNone);
    s.push_back({"kvtrie-nopred", label, none, false});
    EncodeOptions rot = o;
    rot.rotate = true;
    s.push_back({"kvtrie-rot", label, rot, true});
    EncodeOptions sur = o;
    sur.surprisal_step_strength = 1.0;
    s.push_back({"kvtrie-surprisal", label, sur, true, true});
  }
  if (tq3_error > 0) {
    char label[48];
    std::snprintf(label, sizeof label, "e=tq3(%.4f)", tq3_error);
    s.push_back(
        {"kvtrie", label, {.encoding = Encoding::kResidual, .target_rel_rms = tq3_error}, true});
    EncodeOptions rot{.encoding = Encoding::kResidual, .target_rel_rms = tq3_error, .rotate = true};
    s.push_back({"kvtrie-rot", label, rot, true});
  }
  return s;
}

// ---- SVG plot ----------------------------------------------------------------------------------

void WriteSvg(const std::string& path,
              const std::map<std::string, std::vector<std::pair<double, double>>>& series) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return;
  const double W = 760, H = 480, L = 70, R = 200, Tp = 30, B = 50;
  const double xmin = std::log10(0.003), xmax = std::log10(1.0), ymax = 12;
  auto X = [&](double e) {
    return L + (std::log10(std::max(e, 0.003)) - xmin) / (xmax - xmin) * (W - L - R);
  };
  auto Y = [&](double b) { return H - B - std::min(b, ymax) / ymax * (H - Tp - B); };
  std::fprintf(f,
               "<svg xmlns='http://www.w3.org/2000/svg' width='%g' height='%g' "
               "font-family='sans-serif' font-size='12'>\n",
               W, H);
  std::fprintf(f, "<rect width='100%%' height='100%%' fill='white'/>\n");
  std::fprintf(f,
               "<text x='%g' y='18' font-size='14'>bits per component vs relative RMS error (all "
               "tests/data dumps)</text>\n",
               L);
  for (double e : {0.003, 0.01, 0.03, 0.1, 0.3, 1.0}) {
    std::fprintf(f,
                 "<line x1='%g' y1='%g' x2='%g' y2='%g' stroke='#ddd'/><text x='%g' y='%g' "
                 "text-anchor='middle'>%g</text>\n",
                 X(e), Tp, X(e), H - B, X(e), H - B + 16, e);
  }
  for (int b = 0; b <= 12; b += 2) {
    std::fprintf(f,
                 "<line x1='%g' y1='%g' x2='%g' y2='%g' stroke='#ddd'/><text x='%g' y='%g' "
                 "text-anchor='end'>%d</text>\n",
                 L, Y(b), W - R, Y(b), L - 6, Y(b) + 4, b);
  }
  std::fprintf(f,
               "<text x='%g' y='%g' text-anchor='middle'>relative RMS error ||x-x'||/||x|| (K and "
               "V), log scale</text>\n",
               (L + W - R) / 2, H - 12);
  std::fprintf(f,
               "<text transform='translate(18,%g) rotate(-90)' text-anchor='middle'>bits per "
               "component</text>\n",
               (H - B + Tp) / 2);
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                          "#9467bd", "#8c564b", "#e377c2", "#17becf"};
  int i = 0;
  for (const auto& [name, pts] : series) {
    const char* c = colors[i % 8];
    std::vector<std::pair<double, double>> p = pts;
    std::sort(p.begin(), p.end());
    std::fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='2' points='", c);
    for (auto [e, b] : p) std::fprintf(f, "%.1f,%.1f ", X(e), Y(b));
    std::fprintf(f, "'/>\n");
    for (auto [e, b] : p)
      std::fprintf(f, "<circle cx='%.1f' cy='%.1f' r='3' fill='%s'/>\n", X(e), Y(b), c);
    std::fprintf(
        f, "<rect x='%g' y='%g' width='12' height='12' fill='%s'/><text x='%g' y='%g'>%s</text>\n",
        W - R + 12, Tp + 18.0 * i, c, W - R + 30, Tp + 18.0 * i + 10, name.c_str());
    ++i;
  }
  std::fprintf(f, "</svg>\n");
  std::fclose(f);
}

// An oracle cross-layer value predictor, to size what a per-model predictor could save: for each
// layer l >= 1, V_l (all heads) by least squares on [K_l, V_{l-1}, 1] of the same token, fitted
// on the whole dump (in sample, original rather than reconstructed inputs: an upper bound).
// Returns one prediction block per block of the dump (K planes and layer 0 zero), in the dtype.
std::vector<std::vector<uint8_t>> CrossLayerOracle(const Dump& d) {
  const size_t L = d.g.num_layers, H = d.g.num_kv_heads, D = d.g.head_dim, N = d.kv.num_tokens();
  const size_t n = L * H * N * D, q = H * D, p = 2 * q + 1;
  std::vector<float> k(n), v(n), pred(n, 0.0f);
  ToFloat(d.g.dtype, d.kv.k.data(), n, k.data());
  ToFloat(d.g.dtype, d.kv.v.data(), n, v.data());
  auto at = [&](const std::vector<float>& a, size_t l, size_t i, size_t t) {
    return static_cast<double>(a[((l * H + i / D) * N + t) * D + i % D]);
  };
  for (size_t l = 1; l < L; ++l) {
    std::vector<double> f(p), A(p * p, 0.0), B(p * q, 0.0);
    auto features = [&](size_t t) {
      for (size_t i = 0; i < q; ++i) f[i] = at(k, l, i, t), f[q + i] = at(v, l - 1, i, t);
      f[2 * q] = 1.0;
    };
    for (size_t t = 0; t < N; ++t) {
      features(t);
      for (size_t i = 0; i < p; ++i) {
        for (size_t j = 0; j < p; ++j) A[i * p + j] += f[i] * f[j];
        for (size_t o = 0; o < q; ++o) B[i * q + o] += f[i] * at(v, l, o, t);
      }
    }
    for (size_t i = 0; i < p; ++i) A[i * p + i] += 1e-6 * (A[i * p + i] + 1.0);
    for (size_t i = 0; i < p; ++i) {  // Gauss-Jordan: A is symmetric positive definite
      const double piv = A[i * p + i];
      for (size_t j = 0; j < p; ++j) A[i * p + j] /= piv;
      for (size_t o = 0; o < q; ++o) B[i * q + o] /= piv;
      for (size_t r = 0; r < p; ++r) {
        const double m = A[r * p + i];
        if (r == i || m == 0) continue;
        for (size_t j = 0; j < p; ++j) A[r * p + j] -= m * A[i * p + j];
        for (size_t o = 0; o < q; ++o) B[r * q + o] -= m * B[i * q + o];
      }
    }
    for (size_t t = 0; t < N; ++t) {
      features(t);
      for (size_t o = 0; o < q; ++o) {
        double y = 0;
        for (size_t i = 0; i < p; ++i) y += f[i] * B[i * q + o];
        pred[((l * H + o / D) * N + t) * D + o % D] = static_cast<float>(y);
      }
    }
  }
  std::vector<uint8_t> zk(d.kv.k.size(), 0), pv(d.kv.v.size());
  FromFloat(d.g.dtype, pred.data(), n, pv.data());
  std::vector<std::vector<uint8_t>> blocks(d.num_blocks, std::vector<uint8_t>(d.g.num_bytes()));
  for (size_t b = 0; b < d.num_blocks; ++b) {
    GatherBlock(d.g, N, zk.data(), pv.data(), b, absl::MakeSpan(blocks[b]));
  }
  return blocks;
}

// MB/s of a plain memcpy of every block (best of g_repeats per block): the in-process yardstick
// the codec throughputs are divided by.
double MemcpyMbps(const std::vector<Dump>& dumps) {
  double secs = 0, bytes = 0;
  std::vector<uint8_t> dst;
  for (const Dump& d : dumps) {
    dst.resize(d.g.num_bytes());
    for (const std::vector<uint8_t>& blk : d.blocks) {
      double best = INFINITY;
      for (int rep = 0; rep < g_repeats; ++rep) {
        const auto t0 = Clock::now();
        std::memcpy(dst.data(), blk.data(), blk.size());
        asm volatile("" : : "r"(dst.data()) : "memory");
        best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
      }
      secs += best;
      bytes += blk.size();
    }
  }
  return bytes / secs / 1e6;
}

// The headline: bits at the TurboQuant 3-bit error and throughput, each as a ratio against a
// baseline measured in this process (TurboQuant b=3 bits; memcpy and the raw envelope MB/s).
void PrintHeadline(const std::vector<Dump>& dumps, const Result& tq3, double tq3_error) {
  const double memcpy_mbps = MemcpyMbps(dumps);
  Result raw;
  Setting raw_st{"raw", "fp16", {.encoding = Encoding::kRaw}};
  for (const Dump& d : dumps) raw.Add(RunDump(d, raw_st, nullptr));
  const double raw_enc = raw.bytes_in / raw.enc_s / 1e6, raw_dec = raw.bytes_in / raw.dec_s / 1e6;
  std::printf("headline (best of %d runs per block; MB/s of fp16 input on one thread):\n",
              g_repeats);
  std::printf("  memcpy %.0f MB/s; raw envelope (copy + CRC-32C) encode %.0f, decode %.0f MB/s\n",
              memcpy_mbps, raw_enc, raw_dec);
  std::printf("  %-22s %7s %8s %8s %8s %9s %9s %8s %8s\n", "method", "bpc", "bpc/TQ3", "relK",
              "relV", "enc MB/s", "dec MB/s", "enc/raw", "dec/raw");
  auto line = [&](const char* name, const Result& r) {
    const double enc = r.bytes_in / r.enc_s / 1e6, dec = r.bytes_in / r.dec_s / 1e6;
    std::printf("  %-22s %7.3f %8.3f %8.4f %8.4f %9.1f %9.1f %8.3f %8.3f\n", name, r.bpc(),
                r.bpc() / tq3.bpc(), r.rel(0), r.rel(1), enc, dec, enc / raw_enc, dec / raw_dec);
  };
  line("turboquant b=3", tq3);
  Result lossless;
  Setting ll{"lossless", "bit-exact", {.encoding = Encoding::kLossless}};
  for (const Dump& d : dumps) lossless.Add(RunDump(d, ll, nullptr));
  line("lossless", lossless);
  std::printf("  %-22s ratio vs fp16 %.3fx\n", "", 16.0 / lossless.bpc());
  for (bool parent : {true, false}) {
    Result kv;
    Setting st{
        "kvtrie", "tq3", {.encoding = Encoding::kResidual, .target_rel_rms = tq3_error}, parent};
    for (const Dump& d : dumps) kv.Add(RunDump(d, st, nullptr));
    line(parent ? "kvtrie e=tq3 (parent)" : "kvtrie e=tq3 (no parent)", kv);
  }
  std::printf(
      "  targets: kvtrie bpc at the TQ3 error <= 2.0 (stretch 1.5); lossless >= 1.15x; "
      "encode and decode >= 200 MB/s\n\n");
}

// Step groups (EncodeOptions::step_groups) on versus off at the same targets, every dump, parent
// chained. Measured (11 dumps, 16-token blocks, 5 x 4 x 8 heads):
//   groups target   bpc    relK    relV    attn_tv
//   off    0.02     5.537  0.0198  0.0198  0.0504
//   on     0.02     5.906  0.0197  0.0197  0.0816
//   off    0.05     4.158  0.0497  0.0497  0.1290
//   on     0.05     4.519  0.0497  0.0496  0.1936
//   off    0.10     3.102  0.0993  0.0993  0.2275
//   on     0.10     3.455  0.0991  0.0990  0.3587
//   off    tq3      2.267  0.1707  0.1707  0.3649
//   on     tq3      2.623  0.1704  0.1706  0.5179
//   off    0.30     1.475  0.2986  0.2985  0.5685
//   on     0.30     1.920  0.2982  0.2984  0.6476
// One step per plane is better at every target: +0.36 to +0.45 bpc with groups, a larger
// attention error, and half the encode speed (two step searches). The side information is not
// why: with every scale code 0 the option costs only +0.01 bpc. The allocation is: with an
// entropy coder, equal step (equal distortion per component) is MSE-optimal, and scaling a
// group's step with its residual RMS moves distortion onto the high-variance groups, where it
// costs the most bits to take back (KIVI needs per-group scales because it is fixed-rate; kvtrie
// is not). Milder exponents (step ~ rms^0.5, ^0.25) lose less (+0.11-0.18, +0.03-0.06 bpc) but
// never win. The reverse (finer steps for larger groups, rms^-0.5) costs +0.24-0.34 bpc yet
// lowers attn_tv (0.094 vs 0.129 at 0.05; the plane step reaches ~0.11 at the same bits): key
// channels with large values matter most to q . k — a lead for an attention-weighted target,
// not an MSE one.
void PrintStepGroups(const std::vector<Dump>& dumps, double tq3_error) {
  std::printf("step groups: one step per plane (off) vs per key channel / value token (on):\n");
  std::printf("  %-8s %-12s %7s %8s %8s %9s %8s %8s\n", "groups", "target", "bpc", "relK", "relV",
              "attn_tv", "enc MB/s", "dec MB/s");
  for (double e : {0.02, 0.05, 0.1, tq3_error, 0.3}) {
    for (StepGroups sg : {StepGroups::kPlane, StepGroups::kChannelKeysTokenValues}) {
      EncodeOptions o{.encoding = Encoding::kResidual, .target_rel_rms = e};
      o.step_groups = sg;
      Setting st{"kvtrie", "", o, /*chain_parent=*/true};
      Result t;
      for (const Dump& d : dumps) t.Add(RunDump(d, st, nullptr));
      std::printf("  %-8s e=%-10.4f %7.3f %8.4f %8.4f %9.5f %8.1f %8.1f\n",
                  sg == StepGroups::kPlane ? "off" : "on", e, t.bpc(), t.rel(0), t.rel(1),
                  t.attn_mean(), t.bytes_in / t.enc_s / 1e6, t.bytes_in / t.dec_s / 1e6);
    }
  }
  std::printf("\n");
}

int Main(int argc, char** argv) {
  std::string data_dir = KVTRIE_TESTDATA_DIR, out_dir = ".";
  uint32_t block_tokens = 16;
  bool headline_only = false, step_groups_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--data_dir=", 0) == 0)
      data_dir = a.substr(11);
    else if (a.rfind("--out_dir=", 0) == 0)
      out_dir = a.substr(10);
    else if (a.rfind("--block_tokens=", 0) == 0)
      block_tokens = std::stoi(a.substr(15));
    else if (a.rfind("--repeats=", 0) == 0)
      g_repeats = std::max(1, std::stoi(a.substr(10)));
    else if (a == "--headline")
      headline_only = true;
    else if (a == "--step_groups")
      step_groups_only = true;
    else {
      std::fprintf(stderr,
                   "usage: codec_bench [--data_dir=DIR] [--out_dir=DIR] [--block_tokens=16] "
                   "[--repeats=1] [--headline] [--step_groups]\n");
      return 2;
    }
  }
  std::vector<Dump> dumps;
  for (const char* name :
       {"sessions/s0", "sessions/s1", "sessions/s2", "sessions/s3", "neardup/n0", "neardup/n1",
        "neardup/n2", "neardup/n3", "genesis_1-3", "GPL-3", "story_prompt"}) {
    absl::StatusOr<KvDump> kv = ReadKvDump(data_dir + "/" + name);
    if (!kv.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, std::string(kv.status().message()).c_str());
      return 1;
    }
    Dump d{name, std::move(*kv)};
    d.g =
        BlockGeometry{d.kv.num_layers, d.kv.num_kv_heads, block_tokens, d.kv.head_dim, d.kv.dtype};
    d.num_blocks = d.kv.num_tokens() / block_tokens;
    for (size_t b = 0; b < d.num_blocks; ++b) {
      d.blocks.emplace_back(d.g.num_bytes());
      GatherBlock(d.g, d.kv.num_tokens(), d.kv.k.data(), d.kv.v.data(), b,
                  absl::MakeSpan(d.blocks.back()));
    }
    dumps.push_back(std::move(d));
  }
  std::printf("codec_bench: %zu dumps from %s, %u-token blocks, geometry %s\n\n", dumps.size(),
              data_dir.c_str(), block_tokens, dumps[0].g.DebugString().c_str());

  // The TurboQuant 3-bit error sets kvtrie's headline target: the smaller of its K and V errors.
  Result tq3;
  {
    Setting st{"turboquant", "b=3", {.encoding = Encoding::kTurboQuant}};
    for (const Dump& d : dumps) tq3.Add(RunDump(d, st, nullptr));
  }
  const double tq3_error = std::min(tq3.rel(0), tq3.rel(1));
  if (!step_groups_only) PrintHeadline(dumps, tq3, tq3_error);
  if (headline_only) return 0;
  PrintStepGroups(dumps, tq3_error);
  if (step_groups_only) return 0;

  FILE* csv = std::fopen((out_dir + "/codec_bench.csv").c_str(), "w");
  if (csv)
    std::fprintf(
        csv,
        "dump,method,setting,bpc,ratio,rel_rms_k,rel_rms_v,max_abs,attn_tv,enc_mbps,dec_mbps\n");
  std::printf("%-18s %-14s %7s %7s %8s %8s %8s %9s %8s %8s\n", "method", "setting", "bpc", "ratio",
              "relK", "relV", "max_abs", "attn_tv", "enc MB/s", "dec MB/s");
  std::map<std::string, std::vector<std::pair<double, double>>> curves;
  auto report = [&](const std::string& method, const std::string& label, const Result& t) {
    std::printf("%-18s %-14s %7.3f %7.2f %8.4f %8.4f %8.4f %9.5f %8.1f %8.1f\n", method.c_str(),
                label.c_str(), t.bpc(), 16.0 / t.bpc(), t.rel(0), t.rel(1), t.max_abs,
                t.attn_mean(), t.bytes_in / t.enc_s / 1e6, t.bytes_in / t.dec_s / 1e6);
  };
  auto row = [&](const std::string& dump, const std::string& method, const std::string& label,
                 const Result& r) {
    if (csv) {
      std::fprintf(csv, "%s,%s,%s,%.5f,%.4f,%.6f,%.6f,%.6f,%.6f,%.2f,%.2f\n", dump.c_str(),
                   method.c_str(), label.c_str(), r.bpc(), 16.0 / r.bpc(), r.rel(0), r.rel(1),
                   r.max_abs, r.attn_tv, r.bytes_in / r.enc_s / 1e6, r.bytes_in / r.dec_s / 1e6);
    }
  };
  std::map<std::string, Result> per_dump_headline;
  for (const Setting& st : Settings(tq3_error)) {
    Result total;
    for (const Dump& d : dumps) {
      Result r = RunDump(d, st, nullptr);
      if (!r.ok) continue;
      row(d.name, st.method, st.label, r);
      total.Add(r);
      if (st.label.rfind("e=tq3", 0) == 0 && st.method == "kvtrie") per_dump_headline[d.name] = r;
    }
    report(st.method, st.label, total);
    if (st.method != "raw" && st.method != "lossless" && st.label.rfind("e=tq3", 0) != 0) {
      curves[st.method].push_back({total.rel_all(), total.bpc()});
    }
  }
  // Near-duplicates: n1..n3 against n0 as centroid (n0 stored at the same target first).
  {
    // What a per-model cross-layer value predictor could be worth (see CrossLayerOracle).
    Setting st{"kvtrie+xlayer-oracle",
               "e=tq3",
               {.encoding = Encoding::kResidual, .target_rel_rms = tq3_error},
               true};
    st.external = true;
    Result total;
    for (const Dump& d : dumps) {
      const std::vector<std::vector<uint8_t>> oracle = CrossLayerOracle(d);
      total.Add(RunDump(d, st, &oracle));
    }
    std::printf(
        "\nupper bound: with an oracle cross-layer V predictor (V_l from K_l, V_{l-1}; "
        "least squares fitted per dump) as context.external:\n");
    report(st.method, st.label, total);
  }
  std::printf("\nnear-duplicate branches neardup/n1..n3 as residuals of centroid neardup/n0:\n");
  for (double e : {0.05, 0.1, tq3_error}) {
    char label[32];
    std::snprintf(label, sizeof label, "e=%.4f", e);
    Setting st{
        "kvtrie-centroid", label, {.encoding = Encoding::kResidual, .target_rel_rms = e}, true};
    Setting plain{"kvtrie", label, {.encoding = Encoding::kResidual, .target_rel_rms = e}, true};
    std::vector<std::vector<uint8_t>> n0;
    RunDump(dumps[4], plain, nullptr, &n0);
    Result with, without;
    for (size_t i = 5; i <= 7; ++i) {
      Result r = RunDump(dumps[i], st, &n0);
      row(dumps[i].name, st.method, st.label, r);
      with.Add(r);
      without.Add(RunDump(dumps[i], plain, nullptr));
    }
    report("kvtrie (alone)", label, without);
    report("kvtrie-centroid", label, with);
  }
  if (csv) std::fclose(csv);
  WriteSvg(out_dir + "/codec_bench.svg", curves);

  std::printf("\nper dump, kvtrie at the TurboQuant 3-bit error (target %.4f):\n", tq3_error);
  for (const auto& [name, r] : per_dump_headline) {
    std::printf("  %-14s bpc %.3f relK %.4f relV %.4f attn_tv %.5f\n", name.c_str(), r.bpc(),
                r.rel(0), r.rel(1), r.attn_tv);
  }
  std::printf("\nTurboQuant b=3: relK %.4f relV %.4f bpc %.3f\n", tq3.rel(0), tq3.rel(1),
              tq3.bpc());
  std::printf("wrote %s/codec_bench.csv and %s/codec_bench.svg\n", out_dir.c_str(),
              out_dir.c_str());
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
