// ModelShard: its learned predictor states (trie/predictor_registry.h). Learning from committed
// blocks on the store's LearnQueue, persisting and publishing each fitted version, freeing
// versions without dependents, and decoding a block with the state it names.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "codec/crc32c.h"
#include "trie/model_shard.h"

namespace kvtrie {

std::shared_ptr<PredictorRegistry> ModelShard::predictors() const {
  absl::MutexLock lock(&mu_);
  return predictors_;
}

PredictorRegistry::Loader ModelShard::PredictorLoader() {
  return [this](uint32_t version) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
    absl::StatusOr<std::string> bytes = context_->records->ReadPredictor(shard_id_, version);
    if (!bytes.ok()) return bytes.status();
    return PredictorState::Parse(*bytes);
  };
}

void ModelShard::RecoverPredictor(const PredictorMeta& meta,
                                  absl::StatusOr<std::shared_ptr<const PredictorState>> state) {
  if (state.ok() && (*state)->version() != meta.version) {
    state = absl::DataLossError(absl::StrCat("the state names version ", (*state)->version()));
  }
  if (!state.ok()) {
    spdlog::error(
        "predictor state version {} of '{}'/'{}' is unreadable; its dependents are lost: {}",
        meta.version, ns_, meta.model_id, state.status().ToString());
  }
  predictors()->RecoverVersion(meta.version, std::move(state), meta.state_bytes,
                               meta.tokens_learned);
  context_->tiers->AddSideBytes(meta.state_bytes);
}

BlockRead ModelShard::ListLocked(const TrieNode& n, const BlockRead* previous,
                                 std::shared_ptr<const ReadSnapshot>* snapshot) {
  BlockRead r;
  r.node_id = n.id;
  r.encoded = context_->tiers->HotCopy(Ref(n.id));
  r.encoding = n.encoding;
  r.reference_node_id = n.reference_node_id;
  if (n.reference_node_id != 0) r.retired = retired_;
  if (!r.encoded) {
    if (!*snapshot) *snapshot = context_->records->Snapshot();
    r.snapshot = *snapshot;
  }
  r.predictor_version = n.predictor_version;
  if (previous != nullptr && previous->predictor_version == r.predictor_version) {
    r.predictor_hold = previous->predictor_hold;
  } else {
    r.predictor_hold = predictors_->Hold(r.predictor_version);  // under mu_: no gap
  }
  r.tokens.assign(n.token_ids.begin(), n.token_ids.end());
  r.first_position = n.depth == 0 ? 0 : (n.depth - 1) * model_.geometry.block_tokens;
  r.previous_token = n.parent != nullptr && !n.parent->token_ids.empty()
                         ? static_cast<int32_t>(n.parent->token_ids.back())
                         : -1;
  return r;
}

void ModelShard::ScheduleFreeUnusedPredictors() {
  if (context_->learn_queue != nullptr &&
      context_->learn_queue->Push(0, [this] { FreeUnusedPredictors(); })) {
    return;
  }
  FreeUnusedPredictors();
}

absl::Status ModelShard::DecodeNext(const BlockRead& block, const std::string& payload,
                                    DecodeChain* chain, absl::Span<uint8_t> out,
                                    bool* undecodable) {
  *undecodable = false;
  std::shared_ptr<const PredictorState> learned;
  if (block.predictor_version != 0) {
    absl::StatusOr<std::shared_ptr<const PredictorState>> state =
        predictors()->Find(block.predictor_version);
    if (absl::IsNotFound(state.status())) {  // not kept: a bug (a read holds what it names)
      return absl::NotFoundError(absl::StrCat("its learned predictor state version ",
                                              block.predictor_version, " is not kept"));
    }
    if (absl::IsDataLoss(state.status())) {  // failed its own check: dropped as a state
      return absl::DataLossError(absl::StrCat("its learned predictor state is unreadable: ",
                                              state.status().message(), "; the node is kept"));
    }
    if (!state.ok()) return state.status();
    learned = *std::move(state);
  }
  if (chain->first_position() != block.first_position ||
      chain->previous_token() != block.previous_token) {
    // The caller decodes a path from the middle (or skipped blocks): the chain follows the store.
    const std::vector<uint8_t> parent(chain->parent().begin(), chain->parent().end());
    chain->StartAt(block.first_position, block.previous_token, parent);
  }
  chain->AddPredictor(std::move(learned));
  // ReadPayloadInternal's bytes are verified: a hot copy was checked when it was made (encoded
  // here, or parsed when read from disk), a cold one was just parsed. So a DATA_LOSS here is not
  // of the bytes: they do not decode in this context.
  absl::Status s =
      chain->Next(payload, block.reference_node_id, out, block.tokens, /*verified=*/true);
  if (absl::IsDataLoss(s)) {
    *undecodable = true;
    return absl::InternalError(
        absl::StrCat("it passes its checksum but does not decode: ", s.message()));
  }
  return s;
}

