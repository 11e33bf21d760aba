// trie/model_shard.h
//
// ModelShard: one (namespace, model) of the store — its BlockTrie, its near-duplicate
// ClusterIndex (the one owner of "dependents": which nodes are coded against which centroid),
// its counters, and every read and write of its nodes. KvStore (trie/kv_store.h) validates a
// request and routes it here; payload bytes live in the RecordStore (disk) and the TierManager
// (hot copies).
//
// Locks (no lock is held across a RocksDB write or fsync except write_mu_, which only writers of
// this shard take):
//   write_mu_  serializes this shard's writers (Put commits, Delete, Pin, evictions, drops,
//              re-encodes), as LevelDB's writer queue does. A writer takes it, prepares its batch
//              under mu_, releases mu_, writes (the WAL; with --sync the fsync), then takes mu_
//              again and publishes. So what it checked under mu_ still holds when it publishes,
//              and memory changes only after the write succeeded.
//   mu_        guards the trie, the index and the counters; held for memory work only. Readers
//              (Lookup, Get, Inspect, Stats) take only mu_, so they never wait for a disk write;
//              Match/Lookup take it shared (they change nothing), so they run side by side.
// Lock order: write_mu_ -> mu_ -> PredictorRegistry::mu_ | TierManager::mu_ ->
// RecordStore::error_mu_ (the registry takes no other lock). A thread holds
// the locks of at most one shard; eviction for the disk budget runs with none held.
//
#ifndef KVTRIE_TRIE_MODEL_SHARD_H_
#define KVTRIE_TRIE_MODEL_SHARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "codec/decode_chain.h"
#include "codec/task_pool.h"
#include "trie/block_trie.h"
#include "trie/cluster_index.h"
#include "trie/predictor_registry.h"
#include "trie/record_store.h"
#include "trie/store_types.h"
#include "trie/tier_manager.h"

namespace kvtrie {

class ClusterPolicy;  // trie/cluster_policy.h
class PutEncoder;     // trie/put_encoder.h
class ShardLearning;  // trie/shard_learning.h

// INVALID_ARGUMENT naming the first field of `request` that differs from the `stored` model.
absl::Status CheckSameModel(const std::string& ns, const ModelInfo& stored,
                            const ModelInfo& request);

// What every shard of a store shares.
struct ShardContext {
  const StoreOptions* options = nullptr;
  RecordStore* records = nullptr;
  TierManager* tiers = nullptr;
  // Encodes Put blocks as they arrive (trie/put_session.h); null = on the stream's thread.
  TaskPool* codec_pool = nullptr;
  // Evicts leaves (of any shard) until `incoming` more payload bytes fit the disk budget.
  // RESOURCE_EXHAUSTED if pins and dependents hold it. Call with no shard lock held.
  std::function<absl::Status(uint64_t incoming)> make_disk_room;
  std::atomic<uint64_t> inflight_put_bytes{0};  // dense bytes buffered by unfinished Puts
  // Bytes of the reconstructions every shard keeps for continuing Puts (PutParentCache,
  // trie/put_encoder.h), bounded by options->put_parent_cache_bytes across the store.
  std::atomic<uint64_t> put_parent_bytes{0};
  LearnQueue* learn_queue = nullptr;  // null when learning is off
  // Test seam (KvStoreTestPeer::SetDeleteHook): runs in every Delete after the near-duplicates
  // outside the prefix were re-encoded and before the prefix is removed, with the shard's
  // write_mu_ held (so it may read, not write). Set before the store serves.
  std::function<void()> delete_hook_for_test;
  // Test seam (KvStoreTestPeer::SetReplaceHook): runs when a block's new encoding (a centroid's
  // member re-encoded) is on disk and not yet published, with write_mu_ held (it may read).
  std::function<void()> replace_hook_for_test;
};

class ModelShard {
 public:
  // One encoded block of a Put, ready to commit.
  struct NewBlock {
    uint32_t block_index = 0;
    std::shared_ptr<const EncodedBlock> encoded;  // shared with the hot tier once published
    Encoding encoding = Encoding::kRaw;
    uint64_t reference_node_id = 0;  // the centroid it is a residual of (0 = standalone)
    uint32_t predictor_version = 0;  // the learned state it is coded against (0 = none)
    // Encoded by the client (PutSession::AddEncodedBlock): encoded's errors are the client's.
    bool error_client_reported = false;
    bool unverified = false;    // client-encoded and not decoded at the Put (TrieNode::unverified)
    double target_rel_rms = 0;  // RESIDUAL: the Put's error target (TrieNode::target_rel_rms)
    // Encoded with a near-duplicate search (the compact profile on the server). Otherwise
    // (client-encoded, the fast profile) a standalone block is left for the cluster pass to look
    // for a stored block it repeats at any position offset (ClusterPolicy::LookLaterLocked).
    bool near_dup_searched = false;
  };
  // `committed`: the model record is on disk (recovered); otherwise the shard was created by a
  // Put and its model is written with its first blocks.
  ModelShard(ShardContext* context, std::string ns, ModelInfo model, uint64_t shard_id,
             bool committed);
  ~ModelShard();
  ModelShard(const ModelShard&) = delete;
  ModelShard& operator=(const ModelShard&) = delete;

