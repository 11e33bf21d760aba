#include "codec/residual_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "codec/rans.h"
#include "codec/rotation.h"

namespace kvtrie {
namespace internal {
namespace {

constexpr uint8_t kParamsVersion = 1;
constexpr uint8_t kFlagRotated = 1;
constexpr uint8_t kFlagTokenScales = 2;
constexpr uint8_t kKnownFlags = kFlagRotated | kFlagTokenScales;
constexpr int32_t kMaxQ = 32767;   // keeps the escape code within 15 bits of exponent
constexpr int kMaxScaleCode = 12;  // token scale 2^(-code/4), code in [-12, 12]
constexpr int kNumContexts = 24;
// q = sign(u) * floor(|u| + kRounding): 0.5 is plain rounding. A dead zone (0.4) was measured on
// tests/data: -2.5% bits at e = 0.17, +0.7% at e = 0.05; not worth a knob yet.
constexpr float kRounding = 0.5f;

// ---- layout helpers -------------------------------------------------------------------------

struct Dims {
  size_t L, H, T, D;
  explicit Dims(const BlockGeometry& g)
      : L(g.num_layers), H(g.num_kv_heads), T(g.block_tokens), D(g.head_dim) {}
  size_t head_elems() const { return T * D; }
  size_t plane_elems() const { return H * T * D; }
  // Offset of (layer, kv, head) in block layout.
  size_t head(size_t l, size_t kv, size_t h) const { return ((l * 2 + kv) * H + h) * T * D; }
  size_t num_heads() const { return L * 2 * H; }
};

float Bf16Round(float f) { return Bf16ToFloat(FloatToBf16(f)); }
float TokenScale(int code) { return std::exp2(-static_cast<float>(code) / 4.0f); }

bool NeedsSide(Predictor p) { return p != Predictor::kNone && p != Predictor::kTemporal; }

// The prediction of element (t, d) of a head. `side`: channel means (kChannelMean), the parent's
// last token (kParent), or the head of the reference / external block (kCentroid, kExternal).
inline float Predict(Predictor p, const float* side, const float* rec, size_t t, size_t d,
                     size_t D) {
  switch (p) {
    case Predictor::kNone:
      return 0.0f;
    case Predictor::kChannelMean:
      return side[d];
    case Predictor::kTemporal:
      return t ? rec[(t - 1) * D + d] : 0.0f;
    case Predictor::kParent:
      return t ? rec[(t - 1) * D + d] : side[d];
    case Predictor::kCentroid:
    case Predictor::kExternal:
      return side[t * D + d];
  }
  return 0.0f;
}

// x' = prediction + q * step, the one reconstruction rule of encoder and decoder (the codec is
// built with -ffp-contract=off, so this is never fused into an FMA and both sides agree bit for
// bit).
inline float Reconstruct(float pred, int32_t q, float step) {
  return pred + static_cast<float>(q) * step;
}

// Closed-loop quantization of one head. Returns the squared error (in the coded domain).
double QuantizeHead(const float* x, const Dims& n, Predictor p, const float* side,
                    const float* step, int32_t* q, float* rec) {
  double sse = 0;
  for (size_t t = 0; t < n.T; ++t) {
    const float inv = 1.0f / step[t];
    for (size_t d = 0; d < n.D; ++d) {
      const size_t i = t * n.D + d;
      const float pred = Predict(p, side, rec, t, d, n.D);
      const float u = (x[i] - pred) * inv;
      float r = std::copysign(std::floor(std::fabs(u) + kRounding), u);
      r = std::clamp(r, static_cast<float>(-kMaxQ), static_cast<float>(kMaxQ));
      q[i] = static_cast<int32_t>(r);
      rec[i] = Reconstruct(pred, q[i], step[t]);
      const double e = static_cast<double>(x[i]) - rec[i];
      sse += e * e;
    }
  }
  return sse;
}

void ReconstructHead(const int32_t* q, const Dims& n, Predictor p, const float* side,
                     const float* step, float* rec) {
  for (size_t t = 0; t < n.T; ++t) {
    for (size_t d = 0; d < n.D; ++d) {
      const size_t i = t * n.D + d;
      rec[i] = Reconstruct(Predict(p, side, rec, t, d, n.D), q[i], step[t]);
    }
  }
}

// Estimated bits of a head's residuals: zeroth-order entropy of the coder's symbols plus escapes.
double EstimateBits(const int32_t* q, size_t count) {
  uint32_t hist[16] = {};
  double extra = 0;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t z = ZigZag(q[i]);
    if (z < 15) {
      ++hist[z];
    } else {
      ++hist[15];
      extra += 2.0 * std::floor(std::log2(static_cast<double>(z - 14))) + 1.0;
    }
  }
  double bits = extra;
  for (uint32_t c : hist) {
    if (c) bits += c * std::log2(static_cast<double>(count) / c);
  }
  return bits;
}

inline int ContextOf(size_t kv, const int32_t* q, size_t t, size_t d, size_t D) {
  const int a = t ? std::min(std::abs(q[(t - 1) * D + d]), 3) : 0;
  const int b = d ? std::min(std::abs(q[t * D + d - 1]), 2) : 0;
  return static_cast<int>(kv) * 12 + a * 3 + b;
}

// Context blocks as floats in the coded (possibly rotated) domain.
struct Sources {
  std::vector<float> parent, reference, external;
};

absl::Status LoadSource(const BlockGeometry& g, absl::Span<const uint8_t> span, const char* name,
                        const RandomizedHadamard* rot, std::vector<float>* out) {
  if (span.empty()) return absl::OkStatus();
  if (span.size() != g.num_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("context.", name, ": expected ", g.num_bytes(), " bytes, got ", span.size()));
  }
  out->resize(g.num_elements());
  ToFloat(g.dtype, span.data(), out->size(), out->data());
  if (rot) {
    for (size_t i = 0; i < out->size(); i += g.head_dim) rot->Forward(out->data() + i);
  }
  return absl::OkStatus();
}

// Side input of a head for predictor p, or nullptr when the context lacks it.
const float* SideOf(Predictor p, const Sources& s, const Dims& n, size_t off, const float* means) {
  switch (p) {
    case Predictor::kChannelMean:
      return means;
    case Predictor::kParent:
      // The parent's last token, same (layer, kv, head).
      return s.parent.empty() ? nullptr : s.parent.data() + off + (n.T - 1) * n.D;
    case Predictor::kCentroid:
      return s.reference.empty() ? nullptr : s.reference.data() + off;
    case Predictor::kExternal:
      return s.external.empty() ? nullptr : s.external.data() + off;
    default:
      return nullptr;
  }
}

// ---- encoder --------------------------------------------------------------------------------

// One (layer, K/V) plane being coded.
class PlaneCoder {
 public:
  PlaneCoder(const Dims& n, size_t l, size_t kv, const float* x, const Sources& src,
             uint32_t allowed, const float* token_scale)
      : n_(n), l_(l), kv_(kv), x_(x), src_(src), token_scale_(token_scale) {
    choice_.assign(n.H, Predictor::kNone);
    means_.assign(n.H * n.D, 0.0f);
    for (size_t h = 0; h < n.H; ++h) {
      const float* xh = x + h * n.head_elems();
      for (size_t d = 0; d < n.D; ++d) {
        double s = 0;
        for (size_t t = 0; t < n.T; ++t) s += xh[t * n.D + d];
        means_[h * n.D + d] = HalfToFloat(FloatToHalf(static_cast<float>(s / n.T)));
      }
      std::vector<Predictor> c;
      for (int p = 0; p < kNumPredictors; ++p) {
        const Predictor pred = static_cast<Predictor>(p);
        if (!(allowed & (1u << p))) continue;
        if (NeedsSide(pred) && Side(pred, h) == nullptr) continue;
        c.push_back(pred);
      }
      if (c.empty()) c.push_back(Predictor::kNone);
      candidates_.push_back(std::move(c));
    }
    q_.resize(n.plane_elems());
    rec_.resize(n.plane_elems());
    step_.resize(n.T);
  }

