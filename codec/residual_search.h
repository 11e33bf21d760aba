// codec/residual_search.h
//
// The residual encoder's search (residual_codec.h): per (layer, K/V) plane, the predictor of each
// head and the largest bf16 step whose decoded error meets the target. Internal to the codec.
#ifndef KVTRIE_CODEC_RESIDUAL_SEARCH_H_
#define KVTRIE_CODEC_RESIDUAL_SEARCH_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "codec/block_geometry.h"
#include "codec/envelope.h"
#include "codec/residual_kernels.h"
#include "codec/rotation.h"

namespace kvtrie {
namespace internal {
namespace residual {

// Estimated bits of a head's residuals: zeroth-order entropy of the coder's symbols plus escapes.
double EstimateBits(const int32_t* q, size_t count);

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
  // Per-group step scales (StepGroups::kChannelKeysTokenValues): H * D for a key plane (per head
  // and channel), H * T for a value plane (per head and token); empty = none. Head h's step of
  // (t, d) is then (delta * token_scale[t]) * scale[h][d] for keys, * scale[h][t] for values — the
  // decoder's arithmetic, in the same order.
  void SetGroupScales(std::vector<float> scales) { group_ = std::move(scales); }

 private:
  const float* Side(Predictor p, size_t h) const {
    return SideOf(p, src_, n_, n_.head(l_, kv_, h), means_.data() + h * n_.D);
  }
  void SetStep(float delta) {
    for (size_t t = 0; t < n_.T; ++t) step_[t] = delta * token_scale_[t];
  }
  double QuantizeOne(size_t h, Predictor p) {
    const size_t o = h * n_.head_elems();
    const float* step = step_.data();
    const float* chan = nullptr;
    if (!group_.empty() && kv_ == 0) {
      chan = group_.data() + h * n_.D;
    } else if (!group_.empty()) {
      head_step_.resize(n_.T);
      for (size_t t = 0; t < n_.T; ++t) head_step_[t] = step_[t] * group_[h * n_.T + t];
      step = head_step_.data();
    }
    return QuantizeHead(x_ + o, n_, p, Side(p, h), rope_, dead_zone_, step, q_.data() + o,
                        rec_.data() + o, chan);
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
  std::vector<float> group_;      // per-group step scales, empty = one step per plane
  std::vector<float> head_step_;  // a value head's steps with its token scales applied
};

// Scale codes (GroupScale) of the step groups of a plane that `pc` has quantized at step `delta`
// (times `token_scale`, no group scales yet): code = round(2 * exponent * log2(rms_g / rms)),
// clamped, for rms_g the RMS prediction residual x - prediction of group g (keys: per head and
// channel, H * D codes; values: per head and token, H * T codes) and rms that of the plane.
// exponent 1 scales each step with its group's spread (KIVI-like equal relative error); 0 is the
// plane step.
std::vector<int8_t> ChooseGroupCodes(const Dims& n, size_t kv, const float* x, const PlaneCoder& pc,
                                     const float* token_scale, float delta, double exponent);

// Squared error of `rec` (coded domain) against `orig` (original domain) after inverse rotation
// and rounding to the dtype — what the caller will see.
double DecodedError(const BlockGeometry& g, const Dims& n, const float* orig, const float* rec,
                    const RandomizedHadamard* rot);

// Finds the largest bf16 step whose decoded plane error is <= target_sse and leaves `pc` quantized
// at it. The error of an entropy-coded uniform quantizer grows like step^b (b ~ 2 at high rate,
// less once most residuals fall in the zero bin), so each pass fits b to the last two points in
// log-log space and jumps to the step predicted to land just under the target (a secant search),
// kept inside the bracket of the largest passing and smallest failing steps. Predictors are
// chosen (by their estimated bits) once, at the first step (choosing again at the second step
// saved 0.1% bits for 40% more encode time).
float SearchStep(const BlockGeometry& g, const Dims& n, PlaneCoder& pc, const float* x_orig,
                 const RandomizedHadamard* rot, double target_sse, float delta, float min_step);

}  // namespace residual
}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_RESIDUAL_SEARCH_H_
