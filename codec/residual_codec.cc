#include "codec/residual_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "codec/rans.h"
#include "codec/rotation.h"

namespace kvtrie {
namespace internal {
namespace {

constexpr uint8_t kParamsVersion = 1;
constexpr uint8_t kFlagRotated = 1;
constexpr uint8_t kFlagTokenScales = 2;
constexpr uint8_t kFlagRope = 4;
constexpr uint8_t kKnownFlags = kFlagRotated | kFlagTokenScales | kFlagRope;
// Rounding offset of the quantizer at coarse targets: q = sign(u) * round(max(|u| - offset, 0)),
// a dead zone that trades a little error for many more zeros; the step search then takes a
// slightly finer step. Measured on tests/data at the TurboQuant 3-bit error (0.17): -3.3% bits;
// at 0.1: -0.6%; at 0.05: +0.5%, hence only for targets >= kDeadZoneFrom.
constexpr float kDeadZoneOffset = 0.1f;
constexpr double kDeadZoneFrom = 0.1;
// RoPE bases the encoder tries for the key predictor (Llama 1/2 and Llama 3).
constexpr double kRopeBases[] = {10000.0, 500000.0};
constexpr int32_t kMaxQ = 32767;   // keeps the escape code within 15 bits of exponent
constexpr int kMaxScaleCode = 12;  // token scale 2^(-code/4), code in [-12, 12]
constexpr int kNumContexts = 24;

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

// x' = prediction + q * step, the one reconstruction rule of encoder and decoder (the codec is
// built with -ffp-contract=off, so this is never fused into an FMA and both sides agree bit for
// bit).
inline float Reconstruct(float pred, int32_t q, float step) {
  return pred + static_cast<float>(q) * step;
}

// Rounds to the nearest integer (ties to even) for |u| <= 2^22, without a libm call.
inline float RoundHalfEven(float u) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (u + kMagic) - kMagic;
}

// ---- RoPE-aware key prediction ----------------------------------------------------------------
// Keys are stored after RoPE, which turns channel pair (2i, 2i + 1) by theta_i = base^(-2i / D)
// radians per token (theta_0 = 1 rad: plain temporal prediction of that pair is worse than none).
// Rotating the previous token's reconstruction by theta_i first predicts the pair as if its
// pre-RoPE key were constant. The cos / sin table is computed from log(base) (a float in params)
// with +, *, / only (no libm), so encoder and decoder agree bit for bit on any IEEE machine.

double DetExp(double y) {  // e^y for |y| <= ~40: Taylor series of e^(y / 2^12), squared 12 times
  const double z = y / 4096.0;
  double term = 1, sum = 1;
  for (int k = 1; k < 12; ++k) sum += term *= z / k;
  for (int k = 0; k < 12; ++k) sum *= sum;
  return sum;
}

void DetCosSin(double a, double* c, double* s) {  // |a| <= 1: Taylor series
  double term = 1, cs = 1, sn = 0;
  for (int k = 1; k < 24; ++k) {
    term *= a / k;
    switch (k % 4) {
      case 1:
        sn += term;
        break;
      case 2:
        cs -= term;
        break;
      case 3:
        sn -= term;
        break;
      default:
        cs += term;
        break;
    }
  }
  *c = cs;
  *s = sn;
}

// Per-lane factors of the turn, 2 * D floats: cos[] = {c_0, c_0, c_1, c_1, ...} then
// sin[] = {-s_0, s_0, -s_1, s_1, ...}, with c_i, s_i = cos, sin theta_i (an odd last channel:
// 1, 0).
std::vector<float> RopeTable(size_t D, float log_base) {
  std::vector<float> t(2 * D, 0.0f);
  for (size_t d = 0; d < D; ++d) t[d] = 1.0f;
  for (size_t i = 0; i < D / 2; ++i) {
    double c, s;
    DetCosSin(DetExp(-2.0 * static_cast<double>(i) / static_cast<double>(D) * log_base), &c, &s);
    t[2 * i] = t[2 * i + 1] = static_cast<float>(c);
    t[D + 2 * i] = -static_cast<float>(s);
    t[D + 2 * i + 1] = static_cast<float>(s);
  }
  return t;
}

// dst = `src` with each channel pair (a, b) turned by the angles of `rope` (RopeTable):
// (c a + (-s) b, c b + s a) — the same IEEE operations in the SSE and scalar paths.
inline void RopeStep(const float* rope, size_t D, const float* src, float* dst) {
  const float* cs = rope;
  const float* sn = rope + D;
  size_t d = 0;
#if defined(__SSE2__)
  for (; d + 4 <= D; d += 4) {
    const __m128 v = _mm_loadu_ps(src + d);
    const __m128 swapped = _mm_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1));
    _mm_storeu_ps(dst + d, _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(cs + d), v),
                                      _mm_mul_ps(_mm_loadu_ps(sn + d), swapped)));
  }
