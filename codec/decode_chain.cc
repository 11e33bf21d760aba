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

void DecodeChain::ReserveReferences(size_t n) {
  if (references_.size() + n > kMaxReferences) references_.clear();
}

uint64_t DecodeChain::ReferenceParentOf(absl::string_view encoded, uint64_t reference_node_id) {
  if (reference_node_id == 0) return 0;
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  return h.ok() ? h->reference_shift.reference_parent_node_id : 0;
}

absl::StatusOr<absl::Span<const uint8_t>> DecodeChain::Reference(uint64_t node_id) {
  auto it = references_.find(node_id);
  if (it == references_.end()) {
    if (!fetch_) {
      return absl::FailedPreconditionError(
          absl::StrCat("reference node ", node_id, ": no way to fetch it"));
    }
    std::vector<uint8_t> ref(geometry_.num_bytes());
    if (absl::Status s = fetch_(node_id, absl::MakeSpan(ref)); !s.ok()) return s;
    it = references_.emplace(node_id, std::move(ref)).first;
  }
  return absl::MakeConstSpan(it->second);
}

absl::Status DecodeChain::Next(absl::string_view encoded, uint64_t reference_node_id,
                               absl::Span<uint8_t> out) {
  if (out.size() != geometry_.num_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("out: ", out.size(), " bytes, the block has ", geometry_.num_bytes()));
  }
  PredictionContext ctx;
  ctx.parent = parent_;
  if (reference_node_id != 0) {
    const uint64_t parent_id = ReferenceParentOf(encoded, reference_node_id);
    const size_t missing = (references_.contains(reference_node_id) ? 0 : 1) +
                           (parent_id != 0 && !references_.contains(parent_id) ? 1 : 0);
    if (missing > 0) ReserveReferences(missing);  // the two spans below stay valid
    absl::StatusOr<absl::Span<const uint8_t>> ref = Reference(reference_node_id);
    if (!ref.ok()) return ref.status();
    ctx.reference = *ref;
    if (parent_id != 0) {
      absl::StatusOr<absl::Span<const uint8_t>> up = Reference(parent_id);
      if (!up.ok()) return up.status();
      ctx.reference_parent = *up;
    }
  }
  if (absl::Status s = DecodeBlock(encoded, out, ctx); !s.ok()) return s;
  parent_.assign(out.begin(), out.end());
  return absl::OkStatus();
}

void DecodeChain::NextDense(absl::Span<const uint8_t> block) {
  parent_.assign(block.begin(), block.end());
}

}  // namespace kvtrie
