// trie/put_encoder.h
//
// PutEncoder: "encode a Put's blocks" for one ModelShard. A PutSession hands it one PutPlan at
// Finish; it matches the stored prefix, encodes the new blocks not encoded on arrival, hands them
// to the shard's write protocol (ModelShard::Commit) in one batch, and queues a sample for the
// learner (trie/shard_learning.h).
//
// Rules it keeps:
//   - All or nothing: a Put commits every new block in one batch, or none. When the prefix
//     changes under it (Commit's ABORTED) it matches and encodes again, up to 4 times.
//   - A compact-profile block is predicted from its parent's reconstruction: what a reader will
//     decode (the decode chain), never the dense bytes the client sent.
//   - A block is coded against a near-duplicate centroid (ClusterIndex::FindCandidates) only
//     when that is smaller than standalone, and the codec's own check (it names the centroid)
//     passed; the fast profile never is (it ignores a reference context).
//   - A client-encoded stored block that no decode has checked yet (TrieNode::unverified) is
//     decoded before a Put deduplicates onto it; one that does not decode is dropped with its
//     subtree and the Put stores its own (issue 30).
//   - The put-parent cache (PutParentCache) holds reconstructions only: a node's reconstruction
//     never changes (a Delete re-encodes dependents bit-exactly) and ids are not reused, so a
//     kept one is never stale.
//
// Locks: takes the shard's mu_ (briefly, to find candidates) and, through the shard, its
// write_mu_ (Commit, drops); never holds either while it encodes. PutParentCache::mu_ is a leaf.
// Thread-safe: Puts of one shard run side by side.
#ifndef KVTRIE_TRIE_PUT_ENCODER_H_
#define KVTRIE_TRIE_PUT_ENCODER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "codec/block_codec.h"
#include "trie/cluster_index.h"
#include "trie/model_shard.h"
#include "trie/store_types.h"

namespace kvtrie {

// The reconstructions (what a reader decodes) of the last block of recent compact-profile Puts
// of one shard, newest last, so a Put that continues one predicts from it without decoding its
// path again (reading it from RocksDB when cold). Bounded for the whole store: this shard's
// oldest go while the store's kept bytes (ShardContext::put_parent_bytes) would pass
// StoreOptions::put_parent_cache_bytes; when the other shards' alone fill it, none is kept.
// Thread-safe (its mutex is a leaf lock).
class PutParentCache {
 public:
  // `context` outlives this object.
  explicit PutParentCache(ShardContext* context) : context_(context) {}
  PutParentCache(const PutParentCache&) = delete;
  PutParentCache& operator=(const PutParentCache&) = delete;

  // The reconstruction kept for `node_id`, or null.
  std::shared_ptr<const std::vector<uint8_t>> Find(uint64_t node_id);
  // Keeps a copy of `reconstruction` for `node_id` (nothing when it is empty or alone passes
  // the bound).
  void Keep(uint64_t node_id, absl::Span<const uint8_t> reconstruction);
  // Reconstructions kept by this shard.
  size_t size();

