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

ResidualChain::ResidualChain(const BlockGeometry& geometry, FetchReference fetch,
                             FetchPredictor fetch_predictor)
    : geometry_(geometry),
      fetch_predictor_(std::move(fetch_predictor)),
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
                                   uint32_t predictor_version, absl::Span<const uint32_t> tokens,
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
  if (h->predictor_version != predictor_version) {
    return BlockLoss(block_index,
                     absl::StrCat("coded against predictor state version ", h->predictor_version,
                                  ", predictor_version says ", predictor_version));
  }
  if (tokens.size() != geometry_.block_tokens) {
    return BlockLoss(block_index, absl::StrCat(tokens.size(), " token ids for a block of ",
                                               geometry_.block_tokens));
  }
  std::shared_ptr<const PredictorState> learned;
  if (predictor_version != 0) {
    if (!fetch_predictor_) {
      return absl::FailedPreconditionError(
          absl::StrCat("get: block ", block_index, " needs predictor state version ",
                       predictor_version, " and this client cannot fetch it"));
    }
    absl::StatusOr<std::shared_ptr<const PredictorState>> state =
        fetch_predictor_(predictor_version);
    if (!state.ok()) return state.status();
    const BlockGeometry& sg = (*state)->geometry();
    if ((*state)->version() != predictor_version || sg.num_layers != geometry_.num_layers ||
        sg.num_kv_heads != geometry_.num_kv_heads || sg.head_dim != geometry_.head_dim ||
        sg.dtype != geometry_.dtype) {
      return BlockLoss(block_index, absl::StrCat("the fetched predictor state is version ",
                                                 (*state)->version(), " of ", sg.DebugString()));
    }
    learned = *std::move(state);
  }
  const std::vector<int32_t> block_tokens(tokens.begin(), tokens.end());
  current_block_ = block_index;
  chain_.AddPredictor(std::move(learned));
  if (absl::Status s = chain_.Next(encoded, reference_node_id, out, block_tokens); !s.ok()) {
    return s;
  }
  ++next_block_;
  return absl::OkStatus();
}

}  // namespace kvtrie
