// codec/decode_alone.h
//
// Blocks that decode alone: from their own bytes and, when they name a learned predictor state
// (BlockHeader::predictor_version != 0), that state, their token ids, their first position and
// the token before them — never their parent's reconstruction or a centroid. The blocks of a prefix
// that decode alone can be decoded in parallel and in any order (the client's and the store's
// decode chains hand them to a pool); the others go down a DecodeChain (codec/decode_chain.h) in
// order.
//
// Which blocks: the fast profile (Profile::kFast, fast_residual.h and fast_lossless.h), whose
// predictors are none, the channel mean, temporal (inside the block), the learned token / pair
// mean (code 3: the state, the tokens, first_position for the keys' RoPE angles, and the previous
// token for the first token's pair) and the cross-layer linear prediction (code 4: the two planes
// before it in the same block, as decoded) with the state's KLT bases; none reads the parent.
// ParseBlock refuses a fast block with a centroid (a shifted reference needs one too), and
// DecodeBlock hands the fast decoder no parent, so the rule is read from the envelope alone and
// holds for every fast block whatever predictors its params choose: profile kFast and
// reference_node_id 0. A block of the compact profile may read its parent (kParent) or a centroid
// and never decodes alone, even when it happens not to.
//
// Thread-safe: pure functions; a PredictorState is immutable and may be shared by the threads.
#ifndef KVTRIE_CODEC_DECODE_ALONE_H_
#define KVTRIE_CODEC_DECODE_ALONE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_codec.h"

namespace kvtrie {

class PredictorState;  // codec/predictor_state.h

// True if the block `header` describes decodes alone (the rule above).
bool DecodesAlone(const BlockHeader& header);

// What a block that decodes alone may read besides its bytes. Only a block that names a
// predictor version reads it: `state` is that version's state (null when the block names none),
// `tokens` the block's block_tokens token ids, `first_position` the absolute position of
// tokens[0] (block index * block_tokens) and `previous_token` the token before it (the last token
// of the previous block; -1 at the start of a prefix). The same values the encoder was given.
struct AloneContext {
  const PredictorState* state = nullptr;
  absl::Span<const int32_t> tokens;
  uint32_t first_position = 0;
  int32_t previous_token = -1;
};

// Decodes `encoded` — a block that decodes alone — into `out` (geometry.num_bytes() bytes).
// `verified`: the bytes' CRC-32C was checked already (ParseBlock), so it is not again.
// Errors: FAILED_PRECONDITION if the block does not decode alone (it may read its parent or a
// centroid: decode it on a DecodeChain); otherwise DecodeBlock's (DATA_LOSS for malformed bytes;
// INVALID_ARGUMENT for `out` of the wrong size; FAILED_PRECONDITION naming the version when the
// block names one and `context.state` is null or of another version, or `context.tokens` does not
// hold block_tokens ids).
absl::Status DecodeAlone(absl::string_view encoded, const AloneContext& context,
                         absl::Span<uint8_t> out, bool verified = false);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_DECODE_ALONE_H_
