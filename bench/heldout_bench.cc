// bench/heldout_bench.cc
//
// Held-out quality of KV compression on any Llama GGUF (issue 29): KL (bits/token, against the
// model's own fp16 KV) and ΔNLL with standard errors, bits per component, ratio vs fp16 and the
// worst plane's error, for kvtrie's encodings and the per-vector baselines in one run, in process
// (the codec and the reference model of client/worker; no server).
//
//   heldout_bench --model=GGUF --heldout=DATA/heldout.jsonl [--train=DATA/train.jsonl]
//                 [--windows=40] [--context=W] [--block_tokens=16] [--continuation=128]
//                 [--settings=int8,kivi2,turboquant/4,...] [--csv=FILE]
//
// Windows, split by document: each held-out document ({"path", "text"} per JSONL line; a document
// whose name, extensions stripped, also names a --train document is skipped, as
// tools/train/eval_model.py does) gives at most --per_doc (1) windows, its first W tokens as
// the model's tokenizer encodes them (BOS first; then the next W, ...), W = --context, by default
// min(the GGUF's context length, 1024) (stories260K: --context=512, its trained context); documents
// shorter than W tokens are skipped. The first C = W - continuation tokens are the context (its KV
// is coded block by block), the next `continuation` tokens are scored.
//
// Per window the model runs the context with fp16 KV (what an fp16 engine holds); that KV is the
// reference. Each setting encodes the context KV block by block (a block's parent is the previous
// decoded block, as the store gives it), decodes it, loads it into a fresh sequence and runs the
// continuation; the reference is the same path with the uncoded KV (so lossless gives exactly 0).
// Per scored token: KL(p_ref || p_coded) in bits and the surprisal. Reported: pooled means, with
// s.e. from the spread over documents (per-window values averaged per document). ΔNLL % =
// 100 * (summed surprisal - reference) / reference. Lossless settings are checked bit-exact
// against the reference KV instead of being rescored (their KL and ΔNLL are 0 by construction).
//
// Settings (comma-separated): lossless-fast, lossless-compact, int8, kivi2, turboquant/B,
// residual-fast@E, residual-compact@E (E = target rel RMS per plane), and residual-fast@tqB /
// residual-compact@tqB: the target set to turboquant/B's measured error in this run (the smaller
// of its K and V rel RMS; turboquant/B must come earlier in the list), and kvtc@E / kvtc@tqB: the
// KVTC-style baseline below, and learned-fast@E / learned-fast@tqB / learned-lossless-fast: the
// fast profile coded against a PredictorState (codec/predictor_state.h, default LearnerOptions)
// learned from the same training KV. bf16-lossless-fast / bf16-learned-lossless-fast: the context
// KV rounded to bf16 (round to nearest even) and coded losslessly as bf16 blocks (checked
// bit-exact against the rounded KV); bits/component against bf16's 16 bits, and ΔNLL / KL are
// the rounding's own (the model's KV is fp16). Both are fitted on the context KV of --kvtc_docs
// (32) --train documents with >= W tokens, taken from every --kvtc_stride-th (61st) line: training
// split only.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "bench/bench_flags.h"
#include "client/worker/llama_model.h"
#include "codec/block_codec.h"
#include "codec/block_geometry.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/predictor_state.h"
#include "codec/predictor_state_internal.h"