  const std::string& ns() const { return ns_; }
  uint64_t shard_id() const { return shard_id_; }
  const ShardContext& context() const { return *context_; }
  // The model if its record is on disk. INVALID_ARGUMENT naming the field if `request` differs.
  bool committed() const;
  ModelInfo model() const;
  absl::Status CheckModel(const ModelInfo& request) const;

  // Recovery (before the store serves): adds a node read from disk, or adds its deletes to `drop`.
  void Recover(uint64_t id, absl::StatusOr<NodeMeta> meta, const std::string* payload,
               bool verified, RecoveryStats* stats, RecordBatch* drop);
  // Recovery, once every node was read: drops (adding their deletes to `drop`) the members whose
  // centroid is not there, with their subtrees. A re-elected centroid may be newer (a larger id)
  // than a member coded against it, so this is checked only once all nodes are in.
  void FinishRecovery(RecoveryStats* stats, RecordBatch* drop);

  // --- Reads ---
  // Reads never delete data because of an inconsistency inside the store (issue 18). Only a
  // payload that fails its own checksum (a blob checksum, a CRC or parse failure of the bytes, a
  // payload missing from RocksDB) is dropped, with its subtree (which no prefix reaches any more).
  // A missing centroid or learned state, a centroid whose parent differs, a payload that passes
  // its checksum but does not decode in its context: ABORTED when the block changed since it was
  // listed (the caller lists again: a Delete re-encoded it), else INTERNAL naming what is
  // missing; the data is left as it is. A block coded against a state or a centroid that failed
  // its own checksum is DATA_LOSS and kept (recovery drops a block whose centroid is gone).
  MatchResult Lookup(absl::Span<const uint32_t> token_ids);  // counted in Stats
  MatchResult Match(absl::Span<const uint32_t> token_ids);   // not counted (a Put's own match)
  // through_retained: also through retained nodes (a Get of the path to a node named by id, e.g.
  // a member's centroid: "Retained centroids", trie/cluster_policy.h); else a token lookup's view.
  GetResult Get(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                bool through_retained = false);
  // Returns once the write under way (if any) is published: every writer (a Put's commit, a
  // re-encoding by the cluster pass or a Delete) writes its batch, then publishes it, under
  // write_mu_. A read whose listing is older than the bytes it read (written, not yet published
  // when it listed) lists again after this, and sees them. Takes write_mu_; call with no lock.
  void AwaitPublished() { absl::MutexLock writer(&write_mu_); }
  // The payload of a block of a Get (hot copy, or read in the Get's snapshot and promoted when
  // read often). DATA_LOSS when the bytes are bad (the node and its subtree are dropped) or when
  // RocksDB's own files fail their checks (nothing dropped); NOT_FOUND if deleted meanwhile.
  absl::StatusOr<std::shared_ptr<const std::string>> ReadPayload(const BlockRead& block);
  // Reads block `block` and decodes it as the next block of `chain` (fetching its centroid).
  // ReadPayload's errors (a block whose own bytes fail their check is dropped); DATA_LOSS, the
  // block kept, when its centroid or learned state failed its own check; ABORTED when the block
  // changed since the Get listed it (list again); INTERNAL naming what is missing otherwise.
  absl::Status ReadAndDecodeBlock(const BlockRead& block, DecodeChain* chain,
                                  absl::Span<uint8_t> out);
  // As ReadAndDecodeBlock, with `payload`: the block's bytes as ReadPayload returned them (read
  // once by the caller, trie/block_reader.h), so the block is not read (nor counted) again. Its
  // centroid, if any, is read here. Errors: ReadAndDecodeBlock's but ReadPayload's.
  absl::Status DecodeReadBlock(const BlockRead& block, const std::string& payload,
                               DecodeChain* chain, absl::Span<uint8_t> out);
  // Decodes node `node_id` into `out`, its ancestors first when it predicts from them. ABORTED
  // if the node is gone.
  absl::Status ReconstructNode(uint64_t node_id, absl::Span<uint8_t> out);
  absl::StatusOr<std::vector<uint32_t>> PathTokens(uint64_t node_id);
  absl::StatusOr<InspectResult> Inspect(uint64_t node_id);
  absl::StatusOr<double> TrieDistance(uint64_t a, uint64_t b);
  bool HasDependents(uint64_t node_id);
  // Adds this shard's totals and counters to `out` (O(1): counters kept as they change).
  void AddStats(StoreStats* out);

