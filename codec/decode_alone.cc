#include "codec/decode_alone.h"

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvtrie {

bool DecodesAlone(const BlockHeader& header) {
  return header.profile == Profile::kFast && header.reference_node_id == 0 &&
         !header.reference_shift.enabled;
}

absl::Status DecodeAlone(absl::string_view encoded, const AloneContext& context,
                         absl::Span<uint8_t> out, bool verified) {
  absl::StatusOr<BlockHeader> h = verified ? ParseVerifiedBlock(encoded) : ParseBlock(encoded);
  if (!h.ok()) return h.status();
  if (!DecodesAlone(*h)) {
    return absl::FailedPreconditionError(
        absl::StrCat("decode alone: a ", h->profile == Profile::kFast ? "fast" : "compact",
                     "-profile block (centroid node ", h->reference_node_id,
                     ") may read its parent or centroid: decode it on a DecodeChain"));
  }
  PredictionContext ctx;  // no parent, no reference: a block that decodes alone reads neither
  if (h->predictor_version != 0) {
    ctx.learned = context.state;
    ctx.tokens = context.tokens;
    ctx.first_position = context.first_position;
    ctx.previous_token = context.previous_token;
  }
  // The envelope is parsed a second time (no CRC pass): a few dozen bytes.
  return DecodeVerifiedBlock(encoded, out, ctx);
}

}  // namespace kvtrie
