// codec/lossless.h
//
// Bit-exact compression of a dtype tensor: the elements are split into byte planes (for fp16 the
// high bytes — sign, exponent, top mantissa bits — then the low bytes), and each plane is
// compressed with zstd. Planes separate the predictable exponent bytes from the near-random low
// mantissa bytes, which is what makes a general-purpose compressor useful on floats.
// Source: byte-plane ("shuffle") filters as in Blosc and HDF5; zstd (RFC 8878).
#ifndef KVTRIE_CODEC_LOSSLESS_H_
#define KVTRIE_CODEC_LOSSLESS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvtrie {

// Compresses `data`, a sequence of elements of `element_bytes` bytes each (data.size() must be a
// multiple of it), appending to `*out`.
void CompressBytePlanes(absl::Span<const uint8_t> data, size_t element_bytes, std::string* out);

// Inverse of CompressBytePlanes: fills `out` exactly. Errors: DATA_LOSS if `compressed` is
// malformed or does not decode to out.size() bytes.
absl::Status DecompressBytePlanes(absl::string_view compressed, size_t element_bytes,
                                  absl::Span<uint8_t> out);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_LOSSLESS_H_