  // Quantizes every head with the current choices at `delta`; returns the squared error.
  double Evaluate(float delta) {
    SetStep(delta);
    double sse = 0;
    for (size_t h = 0; h < n_.H; ++h) sse += QuantizeOne(h, choice_[h]);
    return sse;
  }

  // Picks, per head, the candidate with the fewest estimated bits at `delta`; returns the error.
  double Choose(float delta) {
    SetStep(delta);
    std::vector<int32_t> best_q(n_.head_elems());
    std::vector<float> best_rec(n_.head_elems());
    double sse = 0;
    for (size_t h = 0; h < n_.H; ++h) {
      double best_bits = INFINITY, best_sse = 0;
      for (Predictor p : candidates_[h]) {
        const double e = QuantizeOne(h, p);
        double bits = EstimateBits(q_.data() + h * n_.head_elems(), n_.head_elems());
        if (p == Predictor::kChannelMean) bits += 16.0 * n_.D;
        if (bits < best_bits) {
          best_bits = bits;
          best_sse = e;
          choice_[h] = p;
          std::copy_n(q_.data() + h * n_.head_elems(), n_.head_elems(), best_q.data());
          std::copy_n(rec_.data() + h * n_.head_elems(), n_.head_elems(), best_rec.data());
        }
      }
      std::copy_n(best_q.data(), n_.head_elems(), q_.data() + h * n_.head_elems());
      std::copy_n(best_rec.data(), n_.head_elems(), rec_.data() + h * n_.head_elems());
      sse += best_sse;
    }
    return sse;
  }

