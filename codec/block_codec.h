// codec/block_codec.h
//
// Encodes one KV block — a tensor [num_layers][2][num_kv_heads][block_tokens][head_dim] in the
// model's dtype (see block_geometry.h) — into a self-describing byte string, and back: the
// dispatch to the encodings' coders (residual_codec.h, fast_residual.h, lossless.h,
// fast_lossless.h, fast_lossless_learned.h, centroid_lossless.h, baselines.h). The envelope
// every block is wrapped in, its enums, EncodeOptions, PredictionContext, EncodedBlock and
// BlockHeader are in codec/envelope.h (included here, so callers need only this header).
//
// Thread-safe: these are pure functions.
// Source: the paper's layer 2 (predictive delta coding), Magarshak 2026 §2.
#ifndef KVTRIE_CODEC_BLOCK_CODEC_H_
#define KVTRIE_CODEC_BLOCK_CODEC_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/envelope.h"

namespace kvtrie {

// Encodes `kv` (exactly geometry.num_bytes() bytes). Errors: INVALID_ARGUMENT naming the field if
// the geometry is invalid or `kv` has the wrong size; for the lossy encodings (kResidual, kInt8,
// kKivi2, kTurboQuant) also INVALID_ARGUMENT naming the element if `kv` holds a NaN or an
// infinity (CheckFinite), or a value the encoding cannot represent (its reconstruction would not
// be finite, e.g. kInt8 of an fp32 value above 65504 * 127, whose fp16 scale overflows). kRaw and
// kLossless store every bit pattern exactly. Lossy decoders saturate finite reconstructions to the
// dtype's largest finite value (kInt8 of fp16 65504 is 65504, never Inf).
absl::StatusOr<EncodedBlock> EncodeBlock(const BlockGeometry& geometry,
                                         absl::Span<const uint8_t> kv, const EncodeOptions& options,
                                         const PredictionContext& context = {});

// OK if every element of `kv` — layers [layer_begin, layer_begin + kv.size() / layer bytes) of a
// block of `geometry`, block layout — is finite. Otherwise INVALID_ARGUMENT naming the first
// non-finite element: "layer 2 V head 1 token 5 channel 3 is NaN". `kv` must hold whole layers.
absl::Status CheckFinite(const BlockGeometry& geometry, uint32_t layer_begin,
                         absl::Span<const uint8_t> kv);

// Decodes `encoded` into `out` (geometry.num_bytes() bytes, dtype of the header).
// Errors: DATA_LOSS on a bad checksum, truncated or malformed input; INVALID_ARGUMENT if `out`
// has the wrong size; FAILED_PRECONDITION if the block needs a context span that is empty, or
// names a predictor version (BlockHeader::predictor_version) and context.learned is null or has
// another version, or context.tokens does not hold block_tokens ids (the message names them).
absl::Status DecodeBlock(absl::string_view encoded, absl::Span<uint8_t> out,
                         const PredictionContext& context = {});
// As DecodeBlock, parsed with ParseVerifiedBlock (no CRC-32C pass).
absl::Status DecodeVerifiedBlock(absl::string_view encoded, absl::Span<uint8_t> out,
                                 const PredictionContext& context = {});

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_BLOCK_CODEC_H_
