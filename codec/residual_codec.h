// codec/residual_codec.h
//
// The kResidual encoding: closed-loop predictive coding of a KV block with a uniform scalar
// quantizer and the rANS coder of rans.h. Internal to the codec; callers use block_codec.h.
//
// For each (layer, K/V) plane [num_kv_heads][block_tokens][head_dim]:
//   - optional randomized Hadamard rotation of every head vector (rotation.h);
//   - a predictor per head (Predictor in block_codec.h), chosen by the bits it costs: the zeroth-
//     order entropy of its quantized residuals plus its side information (fp16 channel means);
//     on key planes the temporal and parent predictors are RoPE-aware when the encoder finds the
//     keys rotate (flag 4): the previous token's reconstruction is first turned by RoPE's angle
//     theta_i = base^(-2i / head_dim) on each channel pair (2i, 2i + 1), base from {1e4, 5e5};
//   - residual r = x - prediction, quantized with one step per (layer, K/V) (bf16-exact) times a
//     per-token scale 2^(-code_t / 4) (surprisal-adaptive; code 0 when off): for u = r / step_t,
//     q = sign(u) * round(max(|u| - z, 0)), with a dead-zone offset z = 0.1 at targets >= 0.1
//     (more zeros for a slightly finer step) and z = 0 (plain rounding) below;
//     reconstruction x' = prediction + q * step_t in float32 (no FMA). Temporal and parent
//     predictors use x' of the previous token, exactly as the decoder has it, so errors never
//     accumulate (closed loop);
//   - the step is searched (secant steps in log-log space, 3-6 quantization passes) so that
//     ||x - x'|| / ||x|| over the plane, after rounding to the model dtype, is <= target_rel_rms.
//     One step per plane is the MSE-optimal allocation for an entropy-coded uniform quantizer
//     (equal distortion everywhere: reverse water-filling at high rate); per-channel / per-token
//     steps matter for fixed-rate quantizers, not here. Measured: the option
//     StepGroups::kChannelKeysTokenValues (flag 32) multiplies the step of each key (head,
//     channel) and value (head, token) by 2^(c / 2), c = round(2 log2(rms_g / rms)) in [-8, 7]
//     from the plane-step residuals, then searches the common step again; it costs 0.35-0.45
//     more bits per component at equal error on tests/data (residual_codec.cc, kGroupExponent);
//   - q is coded in (layer, K/V, head, token, channel) order with adaptive 16-symbol models,
//     context = (K or V, min(|q| of the same channel one token earlier, 3), min(|q| of the
//     previous channel, 2)) — 24 models, each starting from a geometric prior fitted to its
//     context (flag 8; without it, all from decay 0.55) — and an Elias-gamma escape for |q| >= 8.
// Params (version 1): u8 version, u8 flags (1 = rotated, 2 = token scales, 4 = RoPE-aware keys,
// 8 = context priors, 16 = predictor choices in the payload, 32 = step group scales (needs 16);
// blocks written before flags 4-32 existed decode unchanged), [u32 rotation seed], [f32 log(RoPE
// base), in (0, 40]; never with rotation], [block_tokens x i8 scale codes], num_layers * 2 x u16
// bf16 step, [without flag 16: num_layers * 2 * num_kv_heads predictor nibbles, packed two per
// byte], then head_dim x fp16 means per channel-mean head. Payload: one rANS stream (rans.h): with
// flag 16 first the predictor of every head in (layer, K/V, head) order (an adaptive model per
// K/V), with flag 32 then the ZigZag group scale codes (per plane in (layer, K/V) order: H x D for
// keys, H x T for values; an adaptive model per K/V), then the quantized residuals. Source:
// Magarshak 2026 §2 (layer 2, predictive delta coding, surprisal-adaptive quantization); DPCM with
// the quantizer in the loop (Jayant & Noll, "Digital Coding of Waveforms", ch. 6).
#ifndef KVTRIE_CODEC_RESIDUAL_CODEC_H_
#define KVTRIE_CODEC_RESIDUAL_CODEC_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "codec/envelope.h"

namespace kvtrie {
namespace internal {

struct LossyOutput {
  std::string params;
  std::string payload;
  std::vector<float> recon;  // what DecodeResidual will produce, before rounding to the dtype
  uint32_t predictor_count[2][kNumPredictors] = {};  // [K/V][Predictor]
};

// `x`: the block as floats (geometry.num_elements(), block layout). Errors: INVALID_ARGUMENT for a
// bad target, a context span of the wrong size, or rotation of a head_dim that is not a power of 2.
absl::Status EncodeResidual(const BlockGeometry& geometry, const float* x,
                            const EncodeOptions& options, const PredictionContext& context,
                            LossyOutput* out);

// Fills `out` (geometry.num_elements() floats). Errors: DATA_LOSS for malformed params or payload;
// FAILED_PRECONDITION if a predictor needs a context span that is empty; INVALID_ARGUMENT if the
// span has the wrong size.
absl::Status DecodeResidual(const BlockGeometry& geometry, absl::string_view params,
                            absl::string_view payload, const PredictionContext& context,
                            float* out);

}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_RESIDUAL_CODEC_H_
