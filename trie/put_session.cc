// PutSession (trie/put_session.h): buffering of blocks and layer ranges, and the
// all-or-nothing encode-and-commit at Finish.
#include "trie/put_session.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/decode_chain.h"
#include "trie/model_shard.h"

namespace kvtrie {
namespace {

// "[2, 5), [7, 8)": the layers a block is still missing.
std::string RangeString(const std::vector<bool>& have) {
  std::string out;
  for (size_t i = 0; i < have.size();) {
    if (have[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < have.size() && !have[j]) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ", ", "[", i, ", ", j, ")");
    i = j;
  }
  return out;
}

}  // namespace

PutSession::PutSession(ModelShard* shard, ShardContext* context, ModelInfo model,
                       std::vector<uint32_t> token_ids, std::vector<float> surprisal_bits,
                       EncodeOptions encode)
    : shard_(shard),
      context_(context),
      model_(std::move(model)),
      token_ids_(std::move(token_ids)),
      surprisal_bits_(std::move(surprisal_bits)),
      encode_(encode),
      num_blocks_(static_cast<uint32_t>(token_ids_.size() / model_.geometry.block_tokens)) {}

PutSession::~PutSession() {
  context_->inflight_put_bytes.fetch_sub(buffered_bytes_, std::memory_order_relaxed);
}

absl::Status PutSession::AddLayers(uint32_t block_index, uint32_t layer_begin, uint32_t layer_end,
                                   absl::Span<const uint8_t> kv) {
  if (failed_) return absl::FailedPreconditionError("put: the stream already failed");
  const BlockGeometry& g = model_.geometry;
  auto fail = [&](absl::Status s) {
    failed_ = true;
    pending_.clear();
    return s;
  };
  if (block_index >= num_blocks_) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "block_index: ", block_index, " is past the last full block; token_ids hold ",
        token_ids_.size(), " tokens = ", num_blocks_, " full blocks of ", g.block_tokens)));
  }
  if (layer_end == 0) layer_end = g.num_layers;
  if (layer_end > g.num_layers || layer_begin >= layer_end) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("layer_end: layers [", layer_begin, ", ", layer_end, ") of block ",
                     block_index, " are not a range within num_layers=", g.num_layers)));
  }
  const size_t want = g.layer_range_bytes(layer_begin, layer_end);
  if (kv.size() != want) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("kv: block ", block_index, " layers [", layer_begin, ", ", layer_end, ") has ",
                     kv.size(), " bytes; the model spec (", g.DebugString(), ") needs ", want,
                     " — check head_dim, num_kv_heads, dtype and the token count")));
  }
  Pending& p = pending_[block_index];
  if (p.kv.empty()) {
    if (buffered_bytes_ + g.num_bytes() > context_->options->max_put_bytes) {
      return fail(absl::ResourceExhaustedError(absl::StrCat(
          "kv: this Put buffers more than max_put_bytes=", context_->options->max_put_bytes,
          " bytes; split it into several Puts")));
    }
    const uint64_t inflight =
        context_->inflight_put_bytes.fetch_add(g.num_bytes(), std::memory_order_relaxed) +
        g.num_bytes();
    buffered_bytes_ += g.num_bytes();  // released by the destructor
    if (inflight > context_->options->max_inflight_put_bytes) {
      return fail(absl::ResourceExhaustedError(
          absl::StrCat("kv: unfinished Puts hold more than max_inflight_put_bytes=",
                       context_->options->max_inflight_put_bytes, " bytes; retry later")));
    }
    p.kv.resize(g.num_bytes());
    p.have.assign(g.num_layers, false);
    p.layers_missing = g.num_layers;
  }
  for (uint32_t l = layer_begin; l < layer_end; ++l) {
    if (p.have[l]) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("layer_begin: layer ", l, " of block ", block_index, " was sent twice")));
    }
    p.have[l] = true;
    --p.layers_missing;
  }
  std::copy(kv.begin(), kv.end(),
            p.kv.begin() + static_cast<ptrdiff_t>(g.layer_range_bytes(0, layer_begin)));
  return absl::OkStatus();
}