  const std::vector<Predictor>& choice() const { return choice_; }
  void set_choice(const std::vector<Predictor>& c) { choice_ = c; }
  const int32_t* q() const { return q_.data(); }
  const float* rec() const { return rec_.data(); }
  const float* means(size_t h) const { return means_.data() + h * n_.D; }

 private:
  const float* Side(Predictor p, size_t h) const {
    return SideOf(p, src_, n_, n_.head(l_, kv_, h), means_.data() + h * n_.D);
  }
  void SetStep(float delta) {
    for (size_t t = 0; t < n_.T; ++t) step_[t] = delta * token_scale_[t];
  }
  double QuantizeOne(size_t h, Predictor p) {
    const size_t o = h * n_.head_elems();
    return QuantizeHead(x_ + o, n_, p, Side(p, h), step_.data(), q_.data() + o, rec_.data() + o);
  }

  const Dims n_;
  const size_t l_, kv_;
  const float* x_;
  const Sources& src_;
  const float* token_scale_;
  std::vector<std::vector<Predictor>> candidates_;
  std::vector<Predictor> choice_;
  std::vector<float> means_;
  std::vector<int32_t> q_;
  std::vector<float> rec_;
  std::vector<float> step_;
};

// Squared error of `rec` (coded domain) against `orig` (original domain) after inverse rotation
// and rounding to the dtype — what the caller will see.
double DecodedError(const BlockGeometry& g, const Dims& n, const float* orig, const float* rec,
                    const RandomizedHadamard* rot) {
  std::vector<float> v(n.plane_elems());
  std::copy_n(rec, v.size(), v.data());
  if (rot) {
    for (size_t i = 0; i < v.size(); i += n.D) rot->Inverse(v.data() + i);
  }
  std::vector<uint8_t> bytes(v.size() * DTypeBytes(g.dtype));
  FromFloat(g.dtype, v.data(), v.size(), bytes.data());
  ToFloat(g.dtype, bytes.data(), v.size(), v.data());
  double sse = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double e = static_cast<double>(orig[i]) - v[i];
    sse += e * e;
  }
  return sse;
}