  // --- Writes ---
  // `erase`: no centroid is retained (each cluster with a lossy member re-elects too).
  absl::StatusOr<DeleteSummary> Delete(absl::Span<const uint32_t> token_ids, bool erase = false);
  absl::StatusOr<uint64_t> Pin(absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                               bool unpin, bool extend_only = false);
  // Evicts those of `ids` that are still evictable leaves. Returns the bytes freed.
  absl::StatusOr<uint64_t> Evict(const std::vector<uint64_t>& ids);

  // The Put path (trie/put_encoder.h): PutSession hands it its plan.
  PutEncoder& put_encoder() { return *put_encoder_; }

  // --- Learned predictor states (trie/shard_learning.h, trie/predictor_registry.h) ---
  std::shared_ptr<PredictorRegistry> predictors() const;
  ShardLearning& learning() { return *learning_; }

  // --- Near-duplicate clusters after their blocks were stored (trie/cluster_policy.h) ---
  ClusterPolicy& cluster_policy() { return *cluster_policy_; }

 private:
  friend class PutEncoder;
  friend class ClusterPolicy;

  // --- The write protocol the rooms use (PutEncoder, ClusterPolicy) ---
  // Writes `blocks` (consecutive, the first a child of `parent_id`) in one batch and publishes
  // them; creates the model record with the first. Returns their node ids. ABORTED if
  // `parent_id` is gone or a block exists; INVALID_ARGUMENT if the model was created meanwhile
  // with another geometry; RESOURCE_EXHAUSTED if the disk budget is held; the store's errors.
  absl::StatusOr<std::vector<uint64_t>> Commit(const ModelInfo& model, uint64_t parent_id,
                                               absl::Span<const uint32_t> token_ids,
                                               absl::Span<const float> surprisal_bits,
                                               const std::vector<NewBlock>& blocks);
  // Counts a finished Put.
  void CountPut(uint64_t stored, uint64_t deduplicated, uint64_t touched_node);

  using NodeRef = TierManager::NodeRef;
  enum class DropReason { kDeleted, kDataLoss, kDisk };
  // A node that a read found bad: dropped by the caller (with write_mu_).
  struct Corrupt {
    uint64_t node_id = 0;
    std::string why;
  };

  NodeRef Ref(uint64_t id) const { return {this, id}; }
  // A node that is not being removed (retained ones included: a block coded against it finds it).
  TrieNode* FindLive(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // As FindLive, but not a retained node: what a token lookup could reach.
  TrieNode* FindVisible(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<TrieNode*> FindNodeOrNotFound(uint64_t node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status NoModel() const;
  std::vector<TrieNode*> MatchLive(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                                   bool through_retained = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  NodeMeta MetaOf(const TrieNode& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool EvictableLocked(const TrieNode& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateEvictableLocked(TrieNode* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a node to the trie, the index, the counters and the tiers.
  TrieNode* PublishLocked(TrieNode* parent, uint64_t id, const NodeMeta& meta,
                          std::shared_ptr<const std::string> payload)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountNodeLocked(const TrieNode& n, int sign) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddTotalsLocked(StoreStats* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<TrieNode*> SubtreeLocked(TrieNode* node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the subtrees of `roots` (marked removing, deletes written) from memory.
  void RemoveLocked(const std::vector<TrieNode*>& roots, DropReason reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks, writes the deletes of, and removes the subtrees of `roots`. REQUIRES write_mu_.
  // A node is marked `removing` under mu_ before its deletes are written, so no reader starts on
  // it; a reader that started before holds the hot copy or a RocksDB snapshot taken before the
  // write, and a hold on the learned state its blocks name.
  absl::Status RemoveSubtrees(const std::vector<uint64_t>& roots, DropReason reason,
                              uint64_t* removed_nodes, uint64_t* removed_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReadPayloadInternal(const BlockRead& block, std::shared_ptr<const std::string>* out,
                                   std::vector<Corrupt>* corrupt);
  absl::Status ReadAndDecodeInternal(const BlockRead& block, DecodeChain* chain,
                                     absl::Span<uint8_t> out, std::vector<Corrupt>* corrupt);
  // Decodes `payload` (block's, read) as the next block of `chain`, its centroid read here.
  absl::Status DecodeInternal(const BlockRead& block, const std::string& payload,
                              DecodeChain* chain, absl::Span<uint8_t> out,
                              std::vector<Corrupt>* corrupt);
  // The error for `block`, which can not be decoded because of `why` (not its own bytes): ABORTED
  // if it changed since it was listed (gone, or re-encoded), else INTERNAL. Drops nothing.
  // With `corrupt` set, the bytes passed their checksum and do not decode: the node is added
  // to it (dropped with its subtree by the caller) and this is DATA_LOSS naming it and `why`.
  absl::Status NotDecodable(const BlockRead& block, absl::string_view why,
                            std::vector<Corrupt>* corrupt = nullptr);
  absl::Status ReconstructInternal(uint64_t node_id, absl::Span<uint8_t> out,
                                   std::vector<Corrupt>* corrupt);
  // Drops the nodes a read found bad (and their subtrees). Takes write_mu_ unless held.
  void DropCorrupt(const std::vector<Corrupt>& corrupt);
  void DropCorruptLocked(const std::vector<Corrupt>& corrupt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // *replaced_bytes: the payload bytes of the encoding replaced (0 if the node went meanwhile).
  // reference_node_id: the centroid `encoded` is a residual of (0 = standalone).
  absl::Status ReplaceEncodingLocked(uint64_t node_id, const EncodedBlock& encoded,
                                     Encoding encoding, uint64_t reference_node_id,
                                     uint64_t* replaced_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  void ClusterViewLocked(const TrieNode& node, NodeView* view) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A read of node `n` as listed now: the hot copy or else `*snapshot` (taken when first needed),
  // and the learned predictors' context (tokens, position, previous token, version held for the
  // read; shared with `previous`, the read listed before it, when it names the same version).
  BlockRead ListLocked(const TrieNode& n, const BlockRead* previous,
                       std::shared_ptr<const ReadSnapshot>* snapshot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decodes `payload` of `block` as the next block of `chain`, with the learned state it names.
  // DATA_LOSS when that state is unreadable or gone; INTERNAL, with `undecodable` set, when the
  // bytes (checksummed) do not decode.
  absl::Status DecodeNext(const BlockRead& block, const std::string& payload, DecodeChain* chain,
                          absl::Span<uint8_t> out, bool* undecodable);

  ShardContext* const context_;
  const std::string ns_;
  const uint64_t shard_id_;

  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  ModelInfo model_ ABSL_GUARDED_BY(mu_);
  bool committed_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<BlockTrie> trie_ ABSL_GUARDED_BY(mu_);
  ClusterIndex clusters_ ABSL_GUARDED_BY(mu_);  // near-duplicates of trie_, and dependents
  // Learned predictor states (its own lock); replaced only when the first commit changes the
  // geometry of a model that had none on disk.
  std::shared_ptr<PredictorRegistry> predictors_ ABSL_GUARDED_BY(mu_);
  // The current epoch of centroids retired for the reads listed in it (RetiredReferences).
  std::shared_ptr<RetiredReferences> retired_ ABSL_GUARDED_BY(mu_);
  // Centroids dropped because their payload failed its checksum: their members are DATA_LOSS.
  absl::flat_hash_set<uint64_t> corrupt_centroids_ ABSL_GUARDED_BY(mu_);
  // Node ids are 1, 2, ... per shard (so they tell nothing of another namespace), never reused in
  // a process; recovery continues after the largest.
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // The nodes marked retained ("Retained centroids", trie/cluster_policy.h).
  absl::flat_hash_set<uint64_t> retained_ids_ ABSL_GUARDED_BY(mu_);
  // Totals over the trie, kept as nodes come and go.
  uint64_t bytes_logical_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_stored_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t lossy_nodes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t lossy_recoded_nodes_ ABSL_GUARDED_BY(mu_) = 0;    // lossy, coded LOSSLESS now
  uint64_t client_reported_nodes_ ABSL_GUARDED_BY(mu_) = 0;  // error_client_reported nodes
  double sum_rel_rms_k_ ABSL_GUARDED_BY(mu_) = 0;
  double sum_rel_rms_v_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<float, uint64_t> lossy_errors_ ABSL_GUARDED_BY(mu_);  // max(k, v) -> nodes
  std::vector<uint64_t> nodes_at_depth_ ABSL_GUARDED_BY(mu_);
  // Counters since start (relaxed atomics: statistics only).
  std::atomic<uint64_t> blocks_stored_{0}, blocks_deduplicated_{0}, lookups_{0}, lookup_hits_{0},
      gets_{0}, puts_{0}, deletes_{0}, evictions_disk_{0}, evicted_bytes_{0},
      evictions_data_loss_{0}, evictions_deleted_{0}, centroids_reelected_{0},
      cluster_pass_recoded_{0}, cluster_pass_bytes_saved_{0}, cluster_pass_reelected_{0};
  // The rooms (constructed last, destroyed first: they point at the core).
  const std::unique_ptr<ShardLearning> learning_;
  const std::unique_ptr<PutEncoder> put_encoder_;
  const std::unique_ptr<ClusterPolicy> cluster_policy_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_MODEL_SHARD_H_