 private:
  ShardContext* const context_;
  absl::Mutex mu_;
  std::deque<std::pair<uint64_t, std::shared_ptr<const std::vector<uint8_t>>>> parents_
      ABSL_GUARDED_BY(mu_);
};

// One block of a PutSession's plan: its dense bytes, or its encoding (on arrival on the codec
// pool, or by its client).
struct PlanBlock {
  std::string* kv = nullptr;  // dense (empty once encoded on arrival or when client-encoded);
                              // moved to the learner after the commit
  // Encoded already (null: encode it here); an error fails the Put.
  const absl::StatusOr<std::shared_ptr<const EncodedBlock>>* encoded = nullptr;
  bool client_encoded = false;                // by its client (PutSession::AddEncodedBlock)
  Encoding client_encoding = Encoding::kRaw;  // then its encoding
  bool client_decoded = false;  // then decoded at the Put (--verify_encoded_puts sampled it)
};

// What a PutSession hands the shard at Finish: the Put's context and its blocks by index (those
// not stored yet must all be there). Every pointer is the session's and outlives the call.
struct PutPlan {
  const ModelInfo* model = nullptr;  // the request's (validated)
  absl::Span<const uint32_t> token_ids;
  absl::Span<const float> surprisal_bits;
  EncodeOptions encode;
  bool early = false;  // the blocks read no other block (RAW, fast profile)
  std::map<uint32_t, PlanBlock> blocks;
  // The versions client-encoded blocks name, held by the session until it ends.
  const std::map<uint32_t, std::shared_ptr<const PredictorState>>* client_versions = nullptr;
};

// A new block encoded standalone or against a near-duplicate centroid.
struct NearDupEncoded {
  EncodedBlock encoded;
  uint64_t reference_node_id = 0;  // 0 = standalone
  std::vector<uint8_t> reference;  // the centroid's reconstruction when reference_node_id != 0
  // A centroid used at a position offset (codec/reference_shift.h): its parent, whose last
  // tokens start the window, and that parent's reconstruction (0 / empty when not needed).
  uint64_t reference_parent_id = 0;
  std::vector<uint8_t> reference_parent;
};

class PutEncoder {
 public:
  // `shard` owns this object and outlives it.
  explicit PutEncoder(ModelShard* shard);
  PutEncoder(const PutEncoder&) = delete;
  PutEncoder& operator=(const PutEncoder&) = delete;

  // The Put of `plan`, all or nothing: matches the stored prefix, encodes the new blocks not
  // encoded yet (compact profile: in order, each predicted from its parent's reconstruction, or
  // as a residual of a near-duplicate centroid when smaller; the stored parent's is the one a
  // previous Put that ended with it kept, else decoded from its path), commits them in one batch
  // (again, up to 4 times, when the prefix changes under it), counts the Put and queues a sample
  // of the new blocks for the learner (moving their dense bytes). Errors: INVALID_ARGUMENT naming
  // `kv` when a full block is neither stored nor in the plan; ABORTED if the prefix kept
  // changing; Commit's errors; an encoding error.
  absl::StatusOr<PutSummary> ApplyPut(PutPlan& plan);

  // Encodes block `block_index` of a Put whose stored prefix ends at `anchor_id`: standalone, or
  // as a residual of the candidate centroid that makes it smallest, when smaller.
  absl::StatusOr<NearDupEncoded> EncodeNewBlock(
      const ModelInfo& model, uint64_t anchor_id, uint32_t block_index,
      absl::Span<const uint32_t> token_ids, absl::Span<const float> surprisal_bits,
      absl::Span<const uint8_t> kv, const EncodeOptions& options, const PredictionContext& context);

  // Encodes `kv` against each of `candidates` (their reconstructions read here) and keeps in
  // *out the smallest encoding that is smaller than out->encoded. Returns whether one was.
  // `corrupt`: null to drop a candidate that fails its check here (takes the shard's
  // write_mu_), else where to list it (the caller holds write_mu_ and drops it).
  // Shared with the cluster policy (trie/cluster_policy.h), which re-encodes stored blocks.
  absl::StatusOr<bool> EncodeAgainstCandidates(
      const BlockGeometry& g, absl::Span<const uint8_t> kv, const EncodeOptions& options,
      const PredictionContext& context, const std::vector<ClusterIndex::Candidate>& candidates,
      NearDupEncoded* out, std::vector<ModelShard::Corrupt>* corrupt);

  PutParentCache& parents() { return parents_; }

 private:
  // ApplyPut's check before it deduplicates onto stored blocks it carries: every node of
  // `node_ids` whose index is in `carried` and is TrieNode::unverified is decoded; true when one
  // did not decode and was dropped (with its subtree: match again).
  bool DroppedUndecodable(absl::Span<const uint64_t> node_ids,
                          const std::map<uint32_t, PlanBlock>& carried);

  ModelShard* const shard_;
  PutParentCache parents_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_PUT_ENCODER_H_
