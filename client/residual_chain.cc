#include "client/residual_chain.h"

#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/decode_alone.h"
#include "codec/predictor_state.h"

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

absl::Status ResidualChain::Check(uint32_t block_index, uint32_t expected,
                                  uint64_t reference_node_id, uint32_t predictor_version,
                                  size_t token_count, absl::string_view encoded,
                                  absl::Span<uint8_t> out, bool* independent) {
  if (block_index != expected) {
    return BlockLoss(block_index,
                     absl::StrCat("arrived out of order (expected block ", expected, ")"));
  }
  if (out.size() != geometry_.num_bytes()) {
    return BlockLoss(block_index, "output buffer of the wrong size");
  }
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);  // checks the CRC-32C
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
  if (token_count != geometry_.block_tokens) {
    return BlockLoss(block_index, absl::StrCat(token_count, " token ids for a block of ",
                                               geometry_.block_tokens));
  }
  // Fast-profile blocks read their own bytes and, when they name one, a learned state, their
  // tokens, position and previous token: never the parent (codec/decode_alone.h).
  *independent = DecodesAlone(*h);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const PredictorState>> ResidualChain::FetchState(
    uint32_t block_index, uint32_t predictor_version) {
  if (last_state_ != nullptr && last_state_->version() == predictor_version) return last_state_;
  if (!fetch_predictor_) {
    return absl::FailedPreconditionError(
        absl::StrCat("get: block ", block_index, " needs predictor state version ",
                     predictor_version, " and this client cannot fetch it"));
  }
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = fetch_predictor_(predictor_version);
  if (!state.ok()) return state.status();
  if (*state == nullptr) {
    return BlockLoss(block_index, absl::StrCat("no predictor state version ", predictor_version));
  }
  const BlockGeometry& sg = (*state)->geometry();
  if ((*state)->version() != predictor_version || sg.num_layers != geometry_.num_layers ||
      sg.num_kv_heads != geometry_.num_kv_heads || sg.head_dim != geometry_.head_dim ||
      sg.dtype != geometry_.dtype) {
    return BlockLoss(block_index, absl::StrCat("the fetched predictor state is version ",
                                               (*state)->version(), " of ", sg.DebugString()));
  }
  last_state_ = *state;
  return state;
}

absl::Status ResidualChain::UseState(uint32_t block_index, uint32_t predictor_version) {
  if (predictor_version == 0) return absl::OkStatus();
  absl::StatusOr<std::shared_ptr<const PredictorState>> state =
      FetchState(block_index, predictor_version);
  if (!state.ok()) return state.status();
  chain_.AddPredictor(*std::move(state));
  return absl::OkStatus();
}

absl::Status ResidualChain::NextOnChain(uint32_t block_index, uint64_t reference_node_id,
                                        absl::Span<const uint32_t> tokens,
                                        absl::string_view encoded, absl::Span<uint8_t> out) {
  current_block_ = block_index;
  const uint32_t position = block_index * geometry_.block_tokens;
  if (chain_.first_position() != position || chain_.previous_token() != last_token_) {
    // Blocks decoded off the chain (DecodeMany's independent ones) did not advance it.
    const std::vector<uint8_t> parent(chain_.parent().begin(), chain_.parent().end());
    chain_.StartAt(position, last_token_, parent);
  }
  const std::vector<int32_t> block_tokens(tokens.begin(), tokens.end());
  // Check verified the CRC: the chain does not again.
  return chain_.Next(encoded, reference_node_id, out, block_tokens, /*verified=*/true);
}

absl::Status ResidualChain::Decode(uint32_t block_index, uint64_t reference_node_id,
                                   uint32_t predictor_version, absl::Span<const uint32_t> tokens,
                                   absl::string_view encoded, absl::Span<uint8_t> out) {
  bool independent = false;
  if (auto s = Check(block_index, next_block_, reference_node_id, predictor_version, tokens.size(),
                     encoded, out, &independent);
      !s.ok()) {
    return s;
  }
  if (auto s = UseState(block_index, predictor_version); !s.ok()) return s;
  if (auto s = NextOnChain(block_index, reference_node_id, tokens, encoded, out); !s.ok()) {
    return s;
  }
  last_token_ = static_cast<int32_t>(tokens.back());
  ++next_block_;
  return absl::OkStatus();
}

