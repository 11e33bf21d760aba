#include "codec/decode_chain.h"

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"

namespace kvtrie {

DecodeChain::DecodeChain(const BlockGeometry& geometry, FetchReference fetch)
    : geometry_(geometry), fetch_(std::move(fetch)) {}

void DecodeChain::AddReference(uint64_t node_id, absl::Span<const uint8_t> block) {
  if (references_.size() >= kMaxReferences) references_.clear();  // bound the cache
  references_[node_id].assign(block.begin(), block.end());
}

absl::Status DecodeChain::Next(absl::string_view encoded, uint64_t reference_node_id,
                               absl::Span<uint8_t> out, bool verified) {
  std::shared_ptr<const void> owner = std::move(out_owner_);
  out_owner_.reset();
  if (out.size() != geometry_.num_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("out: ", out.size(), " bytes, the block has ", geometry_.num_bytes()));
  }
  PredictionContext ctx;
  ctx.parent = parent_;
  if (reference_node_id != 0) {
    auto it = references_.find(reference_node_id);
    if (it == references_.end()) {
      if (!fetch_) {
        return absl::FailedPreconditionError(
            absl::StrCat("reference node ", reference_node_id, ": no way to fetch it"));
      }
      std::vector<uint8_t> ref(geometry_.num_bytes());
      if (absl::Status s = fetch_(reference_node_id, absl::MakeSpan(ref)); !s.ok()) return s;
      if (references_.size() >= kMaxReferences) references_.clear();
      it = references_.emplace(reference_node_id, std::move(ref)).first;
    }
    ctx.reference = it->second;
  }
  absl::Status s =
      verified ? DecodeVerifiedBlock(encoded, out, ctx) : DecodeBlock(encoded, out, ctx);
  if (!s.ok()) return s;
  if (owner != nullptr) {
    NextDenseShared(std::move(owner), out);
  } else {
    NextDense(out);
  }
  return absl::OkStatus();
}

void DecodeChain::NextDense(absl::Span<const uint8_t> block) {
  parent_owner_.reset();
  parent_copy_.assign(block.begin(), block.end());
  parent_ = parent_copy_;
}

void DecodeChain::NextDenseShared(std::shared_ptr<const void> owner,
                                  absl::Span<const uint8_t> block) {
  parent_owner_ = std::move(owner);
  parent_ = block;
}

}  // namespace kvtrie
