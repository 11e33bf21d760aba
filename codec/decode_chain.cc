#include "codec/decode_chain.h"

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/envelope.h"
#include "codec/predictor_state.h"

namespace kvtrie {

DecodeChain::DecodeChain(const BlockGeometry& geometry, FetchReference fetch,
                         FetchPredictor fetch_predictor)
    : geometry_(geometry), fetch_(std::move(fetch)), fetch_predictor_(std::move(fetch_predictor)) {}

void DecodeChain::AddReference(uint64_t node_id, absl::Span<const uint8_t> block) {
  if (references_.size() >= kMaxReferences) references_.clear();  // bound the cache
  references_[node_id].assign(block.begin(), block.end());
}

void DecodeChain::ReserveReferences(size_t n) {
  if (references_.size() + n > kMaxReferences) references_.clear();
}

uint64_t DecodeChain::ReferenceParentOf(absl::string_view encoded, uint64_t reference_node_id,
                                        bool verified) {
  if (reference_node_id == 0) return 0;
  absl::StatusOr<BlockHeader> h = verified ? ParseVerifiedBlock(encoded) : ParseBlock(encoded);
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

void DecodeChain::AddPredictor(std::shared_ptr<const PredictorState> state) {
  if (state == nullptr) return;
  if (predictors_.size() >= kMaxPredictors) predictors_.clear();
  predictors_[state->version()] = std::move(state);
}

void DecodeChain::StartAt(uint32_t first_position, int32_t previous_token,
                          absl::Span<const uint8_t> parent) {
  first_position_ = first_position;
  previous_token_ = previous_token;
  parent_owner_.reset();
  parent_copy_.assign(parent.begin(), parent.end());
  parent_ = parent_copy_;
}

void DecodeChain::Advance(absl::Span<const int32_t> tokens) {
  first_position_ += geometry_.block_tokens;
  previous_token_ = tokens.empty() ? -1 : tokens.back();
}

absl::Status DecodeChain::Next(absl::string_view encoded, uint64_t reference_node_id,
                               absl::Span<uint8_t> out, absl::Span<const int32_t> tokens,
                               bool verified) {
  std::shared_ptr<const void> owner = std::move(out_owner_);
  out_owner_.reset();
  if (out.size() != geometry_.num_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("out: ", out.size(), " bytes, the block has ", geometry_.num_bytes()));
  }
  PredictionContext ctx;
  ctx.parent = parent_;
  if (reference_node_id != 0) {
    const uint64_t parent_id = ReferenceParentOf(encoded, reference_node_id, verified);
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
  if (const uint32_t version = PeekPredictorVersion(encoded); version != 0) {
    auto it = predictors_.find(version);
    if (it == predictors_.end() && fetch_predictor_) {
      // A corrupt block is DATA_LOSS, not a fetch of whatever version its bytes hold.
      if (absl::StatusOr<BlockHeader> h = ParseBlock(encoded); !h.ok()) return h.status();
      absl::StatusOr<std::shared_ptr<const PredictorState>> state = fetch_predictor_(version);
      if (!state.ok()) return state.status();
      if (*state == nullptr || (*state)->version() != version) {
        return absl::InternalError(
            absl::StrCat("predictor fetcher: asked for version ", version, ", got another"));
      }
      AddPredictor(*std::move(state));
      it = predictors_.find(version);
    }
    if (it != predictors_.end()) ctx.learned = it->second.get();
    ctx.tokens = tokens;
    ctx.first_position = first_position_;
    ctx.previous_token = previous_token_;
  }
  absl::Status s =
      verified ? DecodeVerifiedBlock(encoded, out, ctx) : DecodeBlock(encoded, out, ctx);
  if (!s.ok()) return s;
  if (owner != nullptr) {
    NextDenseShared(std::move(owner), out, tokens);
  } else {
    NextDense(out, tokens);
  }
  return absl::OkStatus();
}

void DecodeChain::NextDense(absl::Span<const uint8_t> block, absl::Span<const int32_t> tokens) {
  parent_owner_.reset();
  parent_copy_.assign(block.begin(), block.end());
  parent_ = parent_copy_;
  Advance(tokens);
}

void DecodeChain::NextDenseShared(std::shared_ptr<const void> owner,
                                  absl::Span<const uint8_t> block,
                                  absl::Span<const int32_t> tokens) {
  parent_owner_ = std::move(owner);
  parent_ = block;
  Advance(tokens);
}

}  // namespace kvtrie