#endif
  for (; d + 1 < D; d += 2) {
    const float a = src[d], b = src[d + 1];
    dst[d] = cs[d] * a + sn[d] * b;
    dst[d + 1] = cs[d + 1] * b + sn[d + 1] * a;
  }
  if (d < D) dst[d] = src[d];  // odd head_dim: the last channel is not turned
}

// The prediction row of token t of a head into `pred` (D floats). `side`: channel means
// (kChannelMean), the parent's last token (kParent), or the head of the reference / external
// block (kCentroid, kExternal); `rec`: the head's reconstruction so far.
// The prediction row of token t of a head: a pointer to D floats, either into `side` / `rec` or
// into `buf` (D floats, zero-filled by the caller, used for kNone and the RoPE-turned rows).
// `rope`: RopeTable of a key plane (temporal and parent predictors), else nullptr.
inline const float* PredictRow(Predictor p, const float* side, const float* rec, size_t t, size_t D,
                               const float* rope, const float* zeros, float* buf) {
  const float* src = zeros;
  switch (p) {
    case Predictor::kNone:
      return zeros;
    case Predictor::kChannelMean:
      return side;
    case Predictor::kTemporal:
      if (t == 0) return zeros;
      src = rec + (t - 1) * D;
      break;
    case Predictor::kParent:
      src = t ? rec + (t - 1) * D : side;
      break;
    case Predictor::kCentroid:
    case Predictor::kExternal:
      return side + t * D;
  }
  if (rope == nullptr) return src;
  RopeStep(rope, D, src, buf);
  return buf;
}

constexpr size_t kMaxRow = 256;  // head_dim rows up to this are predicted on the stack

