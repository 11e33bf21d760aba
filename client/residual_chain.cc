#include "client/residual_chain.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"

namespace kvtrie {

ResidualChain::ResidualChain(const BlockGeometry& geometry, FetchReference fetch)
    : geometry_(geometry), fetch_(std::move(fetch)) {}

absl::Status ResidualChain::Decode(uint32_t block_index, uint64_t reference_node_id,
                                   absl::string_view encoded, absl::Span<uint8_t> out) {
  const auto loss = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat("get: block ", block_index, ": ", what));
  };
  if (block_index != next_block_) {
    return loss(absl::StrCat("arrived out of order (expected block ", next_block_, ")"));
  }
  if (out.size() != geometry_.num_bytes()) return loss("output buffer of the wrong size");
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  if (!h.ok()) return loss(h.status().message());
  if (!(h->geometry == geometry_)) {
    return loss(absl::StrCat("encoded as ", h->geometry.DebugString(), ", the model is ",
                             geometry_.DebugString()));
  }
  if (h->reference_node_id != reference_node_id) {
    return loss(absl::StrCat("encoded against node ", h->reference_node_id,
                             ", reference_node_id says ", reference_node_id));
  }
  PredictionContext ctx;
  ctx.parent = parent_;
  if (reference_node_id != 0) {
    auto it = references_.find(reference_node_id);
    if (it == references_.end()) {
      absl::StatusOr<std::vector<uint8_t>> ref = fetch_(reference_node_id);
      if (!ref.ok()) return ref.status();
      if (ref->size() != geometry_.num_bytes()) {
        return loss(absl::StrCat("centroid ", reference_node_id, " has ", ref->size(), " bytes"));
      }
      if (references_.size() >= 64) references_.clear();  // bound the cache
      it = references_.emplace(reference_node_id, *std::move(ref)).first;
    }
    ctx.reference = it->second;
  }
  if (absl::Status s = DecodeBlock(encoded, out, ctx); !s.ok()) return s;
  parent_.assign(out.begin(), out.end());
  ++next_block_;
  return absl::OkStatus();
}

}  // namespace kvtrie
