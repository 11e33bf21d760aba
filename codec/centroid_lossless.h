// codec/centroid_lossless.h
//
// Bit-exact coding of a block against a reference (centroid) block of the same geometry and dtype:
// the integer difference of the two blocks' bit patterns, element by element (modulo 2^16 for
// fp16/bf16, 2^32 for fp32), zig-zag mapped so small differences of either sign are small
// unsigned numbers, then split into byte planes and compressed with zstd (lossless.h). A near-
// duplicate block (same tokens, slightly different history) differs from its centroid in the low
// mantissa bits only, so the high planes are almost all zero; layers that depend only on token and
// position (layer 0) are identical and cost almost nothing.
// Used by Encoding::kLossless with params mode 3 (block_codec.cc); internal to the codec.
// Thread-safe: pure functions.
// Source: near-duplicate deduplication, Magarshak 2026 §1 (layer 1); byte planes as in Blosc.
#ifndef KVTRIE_CODEC_CENTROID_LOSSLESS_H_
#define KVTRIE_CODEC_CENTROID_LOSSLESS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvtrie {

// Appends the coded difference of `data` against `reference` to `*out`.
// REQUIRES: data.size() == reference.size(), a multiple of element_bytes (1, 2 or 4).
void CompressCentroidDiff(absl::Span<const uint8_t> data, absl::Span<const uint8_t> reference,
                          size_t element_bytes, std::string* out);

// Inverse: out = reference + difference, bit-exact. Errors: DATA_LOSS if `compressed` is malformed
// or of the wrong size; INVALID_ARGUMENT if reference and out differ in size.
absl::Status DecompressCentroidDiff(absl::string_view compressed,
                                    absl::Span<const uint8_t> reference, size_t element_bytes,
                                    absl::Span<uint8_t> out);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_CENTROID_LOSSLESS_H_
