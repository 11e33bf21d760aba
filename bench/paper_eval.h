// bench/paper_eval.h
//
// What bench/paper_bench.cc (and learned_nll_bench.cc) measure with: held-out windows of the
// learned dumps (bench/make_learned_dumps.sh, split by text), each window's context coded block by
// block by a caller-given encoder, decoded, loaded into the reference model (stories260K, real
// forward pass) and its continuation scored against the same continuation after the dump's own fp16
// KV.
#ifndef KVTRIE_BENCH_PAPER_EVAL_H_
#define KVTRIE_BENCH_PAPER_EVAL_H_

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/learned_data.h"
#include "client/worker/llama_model.h"

namespace kvtrie {

struct Window {
  const Text* text = nullptr;
  size_t context = 0, end = 0;  // coded tokens [0, context), scored tokens [context, end)
  double baseline_bits = 0;     // continuation surprisal after the dump's own KV
};

// Sum of surprisal (bits) of tokens [context, end) after loading `prefix` as the context KV.
inline double ScoreWith(const worker::LlamaModel& model, const Window& w, const KvDump& prefix) {
  worker::Sequence seq(&model, w.end, DType::kFp16);
  if (!seq.LoadPrefix(prefix).ok() || !seq.RecomputeLastLogits().ok()) std::exit(2);
  const std::vector<uint32_t>& ids = w.text->dump.token_ids;
  std::vector<uint32_t> cont(ids.begin() + w.context, ids.begin() + w.end);
  if (!seq.Extend(cont).ok()) std::exit(2);
  double s = 0;
  for (size_t i = w.context; i < w.end; ++i) s += seq.surprisal_bits()[i];
  return s;
}

// The first `context` tokens of `t` as a KvDump: from `blocks` (block layout), or, when null, the
// dump's own KV.
inline KvDump PrefixOf(const BlockGeometry& g, const Text& t, size_t context,
                       const std::vector<std::vector<uint8_t>>* blocks) {
  KvDump p;
  p.model_id = t.dump.model_id;
  p.num_layers = t.dump.num_layers;
  p.num_kv_heads = t.dump.num_kv_heads;
  p.head_dim = t.dump.head_dim;
  p.dtype = t.dump.dtype;
  p.token_ids.assign(t.dump.token_ids.begin(), t.dump.token_ids.begin() + context);
  p.surprisal_bits.assign(t.dump.surprisal_bits.begin(), t.dump.surprisal_bits.begin() + context);
  const size_t row = static_cast<size_t>(p.head_dim) * DTypeBytes(p.dtype);
  p.k.resize(static_cast<size_t>(p.num_layers) * p.num_kv_heads * context * row);
  p.v.resize(p.k.size());
  if (blocks == nullptr) {
    const size_t n = t.dump.num_tokens();
    for (size_t lh = 0; lh < static_cast<size_t>(p.num_layers) * p.num_kv_heads; ++lh) {
      std::memcpy(p.k.data() + lh * context * row, t.dump.k.data() + lh * n * row, context * row);
      std::memcpy(p.v.data() + lh * context * row, t.dump.v.data() + lh * n * row, context * row);
    }
    return p;
  }
  for (size_t b = 0; b < blocks->size(); ++b) {
    ScatterBlock(g, context, (*blocks)[b], b, p.k.data(), p.v.data());
  }
  return p;
}

// Windows of the test texts: context = min(max_context, a multiple of block_tokens leaving >= 32
// tokens), the next <= 128 tokens scored; baseline_bits filled in.
inline std::vector<Window> MakeWindows(const worker::LlamaModel& model, const BlockGeometry& g,
                                       const std::vector<Text>& test, size_t max_context) {
  std::vector<Window> out;
  for (const Text& t : test) {
    const size_t n = t.dump.num_tokens();
    if (n < 32 + g.block_tokens) continue;
    Window w;
    w.text = &t;
    w.context = std::min<size_t>(max_context, (n - 32) / g.block_tokens * g.block_tokens);
    w.end = std::min(n, w.context + 128);
    w.baseline_bits = ScoreWith(model, w, PrefixOf(g, t, w.context, nullptr));
    out.push_back(w);
  }
  return out;
}

// One coded block of a window.
struct BlockCost {
  double bits = 0;       // encoded bits (envelope included)
  double surprisal = 0;  // sum of its tokens' surprisal, bits
  uint32_t first_position = 0;
  double rel_k = 0, rel_v = 0;  // errors met
};

struct EvalResult {
  double bits_per_component = 0;
  double delta_nll_pct = 0, se_pct = 0;  // pooled ΔNLL, s.e. from the per-window spread
  double rel_k = 0, rel_v = 0;           // mean error met per block
  std::vector<BlockCost> blocks;
};

// Encodes block `b` of window `w` (window index `wi`); returns the encoded block and its
// decoding context through `ctx_out` (spans must stay valid until the block is decoded).
using BlockEncoder =
    std::function<EncodedBlock(size_t wi, const Window& w, size_t b, PredictionContext* ctx_out)>;

inline EvalResult Evaluate(const worker::LlamaModel& model, const BlockGeometry& g,
                           const std::vector<Window>& windows, const BlockEncoder& encode) {
  EvalResult r;
  double bytes = 0, comps = 0, sum = 0, base = 0;
  std::vector<double> per_window;
  for (size_t i = 0; i < windows.size(); ++i) {
    const Window& w = windows[i];
    std::vector<std::vector<uint8_t>> decoded;
    for (size_t b = 0; b < w.context / g.block_tokens; ++b) {
      PredictionContext ctx;
      const EncodedBlock e = encode(i, w, b, &ctx);
      decoded.emplace_back(g.num_bytes());
      if (!DecodeBlock(e.bytes, absl::MakeSpan(decoded.back()), ctx).ok()) std::exit(3);
      bytes += e.bytes.size();
      comps += g.num_elements();
      BlockCost c;
      c.bits = 8.0 * e.bytes.size();
      for (size_t t = b * g.block_tokens; t < (b + 1) * g.block_tokens; ++t) {
        c.surprisal += w.text->dump.surprisal_bits[t];
      }
      c.first_position = static_cast<uint32_t>(b * g.block_tokens);
      c.rel_k = e.rel_rms_error_k;
      c.rel_v = e.rel_rms_error_v;
      r.rel_k += c.rel_k;
      r.rel_v += c.rel_v;
      r.blocks.push_back(c);
    }
    const double s = ScoreWith(model, w, PrefixOf(g, *w.text, w.context, &decoded));
    sum += s;
    base += w.baseline_bits;
    per_window.push_back(100 * (s - w.baseline_bits) / w.baseline_bits);
  }
  r.bits_per_component = 8 * bytes / comps;
  r.delta_nll_pct = 100 * (sum - base) / base;
  r.rel_k /= r.blocks.size();
  r.rel_v /= r.blocks.size();
  double mean = 0, var = 0;
  for (double v : per_window) mean += v / per_window.size();
  for (double v : per_window) var += (v - mean) * (v - mean) / (per_window.size() - 1);
  r.se_pct = std::sqrt(var / per_window.size());
  return r;
}

// EncodeBlock or exit with the error (a bench: a failure is a bug to see, not to handle).
inline EncodedBlock MustEncode(const BlockGeometry& g, absl::Span<const uint8_t> kv,
                               const EncodeOptions& o, const PredictionContext& ctx) {
  absl::StatusOr<EncodedBlock> e = EncodeBlock(g, kv, o, ctx);
  if (!e.ok()) {
    std::fprintf(stderr, "encode: %s\n", e.status().ToString().c_str());
    std::exit(3);
  }
  return *std::move(e);
}

inline double Pearson(const std::vector<double>& x, const std::vector<double>& y) {
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += x[i] / x.size(), my += y[i] / y.size();
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  return sxy / std::sqrt(sxx * syy);
}

}  // namespace kvtrie

#endif  // KVTRIE_BENCH_PAPER_EVAL_H_
