#include "codec/residual_kernels.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "codec/det_math.h"
#include "codec/predictor_state.h"

namespace kvtrie {
namespace internal {
namespace residual {

float Bf16Round(float f) { return Bf16ToFloat(FloatToBf16(f)); }

float Bf16Ceil(float f) {
  float r = Bf16Round(f);
  if (r < f) {  // the next bf16 up (f > 0)
    uint32_t b;
    std::memcpy(&b, &r, 4);
    b += 0x10000;
    std::memcpy(&r, &b, 4);
  }
  return r;
}
float TokenScale(int code) { return std::exp2(-static_cast<float>(code) / 4.0f); }
float GroupScale(int code) {
  const int e = code >= 0 ? code / 2 : -((1 - code) / 2);  // floor(code / 2)
  return std::ldexp((code - 2 * e) ? 1.41421356f : 1.0f, e);
}
bool NeedsSide(Predictor p) { return p != Predictor::kNone && p != Predictor::kTemporal; }

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

// Zeros (the prediction of a row that has no context) and one row of scratch; on the stack when
// head_dim <= kMaxRow.
class RowScratch {
 public:
  explicit RowScratch(size_t d) {
    if (d > kMaxRow) {
      big_.resize(2 * d);
      zeros_ = big_.data();
    }
    std::fill_n(zeros_, d, 0.0f);
    buf_ = zeros_ + d;
  }
  RowScratch(const RowScratch&) = delete;
  RowScratch& operator=(const RowScratch&) = delete;
  const float* zeros() const { return zeros_; }
  float* buf() { return buf_; }

 private:
  float small_[2 * kMaxRow];
  std::vector<float> big_;
  float* zeros_ = small_;
  float* buf_ = nullptr;
};

double QuantizeHead(const float* x, const Dims& n, Predictor p, const float* side,
                    const float* rope, float dead_zone, const float* step, int32_t* q, float* rec,
                    const float* chan) {
  double sse = 0;
  RowScratch scratch(n.D);
  const float* zeros = scratch.zeros();
  float* buf = scratch.buf();
  constexpr float kLimit = static_cast<float>(kMaxQ);
  if (chan != nullptr) {  // a step per channel: the plain scalar loop (an encoder option only)
    for (size_t t = 0; t < n.T; ++t) {
      const float* pred = PredictRow(p, side, rec, t, n.D, rope, zeros, buf);
      for (size_t d = 0; d < n.D; ++d) {
        const size_t i = t * n.D + d;
        const float st = step[t] * chan[d];
        float u = (x[i] - pred[d]) / st;
        u = u > kLimit ? kLimit : (u < -kLimit ? -kLimit : u);  // also maps nan to -kLimit
        u = std::copysign(std::max(std::fabs(u) - dead_zone, 0.0f), u);
        q[i] = static_cast<int32_t>(RoundHalfEven(u));
        rec[i] = Reconstruct(pred[d], q[i], st);
        const double e = static_cast<double>(x[i]) - rec[i];
        sse += e * e;
      }
    }
    return sse;
  }
  float tail_sse = 0, last_step = 0, inv = 0;
#if defined(__SSE2__)
  // Four lanes at a time: cvtps rounds to nearest even (the default MXCSR mode), as the scalar
  // tail does; min/max clamp (and send nan to -kLimit, like the tail). The squared error is
  // summed in float lanes over the head (128 values for 16 x 8: ample precision for the search;
  // the target itself is checked on the decoded block in double).
  __m128 acc = _mm_setzero_ps();
  const __m128 vhi = _mm_set1_ps(kLimit), vlo = _mm_set1_ps(-kLimit);
  const __m128 vdz = _mm_set1_ps(dead_zone), vsign = _mm_set1_ps(-0.0f);
#endif
  for (size_t t = 0; t < n.T; ++t) {
    const float st = step[t];
    if (st != last_step) inv = 1.0f / st, last_step = st;
    const float* pred = PredictRow(p, side, rec, t, n.D, rope, zeros, buf);
    const float* xt = x + t * n.D;
    int32_t* qt = q + t * n.D;
    float* rt = rec + t * n.D;
    size_t d = 0;
#if defined(__SSE2__)
    const __m128 vinv = _mm_set1_ps(inv), vst = _mm_set1_ps(st);
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
#endif
    for (; d < n.D; ++d) {
      float u = (xt[d] - pred[d]) * inv;
      u = u > kLimit ? kLimit : (u < -kLimit ? -kLimit : u);  // also maps nan to -kLimit
      u = std::copysign(std::max(std::fabs(u) - dead_zone, 0.0f), u);
      qt[d] = static_cast<int32_t>(RoundHalfEven(u));
      rt[d] = Reconstruct(pred[d], qt[d], st);
      const float e = xt[d] - rt[d];
      tail_sse += e * e;
    }
  }
  sse = tail_sse;
#if defined(__SSE2__)
  float lanes[4];
  _mm_storeu_ps(lanes, acc);
  sse += static_cast<double>(lanes[0]) + lanes[1] + lanes[2] + lanes[3];
#endif
  return sse;
}

void ReconstructHead(const int32_t* q, const Dims& n, Predictor p, const float* side,
                     const float* rope, const float* step, float* rec, const float* chan) {
  RowScratch scratch(n.D);
  const float* zeros = scratch.zeros();
  float* buf = scratch.buf();
  for (size_t t = 0; t < n.T; ++t) {
    const float* pred = PredictRow(p, side, rec, t, n.D, rope, zeros, buf);
    const int32_t* qt = q + t * n.D;
    float* rt = rec + t * n.D;
    const float st = step[t];
    if (chan != nullptr) {  // a step per channel, as in QuantizeHead
      for (size_t d = 0; d < n.D; ++d) rt[d] = Reconstruct(pred[d], qt[d], st * chan[d]);
      continue;
    }
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

absl::Status LoadLastTokens(const BlockGeometry& g, absl::Span<const uint8_t> span,
                            const char* name, const RandomizedHadamard* rot,
                            std::vector<float>* out) {
  if (span.empty()) return absl::OkStatus();
  if (span.size() != g.num_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("context.", name, ": expected ", g.num_bytes(), " bytes, got ", span.size()));
  }
  const Dims n(g);
  const size_t bytes = DTypeBytes(g.dtype);
  out->resize(g.num_elements());
  for (size_t head = 0; head < n.num_heads(); ++head) {
    const size_t off = head * n.head_elems() + (n.T - 1) * n.D;
    ToFloat(g.dtype, span.data() + off * bytes, n.D, out->data() + off);
    if (rot) rot->Forward(out->data() + off);
  }
  return absl::OkStatus();
}

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
    case Predictor::kTokenMean:
      return s.learned.empty() ? nullptr : s.learned.data() + off;
    default:
      return nullptr;
  }
}

absl::Status LoadLearned(const BlockGeometry& g, const PredictionContext& c,
                         const RandomizedHadamard* rot, Sources* s) {
  s->learned.clear();
  if (c.learned == nullptr || c.tokens.size() != g.block_tokens) return absl::OkStatus();
  if (auto st = CheckLearnedGeometry(*c.learned, g); !st.ok()) return st;
  s->learned.resize(g.num_elements());
  c.learned->Predict(c.tokens, c.first_position, c.previous_token, s->learned.data());
  if (rot) {
    for (size_t i = 0; i < s->learned.size(); i += g.head_dim) rot->Forward(s->learned.data() + i);
  }
  return absl::OkStatus();
}

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

}  // namespace residual
}  // namespace internal
}  // namespace kvtrie
