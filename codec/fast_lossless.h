// codec/fast_lossless.h
//
// The fast profile of the kLossless encoding (Profile::kFast): bit-exact, built for GB/s. The
// most significant byte of every element (sign, exponent, top mantissa bits: where the
// redundancy of a float is) is gathered into one plane and compressed with zstd at level 1; the
// other bytes (mantissa noise: 8.00 bits of entropy per byte on tests/data, lossless.h) are kept
// as is, de-interleaved, and never touch an entropy coder. Every bit pattern (NaN payloads,
// infinities, -0, subnormals) round-trips because only bytes are moved.
// Payload: u32 zstd frame length F, F bytes of zstd frame holding the high plane (n bytes), then
// (element_bytes - 1) planes of n bytes, the next most significant first. Params: one byte,
// kFastLosslessParamsVersion. See codec/FORMAT.md.
// Source: byte-plane ("shuffle") filters as in Blosc; zstd (RFC 8878).
// Thread-safe: pure functions.
#ifndef KVTRIE_CODEC_FAST_LOSSLESS_H_
#define KVTRIE_CODEC_FAST_LOSSLESS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"

namespace kvtrie {

inline constexpr uint8_t kFastLosslessParamsVersion = 4;

// Appends the payload of `data` (geometry.num_bytes() bytes) to `*out`.
void CompressFastLossless(const BlockGeometry& geometry, absl::Span<const uint8_t> data,
                          std::string* out);

// Fills `out` (geometry.num_bytes()). Errors: DATA_LOSS if `payload` is malformed.
absl::Status DecompressFastLossless(const BlockGeometry& geometry, absl::string_view payload,
                                    absl::Span<uint8_t> out);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_FAST_LOSSLESS_H_