template <typename T>
void PutLE(std::string* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Encodes at one error target. `bits_out`: the size of params + payload in bits.
absl::Status EncodeAt(const BlockGeometry& g, const float* x_orig, const float* x, double target,
                      const EncodeOptions& o, const Sources& src, const RandomizedHadamard* rot,
                      const std::vector<int8_t>& scale_codes, LossyOutput* out) {
  const Dims n(g);
  std::vector<float> token_scale(n.T);
  for (size_t t = 0; t < n.T; ++t)
    token_scale[t] = TokenScale(scale_codes.empty() ? 0 : scale_codes[t]);
  std::vector<float> steps(n.L * 2);
  std::vector<Predictor> choices(n.num_heads());
  std::vector<float> means(n.num_heads() * n.D);
  std::vector<int32_t> q(g.num_elements());
  out->recon.assign(g.num_elements(), 0.0f);

  for (size_t l = 0; l < n.L; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      const size_t off = n.head(l, kv, 0);
      const float* xp = x + off;
      double energy = 0, max_abs = 0;
      for (size_t i = 0; i < n.plane_elems(); ++i) {
        energy += static_cast<double>(xp[i]) * xp[i];
        max_abs = std::max(max_abs, static_cast<double>(std::fabs(xp[i])));
      }
      PlaneCoder pc(n, l, kv, xp, src, o.predictors, token_scale.data());
      const double target_sse = target * target * energy;
      // Smallest step: keeps |q| within kMaxQ for any sane prediction.
      const float min_step = std::max(static_cast<float>(4.0 * max_abs / kMaxQ), 1e-30f);
      float delta = Bf16Round(std::max(
          static_cast<float>(target * std::sqrt(12.0 * energy / n.plane_elems())), min_step));
      if (energy == 0) delta = 1.0f;
      double sse = pc.Choose(delta);
      // Search the largest bf16 step meeting the target: expand / shrink by the high-rate rule
      // sse ~ step^2, then bisect (geometrically) between the last passing and failing steps.
      float lo = 0, hi = INFINITY;
      for (int it = 0; it < 12 && energy > 0; ++it) {
        if (sse <= target_sse) {
          lo = delta;
        } else {
          hi = delta;
        }
        float next;
        const double ratio = sse > 0 ? std::sqrt(target_sse / sse) : 4.0;
        if (hi == INFINITY) {
          next = delta * static_cast<float>(std::clamp(ratio, 1.02, 4.0));
        } else if (lo == 0) {
          next = delta * static_cast<float>(std::clamp(ratio, 0.25, 0.98));
        } else {
          next = std::sqrt(lo * hi);
        }
        next = Bf16Round(std::max(next, min_step));
        if (next == lo || next == hi || next == delta) break;
        delta = next;
        sse = pc.Evaluate(delta);
      }
      if (energy > 0) {
        if (lo == 0) lo = min_step;  // cannot do better than the finest step
        delta = lo;
        const std::vector<Predictor> kept = pc.choice();
        sse = pc.Choose(delta);
        if (sse > target_sse) {
          pc.set_choice(kept);
          sse = pc.Evaluate(delta);
        }
        // The dtype rounding of the output adds a little error: shrink until the decoded block
        // meets the target.
        for (int it = 0; it < 24 && delta > min_step &&
                         DecodedError(g, n, x_orig + off, pc.rec(), rot) > target_sse;
             ++it) {
          delta = Bf16Round(std::max(delta * 0.97f, min_step));
          pc.Evaluate(delta);
        }
      } else {
        pc.Evaluate(delta);
      }
      steps[l * 2 + kv] = delta;
      for (size_t h = 0; h < n.H; ++h) {
        const Predictor p = pc.choice()[h];
        choices[(l * 2 + kv) * n.H + h] = p;
        ++out->predictor_count[kv][static_cast<int>(p)];
        std::copy_n(pc.means(h), n.D, means.data() + ((l * 2 + kv) * n.H + h) * n.D);
      }
      std::copy_n(pc.q(), n.plane_elems(), q.data() + off);
      std::copy_n(pc.rec(), n.plane_elems(), out->recon.data() + off);
    }
  }

  // What the decoder returns, in the original domain.
  if (rot) {
    for (size_t i = 0; i < out->recon.size(); i += n.D) rot->Inverse(out->recon.data() + i);
  }

  // Params.
  std::string& p = out->params;
  p.clear();
  p.push_back(static_cast<char>(kParamsVersion));
  p.push_back(
      static_cast<char>((rot ? kFlagRotated : 0) | (scale_codes.empty() ? 0 : kFlagTokenScales)));
  if (rot) PutLE<uint32_t>(&p, o.rotation_seed);
  for (int8_t c : scale_codes) p.push_back(static_cast<char>(c));
  for (float s : steps) PutLE<uint16_t>(&p, FloatToBf16(s));
  for (size_t i = 0; i < choices.size(); i += 2) {
    const uint8_t lo = static_cast<uint8_t>(choices[i]);
    const uint8_t hi = i + 1 < choices.size() ? static_cast<uint8_t>(choices[i + 1]) : 0;
    p.push_back(static_cast<char>(lo | (hi << 4)));
  }
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] != Predictor::kChannelMean) continue;
    for (size_t d = 0; d < n.D; ++d) PutLE<uint16_t>(&p, FloatToHalf(means[i * n.D + d]));
  }

  // Payload.
  std::vector<AdaptiveModel> models(kNumContexts), escapes(2, AdaptiveModel(0.7));
  RansEncoder enc;
  for (size_t l = 0; l < n.L; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t h = 0; h < n.H; ++h) {
        const int32_t* qh = q.data() + n.head(l, kv, h);
        for (size_t t = 0; t < n.T; ++t) {
          for (size_t d = 0; d < n.D; ++d) {
            PutInt(enc, models[ContextOf(kv, qh, t, d, n.D)], escapes[kv], qh[t * n.D + d]);
          }
        }
      }
    }
  }
  out->payload.clear();
  enc.Finish(&out->payload);
  return absl::OkStatus();
}