void ModelShard::QueueLearning(absl::Span<const uint32_t> token_ids,
                               std::vector<LearnBlock> blocks) {
  if (context_->learn_queue == nullptr || blocks.empty()) return;
  const BlockGeometry& g = model().geometry;
  // A learned state predicts floats: FP8 / uint8 blocks (RAW or LOSSLESS only) teach it nothing.
  if (IsByteDType(g.dtype)) return;
  std::shared_ptr<PredictorRegistry> registry = predictors();
  const uint32_t bt = g.block_tokens;
  std::vector<LearnQueue::Job> jobs;
  jobs.reserve(blocks.size());
  std::vector<bool> is_encoded;
  for (LearnBlock& b : blocks) {
    const size_t off = static_cast<size_t>(b.block_index) * bt;
    if (off + bt > token_ids.size()) continue;
    if (b.encoded == nullptr && b.kv.size() != g.num_bytes()) continue;
    std::vector<int32_t> tokens(token_ids.begin() + off, token_ids.begin() + off + bt);
    const int32_t previous = off == 0 ? -1 : static_cast<int32_t>(token_ids[off - 1]);
    // Keeps the version an encoded block names from being freed until the job is gone (run or
    // dropped); the state itself is kept alive by `b.learned`.
    std::shared_ptr<const void> hold =
        b.encoded != nullptr ? registry->Hold(b.encoded->predictor_version) : nullptr;
    is_encoded.push_back(b.encoded != nullptr);
    auto job = [this, registry, tokens = std::move(tokens), previous, hold = std::move(hold),
                b = std::move(b)] { Learn(registry, b.block_index, tokens, previous, b); };
    // An encoded block counts at its dense size: that is what the learner decodes and reads.
    jobs.emplace_back(g.num_bytes(), std::move(job));
  }
  // Seeded by the Put's first tokens, so Puts of equal length sample different offsets.
  uint64_t seed = token_ids.size();
  for (size_t i = 0; i < std::min<size_t>(token_ids.size(), bt); ++i) {
    seed = seed * 1099511628211ull + token_ids[i];
  }
  std::vector<bool> queued = context_->learn_queue->PushSample(std::move(jobs), seed);
  uint64_t dropped = 0, encoded_dropped = 0;
  for (size_t i = 0; i < queued.size(); ++i) {
    if (queued[i]) continue;
    ++dropped;
    encoded_dropped += is_encoded[i];
  }
  if (dropped != 0) registry->CountDropped(dropped, encoded_dropped);
}