// Closed-loop quantization of one head. Returns the squared error (in the coded domain).
// `dead_zone`: the rounding offset (0 = plain rounding).
double QuantizeHead(const float* x, const Dims& n, Predictor p, const float* side,
                    const float* rope, float dead_zone, const float* step, int32_t* q, float* rec) {
  double sse = 0;
  float small[2 * kMaxRow];
  std::vector<float> big;
  float* zeros = small;
  if (n.D > kMaxRow) {
    big.resize(2 * n.D);
    zeros = big.data();
  }
  std::fill_n(zeros, n.D, 0.0f);
  float* buf = zeros + n.D;
  constexpr float kLimit = static_cast<float>(kMaxQ);
  for (size_t t = 0; t < n.T; ++t) {
    const float st = step[t];
    const float inv = 1.0f / st;
    const float* pred = PredictRow(p, side, rec, t, n.D, rope, zeros, buf);
    const float* xt = x + t * n.D;
    int32_t* qt = q + t * n.D;
    float* rt = rec + t * n.D;
    size_t d = 0;
#if defined(__SSE2__)
    // Four lanes at a time: cvtps rounds to nearest even (the default MXCSR mode), as the
    // scalar tail does; min/max clamp (and send nan to -kLimit, like the tail).
    __m128 acc = _mm_setzero_ps();
    const __m128 vinv = _mm_set1_ps(inv), vst = _mm_set1_ps(st);
    const __m128 vhi = _mm_set1_ps(kLimit), vlo = _mm_set1_ps(-kLimit);
    const __m128 vdz = _mm_set1_ps(dead_zone), vsign = _mm_set1_ps(-0.0f);
    for (; d + 4 <= n.D; d += 4) {
      const __m128 xv = _mm_loadu_ps(xt + d), pv = _mm_loadu_ps(pred + d);
      const __m128 u = _mm_max_ps(_mm_min_ps(_mm_mul_ps(_mm_sub_ps(xv, pv), vinv), vhi), vlo);
      const __m128 mag = _mm_max_ps(_mm_sub_ps(_mm_andnot_ps(vsign, u), vdz), _mm_setzero_ps());
      const __m128i qi = _mm_cvtps_epi32(_mm_or_ps(mag, _mm_and_ps(vsign, u)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + d), qi);
      const __m128 rv = _mm_add_ps(pv, _mm_mul_ps(_mm_cvtepi32_ps(qi), vst));
      _mm_storeu_ps(rt + d, rv);
      const __m128 e = _mm_sub_ps(xv, rv);
      acc = _mm_add_ps(acc, _mm_mul_ps(e, e));
    }
    float lanes[4];
    _mm_storeu_ps(lanes, acc);
    float row_sse = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#else
    float row_sse = 0;
#endif
    for (; d < n.D; ++d) {
      float u = (xt[d] - pred[d]) * inv;
      u = u > kLimit ? kLimit : (u < -kLimit ? -kLimit : u);  // also maps nan to -kLimit
      u = std::copysign(std::max(std::fabs(u) - dead_zone, 0.0f), u);
      qt[d] = static_cast<int32_t>(RoundHalfEven(u));
      rt[d] = Reconstruct(pred[d], qt[d], st);
      const float e = xt[d] - rt[d];
      row_sse += e * e;
    }
    sse += row_sse;
  }
  return sse;
}

void ReconstructHead(const int32_t* q, const Dims& n, Predictor p, const float* side,
                     const float* rope, const float* step, float* rec) {
  float small[2 * kMaxRow];
  std::vector<float> big;
  float* zeros = small;
  if (n.D > kMaxRow) {
    big.resize(2 * n.D);
    zeros = big.data();
  }
  std::fill_n(zeros, n.D, 0.0f);
  float* buf = zeros + n.D;
  for (size_t t = 0; t < n.T; ++t) {
    const float* pred = PredictRow(p, side, rec, t, n.D, rope, zeros, buf);
    const int32_t* qt = q + t * n.D;
    float* rt = rec + t * n.D;
    const float st = step[t];
    size_t d = 0;
#if defined(__SSE2__)
    const __m128 vst = _mm_set1_ps(st);  // the same pred + q * step, four lanes at a time
    for (; d + 4 <= n.D; d += 4) {
      const __m128 qv = _mm_cvtepi32_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qt + d)));
      _mm_storeu_ps(rt + d, _mm_add_ps(_mm_loadu_ps(pred + d), _mm_mul_ps(qv, vst)));
    }
