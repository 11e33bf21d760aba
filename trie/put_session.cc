// PutSession (trie/put_session.h): buffering of blocks and layer ranges, and the
// all-or-nothing encode-and-commit at Finish.
#include "trie/put_session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "codec/block_verify.h"
#include "codec/decode_chain.h"
#include "trie/error_reason.h"
#include "trie/model_shard.h"
#include "trie/put_encoder.h"

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

// VerifyEncoded::kSample decodes the blocks whose index + this is a multiple of 8: which ones is
// drawn per Put, so a client cannot place a forged block where the sample never looks.
uint32_t SamplePhase() {
  thread_local std::minstd_rand rng(std::random_device{}());
  return static_cast<uint32_t>(rng() % 8);
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
      sample_phase_(SamplePhase()),
      num_blocks_(static_cast<uint32_t>(token_ids_.size() / model_.geometry.block_tokens)),
      early_(encode_.encoding == Encoding::kRaw ||
             (encode_.profile == Profile::kFast && (encode_.encoding == Encoding::kResidual ||
                                                    encode_.encoding == Encoding::kLossless))),
      stored_at_begin_(early_ ? static_cast<uint32_t>(shard_->Match(token_ids_).node_ids.size())
                              : 0) {
  if (early_ && (encode_.encoding == Encoding::kResidual ||
                 (encode_.encoding == Encoding::kLossless &&
                  encode_.learned_lossless))) {  // fast LOSSLESS against the state: issue 22
    // Held (counted as pending) until this session ends, so it outlives the commit.
    early_registry_ = shard_->predictors();
    early_learned_ = early_registry_->AcquireLatest();
  }
  if (early_ && context_->codec_pool != nullptr) {
    encoders_ =
        std::make_unique<TaskGroup>(context_->codec_pool, 2 * context_->codec_pool->threads());
  }
}

PutSession::~PutSession() {
  if (encoders_) encoders_->Wait();  // no task may still read early_learned_
  if (early_learned_) early_registry_->Release(early_learned_->version());
  if (!client_versions_.empty()) {
    std::shared_ptr<PredictorRegistry> registry = shard_->predictors();
    for (const auto& [version, state] : client_versions_) registry->Release(version);
  }
  context_->inflight_put_bytes.fetch_sub(buffered_bytes_, std::memory_order_relaxed);
}

absl::Status PutSession::Fail(absl::Status s) {
  failed_ = true;
  if (encoders_) encoders_->Wait();  // no task may still write into a Pending
  pending_.clear();
  return s;
}

absl::Status PutSession::CheckIndex(uint32_t block_index) {
  if (block_index < num_blocks_) return absl::OkStatus();
  return Fail(absl::InvalidArgumentError(
      absl::StrCat("block_index: ", block_index, " is past the last full block; token_ids hold ",
                   token_ids_.size(), " tokens = ", num_blocks_, " full blocks of ",
                   model_.geometry.block_tokens)));
}

absl::StatusOr<PutSession::Pending*> PutSession::Admit(uint32_t block_index, uint64_t reserve) {
  const BlockGeometry& g = model_.geometry;
  if (reserve == 0) reserve = g.num_bytes();
  Pending& p = pending_[block_index];
  if (p.have.empty()) {
    if (buffered_dense_bytes_ + g.num_bytes() > context_->options->max_put_bytes) {
      return Fail(absl::ResourceExhaustedError(absl::StrCat(
          "kv: this Put buffers more than max_put_bytes=", context_->options->max_put_bytes,
          " bytes; split it into several Puts")));
    }
    const uint64_t inflight =
        context_->inflight_put_bytes.fetch_add(reserve, std::memory_order_relaxed) + reserve;
    buffered_bytes_ += reserve;  // released by the destructor
    buffered_dense_bytes_ += g.num_bytes();
    if (inflight > context_->options->max_inflight_put_bytes) {
      return Fail(absl::ResourceExhaustedError(
          absl::StrCat("kv: unfinished Puts hold more than max_inflight_put_bytes=",
                       context_->options->max_inflight_put_bytes, " bytes; retry later")));
    }
    p.have.assign(g.num_layers, false);
    p.layers_missing = g.num_layers;
  }
  return &p;
}

void PutSession::BlockComplete(uint32_t block_index, Pending* p) {
  if (!early_ || block_index < stored_at_begin_) return;  // encoded at Finish if still needed
  const BlockGeometry& g = model_.geometry;
  p->encoded = std::make_unique<absl::StatusOr<std::shared_ptr<const EncodedBlock>>>();
  // With learning on, the dense bytes stay until the commit queues them for the learner;
  // otherwise they move into the task and are freed once encoded.
  const bool learning = context_->learn_queue != nullptr;
  const std::string* kept = learning ? &p->kv : nullptr;  // pending_'s nodes do not move
  std::string moved = learning ? std::string() : std::move(p->kv);
  auto encode = [this, g, block_index, out = p->encoded.get(), kept, moved = std::move(moved)] {
    const std::string& kv = kept != nullptr ? *kept : moved;
    PredictionContext ctx;
    const size_t off = static_cast<size_t>(block_index) * g.block_tokens;
    ctx.surprisal_bits = absl::MakeConstSpan(surprisal_bits_).subspan(off, g.block_tokens);
    std::vector<int32_t> block_tokens;
    if (early_learned_) {  // fast-profile RESIDUAL / LOSSLESS: the learned state, as at Finish
      block_tokens.assign(token_ids_.begin() + off, token_ids_.begin() + off + g.block_tokens);
      ctx.learned = early_learned_.get();
      ctx.tokens = block_tokens;
      ctx.first_position = static_cast<uint32_t>(off);
      ctx.previous_token = off == 0 ? -1 : static_cast<int32_t>(token_ids_[off - 1]);
    }
    absl::StatusOr<EncodedBlock> e =
        EncodeBlock(g, absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(kv.data()), kv.size()),
                    encode_, ctx);
    if (e.ok()) {
      *out = std::make_shared<const EncodedBlock>(*std::move(e));
    } else {
      *out = e.status();
    }
  };
  if (!learning) p->kv = std::string();
  if (encoders_) {
    encoders_->Run(std::move(encode));
  } else {
    encode();
  }
}

absl::Status PutSession::AddLayers(uint32_t block_index, uint32_t layer_begin, uint32_t layer_end,
                                   absl::Span<const uint8_t> kv) {
  if (failed_) return absl::FailedPreconditionError("put: the stream already failed");
  const BlockGeometry& g = model_.geometry;
  if (absl::Status s = CheckIndex(block_index); !s.ok()) return s;
  if (layer_end == 0) layer_end = g.num_layers;
  if (layer_end > g.num_layers || layer_begin >= layer_end) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("layer_end: layers [", layer_begin, ", ", layer_end, ") of block ",
                     block_index, " are not a range within num_layers=", g.num_layers)));
  }
  const size_t want = g.layer_range_bytes(layer_begin, layer_end);
  if (kv.size() != want) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("kv: block ", block_index, " layers [", layer_begin, ", ", layer_end, ") has ",
                     kv.size(), " bytes; the model spec (", g.DebugString(), ") needs ", want,
                     " — check head_dim, num_kv_heads, dtype and the token count")));
  }
  absl::StatusOr<Pending*> admitted = Admit(block_index);
  if (!admitted.ok()) return admitted.status();
  Pending& p = **admitted;
  for (uint32_t l = layer_begin; l < layer_end; ++l) {
    if (p.have[l]) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("layer_begin: layer ", l, " of block ", block_index, " was sent twice")));
    }
  }
  if (p.kv.empty()) p.kv.resize(g.num_bytes());
  for (uint32_t l = layer_begin; l < layer_end; ++l) p.have[l] = true;
  p.layers_missing -= layer_end - layer_begin;
  std::memcpy(p.kv.data() + g.layer_range_bytes(0, layer_begin), kv.data(), kv.size());
  if (p.layers_missing == 0) BlockComplete(block_index, &p);
  return absl::OkStatus();
}

absl::Status PutSession::AddBlock(uint32_t block_index, std::string kv) {
  if (failed_) return absl::FailedPreconditionError("put: the stream already failed");
  const BlockGeometry& g = model_.geometry;
  if (absl::Status s = CheckIndex(block_index); !s.ok()) return s;
  auto it = pending_.find(block_index);
  if (kv.size() != g.num_bytes() || (it != pending_.end() && !it->second.have.empty())) {
    // A size error or a block sent twice: AddLayers names it.
    return AddLayers(block_index, 0, g.num_layers,
                     absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(kv.data()), kv.size()));
  }
  absl::StatusOr<Pending*> admitted = Admit(block_index);
  if (!admitted.ok()) return admitted.status();
  Pending& p = **admitted;
  p.kv = std::move(kv);
  p.have.assign(g.num_layers, true);
  p.layers_missing = 0;
  BlockComplete(block_index, &p);
  return absl::OkStatus();
}

absl::StatusOr<const PredictorState*> PutSession::AcquireVersion(uint32_t version) {
  auto it = client_versions_.find(version);
  if (it != client_versions_.end()) return it->second.get();
  absl::StatusOr<std::shared_ptr<const PredictorState>> state =
      shard_->predictors()->AcquireVersion(version);
  if (!state.ok()) return state.status();
  const PredictorState* raw = state->get();
  client_versions_.emplace(version, *std::move(state));
  return raw;
}

absl::Status PutSession::AddEncodedBlock(uint32_t block_index, std::string encoded,
                                         ClientError error) {
  if (failed_) return absl::FailedPreconditionError("put: the stream already failed");
  const BlockGeometry& g = model_.geometry;
  if (absl::Status s = CheckIndex(block_index); !s.ok()) return s;
  if (pending_.contains(block_index)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("encoded: block ", block_index, " was sent twice")));
  }
  const struct {
    const char* name;
    double value;
    double max;  // a rel RMS error past it is absurd, and would skew every aggregate of Stats
  } reported[] = {{"rel_rms_error_k", error.rel_rms_error_k, kMaxClientRelRmsError},
                  {"rel_rms_error_v", error.rel_rms_error_v, kMaxClientRelRmsError},
                  {"max_abs_error", error.max_abs_error, std::numeric_limits<double>::infinity()}};
  for (const auto& r : reported) {
    if (!std::isfinite(r.value) || r.value < 0 || r.value > r.max) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          r.name, ": block ", block_index, " reports ", r.value, "; must be finite and >= 0",
          std::isfinite(r.max) ? absl::StrCat(" and <= ", r.max) : "")));
    }
  }
  absl::StatusOr<BlockHeader> h =
      VerifyEncodedBlock(g, encoded, [this](uint32_t version) { return AcquireVersion(version); });
  if (!h.ok()) {
    if (absl::IsFailedPrecondition(h.status())) {  // "predictor_version: ..." from the registry
      absl::string_view m = h.status().message();
      absl::ConsumePrefix(&m, "predictor_version: ");
      absl::Status stale = absl::FailedPreconditionError(
          absl::StrCat("predictor_version: block ", block_index, " encoded: ", m));
      if (const std::string reason = ErrorReason(h.status()); !reason.empty()) {
        stale = WithErrorReason(std::move(stale), reason);
      }
      return Fail(std::move(stale));
    }
    if (absl::StartsWith(h.status().message(), "predictor_fingerprint: ")) {
      absl::string_view m = h.status().message();
      absl::ConsumePrefix(&m, "predictor_fingerprint: ");
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("predictor_fingerprint: block ", block_index, " encoded: ", m,
                       " (namespace '", shard_->ns(), "', model '", model_.model_id,
                       "'): fetch that version with GetPredictor and encode again")));
    }
    return Fail(absl::Status(h.status().code(), absl::StrCat("kv: block ", block_index,
                                                             " encoded: ", h.status().message())));
  }
  const VerifyEncoded level = context_->options->verify_encoded_puts;
  bool decoded = false;
  if (level == VerifyEncoded::kAll ||
      (level == VerifyEncoded::kSample && (block_index + sample_phase_) % 8 == 0)) {
    const size_t off = static_cast<size_t>(block_index) * g.block_tokens;
    const std::vector<int32_t> tokens(token_ids_.begin() + off,
                                      token_ids_.begin() + off + g.block_tokens);
    PredictionContext ctx;
    if (h->predictor_version != 0) ctx.learned = client_versions_.at(h->predictor_version).get();
    ctx.tokens = tokens;
    ctx.first_position = static_cast<uint32_t>(off);
    ctx.previous_token = off == 0 ? -1 : static_cast<int32_t>(token_ids_[off - 1]);
    std::vector<uint8_t> out(g.num_bytes());
    if (absl::Status s = DecodeVerifiedBlock(encoded, absl::MakeSpan(out), ctx); !s.ok()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("kv: block ", block_index, " encoded: does not decode: ", s.message())));
    }
    decoded = true;
  }
  absl::StatusOr<Pending*> admitted = Admit(block_index, encoded.size());
  if (!admitted.ok()) return admitted.status();
  Pending& p = **admitted;
  p.have.assign(g.num_layers, true);
  p.layers_missing = 0;
  p.client_encoded = true;
  p.client_encoding = h->encoding;
  p.client_decoded = decoded;
  auto e = std::make_shared<EncodedBlock>();
  e->bits_per_component = 8.0 * static_cast<double>(encoded.size()) / g.num_elements();
  e->rel_rms_error_k = error.rel_rms_error_k;
  e->rel_rms_error_v = error.rel_rms_error_v;
  e->max_abs_error = error.max_abs_error;
  e->predictor_version = h->predictor_version;
  e->bytes = std::move(encoded);
  p.encoded = std::make_unique<absl::StatusOr<std::shared_ptr<const EncodedBlock>>>(std::move(e));
  return absl::OkStatus();
}

absl::StatusOr<PutSummary> PutSession::Finish() {
  if (failed_) return absl::FailedPreconditionError("put: the stream already failed");
  failed_ = true;  // a session finishes once
  if (encoders_) encoders_->Wait();
  for (const auto& [index, p] : pending_) {
    if (p.layers_missing != 0) {
      return absl::InvalidArgumentError(absl::StrCat("kv: block ", index, " is missing layers ",
                                                     RangeString(p.have),
                                                     " (the stream ended early)"));
    }
  }
  if (!early_) {  // a compact-profile block predicts from its parent's reconstruction
    bool client = false, dense = false;
    for (const auto& [index, p] : pending_) (p.client_encoded ? client : dense) = true;
    if (client && dense) {
      return absl::InvalidArgumentError(
          "encoded: a Put whose PutHeader.encoding is of the compact profile cannot mix encoded "
          "and dense blocks (a compact block predicts from its parent); send them in two Puts");
    }
  }
  // One plan for the shard: it matches, encodes what is left, commits, counts and queues
  // learning in one call.
  PutPlan plan;
  plan.model = &model_;
  plan.token_ids = token_ids_;
  plan.surprisal_bits = surprisal_bits_;
  plan.encode = encode_;
  plan.early = early_;
  plan.client_versions = &client_versions_;
  for (auto& [index, p] : pending_) {
    PlanBlock& b = plan.blocks[index];
    b.kv = &p.kv;
    b.encoded = p.encoded.get();
    b.client_encoded = p.client_encoded;
    b.client_encoding = p.client_encoding;
    b.client_decoded = p.client_decoded;
  }
  return shard_->put_encoder().ApplyPut(plan);
}

}  // namespace kvtrie
