#include "codec/fast_residual.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "codec/fast_residual_format.h"
#include "codec/fast_residual_kernels.h"
#include "codec/little_endian.h"
#include "codec/predictor_state.h"
#include "codec/rans.h"
#include "codec/rans_interleaved.h"
#include "codec/residual_kernels.h"
#include "xxhash.h"

namespace kvtrie {
namespace internal {
namespace {

using namespace fast;         // NOLINT: the profile's own kernels
using namespace fast_format;  // NOLINT: its params layout
using residual::Bf16Ceil;
using residual::Bf16Round;
using residual::Dims;

constexpr size_t kMinSegmentSymbols = 65536;  // planes are grouped into segments of >= this
constexpr size_t kMinLaneSymbols = 1024;      // a lane's 4-byte state is < 0.4 % of its bits
constexpr float kDeadZoneOffset = 0.1f;       // as the compact profile (residual_codec.cc)
constexpr double kDeadZoneFrom = 0.1;
constexpr int kMaxSearchPasses = 12;
constexpr int kBisectPasses = 3;  // after a fallback search met the target (EncodePlane)

constexpr Predictor kPredictorOf[5] = {Predictor::kNone, Predictor::kChannelMean,
                                       Predictor::kTemporal, Predictor::kTokenMean,
                                       Predictor::kTokenMeanLinear};

// `planes`: how many planes have symbols (0: no segments; lanes and planes_per_segment are 1).
Layout ChooseLayout(const Dims& n, size_t planes) {
  Layout lo;
  if (planes == 0) return lo;
  const size_t pe = n.plane_elems();
  lo.planes_per_segment = std::min(
      {planes, kMaxSegmentPlanes, std::max<size_t>(1, (kMinSegmentSymbols + pe - 1) / pe)});
  const size_t seg = lo.planes_per_segment * pe;
  lo.lanes = irans::kMaxLanes;
  while (lo.lanes > 1 && (seg / lo.lanes < kMinLaneSymbols || pe % lo.lanes != 0)) lo.lanes /= 2;
  return lo;
}

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 128) {
    out->push_back(static_cast<char>((v & 127) | 128));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// One plane's encoder state.
struct PlaneCode {
  float step = 1.0f;
  std::vector<uint8_t> pred;       // per head
  std::vector<float> means;        // per head x D, fp16-exact (only mean heads are sent)
  const float* learned = nullptr;  // the plane's kTokenMean prediction [H][T][D], or null
  const float* linear = nullptr;   // its kTokenMeanLinear prediction [H][T][D], or null
  const float* klt = nullptr;      // the state's KLT bases of the plane [H][D][D], or null
  bool use_klt = false;            // its learned heads are coded as z = U^T (x - pred)
  std::vector<float> z;            // [H][T][D]: z of the learned heads (use_klt)
  std::vector<int32_t> q;          // plane_elems
  double sse = 0, energy = 0, max_abs = 0;
  // The cost model's bits of the best non-learned predictor per head minus those of the chosen
  // one (at the first step; > 0 only when a learned predictor was chosen).
  double learned_saved_bits = 0;
  // The cost model's bits the linear predictor and the KLT saved on this plane (> 0 only when
  // used): the block is coded again without them when these do not pay for their signalling.
  double extra_gain_bits = 0;
};

struct Scratch {
  std::vector<float> x, rec, rt, zeros, l1, zero_head, qf, lin_rec;
  std::vector<int32_t> q;
  std::vector<uint8_t> dt;
};

// The kernels' `mean` argument of head h: its channel means, or its [T][D] token-mean prediction.
const float* HeadSide(const Dims& n, const PlaneCode& pc, size_t h) {
  if (pc.pred[h] == kPredLinear) return pc.linear + h * n.head_elems();
  return pc.pred[h] == kPredToken ? pc.learned + h * n.head_elems() : pc.means.data() + h * n.D;
}

// Quantizes the plane at `step`; returns the squared error after rounding to the dtype.
double QuantizePlane(const Dims& n, DType dtype, const float* x, const PlaneCode& pc, float step,
                     float dz, Scratch* s, int32_t* q, double* max_abs) {
  const size_t he = n.head_elems();
  if (dtype == DType::kFp16 && n.D % 8 == 0 && HasAvx2F16c() && !pc.use_klt) {
    double sse = 0;
    float mx = 0;
    for (size_t h = 0; h < n.H; ++h) {
      sse += QuantizeHeadFp16(x + h * he, n.T, n.D, KernelCode(pc.pred[h]), HeadSide(n, pc, h),
                              s->zeros.data(), step, dz, q + h * he, s->rec.data() + h * he, &mx);
    }
    *max_abs = mx;
    return sse;
  }
  for (size_t h = 0; h < n.H; ++h) {
    if (pc.use_klt && pc.pred[h] >= kPredToken) {  // q of z; x' = pred + U (q * step)
      QuantizeHead(pc.z.data() + h * he, n.T, n.D, kPredToken, s->zero_head.data(), s->zeros.data(),
                   step, dz, q + h * he, s->rec.data() + h * he);
      for (size_t i = 0; i < he; ++i) s->qf[i] = static_cast<float>(q[h * he + i]);
      KltReconHead(s->qf.data(), HeadSide(n, pc, h), pc.klt + h * n.D * n.D, n.T, n.D, step,
                   s->l1.data(), s->rec.data() + h * he);
      continue;
    }
    QuantizeHead(x + h * he, n.T, n.D, KernelCode(pc.pred[h]), HeadSide(n, pc, h), s->zeros.data(),
                 step, dz, q + h * he, s->rec.data() + h * he);
  }
  const size_t pe = n.plane_elems();
  FromFloat(dtype, s->rec.data(), pe, s->dt.data());
  ToFloat(dtype, s->dt.data(), pe, s->rt.data());
  float mx = 0;
  const double sse = SumSquares(x, s->rt.data(), pe, &mx);
  *max_abs = mx;
  return sse;
}

// Chooses the predictors and the step of one plane (x: pe floats) and quantizes it.
// `hint`: the chosen step over the first guess in the previous plane of the same K/V (0 = none);
// updated, so that the first pass usually meets the target. `mean_removed`: the target is
// relative to the plane's energy around its per-(head, channel) means (KeyError::kMeanRemoved).
void EncodePlane(const Dims& n, DType dtype, const float* x, double target, bool mean_removed,
                 double energy, float max_x, PlaneCode* pc, Scratch* s, float* hint) {
  const size_t pe = n.plane_elems(), he = n.head_elems(), D = n.D;
  pc->pred.assign(n.H, kPredNone);
  pc->means.assign(n.H * D, 0.0f);
  pc->q.resize(pe);  // every element is written below (zeros only for an all-zero plane)
  // (energy and max_x: the caller's SumSquares of x, which also told it that x is finite.)
  pc->energy = energy;
  pc->sse = 0;
  pc->max_abs = 0;
  pc->learned_saved_bits = 0;
  pc->extra_gain_bits = 0;
  pc->use_klt = false;
  if (energy == 0) {
    pc->step = 1.0f;
    std::fill(pc->q.begin(), pc->q.end(), 0);
    return;
  }
  double ref = energy;  // what the target is relative to
  if (mean_removed) {
    double mean_energy = 0;
    for (size_t h = 0; h < n.H; ++h) {
      for (size_t d = 0; d < D; ++d) {
        double m = 0;
        for (size_t t = 0; t < n.T; ++t) m += x[h * he + t * D + d];
        mean_energy += m * m / n.T;
      }
    }
    ref = std::max(energy - mean_energy, 0.0);
    if (ref == 0) ref = energy;  // a constant plane: fall back to its energy
  }
  const float dz = target >= kDeadZoneFrom ? kDeadZoneOffset : 0.0f;
  const float min_step = Bf16Ceil(std::max(2.0f * max_x / kMaxQ, 1e-30f));  // a step as sent
  float step =
      Bf16Round(std::max(static_cast<float>(target * std::sqrt(12.0 * ref / pe)), min_step));
  // Predictors from an open-loop L1 estimate of the bits at the first step. With a linear
  // candidate, a plane's heads share one code (3 or 4: one bit per plane in the params) unless
  // choosing per head saves more than the 4-bit codes cost (4 bits per head).
  double uniform[2] = {0, 0}, mixed = 4.0 * n.H, plain = 0, no_linear = 0;
  std::vector<double> chosen_bits(n.H);
  for (size_t h = 0; h < n.H; ++h) {
    const float* xh = x + h * he;
    float* m = pc->means.data() + h * D;
    ChannelSums(xh, n.T, D, m);
    for (size_t d = 0; d < D; ++d) m[d] /= n.T;  // then rounded to fp16 (F16C where present)
    uint16_t* mh = reinterpret_cast<uint16_t*>(s->dt.data());
    FromFloat(DType::kFp16, m, D, mh);
    ToFloat(DType::kFp16, mh, D, m);
    // Per-channel partial sums (vectorized, the same floats as the scalar order), then totals.
    float* acc = s->l1.data();  // [5][D]
    HeadL1(xh, m, pc->learned ? pc->learned + h * he : nullptr,
           pc->linear ? pc->linear + h * he : nullptr, n.T, D, acc);
    const int num_preds = pc->linear ? 5 : pc->learned ? 4 : 3;
    // Channels outer: the predictors' five double chains overlap (each still sums d ascending,
    // so the same doubles as one chain at a time).
    double l1[5] = {0, 0, 0, 0, 0};
    for (size_t d = 0; d < D; ++d) {
      l1[0] += acc[d];
      l1[1] += acc[D + d];
      l1[2] += acc[2 * D + d];
      l1[3] += acc[3 * D + d];
      l1[4] += acc[4 * D + d];
    }
    double best = INFINITY;
    for (uint8_t p = 0; p < num_preds; ++p) {
      const double bits =
          he * std::log2(1.0 + 2.0 * l1[p] / (he * step)) + (p == kPredMean ? 16.0 * D : 0);
      if (bits < best) best = bits, pc->pred[h] = p;
      if (p >= kPredToken) uniform[p - kPredToken] += bits;
      if (p == kPredTemporal) plain += best;   // the best of none, channel mean, temporal
      if (p == kPredToken) no_linear += best;  // ... and of the token mean
    }
    mixed += best;
    chosen_bits[h] = best;
  }
  double chosen = 0;
  for (double b : chosen_bits) chosen += b;
  if (pc->linear) {
    const double u = std::min(uniform[0], uniform[1]) + 1.0;
    if (u <= mixed) {
      pc->pred.assign(n.H, uniform[1] < uniform[0] ? kPredLinear : uint8_t{kPredToken});
      chosen = u;
    }
  }
  pc->learned_saved_bits = std::max(0.0, plain - chosen);
  bool linear_used = false;
  for (uint8_t c : pc->pred) linear_used |= c == kPredLinear;
  pc->extra_gain_bits = linear_used ? std::max(0.0, no_linear - chosen) : 0.0;
  // The KLT of the learned heads, if the cost model says it saves more than its bitmap bit.
  pc->use_klt = false;
  if (pc->klt != nullptr) {
    pc->z.resize(pe);
    double with = 0, without = 0;
    for (size_t h = 0; h < n.H; ++h) {
      if (pc->pred[h] < kPredToken) continue;
      const float* side = HeadSide(n, *pc, h);
      float* z = pc->z.data() + h * he;
      KltForward(x + h * he, side, pc->klt + h * D * D, n.T, D, z);
      double l1e = 0, l1z = 0;
      for (size_t i = 0; i < he; ++i) {
        l1e += std::fabs(x[h * he + i] - side[i]);
        l1z += std::fabs(z[i]);
      }
      without += he * std::log2(1.0 + 2.0 * l1e / (he * step));
      with += he * std::log2(1.0 + 2.0 * l1z / (he * step));
    }
    pc->use_klt = with + 1.0 < without;
    if (pc->use_klt) pc->extra_gain_bits += without - with;
  }
  const float guess = step;
  if (*hint > 0) step = std::max(Bf16Round(guess * *hint * 0.995f), min_step);
  // Step search: the high-rate model (error ~ step^2) from each pass, bf16 steps, keep the
  // coarsest step that met the target.
  const double target_sse = target * target * ref;
  bool met = false;
  float tried_lo = 0;
  for (int pass = 0; pass < kMaxSearchPasses; ++pass) {
    double mx = 0;
    const double sse = QuantizePlane(n, dtype, x, *pc, step, dz, s, s->q.data(), &mx);
    float next;
    if (sse <= target_sse) {
      met = true;
      pc->step = step;
      pc->sse = sse;
      pc->max_abs = mx;
      pc->q.swap(s->q);
      if (sse >= 0.95 * target_sse || pass >= 3) break;
      next = Bf16Round(step *
                       static_cast<float>(std::sqrt(target_sse / std::max(sse, 1e-300)) * 0.995));
      next = std::min(next, Bf16Round(step * 2.0f));
      if (next <= step || (tried_lo > 0 && next >= tried_lo)) break;
    } else {
      tried_lo = step;
      if (met && pass >= 3) break;
      next = Bf16Round(step * static_cast<float>(std::sqrt(target_sse / sse) * 0.995));
      if (next >= step) next = Bf16Round(step * 0.99f);
      if (next >= step) next = step * 0.5f;
      if (next < min_step) next = min_step;
      if (next == step) break;
    }
    step = next;
  }
  // The next plane starts from this one's step only if the model found it (as before).
  *hint = met ? pc->step / guess : 0;
  if (!met) {
    // The model's steps did not reach the target: a flat error curve (a plane the learned state
    // predicts well quantizes to all zeros, its error the prediction's at any of these steps,
    // from a start far above its step: the hint of a plane predicted better still). Halve the
    // step until it meets, then bisect between the finest failing and the coarsest meeting step.
    // (A plane that met before, here or at the model's last step, is coded as before.)
    auto meets = [&](float at) {
      double mx = 0;
      const double sse = QuantizePlane(n, dtype, x, *pc, at, dz, s, s->q.data(), &mx);
      if (sse > target_sse) return false;
      pc->step = at, pc->sse = sse, pc->max_abs = mx;
      pc->q.swap(s->q);
      return true;
    };
    float fail = tried_lo > 0 ? tried_lo : step;
    if (step < fail) {  // the model's last step, not tried yet: kept, as before, if it meets
      met = meets(step);
      if (!met) fail = step;
    }
    const bool halved = !met;
    while (!met && fail > min_step) {
      const float next = std::max(Bf16Round(fail * 0.5f), min_step);
      met = meets(next);
      if (!met) fail = next;
    }
    for (int pass = 0; halved && met && pass < kBisectPasses; ++pass) {
      const float mid = Bf16Round(static_cast<float>(std::sqrt(double{pc->step} * fail)));
      if (mid <= pc->step || mid >= fail) break;
      if (!meets(mid)) fail = mid;
    }
  }
  if (!met) {  // the finest step: best effort (the target is below the dtype's resolution)
    double mx = 0;
    pc->sse = QuantizePlane(n, dtype, x, *pc, min_step, dz, s, pc->q.data(), &mx);
    pc->step = min_step;
    pc->max_abs = mx;
  }
}

}  // namespace

absl::Status EncodeFastResidual(const BlockGeometry& g, absl::Span<const uint8_t> kv,
                                const EncodeOptions& o, const PredictionContext& context,
                                FastOutput* out) {
  if (!(o.target_rel_rms > 0) || !std::isfinite(o.target_rel_rms)) {
    return absl::InvalidArgumentError("target_rel_rms: the FAST profile needs target_rel_rms > 0");
  }
  if (o.target_bits_per_component > 0 || o.rotate || o.surprisal_step_strength > 0 ||
      o.step_groups != StepGroups::kPlane) {
    return absl::InvalidArgumentError(
        "profile: FAST has no bits budget, rotation, surprisal steps or step groups");
  }
  const Dims n(g);
  const size_t pe = n.plane_elems(), planes = n.L * 2, eb = DTypeBytes(g.dtype);
  Scratch s;
  s.x.resize(pe);
  s.rec.resize(pe);
  s.rt.resize(pe);
  s.zeros.assign(n.D, 0.0f);
  s.l1.resize(5 * n.D);
  s.zero_head.assign(n.head_elems(), 0.0f);
  s.qf.resize(n.head_elems());
  s.lin_rec.resize(n.head_elems());
  // The learned token-mean prediction of the whole block, when eligible.
  // (Per-thread buffers: the recursive call below for the block without codes 4 and the KLT
  // rewrites them with the same prediction, after the last use here.)
  std::vector<float> learned_local, residual_local;
  float* learned = nullptr;
  if (context.learned != nullptr && context.tokens.size() == n.T &&
      (o.predictors & (1u << static_cast<int>(Predictor::kTokenMean)))) {
    if (auto st = CheckLearnedGeometry(*context.learned, g); !st.ok()) return st;
    learned = Reused(kSlotEncLearned, g.num_elements(), &learned_local);
    context.learned->Predict(context.tokens, context.first_position, context.previous_token,
                             learned);
  }
  // The cross-layer linear candidate (closed loop: from the planes' reconstructions, as decoded).
  // (Only a state with linear weights needs the planes' reconstructions.)
  const bool linear_ok = learned != nullptr && context.learned->linear_bytes() > 0 &&
                         (o.predictors & (1u << static_cast<int>(Predictor::kTokenMeanLinear)));
  const bool klt_ok = learned != nullptr && o.klt;
  float* residual = nullptr;  // [planes][pe]: reconstruction - learned
  std::vector<float> linear;  // [pe]
  if (linear_ok) {
    residual = Reused(kSlotEncResidual, g.num_elements(), &residual_local);
    linear.resize(pe);
  }
  out->uses_learned = false;
  out->learned_saved_bits = 0;
  // The content checksum (block_codec.h): XXH3-64 of the reconstruction exactly as the decoder
  // writes it, plane after plane.
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> checksum(
      o.content_checksum ? XXH3_createState() : nullptr, &XXH3_freeState);
  if (checksum != nullptr) XXH3_64bits_reset(checksum.get());
  s.q.resize(pe);
  s.dt.resize(pe * eb);
  // Reused per thread up to 16 MiB (no zeroing or page faults per block); larger ones are local.
  thread_local std::vector<uint8_t> reused;
  std::vector<uint8_t> local;
  std::vector<uint8_t>& symbols = g.num_elements() <= (16u << 20) ? reused : local;
  if (symbols.size() < g.num_elements()) symbols.resize(g.num_elements());
  BitWriter bits;
  std::vector<irans::Table> tables(planes);
  std::vector<uint64_t> escape_bits(planes, 0);
  std::vector<std::string> plane_step(planes), plane_bits(planes);  // step; bucket bit count
  std::vector<std::vector<uint8_t>> plane_pred(planes);
  std::vector<std::array<uint32_t, irans::kMaxSymbols>> plane_counts(planes);
  std::vector<uint8_t> zero(planes, 0);  // the plane's quantized residual is all zero
  std::vector<size_t> coded;             // the other planes, in order
  bool all_learned = true;               // every head chose kPredToken or kPredLinear
  bool any_linear = false;               // some head chose kPredLinear
  std::vector<uint8_t> klt_plane(planes, 0);
  bool any_klt = false;
  double extra_gain_bits = 0;  // what the cost model says codes 4 and the KLT saved
  std::string means_out;
  double sse[2] = {0, 0}, energy[2] = {0, 0};
  out->max_abs_error = 0;
  std::memset(out->predictor_count, 0, sizeof(out->predictor_count));
  PlaneCode pc;
  float hint[2] = {0, 0};
  for (size_t pl = 0; pl < planes; ++pl) {
    const size_t side = pl % 2;  // K or V
    ToFloat(g.dtype, kv.data() + pl * pe * eb, pe, s.x.data());
    // Finite iff the sum of squares is (fp16/bf16/fp32 squares cannot overflow a double): one
    // pass for the check and the plane's energy.
    float max_x = 0;
    const double plane_energy = SumSquares(s.x.data(), nullptr, pe, &max_x);
    if (!std::isfinite(plane_energy))
      return absl::FailedPreconditionError("kv: NaN or infinity (FAST profile)");
    pc.learned = learned == nullptr ? nullptr : learned + pl * pe;
    pc.linear = nullptr;
    pc.klt = klt_ok ? context.learned->Klt(pl) : nullptr;
    if (linear_ok && context.learned->HasLinear(pl)) {
      std::memcpy(linear.data(), pc.learned, pe * sizeof(float));
      context.learned->PredictLinear(pl, context.first_position, n.T, residual + (pl - 1) * pe,
                                     pl >= 2 ? residual + (pl - 2) * pe : nullptr, linear.data());
      pc.linear = linear.data();
    }
    EncodePlane(n, g.dtype, s.x.data(), o.target_rel_rms,
                side == 0 && o.key_error == KeyError::kMeanRemoved, plane_energy, max_x, &pc, &s,
                &hint[side]);
    sse[side] += pc.sse;
    energy[side] += pc.energy;
    out->learned_saved_bits += pc.learned_saved_bits;
    extra_gain_bits += pc.extra_gain_bits;
    out->max_abs_error = std::max(out->max_abs_error, pc.max_abs);
    // Symbols and bucket offsets (none for an all-zero plane).
    zero[pl] = std::all_of(pc.q.begin(), pc.q.end(), [](int32_t v) { return v == 0; });
    if (linear_ok || checksum != nullptr) {  // the decoder's reconstruction of the plane
      // (minus the learned mean for the linear candidate; hashed for the content checksum)
      std::vector<float>& qf = s.qf;
      std::vector<float>& rec = s.lin_rec;
      for (size_t h = 0; h < n.H; ++h) {
        const size_t he = n.head_elems();
        for (size_t i = 0; i < he; ++i) qf[i] = static_cast<float>(pc.q[h * he + i]);
        const uint8_t c = pc.pred[h];
        if (pc.use_klt && c >= kPredToken) {
          KltReconHead(qf.data(), HeadSide(n, pc, h), pc.klt + h * n.D * n.D, n.T, n.D, pc.step,
                       s.l1.data(), rec.data());
        } else {
          ReconHead(qf.data(), n.T, n.D, KernelCode(c),
                    c == kPredMean || c >= kPredToken ? HeadSide(n, pc, h) : s.zeros.data(),
                    s.zeros.data(), pc.step, rec.data());
        }
        FromFloat(g.dtype, rec.data(), he, s.dt.data());
        if (checksum != nullptr) XXH3_64bits_update(checksum.get(), s.dt.data(), he * eb);
        if (!linear_ok) continue;
        ToFloat(g.dtype, s.dt.data(), he, rec.data());
        float* r = residual + pl * pe + h * he;
        const float* m = pc.learned + h * he;
        for (size_t i = 0; i < he; ++i) r[i] = rec[i] - m[i];
      }
    }
    if (!zero[pl]) {
      uint8_t* const sym = symbols.data() + coded.size() * pe;
      coded.push_back(pl);
      const uint64_t bits_before = bits.bits();
      MapSymbols(pc.q.data(), pe, sym);
      uint32_t* const counts = plane_counts[pl].data();
      HistogramDirect(sym, pe, counts);
      EncodeBuckets(pc.q.data(), pe, sym, counts, &bits);
      escape_bits[pl] = bits.bits() - bits_before;
      tables[pl] = irans::NormalizeCounts(counts, irans::kMaxSymbols);
      PutLE<uint16_t>(&plane_step[pl], FloatToBf16(pc.step));
      PutVarint(&plane_bits[pl], escape_bits[pl]);
    }
    plane_pred[pl] = pc.pred;
    klt_plane[pl] = pc.use_klt;
    any_klt |= pc.use_klt;
    for (size_t h = 0; h < n.H; ++h) {
      all_learned &= pc.pred[h] == kPredToken || pc.pred[h] == kPredLinear;
      any_linear |= pc.pred[h] == kPredLinear;
      ++out->predictor_count[side][static_cast<int>(kPredictorOf[pc.pred[h]])];
      out->uses_learned |= pc.pred[h] >= kPredToken;
      if (pc.pred[h] != kPredMean) continue;
      for (size_t d = 0; d < n.D; ++d)
        PutLE<uint16_t>(&means_out, FloatToHalf(pc.means[h * n.D + d]));
    }
  }
  std::string& p = out->params;
  p.clear();
  const Layout lo = ChooseLayout(n, coded.size());
  const bool any_zero = coded.size() < planes;
  // Predictor codes: none (all learned; with linear, a bitmap of the linear planes when every
  // plane is uniform), 4 bits per head (some linear head otherwise), else 2 bits per head.
  bool linear_planes = any_linear && all_learned;
  for (size_t pl = 0; pl < planes && linear_planes; ++pl) {
    for (uint8_t c : plane_pred[pl]) linear_planes &= c == plane_pred[pl][0];
  }
  const bool wide = any_linear && !linear_planes;
  all_learned &= !wide;
  p.push_back(static_cast<char>(kFastResidualParamsVersion));
  p.push_back(static_cast<char>((any_zero ? kFlagZeroPlanes : 0) |
                                (all_learned ? kFlagAllLearned : 0) | (wide ? kFlagWideCodes : 0) |
                                (linear_planes ? kFlagLinearPlanes : 0) |
                                (any_klt ? kFlagKltPlanes : 0)));  // flags
  p.push_back(static_cast<char>(lo.lanes));
  p.push_back(0);  // reserved
  PutLE<uint16_t>(&p, static_cast<uint16_t>(lo.planes_per_segment));
  if (any_zero) {
    for (size_t pl = 0; pl < planes; pl += 8) {
      uint8_t b = 0;
      for (size_t k = 0; k < 8 && pl + k < planes; ++k) b |= zero[pl + k] << k;
      p.push_back(static_cast<char>(b));
    }
  }
  if (linear_planes) {
    for (size_t pl = 0; pl < planes; pl += 8) {
      uint8_t b = 0;
      for (size_t k = 0; k < 8 && pl + k < planes; ++k)
        b |= (plane_pred[pl + k][0] == kPredLinear) << k;
      p.push_back(static_cast<char>(b));
    }
  }
  if (any_klt) {
    for (size_t pl = 0; pl < planes; pl += 8) {
      uint8_t b = 0;
      for (size_t k = 0; k < 8 && pl + k < planes; ++k) b |= klt_plane[pl + k] << k;
      p.push_back(static_cast<char>(b));
    }
  }
  // Tables: one per coded plane, or one per K/V (with coded planes) for the whole block when that
  // costs fewer bits (small blocks, where a table is a large share of a plane's bits).
  irans::Table shared[2];
  bool side_coded[2] = {false, false};
  for (size_t pl : coded) side_coded[pl % 2] = true;
  {
    std::array<uint32_t, irans::kMaxSymbols> side_counts[2] = {};
    for (size_t pl : coded)
      for (int k = 0; k < irans::kMaxSymbols; ++k) side_counts[pl % 2][k] += plane_counts[pl][k];
    double own = 0, common = 0;
    std::string scratch;
    for (int side = 0; side < 2; ++side) {
      if (!side_coded[side]) continue;
      shared[side] = irans::NormalizeCounts(side_counts[side].data(), irans::kMaxSymbols);
      scratch.clear();
      irans::WriteTable(shared[side], &scratch);
      common += 8.0 * scratch.size();
    }
    for (size_t pl : coded) {
      scratch.clear();
      irans::WriteTable(tables[pl], &scratch);
      own += 8.0 * scratch.size() +
             irans::CostBits(tables[pl], plane_counts[pl].data(), irans::kMaxSymbols);
      common += irans::CostBits(shared[pl % 2], plane_counts[pl].data(), irans::kMaxSymbols);
    }
    if (common < own) {
      p[1] = static_cast<char>(p[1] | kFlagSharedTables);
      for (size_t pl : coded) tables[pl] = shared[pl % 2];
    }
  }
  const bool shared_tables = p[1] & kFlagSharedTables;
  for (size_t pl = 0; pl < planes; ++pl) {
    p += plane_step[pl];
    const std::vector<uint8_t>& pr = plane_pred[pl];
    if (wide) {
      for (size_t h = 0; h < n.H; h += 2)
        p.push_back(static_cast<char>(pr[h] | (h + 1 < n.H ? pr[h + 1] << 4 : 0)));
    } else if (!all_learned) {
      for (size_t h = 0; h < n.H; h += 4) {
        uint8_t b = 0;
        for (size_t k = 0; k < 4 && h + k < n.H; ++k) b |= pr[h + k] << (2 * k);
        p.push_back(static_cast<char>(b));
      }
    }
    p += plane_bits[pl];
    if (!shared_tables && !zero[pl]) irans::WriteTable(tables[pl], &p);
  }
  if (shared_tables) {
    for (int side = 0; side < 2; ++side)
      if (side_coded[side]) irans::WriteTable(shared[side], &p);
  }
  p += means_out;
  for (int kv = 0; kv < 2; ++kv) {
    out->rel_rms_error[kv] = energy[kv] > 0 ? std::sqrt(sse[kv] / energy[kv]) : std::sqrt(sse[kv]);
  }
  // Payload: segment sizes, segments, escapes.
  std::string& pay = out->payload;
  pay.clear();
  const size_t nc = coded.size();
  const size_t ns = nc == 0 ? 0 : lo.num_segments(nc);
  {  // One allocation: the tables' cost of the symbols, the lane states and the bucket bits.
    double est = 0;
    for (size_t pl : coded) {
      est += irans::CostBits(tables[pl], plane_counts[pl].data(), irans::kMaxSymbols) / 8.0 +
             escape_bits[pl] / 8.0;
    }
    if (std::isfinite(est))
      pay.reserve(static_cast<size_t>(est * 1.01) + ns * (4 + 4 * lo.lanes + 64) + 64);
  }
  pay.resize(4 * ns);
  std::vector<const irans::Table*> tp(nc);
  for (size_t c = 0; c < nc; ++c) tp[c] = &tables[coded[c]];
  for (size_t sg = 0; sg < ns; ++sg) {
    const size_t first = sg * lo.planes_per_segment;
    const size_t count = std::min(lo.planes_per_segment, nc - first);
    const size_t before = pay.size();
    irans::EncodeSegment(absl::MakeConstSpan(symbols).subspan(first * pe, count * pe), lo.lanes, pe,
                         absl::MakeConstSpan(tp).subspan(first, count), &pay);
    const uint32_t size = static_cast<uint32_t>(pay.size() - before);
    std::memcpy(pay.data() + 4 * sg, &size, 4);
  }
  bits.Finish(&pay);
  out->content_checksum = checksum != nullptr ? XXH3_64bits_digest(checksum.get()) : 0;
  // Codes 4 and the KLT cost their signalling (bitmaps or 4-bit codes: 4-8 bytes at stories260K),
  // which the per-plane cost model does not see. When what it says they saved does not cover
  // 4x that, the block is also coded without them and the smaller kept (tiny blocks at high
  // targets, where the bitmaps are several % of the block).
  if (any_linear || any_klt) {
    const double signal_bits =
        8.0 * ((linear_planes ? (planes + 7) / 8 : 0) + (any_klt ? (planes + 7) / 8 : 0) +
               (wide ? planes * ((n.H + 1) / 2) : 0));
    if (extra_gain_bits < 4 * signal_bits) {
      EncodeOptions plain = o;
      plain.predictors &= ~(1u << static_cast<int>(Predictor::kTokenMeanLinear));
      plain.klt = false;
      FastOutput alt;
      if (auto st = EncodeFastResidual(g, kv, plain, context, &alt); !st.ok()) return st;
      if (alt.params.size() + alt.payload.size() <= p.size() + pay.size()) *out = std::move(alt);
    }
  }
  return absl::OkStatus();
}

}  // namespace internal
}  // namespace kvtrie
