// codec/fast_lossless_learned.h
//
// The fast kLossless profile against a learned predictor state (issue 22; measured in
// bench/lossless.md): bit-exact, decodable alone from the state, the block's token ids, its
// position and the previous token. Every element x of a 16-bit dtype (fp16, bf16) is coded as
//   d = ord(x) - ord(round_to_dtype(p))  (mod 2^16)
// with p = PredictorState::Predict (token and pair means, keys rotated) and ord the monotone
// bijection of the 65,536 patterns (+0 -> 0, -0 -> -1, -|x| -> -1 - bits): every pattern (NaN
// payloads, infinities, -0, subnormals) round-trips whatever p is. d is zigzagged (z) and split
// into a token (z < 16: z; else 11 + bit length of z, 16..27) coded with interleaved rANS
// (codec/rans_interleaved.h, 32 lanes, one table per (layer, K/V) plane) and bit length - 1 raw
// bits below the leading one, LSB first.
// Payload: the 2L planes' rANS tables in block order (irans::WriteTable), u32 segment bytes S,
// one segment of S bytes (32 lanes; plane after plane, each plane's H*T*D tokens padded with
// token 0 to a multiple of 32, the table switching every padded plane), u32 raw bytes R, then R
// bytes of raw bits (every element's, in block order, LSB first, zero-padded to a byte). Params:
// one byte, kFastLosslessLearnedParamsVersion; the envelope names the state's version
// (BlockHeader::predictor_version). See codec/FORMAT.md.
// Thread-safe: pure functions.
#ifndef KVTRIE_CODEC_FAST_LOSSLESS_LEARNED_H_
#define KVTRIE_CODEC_FAST_LOSSLESS_LEARNED_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/predictor_state.h"

namespace kvtrie {

inline constexpr uint8_t kFastLosslessLearnedParamsVersion = 5;

// True if the mode applies: a 16-bit dtype, `state` predicts `geometry` and `tokens` has
// geometry.block_tokens ids.
bool CanCodeFastLosslessLearned(const BlockGeometry& geometry, const PredictorState& state,
                                absl::Span<const int32_t> tokens);

// Appends the payload of `data` (geometry.num_bytes() bytes) to `*out`. REQUIRES:
// CanCodeFastLosslessLearned. `tokens`, `first_position`, `previous_token` as
// PredictorState::Predict takes them; the decoder must be given the same.
void CompressFastLosslessLearned(const BlockGeometry& geometry, absl::Span<const uint8_t> data,
                                 const PredictorState& state, absl::Span<const int32_t> tokens,
                                 uint32_t first_position, int32_t previous_token, std::string* out);

// Fills `out` (geometry.num_bytes()). Errors: DATA_LOSS if `payload` is malformed;
// FAILED_PRECONDITION if !CanCodeFastLosslessLearned.
absl::Status DecompressFastLosslessLearned(const BlockGeometry& geometry, absl::string_view payload,
                                           const PredictorState& state,
                                           absl::Span<const int32_t> tokens,
                                           uint32_t first_position, int32_t previous_token,
                                           absl::Span<uint8_t> out);

// Checks the payload's layout without the state (block_verify.h): every table parses, every
// length stays inside the payload, the segment has no more words than symbols, nothing trails.
// Errors: DATA_LOSS naming what is wrong (and the plane, for a table).
absl::Status CheckFastLosslessLearnedLayout(const BlockGeometry& geometry,
                                            absl::string_view payload);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_FAST_LOSSLESS_LEARNED_H_
