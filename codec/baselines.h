// codec/baselines.h
//
// Per-vector quantizers kept beside the residual codec for side-by-side numbers on the same data.
// Internal to the codec; callers use block_codec.h (Encoding kInt8, kKivi2, kTurboQuant). A
// "vector" is one (layer, K/V, head, token) row of head_dim components. Each returns, besides
// params and payload, the reconstruction its decoder will produce (before dtype rounding).
//
//   kInt8:       per vector, fp16 scale = max|x| / 127, q = round(x / scale) in [-127, 127].
//                Payload: fp16 scales, then int8 values. 8 + 16 / head_dim bits per component.
//   kKivi2:      KIVI (Liu et al. 2024, §3): asymmetric 2-bit, keys per channel (a group is one
//                channel of one head over the block's block_tokens tokens), values per token (a
//                group is the head_dim channels of one vector); fp16 min and fp16 scale
//                (max - min) / 3 per group. Payload: key groups, value groups, then 2-bit codes.
//                2 + 32 / block_tokens (K) and 2 + 32 / head_dim (V) bits per component. KIVI's
//                full-precision recent-token window is not modelled (it is a serving policy).
//   kTurboQuant: TurboQuant-style MSE quantizer (Zandieh et al. 2025, §3.1): each vector is
//                normalized by its fp16 norm, rotated by a randomized Hadamard transform, scaled by
//                sqrt(head_dim) so coordinates are ~N(0, 1), and each coordinate is quantized with
//                the b-bit Gaussian Lloyd-Max codebook (lloyd_max.h). No QJL residual stage.
//                Params: u8 bits, u32 seed. Payload: fp16 norms, then b-bit codes.
//                b + 16 / head_dim bits per component. head_dim must be a power of two.
#ifndef KVTRIE_CODEC_BASELINES_H_
#define KVTRIE_CODEC_BASELINES_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "codec/envelope.h"
#include "codec/residual_codec.h"

namespace kvtrie {
namespace internal {

// `x`: geometry.num_elements() floats, block layout. Errors: INVALID_ARGUMENT (bad bits, or a
// head_dim TurboQuant cannot rotate).
absl::Status EncodeBaseline(Encoding encoding, const BlockGeometry& geometry, const float* x,
                            const EncodeOptions& options, LossyOutput* out);

// Fills `out` (geometry.num_elements() floats). Errors: DATA_LOSS for malformed params/payload.
absl::Status DecodeBaseline(Encoding encoding, const BlockGeometry& geometry,
                            absl::string_view params, absl::string_view payload, float* out);

}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_BASELINES_H_