absl::StatusOr<PutSummary> PutSession::Finish() {
  if (failed_) return absl::FailedPreconditionError("put: the stream already failed");
  failed_ = true;  // a session finishes once
  const BlockGeometry& g = model_.geometry;
  for (const auto& [index, p] : pending_) {
    if (p.layers_missing != 0) {
      return absl::InvalidArgumentError(absl::StrCat("kv: block ", index, " is missing layers ",
                                                     RangeString(p.have),
                                                     " (the stream ended early)"));
    }
  }
  PutSummary summary;
  summary.tail_tokens_ignored = static_cast<uint32_t>(token_ids_.size() % g.block_tokens);
  const absl::Span<const uint32_t> tokens(token_ids_);
  constexpr int kAttempts = 4;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const MatchResult match = shard_->Match(tokens);
    const uint32_t matched = static_cast<uint32_t>(match.node_ids.size());
    const uint64_t anchor = matched ? match.node_ids.back() : 0;
    // Every full block must be stored already or sent now.
    for (uint32_t b = matched; b < num_blocks_; ++b) {
      if (!pending_.contains(b)) {
        uint32_t e = b;
        while (e < num_blocks_ && !pending_.contains(e)) ++e;
        return absl::InvalidArgumentError(absl::StrCat(
            "kv: blocks [", b, ", ", e, ") of token_ids (", token_ids_.size(),
            " tokens) were never sent and are not stored; send every full block or fewer "
            "token_ids"));
      }
    }
    // Encode the new blocks in order; each is predicted from its parent's reconstruction, kept
    // by the decode chain (what a reader will decode).
    std::vector<ModelShard::NewBlock> blocks;
    DecodeChain chain(g, nullptr);
    std::vector<uint8_t> recon(g.num_bytes());
    if (matched > 0) {
      if (auto s = shard_->ReconstructNode(anchor, absl::MakeSpan(recon)); !s.ok()) {
        if (absl::IsAborted(s)) continue;  // the prefix changed under us: match again
        return s;
      }
      chain.NextDense(recon);
    }
    for (uint32_t b = matched; b < num_blocks_; ++b) {
      const std::vector<uint8_t>& kv = pending_.at(b).kv;
      PredictionContext ctx;
      ctx.parent = chain.parent();
      ctx.surprisal_bits = absl::MakeConstSpan(surprisal_bits_)
                               .subspan(static_cast<size_t>(b) * g.block_tokens, g.block_tokens);
      // Standalone, or a residual of a near-duplicate centroid when smaller.
      absl::StatusOr<ModelShard::NearDupEncoded> nd =
          shard_->EncodeNewBlock(model_, anchor, b, tokens, surprisal_bits_, kv, encode_, ctx);
      if (!nd.ok()) return nd.status();
      if (encode_.encoding == Encoding::kRaw || encode_.encoding == Encoding::kLossless) {
        chain.NextDense(kv);
      } else {
        if (nd->reference_node_id != 0) {
          chain.ReserveReferences(2);
          chain.AddReference(nd->reference_node_id, nd->reference);
          if (nd->reference_parent_id != 0) {
            chain.AddReference(nd->reference_parent_id, nd->reference_parent);
          }
        }
        if (auto s = chain.Next(nd->encoded.bytes, nd->reference_node_id, absl::MakeSpan(recon));
            !s.ok()) {
          return absl::InternalError(
              absl::StrCat("codec: cannot decode what it encoded: ", s.message()));
        }
      }
      blocks.push_back({b, std::move(nd->encoded), encode_.encoding, nd->reference_node_id});
    }
    absl::StatusOr<std::vector<uint64_t>> ids =
        blocks.empty() ? std::vector<uint64_t>{}
                       : shard_->Commit(model_, anchor, tokens, surprisal_bits_, blocks);
    if (absl::IsAborted(ids.status())) continue;  // the prefix changed under us: match again
    if (!ids.ok()) return ids.status();
    for (uint32_t b = 0; b < matched; ++b) {
      BlockReport r;
      r.block_index = b;
      r.outcome = BlockOutcome::kDeduplicated;
      r.node_id = match.node_ids[b];
      r.bytes_logical = g.num_bytes();
      summary.blocks.push_back(r);
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      BlockReport r;
      r.block_index = blocks[i].block_index;
      r.outcome =
          blocks[i].reference_node_id ? BlockOutcome::kResidualOfCentroid : BlockOutcome::kStored;
      r.reference_node_id = blocks[i].reference_node_id;
      r.node_id = (*ids)[i];
      r.bytes_logical = g.num_bytes();
      r.bytes_stored = blocks[i].encoded.bytes.size();
      r.encoding = blocks[i].encoding;
      r.bits_per_component = blocks[i].encoded.bits_per_component;
      r.rel_rms_error_k = blocks[i].encoded.rel_rms_error_k;
      r.rel_rms_error_v = blocks[i].encoded.rel_rms_error_v;
      r.max_abs_error = blocks[i].encoded.max_abs_error;
      summary.blocks.push_back(r);
    }
    summary.stored_tokens = num_blocks_ * g.block_tokens;
    shard_->CountPut(blocks.size(), matched, anchor);
    return summary;
  }
  return absl::AbortedError("put: the prefix kept changing under concurrent Puts; retry");
}

}  // namespace kvtrie