absl::Status ResidualChain::DecodeMany(absl::Span<const uint32_t> block_indices,
                                       absl::Span<const uint64_t> reference_node_ids,
                                       absl::Span<const uint32_t> predictor_versions,
                                       absl::Span<const uint32_t> prefix_tokens,
                                       absl::Span<const absl::string_view> encoded,
                                       absl::Span<const absl::Span<uint8_t>> outs, ThreadPool* pool,
                                       const std::function<void(size_t)>& done) {
  const size_t n = encoded.size();
  if (block_indices.size() != n || reference_node_ids.size() != n ||
      predictor_versions.size() != n || outs.size() != n) {
    return absl::InvalidArgumentError("DecodeMany: spans of different lengths");
  }
  const uint32_t bt = geometry_.block_tokens;
  auto tokens_of = [&](size_t i) -> absl::Span<const uint32_t> {
    const size_t first = static_cast<size_t>(block_indices[i]) * bt;
    if (first + bt > prefix_tokens.size()) return {};
    return prefix_tokens.subspan(first, bt);
  };
  std::vector<char> independent(n, 0);
  std::vector<size_t> parallel;
  for (size_t i = 0; i < n; ++i) {
    bool ind = false;
    if (auto s =
            Check(block_indices[i], next_block_ + static_cast<uint32_t>(i), reference_node_ids[i],
                  predictor_versions[i], tokens_of(i).size(), encoded[i], outs[i], &ind);
        !s.ok()) {
      return s;
    }
    independent[i] = ind;
  }
  // The states the independent blocks name, each fetched once, here (the fetcher need not be
  // thread-safe). A failed fetch is reported at the first block that needs it, after the blocks
  // before it (as Decode in order would).
  std::map<uint32_t, absl::StatusOr<std::shared_ptr<const PredictorState>>> states;
  std::vector<absl::Status> status(n);
  std::vector<const PredictorState*> state_of(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    if (!independent[i]) continue;
    if (const uint32_t v = predictor_versions[i]; v != 0) {
      auto it = states.find(v);
      if (it == states.end()) {
        it = states.emplace(v, FetchState(block_indices[i], v)).first;
        if (it->second.ok()) chain_.AddPredictor(*it->second);  // for the chain's blocks too
      }
      if (!it->second.ok()) {
        status[i] = it->second.status();
        continue;
      }
      state_of[i] = it->second->get();
    }
    parallel.push_back(i);
  }
  auto decode = [&](size_t k) {
    const size_t i = parallel[k];
    AloneContext ctx;
    std::vector<int32_t> tokens;
    if (state_of[i] != nullptr) {
      const absl::Span<const uint32_t> t = tokens_of(i);
      tokens.assign(t.begin(), t.end());
      ctx.state = state_of[i];
      ctx.tokens = tokens;
      ctx.first_position = block_indices[i] * bt;
      // The last token of the block before (this batch's, or last_token_ for the first).
      ctx.previous_token = i == 0 ? last_token_ : static_cast<int32_t>(tokens_of(i - 1).back());
    }
    // Check verified the CRC: DecodeAlone does not again.
    absl::Status s = DecodeAlone(encoded[i], ctx, outs[i], /*verified=*/true);
    if (s.ok()) {
      done(i);
    } else {
      // The block's index in the message, the code kept (FAILED_PRECONDITION stays one).
      status[i] =
          absl::Status(s.code(), absl::StrCat("get: block ", block_indices[i], ": ", s.message()));
    }
  };
  if (pool != nullptr) {
    pool->ParallelFor(parallel.size(), decode);
  } else {
    for (size_t k = 0; k < parallel.size(); ++k) decode(k);
  }
  for (size_t i = 0; i < n; ++i) {
    current_block_ = block_indices[i];
    const absl::Span<const uint32_t> tokens = tokens_of(i);
    if (independent[i]) {
      if (!status[i].ok()) return status[i];
      // The chain keeps a block as the parent only where the next block (this batch's, or the
      // first of the next call) may read it.
      if (i + 1 == n || !independent[i + 1]) chain_.NextDense(outs[i]);
    } else {
      if (auto s = UseState(block_indices[i], predictor_versions[i]); !s.ok()) return s;
      if (auto s =
              NextOnChain(block_indices[i], reference_node_ids[i], tokens, encoded[i], outs[i]);
          !s.ok()) {
        return s;
      }
      done(i);
    }
    last_token_ = static_cast<int32_t>(tokens.back());
  }
  next_block_ += static_cast<uint32_t>(n);
  return absl::OkStatus();
}

}  // namespace kvtrie