#endif
    for (; d < n.D; ++d) rt[d] = Reconstruct(pred[d], qt[d], st);
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
             uint32_t allowed, const float* token_scale, const float* rope, float dead_zone)
      : n_(n),
        l_(l),
        kv_(kv),
        x_(x),
        src_(src),
        token_scale_(token_scale),
        rope_(rope),
        dead_zone_(dead_zone) {
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
      for (Predictor p : Shortlist(h, delta)) {
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

  // The (at most) kShortlist candidates of head h with the fewest estimated bits by an open-loop
  // proxy: the previous token's original (not reconstructed) vector for temporal / parent, and
  // bits ~ (N / 2) log2(1 + 12 E / (N delta^2)) for residual energy E over N components, plus
  // 16 bits per channel mean. Only these are quantized closed loop (measured on tests/data: the
  // same bits within 0.1%, a third fewer quantization passes).
  std::vector<Predictor> Shortlist(size_t h, float delta) const {
    constexpr size_t kShortlist = 2;
    const std::vector<Predictor>& c = candidates_[h];
    if (c.size() <= kShortlist) return c;
    const float* x = x_ + h * n_.head_elems();
    const size_t D = n_.D;
    // Residual energies of every predictor in one pass: e_none, e_mean, e_step (rows t >= 1
    // from the previous row), e_first (row 0 from the parent's last row, if any).
    const float* mean = means_.data() + h * D;
    const float* parent = Side(Predictor::kParent, h);
    float e_none = 0, e_mean = 0, e_step = 0, e_row0 = 0, e_first = 0;
    float prev[kMaxRow];
    const bool small = D <= kMaxRow;
    for (size_t t = 0; t < n_.T; ++t) {
      const float* xt = x + t * D;
      if (small && (t > 0 || parent != nullptr)) {
        if (rope_) {
          RopeStep(rope_, D, t ? xt - D : parent, prev);
        } else {
          std::copy_n(t ? xt - D : parent, D, prev);
        }
      }
      for (size_t d = 0; d < D; ++d) {
        const float v = xt[d], m = v - mean[d];
        e_none += v * v;
        e_mean += m * m;
        if (t == 0) e_row0 += v * v;
        if (!small || (t == 0 && parent == nullptr)) continue;
        const float r = v - prev[d];
        (t ? e_step : e_first) += r * r;
      }
    }
    if (!small) return c;
    const double count = static_cast<double>(n_.head_elems());
    std::vector<std::pair<double, Predictor>> scored;
    for (Predictor p : c) {
      double e;
      switch (p) {
        case Predictor::kNone:
          e = e_none;
          break;
        case Predictor::kChannelMean:
          e = e_mean;
          break;
        case Predictor::kTemporal:
          e = e_step + e_row0;
          break;
        case Predictor::kParent:
          e = e_step + e_first;
          break;
        default:
          return c;  // centroid / external: quantize every candidate
      }
      const double d2 = static_cast<double>(delta) * delta;
      double bits = 0.5 * count * std::log2(1.0 + 12.0 * e / (count * d2));
      if (p == Predictor::kChannelMean) bits += 16.0 * n_.D;
      scored.push_back({bits, p});
    }
    std::stable_sort(scored.begin(), scored.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<Predictor> out;
    for (size_t i = 0; i < kShortlist; ++i) out.push_back(scored[i].second);
    return out;
  }

  // Saves / restores the quantized state (q, reconstruction, choices) of the plane.
  void Save(std::vector<int32_t>* q, std::vector<float>* rec, std::vector<Predictor>* c) const {
    *q = q_;
    *rec = rec_;
    *c = choice_;
  }
  void Restore(const std::vector<int32_t>& q, const std::vector<float>& rec,
               const std::vector<Predictor>& c) {
    q_ = q;
    rec_ = rec;
    choice_ = c;
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
    return QuantizeHead(x_ + o, n_, p, Side(p, h), rope_, dead_zone_, step_.data(), q_.data() + o,
                        rec_.data() + o);
  }

  const Dims n_;
  const size_t l_, kv_;
  const float* x_;
  const Sources& src_;
  const float* token_scale_;
  const float* rope_;
  const float dead_zone_;
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

// Finds the largest bf16 step whose decoded plane error is <= target_sse and leaves `pc` quantized
// at it. The error of an entropy-coded uniform quantizer grows like step^b (b ~ 2 at high rate,
// less once most residuals fall in the zero bin), so each pass fits b to the last two points in
// log-log space and jumps to the step predicted to land just under the target (a secant search),
// kept inside the bracket of the largest passing and smallest failing steps. Predictors are
// chosen (by their estimated bits) once, at the first step (choosing again at the second step
// saved 0.1% bits for 40% more encode time).
float SearchStep(const BlockGeometry& g, const Dims& n, PlaneCoder& pc, const float* x_orig,
                 const RandomizedHadamard* rot, double target_sse, float delta, float min_step) {
  constexpr int kMaxPasses = 8;
  constexpr double kAim = 0.995;  // aim a little under the target so the landing step passes
  // A passing step whose error is this close to the target is kept: the error is a noisy
  // function of the step at the 1% scale (closed loop, dead zone), so chasing the last bf16
  // ulp costs passes (measured: 0.99 vs none, -2% encode instructions, +0.01% bits).
  constexpr double kGoodEnough = 0.99;
  float lo = 0, hi = INFINITY;  // largest passing, smallest failing step
  std::vector<int32_t> lo_q;
  std::vector<float> lo_rec;
  std::vector<Predictor> lo_choice;
  double sse = pc.Choose(delta);
  float prev_delta = 0;
  double prev_sse = 0;
  for (int pass = 1; pass < kMaxPasses; ++pass) {
    if (sse <= target_sse) {
      if (delta > lo) {
        lo = delta;
        pc.Save(&lo_q, &lo_rec, &lo_choice);
      }
    } else {
      hi = std::min(hi, delta);
    }
    if (sse <= target_sse && sse >= kGoodEnough * target_sse) break;  // within ~1% of the step
    double b = 2.0;
    if (prev_delta > 0 && prev_delta != delta && prev_sse > 0 && sse > 0) {
      b = std::log(sse / prev_sse) / std::log(static_cast<double>(delta) / prev_delta);
      b = std::clamp(b, 0.5, 3.0);
    }
    double next = sse > 0 ? delta * std::pow(kAim * target_sse / sse, 1.0 / b) : 4.0 * delta;
    next = std::clamp(next, 0.25 * delta, 4.0 * delta);
    if (lo > 0 && hi < INFINITY) {
      if (!(next > lo && next < hi)) next = std::sqrt(static_cast<double>(lo) * hi);
    } else if (lo > 0) {
      next = std::max(next, 1.01 * lo);
    } else if (hi < INFINITY) {
      next = std::min(next, 0.99 * hi);
    }
    float nd = Bf16Round(std::max(static_cast<float>(next), min_step));
    if (nd == lo || nd == hi || nd == delta) break;
    prev_delta = delta;
    prev_sse = sse;
    delta = nd;
    sse = pc.Evaluate(delta);
  }
  if (sse <= target_sse && delta > lo) {
    lo = delta;
  } else if (lo > 0) {
    pc.Restore(lo_q, lo_rec, lo_choice);
  } else {
    // Nothing passed: shrink until the coded error meets the target or the step is the finest.
    while (delta > min_step && sse > target_sse) {
      delta = Bf16Round(std::max(delta * 0.7f, min_step));
      sse = pc.Evaluate(delta);
    }
    lo = delta;
  }
  delta = lo;
  // The dtype rounding of the output adds a little error: shrink until the decoded block meets
  // the target.
  for (int it = 0;
       it < 48 && delta > min_step && DecodedError(g, n, x_orig, pc.rec(), rot) > target_sse;
       ++it) {
    delta = Bf16Round(std::max(delta * 0.985f, min_step));
    pc.Evaluate(delta);
  }
  return delta;
}

template <typename T>
void PutLE(std::string* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Encodes at one error target. `bits_out`: the size of params + payload in bits.
absl::Status EncodeAt(const BlockGeometry& g, const float* x_orig, const float* x, double target,
                      const EncodeOptions& o, const Sources& src, const RandomizedHadamard* rot,
                      const std::vector<int8_t>& scale_codes, float rope_log_base,
                      LossyOutput* out) {
  const Dims n(g);
  std::vector<float> token_scale(n.T);
  for (size_t t = 0; t < n.T; ++t)
    token_scale[t] = TokenScale(scale_codes.empty() ? 0 : scale_codes[t]);
  std::vector<float> steps(n.L * 2);
  std::vector<Predictor> choices(n.num_heads());
  std::vector<float> means(n.num_heads() * n.D);
  std::vector<int32_t> q(g.num_elements());
  out->recon.assign(g.num_elements(), 0.0f);
  const std::vector<float> rope =
      rope_log_base > 0 ? RopeTable(n.D, rope_log_base) : std::vector<float>();
  const float dead_zone = target >= kDeadZoneFrom ? kDeadZoneOffset : 0.0f;

  for (size_t l = 0; l < n.L; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      const size_t off = n.head(l, kv, 0);
      const float* xp = x + off;
      double energy = 0, max_abs = 0;
      for (size_t i = 0; i < n.plane_elems(); ++i) {
        energy += static_cast<double>(xp[i]) * xp[i];
        max_abs = std::max(max_abs, static_cast<double>(std::fabs(xp[i])));
      }
      PlaneCoder pc(n, l, kv, xp, src, o.predictors, token_scale.data(),
                    kv == 0 && !rope.empty() ? rope.data() : nullptr, dead_zone);
      const double target_sse = target * target * energy;
      // Smallest step: keeps |q| within kMaxQ for any sane prediction.
      const float min_step = std::max(static_cast<float>(4.0 * max_abs / kMaxQ), 1e-30f);
      float delta = Bf16Round(std::max(
          static_cast<float>(target * std::sqrt(12.0 * energy / n.plane_elems())), min_step));
      if (energy == 0) delta = 1.0f;
      if (energy > 0) {
        delta = SearchStep(g, n, pc, x_orig + off, rot, target_sse, delta, min_step);
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
  p.push_back(static_cast<char>((rot ? kFlagRotated : 0) |
                                (scale_codes.empty() ? 0 : kFlagTokenScales) |
                                (rope_log_base > 0 ? kFlagRope : 0)));
  if (rot) PutLE<uint32_t>(&p, o.rotation_seed);
  if (rope_log_base > 0) {
    uint32_t bits;
    std::memcpy(&bits, &rope_log_base, 4);
    PutLE<uint32_t>(&p, bits);
  }
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
  enc.Reserve(g.num_elements() + g.num_elements() / 8);
  std::vector<uint8_t> up(n.D);
  for (size_t l = 0; l < n.L; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t h = 0; h < n.H; ++h) {
        const int32_t* qh = q.data() + n.head(l, kv, h);
        std::fill(up.begin(), up.end(), static_cast<uint8_t>(kv * 12));  // as in the decoder
        for (size_t t = 0; t < n.T; ++t) {
          const int32_t* row = qh + t * n.D;
          int left = 0;
          for (size_t d = 0; d < n.D; ++d) {
            PutInt(enc, models[up[d] + left], escapes[kv], row[d]);
            const int a = std::abs(row[d]);
            left = std::min(a, 2);
            up[d] = static_cast<uint8_t>(kv * 12 + std::min(a, 3) * 3);
          }
        }
      }
    }
  }
  out->payload.clear();
  enc.Finish(&out->payload);
  return absl::OkStatus();
}

// log(base) of the RoPE base (kRopeBases) whose rotation best predicts each key from the one
// before it (open loop, over every key plane of the block), or 0 when plain temporal prediction
// is as good (keys without RoPE, or a base not in the list).
float ChooseRope(const BlockGeometry& g, const float* x) {
  const Dims n(g);
  if (n.D < 2 || n.T < 2) return 0.0f;
  float best = 0.0f;
  double best_sse = 0;
  std::vector<float> pred(n.D);
  for (double base : {0.0, kRopeBases[0], kRopeBases[1]}) {
    const float log_base = base > 0 ? static_cast<float>(std::log(base)) : 0.0f;
    const std::vector<float> table = base > 0 ? RopeTable(n.D, log_base) : std::vector<float>();
    double sse = 0;
    for (size_t l = 0; l < n.L; ++l) {
      for (size_t h = 0; h < n.H; ++h) {
        const float* xh = x + n.head(l, 0, h);
        for (size_t t = 1; t < n.T; ++t) {
          if (table.empty()) {
            std::copy_n(xh + (t - 1) * n.D, n.D, pred.data());
          } else {
            RopeStep(table.data(), n.D, xh + (t - 1) * n.D, pred.data());
          }
          for (size_t d = 0; d < n.D; ++d) {
            const double e = static_cast<double>(xh[t * n.D + d]) - pred[d];
            sse += e * e;
          }
        }
      }
    }
    if (base == 0 || sse < 0.98 * best_sse) {
      best = log_base;
      best_sse = base == 0 ? sse : std::min(best_sse, sse);
    }
  }
  return best;
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
  const float rope = r ? 0.0f : ChooseRope(g, xc);
  if (!has_budget) return EncodeAt(g, x, xc, o.target_rel_rms, o, src, r, codes, rope, out);

  // Bits budget: bisect (in log space) the smallest error target whose block fits the budget;
  // the envelope adds 36 bytes (24 header + 3 lengths/CRC x 4).
  const double budget_bits = o.target_bits_per_component * g.num_elements();
  auto fits = [&](double target, LossyOutput* o_out) {
    *o_out = LossyOutput();
    (void)EncodeAt(g, x, xc, target, o, src, r, codes, rope, o_out);
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
    return EncodeAt(g, x, xc, o.target_rel_rms, o, src, r, codes, rope, out);
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
  std::vector<float> rope;
  if (flags & kFlagRope) {
    if (!need(4)) return absl::DataLossError("residual params: truncated RoPE base");
    uint32_t bits = 0;
    for (int i = 0; i < 4; ++i)
      bits |= static_cast<uint32_t>(static_cast<uint8_t>(params[pos + i])) << (8 * i);
    pos += 4;
    float log_base;
    std::memcpy(&log_base, &bits, 4);
    if (!(log_base > 0 && log_base <= 40) || (flags & kFlagRotated)) {
      return absl::DataLossError("residual params: bad RoPE base");
    }
    rope = RopeTable(n.D, log_base);
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

  // Entropy decoding and reconstruction, head by head. The context of q[t][d] is
  // kv * 12 + 3 * min(|q[t - 1][d]|, 3) + min(|q[t][d - 1]|, 2) (0 outside the head), kept
  // incrementally: up[d] holds the first two terms for the next row, `left` the last.
  std::vector<int32_t> qh(n.head_elems());
  std::vector<uint8_t> up(n.D);
  std::vector<float> step(n.T);
  std::vector<AdaptiveModel> models(kNumContexts), escapes(2, AdaptiveModel(0.7));
  RansDecoder dec(payload);
  for (size_t l = 0; l < n.L; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t t = 0; t < n.T; ++t) step[t] = steps[l * 2 + kv] * token_scale[t];
      AdaptiveModel* const m = models.data();
      AdaptiveModel& esc = escapes[kv];
      for (size_t h = 0; h < n.H; ++h) {
        std::fill(up.begin(), up.end(), static_cast<uint8_t>(kv * 12));
        for (size_t t = 0; t < n.T; ++t) {
          int32_t* row = qh.data() + t * n.D;
          int left = 0;
          for (size_t d = 0; d < n.D; ++d) {
            GetInt(dec, m[up[d] + left], esc, &row[d]);
            const int a = std::abs(row[d]);
            left = std::min(a, 2);
            up[d] = static_cast<uint8_t>(kv * 12 + std::min(a, 3) * 3);
          }
        }
        const size_t i = (l * 2 + kv) * n.H + h;
        const size_t off = n.head(l, kv, h);
        const float* side = SideOf(choices[i], src, n, off, means.data() + i * n.D);
        ReconstructHead(qh.data(), n, choices[i], side,
                        kv == 0 && !rope.empty() ? rope.data() : nullptr, step.data(), out + off);
      }
    }
  }
  if (auto s = dec.Finish(); !s.ok()) return s;
  if (r) {
    for (size_t i = 0; i < g.num_elements(); i += n.D) r->Inverse(out + i);
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvtrie
