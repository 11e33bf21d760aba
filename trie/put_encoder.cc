// PutEncoder and PutParentCache (trie/put_encoder.h): a PutSession's plan matched, encoded,
// committed through the shard's write protocol, counted and queued for learning in one call.
#include "trie/put_encoder.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "codec/decode_chain.h"
#include "trie/shard_learning.h"

namespace kvtrie {
namespace {

bool Clusterable(Encoding e) { return e == Encoding::kLossless || e == Encoding::kResidual; }

}  // namespace

std::shared_ptr<const std::vector<uint8_t>> PutParentCache::Find(uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, reconstruction] : parents_) {
    if (id == node_id) return reconstruction;
  }
  return nullptr;
}

void PutParentCache::Keep(uint64_t node_id, absl::Span<const uint8_t> reconstruction) {
  const uint64_t bound = context_->options->put_parent_cache_bytes;
  if (reconstruction.empty() || reconstruction.size() > bound) return;
  auto kept =
      std::make_shared<const std::vector<uint8_t>>(reconstruction.begin(), reconstruction.end());
  std::deque<std::pair<uint64_t, std::shared_ptr<const std::vector<uint8_t>>>> gone;
  std::atomic<uint64_t>& total = context_->put_parent_bytes;
  absl::MutexLock lock(&mu_);
  // The bound is the whole store's: this shard's oldest make room; when the other shards' alone
  // fill it, this one keeps nothing new.
  while (!parents_.empty() &&
         total.load(std::memory_order_relaxed) + reconstruction.size() > bound) {
    total.fetch_sub(parents_.front().second->size(), std::memory_order_relaxed);
    gone.push_back(std::move(parents_.front()));
    parents_.pop_front();
  }
  if (total.fetch_add(reconstruction.size(), std::memory_order_relaxed) + reconstruction.size() >
      bound) {
    total.fetch_sub(reconstruction.size(), std::memory_order_relaxed);
    return;
  }
  parents_.emplace_back(node_id, std::move(kept));
}

size_t PutParentCache::size() {
  absl::MutexLock lock(&mu_);
  return parents_.size();
}

PutEncoder::PutEncoder(ModelShard* shard) : shard_(shard), parents_(shard->context_) {}

absl::StatusOr<PutSummary> PutEncoder::ApplyPut(PutPlan& plan) {
  const ModelInfo& m = *plan.model;
  const BlockGeometry& g = m.geometry;
  const uint32_t num_blocks = static_cast<uint32_t>(plan.token_ids.size() / g.block_tokens);
  PutSummary summary;
  summary.tail_tokens_ignored = static_cast<uint32_t>(plan.token_ids.size() % g.block_tokens);
  const absl::Span<const uint32_t> tokens = plan.token_ids;
  constexpr int kAttempts = 4;
  uint32_t drops = 0;  // undecodable nodes dropped before a dedup: each removes one, not attempts
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const MatchResult match = shard_->Match(tokens);
    // A client-encoded node no decode has checked yet is decoded before this Put deduplicates
    // onto it; one that does not decode is dropped with its subtree, and the Put, which carries
    // the block, matches again and stores its own (issue 30).
    if (DroppedUndecodable(match.node_ids, plan.blocks)) {
      if (++drops <= num_blocks) --attempt;
      continue;
    }
    const uint32_t matched = static_cast<uint32_t>(match.node_ids.size());
    const uint64_t anchor = matched ? match.node_ids.back() : 0;
    // Every full block must be stored already or sent now.
    for (uint32_t b = matched; b < num_blocks; ++b) {
      if (!plan.blocks.contains(b)) {
        uint32_t e = b;
        while (e < num_blocks && !plan.blocks.contains(e)) ++e;
        return absl::InvalidArgumentError(absl::StrCat(
            "kv: blocks [", b, ", ", e, ") of token_ids (", plan.token_ids.size(),
            " tokens) were never sent and are not stored; send every full block or fewer "
            "token_ids"));
      }
    }
    // The new blocks: encoded on arrival (plan.early), or now, in order; a compact-profile block is
    // predicted from its parent's reconstruction, kept by the decode chain (what a reader will
    // decode).
    std::vector<ModelShard::NewBlock> blocks;
    // The latest learned state (kept until the commit; null when there is none) and what it
    // conditions on.
    std::shared_ptr<PredictorRegistry> registry = shard_->predictors();
    std::shared_ptr<const PredictorState> learned;
    if (plan.encode.encoding == Encoding::kResidual ||
        (plan.encode.encoding == Encoding::kLossless && plan.encode.profile == Profile::kFast &&
         plan.encode.learned_lossless)) {  // fast LOSSLESS against the state: issue 22
      learned = registry->AcquireLatest();
    }
    absl::Cleanup release = [&] {
      if (learned) registry->Release(learned->version());
    };
    DecodeChain chain(g, nullptr);
    chain.AddPredictor(learned);
    bool dense_new = false;  // some new block is dense: a compact chain may need its parent
    for (uint32_t b = matched; b < num_blocks; ++b) dense_new |= !plan.blocks.at(b).client_encoded;
    std::vector<uint8_t> recon(plan.early ? 0 : g.num_bytes());
    if (matched > 0 && !plan.early && dense_new) {
      std::shared_ptr<const std::vector<uint8_t>> kept = parents_.Find(anchor);
      if (kept != nullptr && kept->size() == recon.size()) {
        std::copy(kept->begin(), kept->end(), recon.begin());
      } else if (auto s = shard_->ReconstructNode(anchor, absl::MakeSpan(recon)); !s.ok()) {
        if (absl::IsAborted(s)) continue;  // the prefix changed under us: match again
        return s;
      }
      const size_t next = static_cast<size_t>(matched) * g.block_tokens;
      chain.StartAt(static_cast<uint32_t>(next), static_cast<int32_t>(plan.token_ids[next - 1]),
                    recon);
    }
    for (uint32_t b = matched; b < num_blocks; ++b) {
      const PlanBlock& p = plan.blocks.at(b);
      if (p.encoded != nullptr) {
        if (!p.encoded->ok()) return p.encoded->status();
        blocks.push_back(
            {b, **p.encoded, p.client_encoded ? p.client_encoding : plan.encode.encoding, 0,
             (**p.encoded)->predictor_version, p.client_encoded,
             p.client_encoded && !p.client_decoded && p.client_encoding != Encoding::kRaw});
        continue;
      }
      const auto kv =
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(p.kv->data()), p.kv->size());
      PredictionContext ctx;
      if (!plan.early) ctx.parent = chain.parent();
      const size_t off = static_cast<size_t>(b) * g.block_tokens;
      const std::vector<int32_t> block_tokens(plan.token_ids.begin() + off,
                                              plan.token_ids.begin() + off + g.block_tokens);
      const int32_t previous_token = off == 0 ? -1 : static_cast<int32_t>(plan.token_ids[off - 1]);
      ctx.learned = learned.get();
      ctx.tokens = block_tokens;
      ctx.first_position = static_cast<uint32_t>(off);
      ctx.previous_token = previous_token;
      ctx.surprisal_bits = absl::MakeConstSpan(plan.surprisal_bits)
                               .subspan(static_cast<size_t>(b) * g.block_tokens, g.block_tokens);
      // Standalone, or a residual of a near-duplicate centroid when smaller.
      absl::StatusOr<NearDupEncoded> nd =
          EncodeNewBlock(m, anchor, b, tokens, plan.surprisal_bits, kv, plan.encode, ctx);
      if (!nd.ok()) return nd.status();
      if (plan.early) {
        // Reads no other block: no chain to keep.
      } else if (plan.encode.encoding == Encoding::kRaw ||
                 plan.encode.encoding == Encoding::kLossless) {
        chain.NextDense(kv, block_tokens);
      } else {
        if (nd->reference_node_id != 0) {
          chain.ReserveReferences(2);
          chain.AddReference(nd->reference_node_id, nd->reference);
          if (nd->reference_parent_id != 0) {
            chain.AddReference(nd->reference_parent_id, nd->reference_parent);
          }
        }
        if (auto s = chain.Next(nd->encoded.bytes, nd->reference_node_id, absl::MakeSpan(recon),
                                block_tokens);
            !s.ok()) {
          return absl::InternalError(
              absl::StrCat("codec: cannot decode what it encoded: ", s.message()));
        }
      }
      const uint32_t predictor_version = nd->encoded.predictor_version;
      blocks.push_back({b, std::make_shared<const EncodedBlock>(std::move(nd->encoded)),
                        plan.encode.encoding, nd->reference_node_id, predictor_version});
      blocks.back().near_dup_searched = plan.encode.profile != Profile::kFast;
    }
    for (ModelShard::NewBlock& nb : blocks) {  // what a RESIDUAL block was asked to meet
      if (nb.encoding == Encoding::kResidual) nb.target_rel_rms = plan.encode.target_rel_rms;
    }
    absl::StatusOr<std::vector<uint64_t>> ids =
        blocks.empty() ? std::vector<uint64_t>{}
                       : shard_->Commit(m, anchor, tokens, plan.surprisal_bits, blocks);
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
      const EncodedBlock& e = *blocks[i].encoded;
      r.bytes_stored = e.bytes.size();
      r.encoding = blocks[i].encoding;
      r.bits_per_component = e.bits_per_component;
      r.rel_rms_error_k = e.rel_rms_error_k;
      r.rel_rms_error_v = e.rel_rms_error_v;
      r.max_abs_error = e.max_abs_error;
      summary.blocks.push_back(r);
    }
    summary.stored_tokens = num_blocks * g.block_tokens;
    // The last new block's reconstruction, for a Put that continues this one.
    if (!plan.early && dense_new && !blocks.empty()) parents_.Keep(ids->back(), chain.parent());
    shard_->CountPut(blocks.size(), matched, anchor);
    // Learned from in the background, never on this Put's path: a sample spread over the new
    // blocks, as many as the queue has room for; a client-encoded block is decoded there.
    if (shard_->context_->learn_queue != nullptr && !blocks.empty()) {
      std::vector<ShardLearning::LearnBlock> learn;
      learn.reserve(blocks.size());
      for (const ModelShard::NewBlock& nb : blocks) {
        PlanBlock& p = plan.blocks.at(nb.block_index);
        ShardLearning::LearnBlock lb;
        lb.block_index = nb.block_index;
        if (p.client_encoded) {
          lb.encoded = nb.encoded;
          if (nb.predictor_version != 0)
            lb.learned = plan.client_versions->at(nb.predictor_version);
        } else if (!p.kv->empty()) {
          lb.kv = std::move(*p.kv);  // the session is done with it
        } else {
          continue;
        }
        learn.push_back(std::move(lb));
      }
      shard_->learning_->QueueLearning(tokens, std::move(learn));
    }
    return summary;
  }
  return absl::AbortedError("put: the prefix kept changing under concurrent Puts; retry");
}

bool PutEncoder::DroppedUndecodable(absl::Span<const uint64_t> node_ids,
                                    const std::map<uint32_t, PlanBlock>& carried) {
  std::vector<BlockRead> unverified;  // listed under one lock, decoded with none held
  BlockGeometry g;
  {
    absl::MutexLock lock(&shard_->mu_);
    g = shard_->model_.geometry;
    std::shared_ptr<const ReadSnapshot> snapshot;
    for (const auto& [index, block] : carried) {
      if (index >= node_ids.size()) break;
      const TrieNode* n = shard_->FindLive(node_ids[index]);
      if (n != nullptr && n->unverified && !n->hidden()) {
        unverified.push_back(shard_->ListLocked(*n, nullptr, &snapshot));
      }
    }
  }
  if (unverified.empty()) return false;
  std::vector<uint8_t> out(g.num_bytes());
  for (const BlockRead& read : unverified) {
    DecodeChain chain(g, nullptr);  // a client-encoded block decodes alone (fast profile)
    std::vector<ModelShard::Corrupt> corrupt;
    absl::Status s = shard_->ReadAndDecodeInternal(read, &chain, absl::MakeSpan(out), &corrupt);
    shard_->DropCorrupt(corrupt);
    if (!corrupt.empty()) return true;
    if (s.ok()) {
      absl::MutexLock lock(&shard_->mu_);
      if (TrieNode* n = shard_->FindLive(read.node_id)) n->unverified = false;
    } else {  // not its bytes (a race, a state unreadable): deduplicated as before
      spdlog::warn("node {} of '{}'/'{}' could not be checked before a dedup: {}", read.node_id,
                   shard_->ns_, shard_->model_.model_id, s.ToString());
    }
  }
  return false;
}