std::vector<int8_t> SurprisalScaleCodes(const Dims& n, const EncodeOptions& o,
                                        const PredictionContext& c) {
  if (o.surprisal_step_strength <= 0 || c.surprisal_bits.size() != n.T) return {};
  double mean = 0;
  for (float s : c.surprisal_bits) mean += std::max(0.0f, s);
  mean /= n.T;
  std::vector<int8_t> codes(n.T);
  for (size_t t = 0; t < n.T; ++t) {
    const double s = std::max(0.0f, c.surprisal_bits[t]);
    const double code = 4.0 * o.surprisal_step_strength * std::log2((s + 1.0) / (mean + 1.0));
    codes[t] = static_cast<int8_t>(std::clamp(std::lround(code), static_cast<long>(-kMaxScaleCode),
                                              static_cast<long>(kMaxScaleCode)));
  }
  return codes;
}

}  // namespace

absl::Status EncodeResidual(const BlockGeometry& g, const float* x, const EncodeOptions& o,
                            const PredictionContext& c, LossyOutput* out) {
  const bool has_target = o.target_rel_rms > 0 && std::isfinite(o.target_rel_rms);
  const bool has_budget =
      o.target_bits_per_component > 0 && std::isfinite(o.target_bits_per_component);
  if (!has_target && !has_budget) {
    return absl::InvalidArgumentError(
        "target_rel_rms: residual encoding needs target_rel_rms > 0 or target_bits_per_component > "
        "0");
  }
  const Dims n(g);
  std::optional<RandomizedHadamard> rot;
  if (o.rotate) {
    if (!IsRotatableDim(n.D)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rotate: head_dim ", n.D, " is not a power of two"));
    }
    rot.emplace(n.D, o.rotation_seed);
  }
  const RandomizedHadamard* r = rot ? &*rot : nullptr;
  Sources src;
  if (auto s = LoadSource(g, c.parent, "parent", r, &src.parent); !s.ok()) return s;
  if (auto s = LoadSource(g, c.reference, "reference", r, &src.reference); !s.ok()) return s;
  if (auto s = LoadSource(g, c.external, "external", r, &src.external); !s.ok()) return s;
  std::vector<float> xr;
  const float* xc = x;
  if (r) {
    xr.assign(x, x + g.num_elements());
    for (size_t i = 0; i < xr.size(); i += n.D) r->Forward(xr.data() + i);
    xc = xr.data();
  }
  const std::vector<int8_t> codes = SurprisalScaleCodes(n, o, c);
  if (!has_budget) return EncodeAt(g, x, xc, o.target_rel_rms, o, src, r, codes, out);

  // Bits budget: bisect (in log space) the smallest error target whose block fits the budget;
  // the envelope adds 36 bytes (24 header + 3 lengths/CRC x 4).
  const double budget_bits = o.target_bits_per_component * g.num_elements();
  auto fits = [&](double target, LossyOutput* o_out) {
    *o_out = LossyOutput();
    (void)EncodeAt(g, x, xc, target, o, src, r, codes, o_out);
    return 8.0 * (o_out->params.size() + o_out->payload.size() + 36) <= budget_bits;
  };
  double lo = 1e-4, hi = 1.0;  // log-bisection bounds on the target
  LossyOutput best;
  if (!fits(hi, &best)) {
    // Even a 100% error does not fit: use the coarsest target.
  } else {
    for (int it = 0; it < 10; ++it) {
      const double mid = std::sqrt(lo * hi);
      LossyOutput trial;
      if (fits(mid, &trial)) {
        hi = mid;
        best = std::move(trial);
      } else {
        lo = mid;
      }
    }
  }
  if (has_target && o.target_rel_rms > hi) {
    return EncodeAt(g, x, xc, o.target_rel_rms, o, src, r, codes, out);
  }
  *out = std::move(best);
  return absl::OkStatus();
}