bool ModelShard::Learn(const std::shared_ptr<PredictorRegistry>& registry, uint32_t block_index,
                       const std::vector<int32_t>& tokens, int32_t previous_token,
                       const LearnBlock& block) {
  const uint32_t first_position = block_index * static_cast<uint32_t>(tokens.size());
  std::vector<uint8_t> decoded;
  absl::Span<const uint8_t> kv(reinterpret_cast<const uint8_t*>(block.kv.data()), block.kv.size());
  if (block.encoded != nullptr) {
    // Checked when it arrived (PutSession::AddEncodedBlock) and in memory since.
    PredictionContext ctx;
    ctx.learned = block.learned.get();
    ctx.tokens = tokens;
    ctx.first_position = first_position;
    ctx.previous_token = previous_token;
    decoded.resize(model().geometry.num_bytes());
    if (absl::Status s = DecodeVerifiedBlock(block.encoded->bytes, absl::MakeSpan(decoded), ctx);
        !s.ok()) {
      spdlog::warn("decoding a client-encoded block of '{}'/'{}' to learn from: {}", ns_,
                   model().model_id, s.ToString());
      registry->CountDropped(1, 1);
      return false;
    }
    kv = decoded;
  }
  absl::StatusOr<bool> due = registry->Observe(kv, tokens, first_position, previous_token);
  if (!due.ok()) {
    spdlog::warn("learning from a block of '{}'/'{}': {}", ns_, model().model_id,
                 due.status().ToString());
    return false;
  }
  // Counted before a refit publishes: Stats never shows a version without its observations.
  if (block.encoded != nullptr) registry->CountEncodedObserved();
  if (!*due || !context_->records->health().ok()) return true;
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = registry->Fit();
  if (!state.ok()) {
    spdlog::warn("fitting a predictor state of '{}'/'{}': {}", ns_, model().model_id,
                 state.status().ToString());
    return true;
  }
  const std::string bytes = (*state)->Serialize();
  // Persisted first, inside the disk budget; published (new blocks code against it) only then.
  if (!context_->tiers->Reserve(bytes.size())) {
    spdlog::warn(
        "predictor state version {} of '{}'/'{}' ({} bytes) does not fit the disk "
        "budget; not published",
        (*state)->version(), ns_, model().model_id, bytes.size());
    return true;
  }
  PredictorMeta meta;
  meta.ns = ns_;
  meta.model_id = model().model_id;
  meta.version = (*state)->version();
  meta.state_bytes = bytes.size();
  meta.state_crc32c = Crc32c(bytes);
  meta.tokens_learned = (*state)->tokens_learned();
  RecordBatch batch(context_->records);
  batch.PutPredictor(shard_id_, meta, bytes);
  absl::Status s = context_->records->Write(batch);
  if (s.ok()) context_->tiers->AddSideBytes(bytes.size());
  context_->tiers->Unreserve(bytes.size());
  if (!s.ok()) {
    spdlog::error("persisting predictor state version {} of '{}'/'{}': {}", meta.version, ns_,
                  meta.model_id, s.ToString());
    return true;
  }
  registry->Publish(*std::move(state), bytes.size());
  FreeUnusedPredictors();  // the previous latest, if nothing was coded against it
  return true;
}

void ModelShard::FreeUnusedPredictors() {
  std::shared_ptr<PredictorRegistry> registry = predictors();
  std::vector<uint32_t> unused = registry->TakeUnused();
  if (unused.empty()) return;
  RecordBatch batch(context_->records);
  uint64_t bytes = 0;
  for (uint32_t v : unused) {
    batch.DeletePredictor(shard_id_, v);
    bytes += registry->StateBytes(v);
  }
  if (absl::Status s = context_->records->Write(batch); !s.ok()) {
    registry->Unmark(unused);
    spdlog::error("freeing {} predictor states of '{}'/'{}': {}", unused.size(), ns_,
                  model().model_id, s.ToString());
    return;
  }
  registry->Forget(unused);
  context_->tiers->RemoveSideBytes(bytes);
}

absl::StatusOr<std::string> ModelShard::SerializedPredictor(uint32_t version) {
  if (version == 0) {
    return absl::InvalidArgumentError("version: 0 names no predictor state; versions start at 1");
  }
  if (absl::Status s = predictors()->Check(version); !s.ok()) return s;
  absl::StatusOr<std::string> bytes = context_->records->ReadPredictor(shard_id_, version);
  if (absl::IsNotFound(bytes.status())) {
    return absl::NotFoundError(absl::StrCat("version: predictor state version ", version,
                                            " is not stored (freed meanwhile)"));
  }
  return bytes;
}

std::vector<PredictorVersionView> ModelShard::PredictorVersions() const {
  return predictors()->Versions();
}

}  // namespace kvtrie
