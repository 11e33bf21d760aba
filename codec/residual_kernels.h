// codec/residual_kernels.h
//
// The arithmetic the residual encoder and decoder share (residual_codec.h): the block layout, the
// (RoPE-aware) prediction of a token row, closed-loop quantization of one head and its exact
// reconstruction, and the context blocks predictors read. Internal to the codec.
// Encoder and decoder reach the same floats because they call these same functions and the codec
// is built with -ffp-contract=off (prediction + q * step is never fused into an FMA).
#ifndef KVTRIE_CODEC_RESIDUAL_KERNELS_H_
#define KVTRIE_CODEC_RESIDUAL_KERNELS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/envelope.h"
#include "codec/rotation.h"

namespace kvtrie {
namespace internal {
namespace residual {

constexpr int32_t kMaxQ = 32767;  // |q| bound: keeps the escape code within 15 bits of exponent
// RoPE bases the encoder tries for the key predictor (Llama 1/2 and Llama 3).
constexpr double kRopeBases[] = {10000.0, 500000.0};
constexpr size_t kMaxRow = 256;  // head_dim rows up to this are predicted on the stack

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

// bf16 rounding of a step; the step scale 2^(-code / 4) of a token; whether a predictor reads a
// context block or channel means.
float Bf16Round(float f);
// The smallest bf16 value >= f (f > 0 and finite).
float Bf16Ceil(float f);
float TokenScale(int code);
// The step scale 2^(code / 2) of a step group (StepGroups::kChannelKeysTokenValues), code in
// [kMinGroupCode, kMaxGroupCode]: exact powers of two (ldexp) and sqrt(2) times them, so encoder
// and decoder agree on any machine.
constexpr int kMinGroupCode = -8, kMaxGroupCode = 7;
float GroupScale(int code);
bool NeedsSide(Predictor p);

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
// with +, *, / only (no libm: det_math.h), so encoder and decoder agree bit for bit on any IEEE
// machine.

// Per-lane factors of the turn, 2 * D floats: cos[] = {c_0, c_0, c_1, c_1, ...} then
// sin[] = {-s_0, s_0, -s_1, s_1, ...}, with c_i, s_i = cos, sin theta_i (an odd last channel:
// 1, 0).
std::vector<float> RopeTable(size_t D, float log_base);

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
    case Predictor::kTokenMean:
    case Predictor::kTokenMeanLinear:  // never chosen by the compact profile (no side)
      return side + t * D;
  }
  if (rope == nullptr) return src;
  RopeStep(rope, D, src, buf);
  return buf;
}

// Closed-loop quantization of one head. Returns the squared error (in the coded domain).
// `dead_zone`: the rounding offset (0 = plain rounding). The step of (t, d) is step[t], or
// step[t] * chan[d] when `chan` (head_dim per-channel scales) is not null.
double QuantizeHead(const float* x, const Dims& n, Predictor p, const float* side,
                    const float* rope, float dead_zone, const float* step, int32_t* q, float* rec,
                    const float* chan = nullptr);

// The decoder side of QuantizeHead: rec = prediction + q * step, row by row.
void ReconstructHead(const int32_t* q, const Dims& n, Predictor p, const float* side,
                     const float* rope, const float* step, float* rec, const float* chan = nullptr);

// Context blocks as floats in the coded (possibly rotated) domain.
struct Sources {
  std::vector<float> parent, reference, external;
  std::vector<float> learned;  // kTokenMean: PredictorState::PredictTokenMean of the block
};

// Fills s->learned from context.learned (PredictTokenMean, rotated by `rot` if set) when it is
// present and context.tokens holds block_tokens ids; else leaves it empty. Errors:
// INVALID_ARGUMENT when the state's geometry does not match.
absl::Status LoadLearned(const BlockGeometry& g, const PredictionContext& c,
                         const RandomizedHadamard* rot, Sources* s);

// Converts a context span (empty = absent) to floats in the coded domain (rotated if `rot`).
// Errors: INVALID_ARGUMENT naming context.`name` when the span has the wrong size.
absl::Status LoadSource(const BlockGeometry& g, absl::Span<const uint8_t> span, const char* name,
                        const RandomizedHadamard* rot, std::vector<float>* out);
// As LoadSource, but only the last token of each head is converted (the rest of `out` is left
// unset): all the parent predictor reads.
absl::Status LoadLastTokens(const BlockGeometry& g, absl::Span<const uint8_t> span,
                            const char* name, const RandomizedHadamard* rot,
                            std::vector<float>* out);

// Side input of a head for predictor p, or nullptr when the context lacks it.
const float* SideOf(Predictor p, const Sources& s, const Dims& n, size_t off, const float* means);

// log(base) of the RoPE base (kRopeBases) whose rotation best predicts each key from the one
// before it (open loop, over every key plane of the block), or 0 when plain temporal prediction
// is as good (keys without RoPE, or a base not in the list).
float ChooseRope(const BlockGeometry& g, const float* x);

}  // namespace residual
}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_RESIDUAL_KERNELS_H_