namespace kvtrie {
namespace {

using bench::Flag;

// Appends code point `c` to `out` as UTF-8.
void AppendUtf8(uint32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

// The JSON string value of `key` in the one-line object `line` (escapes decoded; at most
// `max_bytes` bytes kept), or false when the key is absent.
bool JsonString(const std::string& line, const std::string& key, size_t max_bytes,
                std::string* out) {
  const std::string pat = "\"" + key + "\": \"";
  size_t i = line.find(pat);
  if (i == std::string::npos) return false;
  i += pat.size();
  out->clear();
  while (i < line.size() && line[i] != '"' && out->size() < max_bytes) {
    if (line[i] != '\\') {
      out->push_back(line[i++]);
      continue;
    }
    const char e = line[i + 1];
    i += 2;
    switch (e) {
      case 'n':
        out->push_back('\n');
        break;
      case 't':
        out->push_back('\t');
        break;
      case 'r':
        out->push_back('\r');
        break;
      case 'b':
        out->push_back('\b');
        break;
      case 'f':
        out->push_back('\f');
        break;
      case 'u': {
        uint32_t c = std::stoul(line.substr(i, 4), nullptr, 16);
        i += 4;
        if (c >= 0xD800 && c < 0xDC00 && line.compare(i, 2, "\\u") == 0) {
          const uint32_t lo = std::stoul(line.substr(i + 2, 4), nullptr, 16);
          c = 0x10000 + ((c - 0xD800) << 10) + (lo - 0xDC00);
          i += 6;
        }
        AppendUtf8(c, out);
        break;
      }
      default:
        out->push_back(e);  // \" \\ \/
    }
  }
  // Do not end inside a UTF-8 sequence.
  while (!out->empty() && (static_cast<uint8_t>(out->back()) & 0xC0) == 0x80) out->pop_back();
  if (!out->empty() && (static_cast<uint8_t>(out->back()) & 0x80)) out->pop_back();
  return true;
}

// tools/train/eval_model.py doc_key: the base name without its extensions, lower case.
std::string DocKey(const std::string& path) {
  std::string base = path.substr(path.rfind('/') + 1);
  for (bool again = true; again;) {
    again = false;
    const size_t dot = base.rfind('.');
    if (dot == std::string::npos) break;
    const std::string ext = base.substr(dot + 1);
    const bool known =
        ext == "gz" || ext == "txt" || ext == "rst" || ext == "html" || ext == "htm" ||
        ext == "md" ||
        (!ext.empty() && std::isdigit(static_cast<unsigned char>(ext[0])) &&
         std::all_of(ext.begin() + 1, ext.end(), [](char c) { return c >= 'a' && c <= 'z'; }));
    if (known) {
      base.resize(dot);
      again = true;
    }
  }
  std::transform(base.begin(), base.end(), base.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return base;
}

struct Window {
  std::string path;
  size_t doc = 0;                // index of its document among the kept ones
  std::vector<uint32_t> tokens;  // W tokens
  size_t context = 0;            // coded tokens [0, context), scored [context, W)
  KvDump prefix;                 // the context's fp16 KV
  std::vector<float> ref_logp;   // [scored][vocab] natural log-probabilities, reference
  double ref_bits = 0;           // summed reference surprisal of the scored tokens
};

// Log-softmax of `logits` into `out` (double precision).
void LogSoftmax(const std::vector<float>& logits, std::vector<double>* out) {
  out->resize(logits.size());
  double m = -INFINITY;
  for (float x : logits) m = std::max<double>(m, x);
  double s = 0;
  for (float x : logits) s += std::exp(x - m);
  const double lse = m + std::log(s);
  for (size_t i = 0; i < logits.size(); ++i) (*out)[i] = logits[i] - lse;
}

// Runs the scored tokens of `w` after `prefix`; fills per-token surprisal sum and KL sum (bits)
// against w.ref_logp, or, with `record`, records w.ref_logp and w.ref_bits instead.
void Score(const worker::LlamaModel& model, Window* w, const KvDump& prefix, bool record,
           double* bits, double* kl) {
  worker::Sequence seq(&model, w->tokens.size(), DType::kFp16);
  if (!seq.LoadPrefix(prefix).ok() || !seq.RecomputeLastLogits().ok()) std::exit(2);
  const size_t V = model.config().vocab_size;
  const size_t n = w->tokens.size() - w->context;
  if (record) w->ref_logp.resize(n * V);
  std::vector<double> lq;
  *bits = 0;
  *kl = 0;
  for (size_t i = 0; i < n; ++i) {
    LogSoftmax(seq.logits(), &lq);
    const uint32_t tok = w->tokens[w->context + i];
    *bits += -lq[tok] / std::log(2.0);
    if (record) {
      for (size_t v = 0; v < V; ++v) w->ref_logp[i * V + v] = static_cast<float>(lq[v]);
    } else {
      double d = 0;
      const float* lp = &w->ref_logp[i * V];
      for (size_t v = 0; v < V; ++v) d += std::exp(static_cast<double>(lp[v])) * (lp[v] - lq[v]);
      *kl += std::max(0.0, d) / std::log(2.0);
    }
    if (i + 1 < n && !seq.Extend({&tok, 1}).ok()) std::exit(2);
  }
  if (record) w->ref_bits = *bits;
}

// A KVTC-style transform coder (KVTC, arXiv 2511.01815, simplified), fitted on training-split KV:
// per (layer, K/V) plane, a token's num_kv_heads * head_dim values (keys with RoPE undone) minus
// the training mean are rotated into the training PCA basis; every coefficient is quantized
// uniformly with the plane's one step (the step that meets the target rel RMS on the training
// KV: one step for all coefficients is the entropy-coded optimum, low-variance coefficients
// quantize to 0 and cost ~0 bits); the symbols are costed as the ideal code length under
// static per-coefficient tables counted on the training KV (+0.5 smoothing, an escape plus 16
// bits for a symbol never seen): what an arithmetic / rANS coder with those tables spends. The
// basis, means and tables are side information shared like a learned state (not counted).
class Kvtc {
 public:
  explicit Kvtc(const worker::LlamaConfig& cfg)
      : cfg_(cfg), n_(cfg.kv_dim()), planes_(2 * cfg.num_layers) {}

  void Observe(const KvDump& d) {
    const size_t T = d.num_tokens();
    for (size_t p = 0; p < planes_.size(); ++p) {
      Plane& pl = planes_[p];
      std::vector<double> x(n_);
      for (size_t t = 0; t < T; ++t) {
        Vector(d, p, t, T, x.data());
        pl.samples.insert(pl.samples.end(), x.begin(), x.end());
      }
    }
  }

  // Mean, covariance and its eigenvectors per plane; the training samples become coefficients.
  void Fit() {
    for (Plane& pl : planes_) {
      const size_t m = pl.samples.size() / n_;
      pl.mean.assign(n_, 0);
      for (size_t t = 0; t < m; ++t)
        for (size_t i = 0; i < n_; ++i) pl.mean[i] += pl.samples[t * n_ + i] / m;
      std::vector<double> cov(n_ * n_, 0);
      for (size_t t = 0; t < m; ++t) {
        const double* x = &pl.samples[t * n_];
        pl.energy += [&] {
          double e = 0;
          for (size_t i = 0; i < n_; ++i) e += x[i] * x[i];
          return e;
        }();
        for (size_t i = 0; i < n_; ++i)
          for (size_t j = 0; j <= i; ++j)
            cov[i * n_ + j] += (x[i] - pl.mean[i]) * (x[j] - pl.mean[j]) / m;
      }
      for (size_t i = 0; i < n_; ++i)
        for (size_t j = 0; j < i; ++j) cov[j * n_ + i] = cov[i * n_ + j];
      std::vector<double> eigenvalues;  // the codec's cyclic Jacobi (its KLT's)
      internal::SymmetricEigen(cov, n_, &eigenvalues, &pl.basis);
      for (size_t t = 0; t < m; ++t) Project(pl, &pl.samples[t * n_]);
    }
  }

  // Codes `prefix` (all of it) at target `e`; writes the reconstruction into `dec`; returns bits.
  double Code(const KvDump& prefix, double e, KvDump* dec) {
    const Tables& tab = TablesFor(e);
    const size_t T = prefix.num_tokens();
    double bits = 0;
    std::vector<double> x(n_);
    for (size_t p = 0; p < planes_.size(); ++p) {
      const Plane& pl = planes_[p];
      const double step = tab.step[p];
      for (size_t t = 0; t < T; ++t) {
        Vector(prefix, p, t, T, x.data());
        Project(pl, x.data());
        for (size_t j = 0; j < n_; ++j) {
          const long q = std::lround(x[j] / step);
          bits += tab.Cost(p * n_ + j, q);
          x[j] = q * step;
        }
        Unproject(pl, x.data());
        Store(p, t, T, x.data(), dec);
      }
    }
    return bits;
  }

 private:
  struct Plane {
    std::vector<double> samples;      // training vectors, then their coefficients
    std::vector<double> mean, basis;  // basis: n x n, column k = k-th eigenvector
    double energy = 0;                // sum of ||x||^2 over the training vectors
  };
  struct Tables {
    std::vector<double> step;                   // per plane
    std::vector<std::map<long, double>> count;  // per (plane, coefficient)
    std::vector<double> total;
    double Cost(size_t c, long q) const {
      const auto it = count[c].find(q);
      const double denom = total[c] + 0.5 * (count[c].size() + 1);
      if (it != count[c].end()) return -std::log2((it->second + 0.5) / denom);
      return -std::log2(0.5 / denom) + 16;
    }
  };

  // Token t of plane p (layer p / 2, K if p even) as n_ doubles, keys with RoPE undone.
  void Vector(const KvDump& d, size_t p, size_t t, size_t T, double* x) const {
    const size_t H = cfg_.num_kv_heads, D = cfg_.head_dim(), l = p / 2;
    const uint16_t* src = reinterpret_cast<const uint16_t*>(p % 2 ? d.v.data() : d.k.data());
    for (size_t h = 0; h < H; ++h) {
      for (size_t i = 0; i < D; ++i) x[h * D + i] = HalfToFloat(src[((l * H + h) * T + t) * D + i]);
      if (p % 2 == 0) Rope(x + h * D, t, -1);
    }
  }
  void Store(size_t p, size_t t, size_t T, double* x, KvDump* d) const {
    const size_t H = cfg_.num_kv_heads, D = cfg_.head_dim(), l = p / 2;
    uint16_t* dst = reinterpret_cast<uint16_t*>(p % 2 ? d->v.data() : d->k.data());
    for (size_t h = 0; h < H; ++h) {
      if (p % 2 == 0) Rope(x + h * D, t, +1);
      for (size_t i = 0; i < D; ++i)
        dst[((l * H + h) * T + t) * D + i] = FloatToHalf(static_cast<float>(x[h * D + i]));
    }
  }
  // llama_model.cc's RoPE on adjacent pairs at position `pos` (sign -1: its inverse).
  void Rope(double* v, size_t pos, int sign) const {
    const size_t D = cfg_.head_dim();
    for (size_t i = 0; i < D; i += 2) {
      const float freq = 1.0f / std::pow(cfg_.rope_theta, static_cast<float>(i) / D);
      const float val = static_cast<float>(pos) * freq;
      const double c = std::cos(val), s = sign * std::sin(val);
      const double a = v[i], b = v[i + 1];
      v[i] = a * c - b * s;
      v[i + 1] = a * s + b * c;
    }
  }
  void Project(const Plane& pl, double* x) const {
    std::vector<double> c(n_, 0);
    for (size_t k = 0; k < n_; ++k)
      for (size_t i = 0; i < n_; ++i) c[k] += pl.basis[i * n_ + k] * (x[i] - pl.mean[i]);
    std::copy(c.begin(), c.end(), x);
  }
  void Unproject(const Plane& pl, double* c) const {
    std::vector<double> x(pl.mean);
    for (size_t i = 0; i < n_; ++i)
      for (size_t k = 0; k < n_; ++k) x[i] += pl.basis[i * n_ + k] * c[k];
    std::copy(x.begin(), x.end(), c);
  }
  // Training-KV squared error of plane `pl` at `step`, relative to its energy.
  double RelErr2(const Plane& pl, double step) const {
    double e = 0;
    for (double c : pl.samples) {
      const double d = c - step * std::lround(c / step);
      e += d * d;
    }
    return e / pl.energy;
  }
  const Tables& TablesFor(double target) {
    auto it = tables_.find(target);
    if (it != tables_.end()) return it->second;
    Tables& tab = tables_[target];
    tab.count.resize(planes_.size() * n_);
    tab.total.assign(planes_.size() * n_, 0);
    for (size_t p = 0; p < planes_.size(); ++p) {
      const Plane& pl = planes_[p];
      const double rms = std::sqrt(pl.energy / (pl.samples.size()));
      double lo = 1e-6 * rms, hi = 100 * rms;  // largest step with RelErr2 <= target^2
      for (int i = 0; i < 50; ++i) {
        const double mid = std::sqrt(lo * hi);
        (RelErr2(pl, mid) <= target * target ? lo : hi) = mid;
      }
      tab.step.push_back(lo);
      for (size_t k = 0; k < pl.samples.size(); ++k) {
        const size_t c = p * n_ + k % n_;
        tab.count[c][std::lround(pl.samples[k] / lo)] += 1;
        tab.total[c] += 1;
      }
    }
    return tab;
  }

  const worker::LlamaConfig cfg_;
  const size_t n_;
  std::vector<Plane> planes_;
  std::map<double, Tables> tables_;
};

struct Setting {
  std::string name;
  EncodeOptions options;
  std::string tq_ref;    // "turboquant/B": target from that row's measured error
  bool kvtc = false;     // the Kvtc coder at options.target_rel_rms
  bool learned = false;  // coded against the PredictorState learned from the training split
  bool bf16 = false;     // the fp16 KV rounded to bf16 and coded as bf16 blocks
};

bool ParseSetting(const std::string& s, Setting* out) {
  out->name = s;
  EncodeOptions& o = out->options;
  const size_t at = s.find('@');
  std::string head = s.substr(0, at);
  if (head.rfind("bf16-", 0) == 0) {
    head = head.substr(5);
    out->bf16 = true;
    if (head != "lossless-fast" && head != "learned-lossless-fast") return false;
  }
  const std::string arg = at == std::string::npos ? "" : s.substr(at + 1);
  if (head == "lossless-fast" || head == "lossless-compact" || head == "learned-lossless-fast") {
    o.encoding = Encoding::kLossless;
    o.profile = head == "lossless-compact" ? Profile::kCompact : Profile::kFast;
    out->learned = o.learned_lossless = head == "learned-lossless-fast";
  } else if (head == "int8") {
    o.encoding = Encoding::kInt8;
  } else if (head == "kivi2") {
    o.encoding = Encoding::kKivi2;
  } else if (head.rfind("turboquant/", 0) == 0) {
    o.encoding = Encoding::kTurboQuant;
    o.turboquant_bits = std::stoi(head.substr(11));
  } else if (head == "residual-fast" || head == "residual-compact" || head == "kvtc" ||
             head == "learned-fast") {
    o.encoding = Encoding::kResidual;
    o.profile = head == "residual-compact" ? Profile::kCompact : Profile::kFast;
    out->kvtc = head == "kvtc";
    out->learned = head == "learned-fast";
    if (arg.rfind("tq", 0) == 0) {
      out->tq_ref = "turboquant/" + arg.substr(2);
    } else {
      o.target_rel_rms = std::stod(arg);
      if (!(o.target_rel_rms > 0)) return false;
    }
  } else {
    return false;
  }
  return true;
}

struct Row {
  std::string name;
  double target = 0;
  double bpc = 0;
  double rel_k = 0, rel_v = 0, worst_plane = 0;
  std::string worst_plane_name;
  double nll = 0, delta_pct = 0, se_pct = 0, kl = 0, kl_se = 0;
  std::vector<double> win_delta_pct, win_kl;  // per document (ByDoc)
  std::string error;                          // the encoder's error, if it failed
};

double Mean(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m += v / x.size();
  return m;
}
double Se(const std::vector<double>& x) {
  const double m = Mean(x);
  double var = 0;
  for (double v : x) var += (v - m) * (v - m) / (x.size() - 1);
  return std::sqrt(var / x.size());
}

// Per-window values averaged per document (windows of a document are correlated: the s.e. and
// the paired differences are taken over documents).
std::vector<double> ByDoc(const std::vector<Window>& windows, const std::vector<double>& v) {
  std::vector<double> sum, n;
  for (size_t i = 0; i < windows.size(); ++i) {
    if (windows[i].doc >= sum.size()) sum.resize(windows[i].doc + 1), n.resize(windows[i].doc + 1);
    sum[windows[i].doc] += v[i];
    n[windows[i].doc] += 1;
  }
  for (size_t d = 0; d < sum.size(); ++d) sum[d] /= n[d];
  return sum;
}

Row Run(const worker::LlamaModel& model, const BlockGeometry& g, std::vector<Window>& windows,
        const Setting& s, size_t scored, Kvtc* kvtc, const PredictorState* state) {
  Row r;
  r.name = s.name;
  r.target = s.options.target_rel_rms;
  const size_t L = g.num_layers, H = g.num_kv_heads, D = g.head_dim;
  std::vector<double> err2(2 * L), energy(2 * L);
  double bytes = 0, comps = 0, bits = 0, ref = 0, kl = 0;
  for (Window& w : windows) {
    const size_t C = w.context;
    KvDump dec = w.prefix;
    std::vector<uint8_t> block(g.num_bytes()), parent;
    if (s.kvtc) {
      bytes += kvtc->Code(w.prefix, s.options.target_rel_rms, &dec) / 8;
      comps += static_cast<double>(C) * g.num_layers * 2 * g.num_kv_heads * g.head_dim;
    }
    for (size_t b = 0; !s.kvtc && b < C / g.block_tokens; ++b) {
      GatherBlock(g, C, w.prefix.k.data(), w.prefix.v.data(), b, absl::MakeSpan(block));
      PredictionContext ctx;
      if (!parent.empty()) ctx.parent = parent;
      std::vector<int32_t> toks(w.tokens.begin() + b * g.block_tokens,
                                w.tokens.begin() + (b + 1) * g.block_tokens);
      if (s.learned) {
        ctx.learned = state;
        ctx.tokens = toks;
        ctx.first_position = static_cast<uint32_t>(b * g.block_tokens);
        ctx.previous_token = b ? static_cast<int32_t>(w.tokens[b * g.block_tokens - 1]) : -1;
      }
      BlockGeometry gb = g;
      if (s.bf16) {  // fp16 -> bf16 in place (bf16 -> fp16 below is exact at KV magnitudes)
        gb.dtype = DType::kBf16;
        uint16_t* h = reinterpret_cast<uint16_t*>(block.data());
        for (size_t i = 0; i < g.num_elements(); ++i) h[i] = FloatToBf16(HalfToFloat(h[i]));
      }
      absl::StatusOr<EncodedBlock> e = EncodeBlock(gb, block, s.options, ctx);
      if (!e.ok()) {  // reported as the row's result (e.g. a target the coder cannot meet)
        r.error = std::string(e.status().message());
        return r;
      }
      std::vector<uint8_t> out(g.num_bytes());
      absl::Status st = DecodeBlock(e->bytes, absl::MakeSpan(out), ctx);
      if (!st.ok()) {
        std::fprintf(stderr, "%s: decode: %s\n", s.name.c_str(), st.ToString().c_str());
        std::exit(3);
      }
      if (s.bf16) {
        if (out != block) {
          std::fprintf(stderr, "%s: not bit-exact\n", s.name.c_str());
          std::exit(3);
        }
        uint16_t* h = reinterpret_cast<uint16_t*>(out.data());
        for (size_t i = 0; i < g.num_elements(); ++i) h[i] = FloatToHalf(Bf16ToFloat(h[i]));
      }
      bytes += e->bytes.size();
      comps += g.num_elements();
      ScatterBlock(g, C, out, b, dec.k.data(), dec.v.data());
      parent = s.bf16 ? block : std::move(out);
    }
    for (size_t kv = 0; kv < 2; ++kv) {
      const uint16_t* x =
          reinterpret_cast<const uint16_t*>(kv ? w.prefix.v.data() : w.prefix.k.data());
      const uint16_t* y = reinterpret_cast<const uint16_t*>(kv ? dec.v.data() : dec.k.data());
      for (size_t l = 0; l < L; ++l) {
        const size_t n = H * C * D;
        for (size_t i = l * n; i < (l + 1) * n; ++i) {
          const double a = HalfToFloat(x[i]), d = a - HalfToFloat(y[i]);
          err2[2 * l + kv] += d * d;
          energy[2 * l + kv] += a * a;
        }
      }
    }
    double wb = w.ref_bits, wkl = 0;
    if (s.options.encoding == Encoding::kLossless && !s.kvtc && !s.bf16) {
      // Bit-exact, so the scores are the reference's: checked, not rerun.
      if (dec.k != w.prefix.k || dec.v != w.prefix.v) {
        std::fprintf(stderr, "%s: not bit-exact\n", s.name.c_str());
        std::exit(3);
      }
    } else {
      Score(model, &w, dec, false, &wb, &wkl);
    }
    bits += wb;
    ref += w.ref_bits;
    kl += wkl;
    r.win_delta_pct.push_back(100 * (wb - w.ref_bits) / w.ref_bits);
    r.win_kl.push_back(wkl / (w.tokens.size() - w.context));
  }
  double ek = 0, xk = 0, ev = 0, xv = 0;
  for (size_t l = 0; l < L; ++l) {
    ek += err2[2 * l], xk += energy[2 * l], ev += err2[2 * l + 1], xv += energy[2 * l + 1];
    for (size_t kv = 0; kv < 2; ++kv) {
      const double e = std::sqrt(err2[2 * l + kv] / energy[2 * l + kv]);
      if (e > r.worst_plane) {
        r.worst_plane = e;
        r.worst_plane_name = std::string(kv ? "V" : "K") + std::to_string(l);
      }
    }
  }
  r.rel_k = std::sqrt(ek / xk);
  r.rel_v = std::sqrt(ev / xv);
  r.bpc = 8 * bytes / comps;
  r.nll = bits / scored;
  r.delta_pct = 100 * (bits - ref) / ref;
  r.win_delta_pct = ByDoc(windows, r.win_delta_pct);
  r.win_kl = ByDoc(windows, r.win_kl);
  r.se_pct = Se(r.win_delta_pct);
  r.kl = kl / scored;
  r.kl_se = Se(r.win_kl);  // both s.e. per document
  return r;
}

// Paired difference b - a of per-window values and its s.e.
void Paired(const std::vector<double>& a, const std::vector<double>& b, double* diff, double* se) {
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = b[i] - a[i];
  *diff = Mean(d);
  *se = Se(d);
}

int Main(int argc, char** argv) {
  const std::string model_path = Flag(argc, argv, "model", "tests/data/kvllama3M/kvllama3M.gguf");
  const std::string heldout = Flag(argc, argv, "heldout", "/work/train-run/data/heldout.jsonl");
  const std::string train = Flag(argc, argv, "train", "");
  const size_t want = std::stoul(Flag(argc, argv, "windows", "40"));
  // --per_doc=K: up to K consecutive W-token windows per document (only the first starts with
  // BOS); s.e. are then taken per document.
  const size_t per_doc = std::stoul(Flag(argc, argv, "per_doc", "1"));
  const uint32_t T = std::stoul(Flag(argc, argv, "block_tokens", "16"));
  const size_t cont = std::stoul(Flag(argc, argv, "continuation", "128"));
  const std::string csv = Flag(argc, argv, "csv", "");
  const std::string settings_flag =
      Flag(argc, argv, "settings",
           "lossless-fast,lossless-compact,learned-lossless-fast,int8,kivi2,turboquant/4,"
           "turboquant/3,turboquant/2,residual-fast@0.05,residual-fast@0.1,residual-fast@0.2,"
           "residual-fast@0.3,residual-fast@0.5,residual-fast@0.7,residual-compact@0.05,"
           "residual-compact@0.3,residual-compact@0.7,learned-fast@0.1,learned-fast@0.3,"
           "learned-fast@0.5,learned-fast@0.7,residual-fast@tq3,residual-compact@tq3,"
           "learned-fast@tq3,learned-fast@tq4,kvtc@0.1,kvtc@0.2,kvtc@0.3,kvtc@tq3");
  std::vector<Setting> settings;
  for (absl::string_view s : absl::StrSplit(settings_flag, ',', absl::SkipEmpty())) {
    Setting st;
    if (!ParseSetting(std::string(s), &st)) {
      std::fprintf(stderr, "--settings: cannot parse \"%s\"\n", std::string(s).c_str());
      return 1;
    }
    settings.push_back(st);
  }
  auto model_or = worker::LlamaModel::Load(model_path);
  if (!model_or.ok()) {
    std::fprintf(stderr, "%s\n", model_or.status().ToString().c_str());
    return 1;
  }
  const worker::LlamaModel& model = **model_or;
  const worker::LlamaConfig& cfg = model.config();
  // --context: the window length W (default: the GGUF's context length, at most 1024; a GGUF may
  // state more than the model was trained on, e.g. stories260K: 1024 stated, 512 trained).
  const size_t W = std::stoul(
      Flag(argc, argv, "context", std::to_string(std::min<size_t>(cfg.context_length, 1024))));
  const size_t C = (W - cont) / T * T;

  std::set<std::string> train_keys;
  if (!train.empty()) {
    std::ifstream f(train);
    std::string line, path;
    while (std::getline(f, line)) {
      if (JsonString(line.substr(0, 4096), "path", 4096, &path)) train_keys.insert(DocKey(path));
    }
    if (train_keys.empty()) {
      std::fprintf(stderr, "--train: no documents in %s\n", train.c_str());
      return 1;
    }
  }
  std::vector<Window> windows;
  size_t skipped_name = 0, skipped_short = 0, docs = 0;
  {
    std::ifstream f(heldout);
    std::string line, path, text;
    while (windows.size() < want && std::getline(f, line)) {
      if (!JsonString(line, "path", 4096, &path) ||
          !JsonString(line, "text", 5 * W * per_doc, &text)) {
        std::fprintf(stderr, "--heldout: a line without path and text in %s\n", heldout.c_str());
        return 1;
      }
      if (train_keys.count(DocKey(path))) {
        ++skipped_name;
        continue;
      }
      std::vector<uint32_t> ids = model.tokenizer().Encode(text, true, false);
      if (ids.size() < W) {
        ++skipped_short;
        continue;
      }
      for (size_t k = 0; k < per_doc && (k + 1) * W <= ids.size() && windows.size() < want; ++k) {
        Window w;
        w.path = path;
        w.doc = docs;
        w.tokens.assign(ids.begin() + k * W, ids.begin() + (k + 1) * W);
        w.context = C;
        windows.push_back(std::move(w));
      }
      ++docs;
    }
  }
  if (docs < 2) {
    std::fprintf(stderr, "only %zu windows\n", windows.size());
    return 1;
  }
  BlockGeometry g{cfg.num_layers, cfg.num_kv_heads, T, cfg.head_dim(), DType::kFp16};
  // The KVTC baseline's fit and the learned state: the context KV of every --kvtc_stride-th
  // --train document that has W tokens, --kvtc_docs of them.
  std::unique_ptr<Kvtc> kvtc;
  std::unique_ptr<PredictorLearner> learner;
  std::shared_ptr<const PredictorState> state;
  size_t kvtc_docs = 0;
  if (std::any_of(settings.begin(), settings.end(),
                  [](const Setting& s) { return s.kvtc || s.learned; })) {
    if (train.empty()) {
      std::fprintf(stderr, "kvtc settings need --train\n");
      return 1;
    }
    const size_t want_docs = std::stoul(Flag(argc, argv, "kvtc_docs", "32"));
    const size_t stride = std::stoul(Flag(argc, argv, "kvtc_stride", "61"));
    kvtc = std::make_unique<Kvtc>(cfg);
    std::ifstream f(train);
    std::string line, text;
    for (size_t i = 0; kvtc_docs < want_docs && std::getline(f, line); ++i) {
      if (i % stride || !JsonString(line, "text", 5 * W, &text)) continue;
      std::vector<uint32_t> ids = model.tokenizer().Encode(text, true, false);
      if (ids.size() < W) continue;
      worker::Sequence seq(&model, C, DType::kFp16);
      if (!seq.Extend({ids.data(), C}).ok()) std::exit(2);
      const KvDump d = seq.ToKvDump(DType::kFp16, C);
      kvtc->Observe(d);
      if (!learner) {
        absl::StatusOr<std::unique_ptr<PredictorLearner>> l = PredictorLearner::Create(g, {});
        if (!l.ok()) {
          std::fprintf(stderr, "learner: %s\n", l.status().ToString().c_str());
          return 1;
        }
        learner = *std::move(l);
      }
      std::vector<uint8_t> block(g.num_bytes());
      for (size_t b = 0; b < C / T; ++b) {
        GatherBlock(g, C, d.k.data(), d.v.data(), b, absl::MakeSpan(block));
        const std::vector<int32_t> toks(ids.begin() + b * T, ids.begin() + (b + 1) * T);
        if (!learner->Observe(block, toks, b * T, b ? static_cast<int32_t>(ids[b * T - 1]) : -1)
                 .ok()) {
          std::exit(2);
        }
      }
      ++kvtc_docs;
    }
    kvtc->Fit();
    absl::StatusOr<std::shared_ptr<const PredictorState>> st = learner->Fit(1);
    if (!st.ok()) {
      std::fprintf(stderr, "learner fit: %s\n", st.status().ToString().c_str());
      return 1;
    }
    state = *std::move(st);
  }
  size_t scored = 0;
  double ref_bits = 0;
  for (Window& w : windows) {
    worker::Sequence seq(&model, C, DType::kFp16);
    if (!seq.Extend({w.tokens.data(), C}).ok()) std::exit(2);
    w.prefix = seq.ToKvDump(DType::kFp16, C);
    double b, kl;
    Score(model, &w, w.prefix, true, &b, &kl);
    scored += w.tokens.size() - C;
    ref_bits += w.ref_bits;
  }
  std::printf(
      "# heldout_bench: model %s (%u layers, %u KV heads, head_dim %u), %zu held-out windows from "
      "%zu documents (at most %zu per document; %zu documents skipped as named in the train split, "
      "%zu shorter than %zu "
      "tokens) of %zu tokens: context %zu (%zu blocks of %u), %zu scored tokens; reference NLL "
      "%.4f bits/token; kvtc and the learned state (%s) fitted on the context KV of %zu train "
      "documents\n\n",
      model.model_id().c_str(), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim(), windows.size(),
      docs, per_doc, skipped_name, skipped_short, W, W, C, C / T, T, scored, ref_bits / scored,
      state ? state->Describe().c_str() : "none", kvtc_docs);
  std::printf(
      "| setting | bits/component | ratio vs fp16 | rel RMS K | rel RMS V | worst plane | NLL "
      "bits/token | ΔNLL %% | s.e. %% | KL bits/token | s.e. |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);
  std::FILE* out = csv.empty() ? nullptr : std::fopen(csv.c_str(), "w");
  if (out) {
    std::fprintf(out,
                 "model,setting,target,bits_per_component,ratio,rel_k,rel_v,worst_plane,nll,"
                 "delta_nll_pct,se_pct,kl_bits,kl_se\n");
  }
  std::map<std::string, Row> rows;
  for (Setting s : settings) {
    if (!s.tq_ref.empty()) {
      auto it = rows.find(s.tq_ref);
      if (it == rows.end()) {
        std::fprintf(stderr, "%s needs %s earlier in --settings\n", s.name.c_str(),
                     s.tq_ref.c_str());
        return 1;
      }
      s.options.target_rel_rms = std::min(it->second.rel_k, it->second.rel_v);
    }
    const Row r = Run(model, g, windows, s, scored, kvtc.get(), state.get());
    if (!r.error.empty()) {
      std::printf("| %s | encode failed: %s |\n", s.name.c_str(), r.error.c_str());
      std::fflush(stdout);
      continue;
    }
    char label[96];
    if (!s.tq_ref.empty()) {
      std::snprintf(label, sizeof(label), "%s (%.4f)", s.name.c_str(), s.options.target_rel_rms);
    } else {
      std::snprintf(label, sizeof(label), "%s", s.name.c_str());
    }
    std::printf(
        "| %s | %.3f | %.2fx | %.4f | %.4f | %.4f (%s) | %.4f | %+.3f | %.3f | %.5f | %.5f |\n",
        label, r.bpc, 16.0 / r.bpc, r.rel_k, r.rel_v, r.worst_plane, r.worst_plane_name.c_str(),
        r.nll, r.delta_pct, r.se_pct, r.kl, r.kl_se);
    std::fflush(stdout);
    if (out) {
      std::fprintf(out, "%s,%s,%.5f,%.5f,%.4f,%.5f,%.5f,%.5f,%.5f,%.5f,%.5f,%.6f,%.6f\n",
                   model.model_id().c_str(), s.name.c_str(), s.options.target_rel_rms, r.bpc,
                   16.0 / r.bpc, r.rel_k, r.rel_v, r.worst_plane, r.nll, r.delta_pct, r.se_pct,
                   r.kl, r.kl_se);
      std::fflush(out);
    }
    rows[s.name] = r;
  }
  if (out) std::fclose(out);

  // The sensitivity gate (bench/model.md): KL and ΔNLL rise through turboquant 4 -> 3 -> 2 and
  // from int8 to kivi2, each step by more than 2 s.e. of the paired per-window difference.
  const std::pair<const char*, const char*> steps[] = {
      {"turboquant/4", "turboquant/3"}, {"turboquant/3", "turboquant/2"}, {"int8", "kivi2"}};
  bool any = false, pass = true;
  for (const auto& [a, b] : steps) {
    if (!rows.count(a) || !rows.count(b)) continue;
    if (!any) {
      std::printf(
          "\nSensitivity (paired per-document differences, later minus earlier; separated = "
          "difference > 2 s.e.):\n\n| step | ΔKL bits/token | s.e. | separated | Δ(ΔNLL %%) | "
          "s.e. | separated |\n|---|---|---|---|---|---|---|\n");
    }
    any = true;
    double dk, sk, dn, sn;
    Paired(rows[a].win_kl, rows[b].win_kl, &dk, &sk);
    Paired(rows[a].win_delta_pct, rows[b].win_delta_pct, &dn, &sn);
    const bool ok_k = dk > 2 * sk, ok_n = dn > 2 * sn;
    pass = pass && ok_k && ok_n;
    std::printf("| %s -> %s | %+.5f | %.5f | %s | %+.3f | %.3f | %s |\n", a, b, dk, sk,
                ok_k ? "yes" : "NO", dn, sn, ok_n ? "yes" : "NO");
  }
  if (any) std::printf("\nSensitivity gate: %s\n", pass ? "MET" : "NOT MET");
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) { return kvtrie::Main(argc, argv); }