absl::StatusOr<NearDupEncoded> PutEncoder::EncodeNewBlock(
    const ModelInfo& model, uint64_t anchor_id, uint32_t block_index,
    absl::Span<const uint32_t> token_ids, absl::Span<const float> surprisal_bits,
    absl::Span<const uint8_t> kv, const EncodeOptions& options, const PredictionContext& context) {
  const BlockGeometry& g = model.geometry;
  const uint32_t bt = g.block_tokens;
  NearDupEncoded out;
  absl::StatusOr<EncodedBlock> standalone = EncodeBlock(g, kv, options, context);
  if (!standalone.ok()) return standalone.status();
  out.encoded = *std::move(standalone);
  const NearDupOptions& nd = shard_->context_->options->near_dup;
  // The fast profile ignores a reference context: no candidate could be smaller.
  // FP8 / uint8 blocks are never coded against a centroid (the cluster pass skips them too).
  if (!nd.enabled || !Clusterable(options.encoding) || options.profile == Profile::kFast ||
      IsByteDType(g.dtype)) {
    return out;
  }

  std::vector<ClusterIndex::Candidate> candidates;
  {
    absl::MutexLock lock(&shard_->mu_);
    if (!shard_->committed_) return out;
    TrieNode* anchor = anchor_id == 0 ? shard_->trie_->root() : shard_->FindLive(anchor_id);
    if (anchor == nullptr) return out;  // changed concurrently: Commit will retry
    double path = anchor->path_surprisal_bits;
    for (size_t i = static_cast<size_t>(anchor->depth) * bt;
         i < static_cast<size_t>(block_index + 1) * bt && i < surprisal_bits.size(); ++i) {
      path += surprisal_bits[i];
    }
    candidates = shard_->clusters_.FindCandidates(
        shard_->trie_.get(), anchor, block_index + 1,
        token_ids.subspan(static_cast<size_t>(block_index) * bt, bt), path, nd.max_distance_bits,
        nd.max_candidates);
    if (!nd.position_shifted && !candidates.empty() && candidates.front().shifted) {
      shard_->clusters_.CountShifted(false);
      candidates.clear();
    }
    shard_->clusters_.CountTried(candidates.size());
  }
  if (candidates.empty()) return out;

  absl::StatusOr<bool> found =
      EncodeAgainstCandidates(g, kv, options, context, candidates, &out, nullptr);
  if (!found.ok()) return found.status();
  absl::MutexLock lock(&shard_->mu_);
  if (!*found) shard_->clusters_.CountNotSmaller();
  if (candidates.front().shifted) shard_->clusters_.CountShifted(*found);
  return out;
}

absl::StatusOr<bool> PutEncoder::EncodeAgainstCandidates(
    const BlockGeometry& g, absl::Span<const uint8_t> kv, const EncodeOptions& options,
    const PredictionContext& context, const std::vector<ClusterIndex::Candidate>& candidates,
    NearDupEncoded* out, std::vector<ModelShard::Corrupt>* corrupt) {
  // With write_mu_ held (corrupt set) a bad block is left for the caller to drop.
  const auto reconstruct = [&](uint64_t id, absl::Span<uint8_t> block) {
    return corrupt != nullptr ? shard_->ReconstructInternal(id, block, corrupt)
                              : shard_->ReconstructNode(id, block);
  };
  bool found = false;
  std::vector<uint8_t> reference(g.num_bytes());
  std::vector<uint8_t> reference_parent;
  for (const ClusterIndex::Candidate& c : candidates) {
    absl::Status s = reconstruct(c.node_id, absl::MakeSpan(reference));
    if (!s.ok()) continue;  // gone meanwhile: not a candidate any more
    PredictionContext ctx = context;
    ctx.reference = reference;
    EncodeOptions o = options;
    o.reference_node_id = c.node_id;
    if (c.shifted) {  // the centroid's window at a position offset (codec/reference_shift.h)
      reference_parent.resize(g.num_bytes());
      if (c.reference_parent_id != 0 &&
          !reconstruct(c.reference_parent_id, absl::MakeSpan(reference_parent)).ok()) {
        continue;
      }
      ctx.reference_parent = reference_parent;
      o.reference_shift = {.enabled = true,
                           .token_shift = c.token_shift,
                           .rotation = c.rotation,
                           .log_rope_base = -1,  // detected from the block and the window
                           .reference_parent_node_id = c.reference_parent_id,
                           .tail = c.tail};
    }
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, kv, o, ctx);
    if (!e.ok()) return e.status();
    absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
    if (!h.ok() || h->reference_node_id != c.node_id) continue;  // did not use the centroid
    if (e->bytes.size() < out->encoded.bytes.size()) {
      out->encoded = *std::move(e);
      out->reference_node_id = c.node_id;
      out->reference = reference;
      out->reference_parent_id = h->reference_shift.reference_parent_node_id;
      out->reference_parent = out->reference_parent_id ? reference_parent : std::vector<uint8_t>();
      found = true;
    }
  }
  return found;
}

}  // namespace kvtrie
