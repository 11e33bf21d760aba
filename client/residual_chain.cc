#include "client/residual_chain.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"

namespace kvtrie {

namespace {

absl::Status BlockLoss(uint32_t block_index, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("get: block ", block_index, ": ", what));
}

}  // namespace

ResidualChain::ResidualChain(const BlockGeometry& geometry, FetchReference fetch)
    : geometry_(geometry),
      chain_(geometry,
             [this, fetch = std::move(fetch)](uint64_t node_id,
                                              absl::Span<uint8_t> out) -> absl::Status {
               absl::StatusOr<std::vector<uint8_t>> ref = fetch(node_id);
               if (!ref.ok()) return ref.status();
               if (ref->size() != out.size()) {
                 return BlockLoss(current_block_, absl::StrCat("centroid ", node_id, " has ",
                                                               ref->size(), " bytes"));
               }
               std::memcpy(out.data(), ref->data(), out.size());
               return absl::OkStatus();
             }) {}

absl::Status ResidualChain::Decode(uint32_t block_index, uint64_t reference_node_id,
                                   absl::string_view encoded, absl::Span<uint8_t> out) {
  if (block_index != next_block_) {
    return BlockLoss(block_index,
                     absl::StrCat("arrived out of order (expected block ", next_block_, ")"));
  }
  if (out.size() != geometry_.num_bytes()) {
    return BlockLoss(block_index, "output buffer of the wrong size");
  }
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  if (!h.ok()) return BlockLoss(block_index, h.status().message());
  if (!(h->geometry == geometry_)) {
    return BlockLoss(block_index, absl::StrCat("encoded as ", h->geometry.DebugString(),
                                               ", the model is ", geometry_.DebugString()));
  }
  if (h->reference_node_id != reference_node_id) {
    return BlockLoss(block_index, absl::StrCat("encoded against node ", h->reference_node_id,
                                               ", reference_node_id says ", reference_node_id));
  }
  current_block_ = block_index;
  if (absl::Status s = chain_.Next(encoded, reference_node_id, out); !s.ok()) return s;
  ++next_block_;
  return absl::OkStatus();
}

}  // namespace kvtrie
