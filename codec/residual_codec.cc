#include "codec/residual_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "codec/little_endian.h"
#include "codec/rans.h"
#include "codec/residual_kernels.h"
#include "codec/residual_search.h"
#include "codec/rotation.h"

namespace kvtrie {
namespace internal {
namespace {

using residual::Bf16Round;
using residual::ChooseGroupCodes;
using residual::ChooseRope;
using residual::Dims;
using residual::GroupScale;
using residual::kMaxQ;
using residual::LoadLastTokens;
using residual::LoadSource;
using residual::PlaneCoder;
using residual::ReconstructHead;
using residual::RopeTable;
using residual::SearchStep;
using residual::SideOf;
using residual::Sources;
using residual::TokenScale;

constexpr uint8_t kParamsVersion = 1;
constexpr uint8_t kFlagRotated = 1;
constexpr uint8_t kFlagTokenScales = 2;
constexpr uint8_t kFlagRope = 4;
constexpr uint8_t kFlagContextPriors = 8;  // models start from kContextDecay, not decay 0.55
// The predictor of each head opens the payload (adaptive model per K/V, prior kChoiceDecay)
// instead of taking a nibble of params: ~3 bytes instead of 20 for 5 layers x 4 heads.
constexpr uint8_t kFlagChoicesInPayload = 16;
// StepGroups::kChannelKeysTokenValues: after the predictor choices, the payload holds a scale
// code per step group (ZigZag, adaptive model per K/V, prior kGroupCodeDecay).
constexpr uint8_t kFlagGroupScales = 32;
constexpr uint8_t kKnownFlags = kFlagRotated | kFlagTokenScales | kFlagRope | kFlagContextPriors |
                                kFlagChoicesInPayload | kFlagGroupScales;
constexpr double kChoiceDecay = 0.5;
constexpr double kGroupCodeDecay = 0.6;
// The exponent of ChooseGroupCodes: step_g ~ rms_g^kGroupExponent (1: each group's step in
// proportion to its residual RMS, as KIVI's per-group scales). Measured on tests/data with the
// parent chained (codec_bench --step_groups), bits at equal error versus the plane step: exponent
// 1: +0.35-0.45 bpc at every target 0.02-0.3; 0.5: +0.11-0.18; 0.25: +0.03-0.06; 0 (codes all
// 0, side info only): +0.01; -0.5 (finer steps for the larger groups): +0.24-0.34 bpc, but a
// lower attention error (attn_tv 0.094 vs 0.129 at 0.05, ~0.11 for the plane step at equal bits).
constexpr double kGroupExponent = 1.0;
// Rounding offset of the quantizer at coarse targets: q = sign(u) * round(max(|u| - offset, 0)),
// a dead zone that trades a little error for many more zeros; the step search then takes a
// slightly finer step. Measured on tests/data at the TurboQuant 3-bit error (0.17): -3.3% bits;
// at 0.1: -0.6%; at 0.05: +0.5%, hence only for targets >= kDeadZoneFrom.
constexpr float kDeadZoneOffset = 0.1f;
constexpr double kDeadZoneFrom = 0.1;
constexpr int kMaxScaleCode = 12;  // token scale 2^(-code/4), code in [-12, 12]
constexpr int kNumContexts = 24;
// Geometric prior p(z) ~ decay^z of each context's model (flag 8), context = kv * 12 +
// 3 * min(|q above|, 3) + min(|q left|, 2): decay = m / (1 + m) for m the mean symbol of the
// context on tests/data at the TurboQuant 3-bit error. Measured: -0.9% bits there, -1.8% at
// 0.05 (the models then need fewer symbols to learn their context's distribution).
constexpr double kContextDecay[kNumContexts] = {
    0.250, 0.367, 0.446, 0.421, 0.495, 0.568, 0.599, 0.678, 0.766, 0.699, 0.777, 0.845,  // K
    0.592, 0.671, 0.689, 0.667, 0.675, 0.694, 0.678, 0.685, 0.699, 0.707, 0.712, 0.718,  // V
};

// The context models a payload starts from (flag 8: kContextDecay; else the old 0.55 prior).
std::vector<AdaptiveModel> InitialModels(bool context_priors) {
  if (!context_priors) return std::vector<AdaptiveModel>(kNumContexts);
  static const std::vector<AdaptiveModel>* const kPriors = [] {
    auto* m = new std::vector<AdaptiveModel>;
    for (double decay : kContextDecay) m->emplace_back(decay);
    return m;
  }();
  return *kPriors;
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
  const bool grouped = o.step_groups == StepGroups::kChannelKeysTokenValues;
  std::vector<int8_t> group_codes;  // per plane in (layer, K/V) order: H * D or H * T codes

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
      if (grouped) {
        // Scales from the plane-step residuals, then the common factor searched again.
        std::vector<int8_t> codes(n.H * (kv == 0 ? n.D : n.T), 0);
        if (energy > 0) {
          codes = ChooseGroupCodes(n, kv, xp, pc, token_scale.data(), delta, kGroupExponent);
          std::vector<float> scales(codes.size());
          for (size_t i = 0; i < codes.size(); ++i) scales[i] = GroupScale(codes[i]);
          pc.SetGroupScales(std::move(scales));
          delta = SearchStep(g, n, pc, x_orig + off, rot, target_sse, delta, min_step);
        }
        group_codes.insert(group_codes.end(), codes.begin(), codes.end());
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
                                (rope_log_base > 0 ? kFlagRope : 0) | kFlagContextPriors |
                                kFlagChoicesInPayload | (grouped ? kFlagGroupScales : 0)));
  if (rot) PutLE<uint32_t>(&p, o.rotation_seed);
  if (rope_log_base > 0) {
    uint32_t bits;
    std::memcpy(&bits, &rope_log_base, 4);
    PutLE<uint32_t>(&p, bits);
  }
  for (int8_t c : scale_codes) p.push_back(static_cast<char>(c));
  for (float s : steps) PutLE<uint16_t>(&p, FloatToBf16(s));
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] != Predictor::kChannelMean) continue;
    for (size_t d = 0; d < n.D; ++d) PutLE<uint16_t>(&p, FloatToHalf(means[i * n.D + d]));
  }

  // Payload.
  std::vector<AdaptiveModel> models = InitialModels(true), escapes(2, AdaptiveModel(0.7));
  RansEncoder enc;
  enc.Reserve(g.num_elements() + g.num_elements() / 8);
  std::vector<uint8_t> up(n.D);
  AdaptiveModel choice_models[2] = {AdaptiveModel(kChoiceDecay), AdaptiveModel(kChoiceDecay)};
  for (size_t i = 0; i < choices.size(); ++i) {
    enc.Put(choice_models[(i / n.H) % 2], static_cast<int>(choices[i]));
  }
  AdaptiveModel group_models[2] = {AdaptiveModel(kGroupCodeDecay), AdaptiveModel(kGroupCodeDecay)};
  for (size_t l = 0, i = 0; l < n.L && grouped; ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t k = 0; k < n.H * (kv == 0 ? n.D : n.T); ++k, ++i) {
        enc.Put(group_models[kv], static_cast<int>(ZigZag(group_codes[i])));
      }
    }
  }
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
  if (o.key_error != KeyError::kRaw) {
    return absl::InvalidArgumentError(
        "key_error: KeyError::kMeanRemoved is a FAST-profile option (profile = FAST)");
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
  if (auto s = LoadLastTokens(g, c.parent, "parent", r, &src.parent); !s.ok()) return s;
  if (auto s = LoadSource(g, c.reference, "reference", r, &src.reference); !s.ok()) return s;
  if (auto s = LoadSource(g, c.external, "external", r, &src.external); !s.ok()) return s;
  if (auto s = LoadLearned(g, c, r, &src); !s.ok()) return s;
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
  // the envelope adds 36 bytes (24 header + 3 lengths/CRC x 4), 44 with the content checksum.
  const double budget_bits = o.target_bits_per_component * g.num_elements();
  const size_t envelope = 36 + (o.content_checksum ? 8 : 0);
  auto fits = [&](double target, LossyOutput* o_out) {
    *o_out = LossyOutput();
    (void)EncodeAt(g, x, xc, target, o, src, r, codes, rope, o_out);
    return 8.0 * (o_out->params.size() + o_out->payload.size() + envelope) <= budget_bits;
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
  std::vector<Predictor> choices(nh);
  bool uses[kNumPredictors] = {};
  RansDecoder dec(payload);
  if (flags & kFlagChoicesInPayload) {
    AdaptiveModel choice_models[2] = {AdaptiveModel(kChoiceDecay), AdaptiveModel(kChoiceDecay)};
    for (size_t i = 0; i < nh; ++i) {
      const int v = dec.Get(choice_models[(i / n.H) % 2]);
      if (v >= kNumPredictors) return absl::DataLossError("residual payload: unknown predictor");
      if (v == static_cast<int>(Predictor::kTokenMeanLinear))  // FAST only
        return absl::DataLossError("residual payload: unknown predictor");
      choices[i] = static_cast<Predictor>(v);
      uses[v] = true;
    }
  } else {
    if (!need((nh + 1) / 2)) return absl::DataLossError("residual params: truncated predictors");
    for (size_t i = 0; i < nh; ++i) {
      const uint8_t b = static_cast<uint8_t>(params[pos + i / 2]);
      const uint8_t v = (i % 2) ? (b >> 4) : (b & 15);
      if (v >= kNumPredictors) return absl::DataLossError("residual params: unknown predictor");
      if (v == static_cast<int>(Predictor::kTokenMeanLinear))  // FAST only
        return absl::DataLossError("residual params: unknown predictor");
      choices[i] = static_cast<Predictor>(v);
      uses[v] = true;
    }
    pos += (nh + 1) / 2;
  }
  // Per plane, the step group scales (empty without flag 32).
  std::vector<std::vector<float>> group(n.L * 2);
  if (flags & kFlagGroupScales) {
    if (!(flags & kFlagChoicesInPayload)) {
      return absl::DataLossError("residual params: group scales without payload choices");
    }
    AdaptiveModel group_models[2] = {AdaptiveModel(kGroupCodeDecay),
                                     AdaptiveModel(kGroupCodeDecay)};
    for (size_t pl = 0; pl < group.size(); ++pl) {
      const size_t kv = pl % 2;
      group[pl].resize(n.H * (kv == 0 ? n.D : n.T));
      for (float& s : group[pl]) {
        const int32_t code = UnZigZag(static_cast<uint32_t>(dec.Get(group_models[kv])));
        if (code < residual::kMinGroupCode || code > residual::kMaxGroupCode) {
          return absl::DataLossError("residual payload: group scale out of range");
        }
        s = GroupScale(code);
        // The finest and coarsest step of the group must be a normal positive float.
        const float lo = steps[pl] * s * TokenScale(kMaxScaleCode);
        const float hi = steps[pl] * s * TokenScale(-kMaxScaleCode);
        if (!(lo > 0) || !std::isfinite(hi)) {
          return absl::DataLossError("residual payload: group step out of range");
        }
      }
    }
  }
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
    const auto load =
        nd.predictor == static_cast<int>(Predictor::kParent) ? LoadLastTokens : LoadSource;
    if (auto s = load(g, nd.span, nd.name, r, nd.dst); !s.ok()) return s;
  }
  if (uses[static_cast<int>(Predictor::kTokenMean)]) {
    // DecodeBlock passes the state only for a block that names its version (and checked it).
    if (c.learned == nullptr || c.tokens.size() != n.T) {
      return absl::DataLossError(
          "residual params: a learned predictor in a block that names no predictor state");
    }
    if (auto s = LoadLearned(g, c, r, &src); !s.ok()) return s;
  }

  // Entropy decoding and reconstruction, head by head. The context of q[t][d] is
  // kv * 12 + 3 * min(|q[t - 1][d]|, 3) + min(|q[t][d - 1]|, 2) (0 outside the head), kept
  // incrementally: up[d] holds the first two terms for the next row, `left` the last.
  std::vector<int32_t> qh(n.head_elems());
  std::vector<uint8_t> up(n.D);
  std::vector<float> step(n.T), head_step(n.T);
  std::vector<AdaptiveModel> models = InitialModels(flags & kFlagContextPriors),
                             escapes(2, AdaptiveModel(0.7));
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
        const std::vector<float>& gs = group[l * 2 + kv];
        const float* chan = nullptr;
        const float* st = step.data();
        if (!gs.empty() && kv == 0) {
          chan = gs.data() + h * n.D;
        } else if (!gs.empty()) {  // (plane step * token scale) * group scale, as the encoder
          for (size_t t = 0; t < n.T; ++t) head_step[t] = step[t] * gs[h * n.T + t];
          st = head_step.data();
        }
        ReconstructHead(qh.data(), n, choices[i], side,
                        kv == 0 && !rope.empty() ? rope.data() : nullptr, st, out + off, chan);
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
