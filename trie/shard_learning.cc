// ShardLearning (trie/shard_learning.h): learning from committed blocks on the store's
// LearnQueue, persisting and publishing each fitted version, freeing versions without dependents.
#include "trie/shard_learning.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "codec/crc32c.h"
#include "trie/model_shard.h"

namespace kvtrie {

PredictorRegistry::Loader PersistedPredictorLoader(RecordStore* records, uint64_t shard_id) {
  return [records,
          shard_id](uint32_t version) -> absl::StatusOr<std::shared_ptr<const PredictorState>> {
    absl::StatusOr<std::string> bytes = records->ReadPredictor(shard_id, version);
    if (!bytes.ok()) return bytes.status();
    return PredictorState::Parse(*bytes);
  };
}

void ShardLearning::RecoverPredictor(const PredictorMeta& meta,
                                     absl::StatusOr<std::shared_ptr<const PredictorState>> state) {
  if (state.ok() && (*state)->version() != meta.version) {
    state = absl::DataLossError(absl::StrCat("the state names version ", (*state)->version()));
  }
  if (!state.ok()) {
    spdlog::error(
        "predictor state version {} of '{}'/'{}' is unreadable; its dependents are lost: {}",
        meta.version, shard_->ns(), meta.model_id, state.status().ToString());
  }
  shard_->predictors()->RecoverVersion(meta.version, std::move(state), meta.state_bytes,
                                       meta.tokens_learned);
  shard_->context().tiers->AddSideBytes(meta.state_bytes);
}

void ShardLearning::ScheduleFreeUnusedPredictors() {
  if (shard_->context().learn_queue != nullptr &&
      shard_->context().learn_queue->Push(0, [this] { FreeUnusedPredictors(); })) {
    return;
  }
  FreeUnusedPredictors();
}

void ShardLearning::QueueLearning(absl::Span<const uint32_t> token_ids,
                                  std::vector<LearnBlock> blocks) {
  if (shard_->context().learn_queue == nullptr || blocks.empty()) return;
  const BlockGeometry& g = shard_->model().geometry;
  // A learned state predicts floats: FP8 / uint8 blocks (RAW or LOSSLESS only) teach it nothing.
  if (IsByteDType(g.dtype)) return;
  std::shared_ptr<PredictorRegistry> registry = shard_->predictors();
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
  std::vector<bool> queued = shard_->context().learn_queue->PushSample(std::move(jobs), seed);
  uint64_t dropped = 0, encoded_dropped = 0;
  for (size_t i = 0; i < queued.size(); ++i) {
    if (queued[i]) continue;
    ++dropped;
    encoded_dropped += is_encoded[i];
  }
  if (dropped != 0) registry->CountDropped(dropped, encoded_dropped);
}

bool ShardLearning::Learn(const std::shared_ptr<PredictorRegistry>& registry, uint32_t block_index,
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
    decoded.resize(shard_->model().geometry.num_bytes());
    if (absl::Status s = DecodeVerifiedBlock(block.encoded->bytes, absl::MakeSpan(decoded), ctx);
        !s.ok()) {
      spdlog::warn("decoding a client-encoded block of '{}'/'{}' to learn from: {}", shard_->ns(),
                   shard_->model().model_id, s.ToString());
      registry->CountDropped(1, 1);
      return false;
    }
    kv = decoded;
  }
  absl::StatusOr<bool> due = registry->Observe(kv, tokens, first_position, previous_token);
  if (!due.ok()) {
    spdlog::warn("learning from a block of '{}'/'{}': {}", shard_->ns(), shard_->model().model_id,
                 due.status().ToString());
    return false;
  }
  // Counted before a refit publishes: Stats never shows a version without its observations.
  if (block.encoded != nullptr) registry->CountEncodedObserved();
  if (!*due || !shard_->context().records->health().ok()) return true;
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = registry->Fit();
  if (!state.ok()) {
    spdlog::warn("fitting a predictor state of '{}'/'{}': {}", shard_->ns(),
                 shard_->model().model_id, state.status().ToString());
    return true;
  }
  const std::string bytes = (*state)->Serialize();
  // Persisted first, inside the disk budget; published (new blocks code against it) only then.
  if (!shard_->context().tiers->Reserve(bytes.size())) {
    spdlog::warn(
        "predictor state version {} of '{}'/'{}' ({} bytes) does not fit the disk "
        "budget; not published",
        (*state)->version(), shard_->ns(), shard_->model().model_id, bytes.size());
    return true;
  }
  PredictorMeta meta;
  meta.ns = shard_->ns();
  meta.model_id = shard_->model().model_id;
  meta.version = (*state)->version();
  meta.state_bytes = bytes.size();
  meta.state_crc32c = Crc32c(bytes);
  meta.tokens_learned = (*state)->tokens_learned();
  RecordBatch batch(shard_->context().records);
  batch.PutPredictor(shard_->shard_id(), meta, bytes);
  absl::Status s = shard_->context().records->Write(batch);
  if (s.ok()) shard_->context().tiers->AddSideBytes(bytes.size());
  shard_->context().tiers->Unreserve(bytes.size());
  if (!s.ok()) {
    spdlog::error("persisting predictor state version {} of '{}'/'{}': {}", meta.version,
                  shard_->ns(), meta.model_id, s.ToString());
    return true;
  }
  registry->Publish(*std::move(state), bytes.size());
  FreeUnusedPredictors();  // the previous latest, if nothing was coded against it
  return true;
}

void ShardLearning::FreeUnusedPredictors() {
  std::shared_ptr<PredictorRegistry> registry = shard_->predictors();
  std::vector<uint32_t> unused = registry->TakeUnused();
  if (unused.empty()) return;
  RecordBatch batch(shard_->context().records);
  uint64_t bytes = 0;
  for (uint32_t v : unused) {
    batch.DeletePredictor(shard_->shard_id(), v);
    bytes += registry->StateBytes(v);
  }
  if (absl::Status s = shard_->context().records->Write(batch); !s.ok()) {
    registry->Unmark(unused);
    spdlog::error("freeing {} predictor states of '{}'/'{}': {}", unused.size(), shard_->ns(),
                  shard_->model().model_id, s.ToString());
    return;
  }
  registry->Forget(unused);
  shard_->context().tiers->RemoveSideBytes(bytes);
}

absl::StatusOr<std::string> ShardLearning::SerializedPredictor(uint32_t version) {
  if (version == 0) {
    return absl::InvalidArgumentError("version: 0 names no predictor state; versions start at 1");
  }
  if (absl::Status s = shard_->predictors()->Check(version); !s.ok()) return s;
  absl::StatusOr<std::string> bytes =
      shard_->context().records->ReadPredictor(shard_->shard_id(), version);
  if (absl::IsNotFound(bytes.status())) {
    return absl::NotFoundError(absl::StrCat("version: predictor state version ", version,
                                            " is not stored (freed meanwhile)"));
  }
  return bytes;
}

std::vector<PredictorVersionView> ShardLearning::PredictorVersions() const {
  return shard_->predictors()->Versions();
}

}  // namespace kvtrie
