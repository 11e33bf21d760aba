// trie/shard_learning.h
//
// ShardLearning: a ModelShard's learned predictor states (trie/predictor_registry.h) as the
// shard feeds and publishes them. After a committed Put a sample of its new blocks is queued on
// the store's LearnQueue (never on the Put's path); each job observes one block (decoding a
// client-encoded one first), refits when due, persists the fitted version and only then
// publishes it (new blocks code against it from then on). Versions no block depends on and no
// reader holds (but the latest) are freed, on disk then in memory.
//
// Rules it keeps:
//   - A version is published only once its record is on disk, inside the disk budget
//     (TierManager::Reserve); a version that does not fit is not published.
//   - A version is freed only when no node depends on it (PredictorRegistry::AddDependent, kept
//     by the shard as nodes come and go) and no read holds it (PredictorRegistry::Hold: a read
//     listed under the shard's mu_ takes its hold there, so there is no gap).
//   - An encoded block queued to learn from holds the version it names until its job has run or
//     was dropped.
//
// Uses only ModelShard's public interface (ns, shard_id, context, model, predictors). Takes no
// shard lock itself; call with none held. Thread-safe.
#ifndef KVTRIE_TRIE_SHARD_LEARNING_H_
#define KVTRIE_TRIE_SHARD_LEARNING_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "codec/block_codec.h"
#include "trie/predictor_registry.h"
#include "trie/record_store.h"
#include "trie/store_types.h"

namespace kvtrie {

class ModelShard;

// Reads a persisted version of shard `shard_id` back (for the registry's non-resident versions).
PredictorRegistry::Loader PersistedPredictorLoader(RecordStore* records, uint64_t shard_id);

class ShardLearning {
 public:
  // One committed block of a Put to learn from: its dense bytes (moved in), or the envelope its
  // client encoded (RAW, LOSSLESS fast or RESIDUAL fast) with the state it names (null for 0).
  struct LearnBlock {
    uint32_t block_index = 0;
    std::string kv;  // dense: geometry.num_bytes() bytes; empty when `encoded` is set
    std::shared_ptr<const EncodedBlock> encoded;
    std::shared_ptr<const PredictorState> learned;  // the version `encoded` names
  };

  // `shard` outlives this object (it owns it).
  explicit ShardLearning(ModelShard* shard) : shard_(shard) {}
  ShardLearning(const ShardLearning&) = delete;
  ShardLearning& operator=(const ShardLearning&) = delete;

  // Recovery: a persisted version (read and parsed, or its error) and its disk bytes.
  void RecoverPredictor(const PredictorMeta& meta,
                        absl::StatusOr<std::shared_ptr<const PredictorState>> state);
  // After a committed Put (`token_ids` the Put's): queues a sample of `blocks` (ascending block
  // index) spread over the whole Put, as many as the store's LearnQueue has room for
  // (LearnQueue::PushSample), to be learned from in the background; an encoded block is decoded
  // there first, its version held (PredictorRegistry::Hold) until then. The others are counted
  // as dropped. Never blocks on the learner.
  void QueueLearning(absl::Span<const uint32_t> token_ids, std::vector<LearnBlock> blocks);
  // Deletes the versions no block depends on and no reader holds any more (but the latest), on
  // disk then in memory.
  void FreeUnusedPredictors();
  // As FreeUnusedPredictors, off the caller's path (on the LearnQueue when there is one).
  void ScheduleFreeUnusedPredictors();
  // The serialized bytes of `version`, as persisted (RocksDB-checksummed). NOT_FOUND naming
  // `version`; DATA_LOSS when unreadable.
  absl::StatusOr<std::string> SerializedPredictor(uint32_t version);
  // The model's versions for Inspect and Stats.
  std::vector<PredictorVersionView> PredictorVersions() const;

 private:
  // The LearnQueue job of QueueLearning: decodes an encoded block (false: it did not decode,
  // logged), then observes (counting an encoded block as observed), refits when due, persists
  // and publishes.
  bool Learn(const std::shared_ptr<PredictorRegistry>& registry, uint32_t block_index,
             const std::vector<int32_t>& tokens, int32_t previous_token, const LearnBlock& block);

  ModelShard* const shard_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_SHARD_LEARNING_H_