// ---- decoder --------------------------------------------------------------------------------

absl::Status DecodeResidual(const BlockGeometry& g, absl::string_view params,
                            absl::string_view payload, const PredictionContext& c, float* out) {
  const Dims n(g);
  size_t pos = 0;
  auto need = [&](size_t k) { return params.size() - pos >= k; };
  auto u16 = [&]() {
    const uint16_t v =
        static_cast<uint8_t>(params[pos]) | (static_cast<uint8_t>(params[pos + 1]) << 8);
    pos += 2;
    return v;
  };
  if (!need(2) || static_cast<uint8_t>(params[0]) != kParamsVersion) {
    return absl::DataLossError("residual params: bad version");
  }
  const uint8_t flags = static_cast<uint8_t>(params[1]);
  pos = 2;
  if (flags & ~kKnownFlags) return absl::DataLossError("residual params: unknown flags");
  std::optional<RandomizedHadamard> rot;
  if (flags & kFlagRotated) {
    if (!need(4)) return absl::DataLossError("residual params: truncated seed");
    uint32_t seed = 0;
    for (int i = 0; i < 4; ++i)
      seed |= static_cast<uint32_t>(static_cast<uint8_t>(params[pos + i])) << (8 * i);
    pos += 4;
    if (!IsRotatableDim(n.D))
      return absl::DataLossError("residual params: rotated non-power-of-2 head_dim");
    rot.emplace(n.D, seed);
  }
  std::vector<float> token_scale(n.T, 1.0f);
  if (flags & kFlagTokenScales) {
    if (!need(n.T)) return absl::DataLossError("residual params: truncated token scales");
    for (size_t t = 0; t < n.T; ++t) {
      const int code = static_cast<int8_t>(params[pos++]);
      if (code < -kMaxScaleCode || code > kMaxScaleCode) {
        return absl::DataLossError("residual params: token scale out of range");
      }
      token_scale[t] = TokenScale(code);
    }
  }
  if (!need(4 * n.L)) return absl::DataLossError("residual params: truncated steps");
  std::vector<float> steps(n.L * 2);
  for (float& s : steps) {
    s = Bf16ToFloat(u16());
    if (!(s > 0) || !std::isfinite(s)) return absl::DataLossError("residual params: bad step");
  }
  const size_t nh = n.num_heads();
  if (!need((nh + 1) / 2)) return absl::DataLossError("residual params: truncated predictors");
  std::vector<Predictor> choices(nh);
  bool uses[kNumPredictors] = {};
  for (size_t i = 0; i < nh; ++i) {
    const uint8_t b = static_cast<uint8_t>(params[pos + i / 2]);
    const uint8_t v = (i % 2) ? (b >> 4) : (b & 15);
    if (v >= kNumPredictors) return absl::DataLossError("residual params: unknown predictor");
    choices[i] = static_cast<Predictor>(v);
    uses[v] = true;
  }
  pos += (nh + 1) / 2;
  std::vector<float> means(nh * n.D);
  for (size_t i = 0; i < nh; ++i) {
    if (choices[i] != Predictor::kChannelMean) continue;
    if (!need(2 * n.D)) return absl::DataLossError("residual params: truncated channel means");
    for (size_t d = 0; d < n.D; ++d) means[i * n.D + d] = HalfToFloat(u16());
  }
  if (pos != params.size()) return absl::DataLossError("residual params: trailing bytes");

  const RandomizedHadamard* r = rot ? &*rot : nullptr;
  Sources src;
  struct Need {
    int predictor;
    absl::Span<const uint8_t> span;
    const char* name;
    std::vector<float>* dst;
  };
  for (const Need& nd :
       {Need{3, c.parent, "parent", &src.parent}, Need{4, c.reference, "reference", &src.reference},
        Need{5, c.external, "external", &src.external}}) {
    if (!uses[nd.predictor]) continue;
    if (nd.span.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "context.", nd.name, ": the block was coded against a ", nd.name, " prediction (",
          PredictorName(static_cast<Predictor>(nd.predictor)), ") that was not supplied"));
    }
    if (auto s = LoadSource(g, nd.span, nd.name, r, nd.dst); !s.ok()) return s;
  }

  std::vector<int32_t> q(g.num_elements());
  std::vector<AdaptiveModel> models(kNumContexts), escapes(2, AdaptiveModel(0.7));
  RansDecoder dec(payload);
  for (size_t l = 0; l < n.L; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t h = 0; h < n.H; ++h) {
        int32_t* qh = q.data() + n.head(l, kv, h);
        for (size_t t = 0; t < n.T; ++t) {
          for (size_t d = 0; d < n.D; ++d) {
            GetInt(dec, models[ContextOf(kv, qh, t, d, n.D)], escapes[kv], &qh[t * n.D + d]);
          }
        }
      }
    }
  }
  if (auto s = dec.Finish(); !s.ok()) return s;
  std::vector<float> step(n.T);
  for (size_t l = 0; l < n.L; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t t = 0; t < n.T; ++t) step[t] = steps[l * 2 + kv] * token_scale[t];
      for (size_t h = 0; h < n.H; ++h) {
        const size_t i = (l * 2 + kv) * n.H + h;
        const size_t off = n.head(l, kv, h);
        const float* side = SideOf(choices[i], src, n, off, means.data() + i * n.D);
        ReconstructHead(q.data() + off, n, choices[i], side, step.data(), out + off);
      }
    }
  }
  if (r) {
    for (size_t i = 0; i < g.num_elements(); i += n.D) r->Inverse(out + i);
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvtrie
