// codec/fast_residual.h
//
// The fast profile of the kResidual encoding (EncodeOptions::profile = Profile::kFast): the same
// closed-loop quantizer and error target as residual_codec.h, built for throughput instead of the
// last 10 % of bits. Internal to the codec; callers use block_codec.h. Byte layout and how a GPU
// decoder reads it: codec/FORMAT.md.
//
// Differences from the compact profile:
//   - predictors only from inside the block: none, channel mean (fp16 means in params), or
//     temporal (previous token's reconstruction, first token from 0), chosen per (layer, K/V,
//     head) from an open-loop L1 estimate; never the parent, so the blocks of a prefix decode in
//     parallel and in any order;
//   - the quantized residuals are coded with static per-plane frequency tables (rans_interleaved.h,
//     32 symbols: ZigZag values 0..30, 31 = escape to a u16 list) and many interleaved rANS lanes;
//     a plane whose quantized residual is all zero (keys under a learned state) is flagged in the
//     params and has no step, table, bit count or symbols; a block whose every head uses the
//     learned predictor has no predictor bytes;
//   - with a learned state (PredictionContext::learned): the token / pair mean (code 3), the
//     cross-layer linear prediction from the two planes decoded before (code 4,
//     Predictor::kTokenMeanLinear; the planes of such a block reconstruct in plane order, each
//     plane's heads independently) and the state's per-plane KLT bases for the learned heads,
//     each chosen by the encoder's cost model (EncodeOptions::predictors, EncodeOptions::klt);
//     blocks without codes 4 or a KLT are byte-identical to those of main 20a16da;
//     no rotation, RoPE-aware keys, surprisal steps, step groups or bits budget (INVALID_ARGUMENT
//     naming `profile` if asked for).
// The step per (layer, K/V) plane is bf16 and searched (2-4 quantization passes) so that the
// relative RMS error of the plane after rounding to the dtype is <= target_rel_rms, as in the
// compact profile: every plane, not the block on average. The encoder measures the error itself
// (the blocks are never decoded twice). When the search's error model does not reach the target
// in 12 passes (a flat error curve: a plane the learned state predicts well quantizes to all
// zeros over a wide range of steps), the step is halved until the plane meets it and bisected
// back (a few more passes on such planes). Only a plane that misses at the finest step
// (2 max|x| / 2051: a target below the dtype's resolution) is kept at that step, best effort.
// The encoder and decoder allocate nothing per plane and little per block: the prediction, the
// symbols and the rANS words live in per-thread buffers kept between calls (up to 16 MiB each,
// fast_residual_kernels.h Reused), the SIMD kernels are AVX2 / F16C with runtime dispatch and
// scalar versions that give the same bytes; on Llama-3-8B-shaped blocks with a learned state the
// step search takes 1.3 quantization passes per plane on average (bench/fast_codec_bench.md).
// Thread-safe: pure functions (the per-thread buffers are not shared).
#ifndef KVTRIE_CODEC_FAST_RESIDUAL_H_
#define KVTRIE_CODEC_FAST_RESIDUAL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/envelope.h"

namespace kvtrie {
namespace internal {

struct FastOutput {
  std::string params;
  std::string payload;
  double rel_rms_error[2] = {0, 0};  // K, V over the block
  double max_abs_error = 0;
  uint32_t predictor_count[2][kNumPredictors] = {};
  bool uses_learned = false;      // some head uses kTokenMean: the block names the state's version
  double learned_saved_bits = 0;  // EncodedBlock::learned_bytes_saved, in bits
  // EncodeOptions::content_checksum: XXH3-64 of the block as DecodeFastResidual writes it.
  uint64_t content_checksum = 0;
};

// The first params byte of a fast-profile residual block.
inline constexpr uint8_t kFastResidualParamsVersion = 16;

// `kv`: the block in geometry.dtype. Errors: INVALID_ARGUMENT for a missing target or an option
// the fast profile does not have; FAILED_PRECONDITION if `kv` holds a NaN or an infinity (the
// caller then uses the compact profile).
// `context`: only learned, tokens and first_position are read (kTokenMean, eligible when
// context.learned is set, context.tokens holds block_tokens ids and options.predictors has it;
// INVALID_ARGUMENT if the state's geometry does not match).
absl::Status EncodeFastResidual(const BlockGeometry& geometry, absl::Span<const uint8_t> kv,
                                const EncodeOptions& options, const PredictionContext& context,
                                FastOutput* out);

// Writes the block in its dtype to `out` (geometry.num_bytes()). `context`: as for the encoder;
// the caller (DecodeBlock) has checked that it is the block's state and its tokens. Errors:
// DATA_LOSS if `params` or `payload` is malformed (a learned head without context.learned, a
// linear head or a KLT plane that the state has no weights or basis for).
absl::Status DecodeFastResidual(const BlockGeometry& geometry, absl::string_view params,
                                absl::string_view payload, absl::Span<uint8_t> out,
                                const PredictionContext& context = {});

}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_FAST_RESIDUAL_H_
