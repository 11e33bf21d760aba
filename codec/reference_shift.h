// codec/reference_shift.h
//
// A centroid prediction at a position offset: for a block that repeats stored text a few tokens
// later or earlier (a word inserted or deleted before it), the prediction is the stored text's KV
// at the same tokens, with the keys turned by RoPE to the block's positions. Keys after RoPE at
// position p are R(p) k; turning a stored key by R(r) moves it from position q to q + r, and
// rotations compose, so token-and-position dependent parts (all of layer 0, the per-channel key
// offsets of every layer) match again; values carry no position and are copied.
//
// The reference window: the stored path's tokens at positions [start, start + block_tokens) where
// the block repeats them. It straddles two consecutive nodes of that path: `reference` (the
// centroid, the block's reference_node_id, positions [q, q + T)) and its parent (positions
// [q - T, q)). With token_shift s (0 <= s < T, T = block_tokens), block token j is predicted from
//   j <  s: the centroid's parent's token T - s + j,
//   j >= s: the centroid's token j - s,
// keys turned by `rotation` positions (block position of token j minus the position of the token
// it is predicted from; the same for every token, as the window is contiguous). With `tail` the
// window's end is not stored (the stored text stops there): the centroid is the node holding the
// window's start, block tokens j < s come from its tokens T - s + j, and every later token from
// its last token, turned by rotation + (j - s + 1) positions (its own position difference). On each
// channel pair (a, b) with angle phi = rotation * theta_i, theta_i = base^(-2i / head_dim): (a cos
// phi - b sin phi, a sin phi + b cos phi), computed in double from a deterministic cos/sin
// (Cody-Waite reduction and Taylor series, IEEE operations only) and rounded to float, then to the
// dtype, so encoder and decoder build the same window bit for bit on any machine. Channel pairs are
// adjacent (2i, 2i + 1) (llama2.c, GGML; stories260K with base 10000) or, with `half_split`,
// (i, i + head_dim / 2) (GPT-NeoX / Hugging Face). An odd head_dim's last channel is not turned.
//
// In the envelope (envelope.h): flags bit 7 marks a block coded against a shifted reference;
// its params then start with this prefix (the encoding's own params follow), 4-5 bytes typically:
//   u8 flags: bit 0 = half_split; bits 1-2 = the RoPE base: 0 = keys not turned, 1 = 10000,
//     2 = 500000, 3 = an f32 ln(base) follows (finite, in (0, 40]); bit 3 = tail; other bits 0;
//   LEB128 token_shift (< block_tokens); LEB128 ZigZag rotation (|rotation| <= kMaxShiftRotation);
//   [f32 ln(base), little-endian]; LEB128 reference parent node id (nonzero iff token_shift > 0
//   and not tail; a tail window needs token_shift > 0).
// (ln 10000 and ln 500000 are the float constants kLogRopeBase10000 / kLogRopeBase500000.)
// Only the compact kResidual (a head predicted with kCentroid) and the kLossless centroid
// difference (centroid_lossless.h) use it; anything else with the flag, or a malformed prefix, is
// DATA_LOSS. Blocks without the flag decode as before.
//
// Thread-safe: pure functions. Source: RoPE, Su et al. 2021 (RoFormer), §3.4; the near-duplicate
// centroids of Magarshak 2026 §1 (layer 1).
#ifndef KVTRIE_CODEC_REFERENCE_SHIFT_H_
#define KVTRIE_CODEC_REFERENCE_SHIFT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"

namespace kvtrie {

// The most positions a shifted reference's keys are turned by.
inline constexpr int32_t kMaxShiftRotation = 1 << 16;
// ln(10000) and ln(500000) as floats (the bases coded in one flag value).
inline constexpr float kLogRopeBase10000 = 9.21034037197618f;
inline constexpr float kLogRopeBase500000 = 13.1223633774043f;

struct ReferenceShift {
  bool enabled = false;
  uint32_t token_shift = 0;  // s, see above; < block_tokens
  int32_t rotation = 0;      // positions the reference's keys are turned by
  // ln(RoPE base) of the keys: 0 = not turned, else in (0, 40]. Encoder only: < 0 = detect it,
  // with half_split, from the block and the window (no rotation, 10000 or 500000, either pairing:
  // the one whose keys predict the block's best).
  float log_rope_base = -1;
  bool half_split = false;                // channel pairs (i, i + D / 2), else (2i, 2i + 1)
  uint64_t reference_parent_node_id = 0;  // the centroid's parent; nonzero iff token_shift > 0
  bool tail = false;  // the window's end is not stored (see above); no reference parent
};

namespace internal {

// INVALID_ARGUMENT naming the field when `shift` (log_rope_base already chosen) cannot be coded.
absl::Status CheckReferenceShift(const BlockGeometry& geometry, const ReferenceShift& shift);

// Appends the params prefix. REQUIRES: CheckReferenceShift is OK.
void AppendReferenceShift(const ReferenceShift& shift, std::string* out);

// Parses the prefix off the front of `*params` (advanced past it). Errors: DATA_LOSS naming what
// is malformed.
absl::StatusOr<ReferenceShift> ParseReferenceShift(const BlockGeometry& geometry,
                                                   absl::string_view* params);

// Sets shift->log_rope_base and half_split to the candidate whose window keys are nearest the
// block's keys (sum of squares over every key plane); no rotation unless a base is 2 % better.
// `kv`, `reference`, `reference_parent`: blocks of `geometry` (reference_parent may be empty when
// token_shift is 0).
void DetectShiftRope(const BlockGeometry& geometry, absl::Span<const uint8_t> kv,
                     absl::Span<const uint8_t> reference,
                     absl::Span<const uint8_t> reference_parent, ReferenceShift* shift);

// Writes the window (block layout, the dtype) into `out`. Errors: FAILED_PRECONDITION when
// `reference_parent` is needed (token_shift > 0) and empty; INVALID_ARGUMENT when a span has the
// wrong size.
absl::Status BuildShiftedReference(const BlockGeometry& geometry, const ReferenceShift& shift,
                                   absl::Span<const uint8_t> reference,
                                   absl::Span<const uint8_t> reference_parent,
                                   absl::Span<uint8_t> out);

}  // namespace internal
}  // namespace kvtrie

#endif  // KVTRIE_CODEC_REFERENCE_SHIFT_H_
