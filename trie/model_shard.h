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
// A node being deleted or evicted is marked `removing` under mu_ before its deletes are written,
// so no reader starts on it; a reader that started before holds the hot copy or a RocksDB
// snapshot taken before the write, and a hold on the learned state its blocks name.
//
// Reads never delete data because of an inconsistency inside the store (issue 18). Only a payload
// that fails its own checksum (a blob checksum, a CRC or parse failure of the bytes, a payload
// missing from RocksDB) is dropped, with its subtree (which no prefix reaches any more). A missing
// centroid or learned state, a centroid whose parent differs, a payload that passes its checksum
// but does not decode in its context: ABORTED when the block changed since it was listed (the
// caller lists again: a Delete re-encoded it), else INTERNAL naming what is missing; the data is
// left as it is. A block coded against a state or a centroid that failed its own checksum is
// DATA_LOSS and kept (recovery drops a block whose centroid is gone).
//
// Retained centroids. Deleting a prefix whose blocks are the centroids of near-duplicates outside
// it re-elects a centroid among each cluster's members when they are all stored bit-exact (each
// member's exact reconstruction is coded losslessly again: bytes shrink). A cluster with a lossy
// member keeps the deleted centroid instead: re-encoding a lossy member would add error to one
// that already used its target (its reconstruction must stay what it is), and coding the new
// centroid's reconstruction exactly costs ~5x its lossy bytes (issue 20: +205 % on
// tests/data/neardup). The centroid and its ancestors inside the deleted prefix stay, marked
// `retained` (TrieNode) in the same batch that deletes the rest: no lookup, Get, Pin or Delete
// matches them, no Put finds them as a candidate, eviction skips them, and the namespace's
// stored bytes count them. Each is removed (SweepRetainedLocked: after a Delete or eviction,
// every cluster-pass round, at recovery) once no block is coded against it and it has no child.
// A Put of the deleted prefix again revives them (ReviveRetainedLocked): the blocks are that
// prefix's KV within the target they were stored at, and deduplicate the Put's as any stored
// block does.
//
// Node ids are 1, 2, ... per shard (so they tell nothing of another namespace), never reused in
// a process; recovery continues after the largest.
#ifndef KVTRIE_TRIE_MODEL_SHARD_H_
#define KVTRIE_TRIE_MODEL_SHARD_H_

#include <atomic>
#include <cstdint>
#include <deque>
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

// INVALID_ARGUMENT naming the first field of `request` that differs from the `stored` model.
absl::Status CheckSameModel(const std::string& ns, const ModelInfo& stored,
                            const ModelInfo& request);

// The reconstructions of the centroids (and their parents) that a Delete removed while reads that
// listed blocks coded against them were alive: one object per shard epoch. A read listed now holds
// the current one (BlockRead::retired); a Delete that removes centroids while it is held puts
// their reconstructions in it before the removal and then starts a new one, so they are freed
// with the last read that may need them (as RocksDB keeps a Version while an iterator holds it).
struct RetiredReferences {
  void Add(uint64_t node_id, std::vector<uint8_t> block) {
    absl::MutexLock lock(&mu);
    blocks.emplace(node_id, std::move(block));
  }
  // The reconstruction of `node_id`, or null.
  const std::vector<uint8_t>* Find(uint64_t node_id) {
    absl::MutexLock lock(&mu);
    auto it = blocks.find(node_id);
    return it == blocks.end() ? nullptr : &it->second;  // never erased while the object lives
  }
  bool empty() {
    absl::MutexLock lock(&mu);
    return blocks.empty();
  }

  absl::Mutex mu;
  // node id -> its reconstruction; node_hash_map: a found block stays where it is.
  absl::node_hash_map<uint64_t, std::vector<uint8_t>> blocks ABSL_GUARDED_BY(mu);
};

// The reconstructions one Delete keeps at most (dense bytes): past it, the blocks coded against the
// other centroids are listed again (ABORTED, the service retries) and end ABORTED if they went too.
inline constexpr uint64_t kMaxRetiredBytes = 64ull << 20;

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
  // Bytes of the reconstructions every shard keeps for continuing Puts (ModelShard::KeepPutParent),
  // bounded by options->put_parent_cache_bytes across the store.
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
    bool unverified = false;  // client-encoded and not decoded at the Put (TrieNode::unverified)
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

  // `committed`: the model record is on disk (recovered); otherwise the shard was created by a
  // Put and its model is written with its first blocks.
  ModelShard(ShardContext* context, std::string ns, ModelInfo model, uint64_t shard_id,
             bool committed);
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
  MatchResult Lookup(absl::Span<const uint32_t> token_ids);  // counted in Stats
  MatchResult Match(absl::Span<const uint32_t> token_ids);   // not counted (a Put's own match)
  // through_retained: also through retained nodes (a Get of the path to a node named by id, e.g.
  // a member's centroid: "Retained centroids" above); else a token lookup's view.
  GetResult Get(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                bool through_retained = false);
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
  // What a PutSession hands the shard at Finish: the Put's context and its blocks by index
  // (those not stored yet must all be there). Every pointer is the session's and outlives the
  // call.
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
  // The Put of `plan`, all or nothing: matches the stored prefix, encodes the new blocks not
  // encoded yet (compact profile: in order, each predicted from its parent's reconstruction, or
  // as a residual of a near-duplicate centroid when smaller; the stored parent's is the one a
  // previous Put that ended with it kept, else decoded from its path), commits them in one batch
  // (again, up to 4 times, when the prefix changes under it), counts the Put and queues a sample of
  // the new blocks for the learner (moving their dense bytes). Errors: INVALID_ARGUMENT naming `kv`
  // when a full block is neither stored nor in the plan; ABORTED if the prefix kept changing;
  // Commit's errors; an encoding error.
  absl::StatusOr<PutSummary> ApplyPut(PutPlan& plan);
  // Writes `blocks` (consecutive, the first a child of `parent_id`) in one batch and publishes
  // them; creates the model record with the first. Returns their node ids. ABORTED if
  // `parent_id` is gone or a block exists; INVALID_ARGUMENT if the model was created meanwhile
  // with another geometry; RESOURCE_EXHAUSTED if the disk budget is held; the store's errors.
  absl::StatusOr<std::vector<uint64_t>> Commit(const ModelInfo& model, uint64_t parent_id,
                                               absl::Span<const uint32_t> token_ids,
                                               absl::Span<const float> surprisal_bits,
                                               const std::vector<NewBlock>& blocks);
  // `erase`: no centroid is retained (each cluster with a lossy member re-elects too).
  absl::StatusOr<DeleteSummary> Delete(absl::Span<const uint32_t> token_ids, bool erase = false);
  absl::StatusOr<uint64_t> Pin(absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                               bool unpin, bool extend_only = false);
  // Evicts those of `ids` that are still evictable leaves. Returns the bytes freed.
  absl::StatusOr<uint64_t> Evict(const std::vector<uint64_t>& ids);
  // Counts a finished Put.
  void CountPut(uint64_t stored, uint64_t deduplicated, uint64_t touched_node);

  // --- Learned predictor states (model_shard_predictors.cc, trie/predictor_registry.h) ---
  std::shared_ptr<PredictorRegistry> predictors() const;
  // Recovery: a persisted version (read and parsed, or its error) and its disk bytes.
  void RecoverPredictor(const PredictorMeta& meta,
                        absl::StatusOr<std::shared_ptr<const PredictorState>> state);
  // One committed block of a Put to learn from: its dense bytes (moved in), or the envelope its
  // client encoded (RAW, LOSSLESS fast or RESIDUAL fast) with the state it names (null for 0).
  struct LearnBlock {
    uint32_t block_index = 0;
    std::string kv;  // dense: geometry.num_bytes() bytes; empty when `encoded` is set
    std::shared_ptr<const EncodedBlock> encoded;
    std::shared_ptr<const PredictorState> learned;  // the version `encoded` names
  };
  // After a committed Put (`token_ids` the Put's): queues a sample of `blocks` (ascending block
  // index) spread over the whole Put, as many as the store's LearnQueue has room for
  // (LearnQueue::PushSample), to be learned from in the background; an encoded block is decoded
  // there first, its version held (PredictorRegistry::Hold) until then. The others are counted
  // as dropped. Never blocks on the learner.
  void QueueLearning(absl::Span<const uint32_t> token_ids, std::vector<LearnBlock> blocks);
  // Deletes the versions no block depends on and no reader holds any more (but the latest), on
  // disk then in memory.
  void FreeUnusedPredictors();
  // The serialized bytes of `version`, as persisted (RocksDB-checksummed). NOT_FOUND naming
  // `version`; DATA_LOSS when unreadable.
  absl::StatusOr<std::string> SerializedPredictor(uint32_t version);
  // The model's versions for Inspect and Stats.
  std::vector<PredictorVersionView> PredictorVersions() const;

  // --- Near-duplicate clusters (model_shard_cluster.cc) ---
  // The background pass's hook: re-encodes standalone node `node_id` (its exact reconstruction,
  // losslessly: a lossless block stays bit-exact, a lossy one keeps its error) as a residual of
  // `centroid_id`, a standalone node with the same tokens at the same depth, and publishes it in
  // one batch when smaller than what node_id stores now. Returns the payload bytes saved (0: not
  // smaller, left as it was). Errors: NOT_FOUND naming node_id or centroid_id;
  // FAILED_PRECONDITION when node_id is not standalone or is a centroid itself, centroid_id is not
  // standalone, or their depths or tokens differ; the store's write errors.
  absl::StatusOr<uint64_t> RecodeAgainstCentroid(uint64_t node_id, uint64_t centroid_id);
  // The background cluster pass's round on this shard (trie/cluster_pass.cc): visits the dirty
  // near-duplicate groups (ClusterIndex::DirtyGroups) and elects each group's centroid: the
  // member whose path is most probable (lowest path surprisal), then the most hit, then the
  // current centroid, the oldest; a lossy residual is not eligible. Then codes the others against
  // it (ConvergeGroup): each member's exact reconstruction, losslessly, kept when smaller; an
  // elected residual is first stored standalone, only when the group's bytes fall. A centroid
  // is only re-encoded, never removed, so a read listed before still decodes. At most about
  // `budget` encodings (a round's first group may pass it by its size); a group it could not
  // visit stays dirty. Returns the encodings spent; adds the groups visited to *groups.
  // Errors: the store's write errors.
  absl::StatusOr<uint32_t> RunClusterPass(uint32_t budget, uint64_t* groups);
  // Encodes block `block_index` of a Put whose stored prefix ends at `anchor_id`: standalone, or
  // as a residual of the candidate centroid that makes it smallest, when smaller.
  absl::StatusOr<NearDupEncoded> EncodeNewBlock(
      const ModelInfo& model, uint64_t anchor_id, uint32_t block_index,
      absl::Span<const uint32_t> token_ids, absl::Span<const float> surprisal_bits,
      absl::Span<const uint8_t> kv, const EncodeOptions& options, const PredictionContext& context);

 private:
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
  // ApplyPut's check before it deduplicates onto stored blocks it carries: every node of
  // `node_ids` whose index is in `carried` and is TrieNode::unverified is decoded; true when one
  // did not decode and was dropped (with its subtree: match again).
  bool DroppedUndecodable(absl::Span<const uint64_t> node_ids,
                          const std::map<uint32_t, PlanBlock>& carried);
  absl::Status ReconstructInternal(uint64_t node_id, absl::Span<uint8_t> out,
                                   std::vector<Corrupt>* corrupt);
  // Drops the nodes a read found bad (and their subtrees). Takes write_mu_ unless held.
  void DropCorrupt(const std::vector<Corrupt>& corrupt);
  void DropCorruptLocked(const std::vector<Corrupt>& corrupt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Before a Delete removes node_id's subtree: when reads hold the current RetiredReferences,
  // puts in it the reconstructions of the subtree's centroids (and of their parents inside it).
  // Returns whether it added any (the Delete then starts a new epoch once the subtree is gone).
  bool RetireReferencesLocked(uint64_t node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Near-duplicates (model_shard_cluster.cc): for every centroid inside the subtree of one of
  // `roots` with members outside them all, re-elects (ReelectLocked) a member outside them all,
  // so the subtrees can go together (an eviction of many leaves never elects one that goes).
  // Every member's reconstruction stays bit-exact. Counts the bytes replaced and written, the
  // nodes re-encoded and the centroids re-elected in *summary. With `retain` set, a centroid with
  // a lossy member is not re-elected but added to *retain (see "Retained centroids" above).
  // `erasing`: an erasing Delete that would otherwise retain; the bytes written for the clusters
  // with a lossy member are added to summary->erase_bytes_rewritten.
  absl::Status ReleaseDependentsLocked(absl::Span<const uint64_t> roots, DeleteSummary* summary,
                                       absl::flat_hash_set<uint64_t>* retain = nullptr,
                                       bool erasing = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Deletes root_id's subtree but `retain` (centroids inside it) and their ancestors inside it,
  // which are marked retained, in one batch. Adds to the summary's nodes_deleted, bytes_freed and
  // nodes_retained.
  absl::Status RemoveRetainingLocked(uint64_t root_id, const absl::flat_hash_set<uint64_t>& retain,
                                     DeleteSummary* summary)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the retained nodes that nothing is coded against and that have no child, until none
  // is left. Logs (and leaves for the next sweep) a failed write.
  void SweepRetainedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // A Put whose block `first_block` (of token_ids) under parent_id is a retained node: marks it,
  // and the retained nodes below it along token_ids, visible again (written first). Returns
  // whether it revived any.
  absl::StatusOr<bool> ReviveRetainedLocked(uint64_t parent_id,
                                            absl::Span<const uint32_t> token_ids,
                                            uint32_t first_block)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Elects among `members` (of centroid_id, which goes; ascending ids) the one whose path is most
  // probable (lowest path surprisal), then most hit, then with most dependents (preferring those
  // at centroid_id's own position over position-shifted ones), re-encodes it
  // standalone, then each other member against it (or another candidate outside `leaving`, or
  // standalone, whichever is smallest). Each member is published alone (one RecordBatch): a crash
  // leaves each one either old, its old centroid still stored, or new.
  absl::Status ReelectLocked(uint64_t centroid_id, const std::vector<uint64_t>& members,
                             const absl::flat_hash_set<uint64_t>& leaving, DeleteSummary* summary)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Re-encodes node_id's exact reconstruction losslessly: standalone when centroid_id is 0, else
  // as a residual of centroid_id or of another candidate not in `leaving` when smaller than
  // standalone. *replaced: false when the node went meanwhile.
  absl::Status RecodeMemberLocked(uint64_t node_id, uint64_t centroid_id,
                                  const absl::flat_hash_set<uint64_t>& leaving,
                                  DeleteSummary* summary, bool* replaced)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // The candidates the Put path would find now for the stored block `n` (aligned, else at a
  // position offset), never n or below it, nor one in `leaving` (or its parent).
  std::vector<ClusterIndex::Candidate> StoredCandidatesLocked(
      const TrieNode& n, const absl::flat_hash_set<uint64_t>& leaving)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Re-encodes node_id's exact reconstruction, losslessly, against the best of `candidates` when
  // that is smaller than the `current` bytes it stores (RecheckLocked, RecodeAgainstCentroid).
  // Returns the payload bytes saved (0: none was smaller); ABORTED when the node is gone.
  absl::StatusOr<uint64_t> RecodeIfSmallerLocked(
      uint64_t node_id, const BlockGeometry& g, uint64_t current,
      const std::vector<ClusterIndex::Candidate>& candidates)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // The exact reconstruction of node_id (what a re-encoding stores again, bit-exact). ABORTED
  // when it is gone; drops what fails its own check.
  absl::Status ReconstructExactLocked(uint64_t node_id, const BlockGeometry& g,
                                      std::vector<uint8_t>* recon)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Encodes `kv` against each of `candidates` (their reconstructions read here) and keeps in *out
  // the smallest encoding that is smaller than out->encoded. Returns whether one was. `corrupt`:
  // null to drop a candidate that fails its check here, else where to list it (write_mu_ held).
  absl::StatusOr<bool> EncodeAgainstCandidates(
      const BlockGeometry& g, absl::Span<const uint8_t> kv, const EncodeOptions& options,
      const PredictionContext& context, const std::vector<ClusterIndex::Candidate>& candidates,
      NearDupEncoded* out, std::vector<Corrupt>* corrupt);
  // *replaced_bytes: the payload bytes of the encoding replaced (0 if the node went meanwhile).
  // reference_node_id: the centroid `encoded` is a residual of (0 = standalone).
  absl::Status ReplaceEncodingLocked(uint64_t node_id, const EncodedBlock& encoded,
                                     Encoding encoding, uint64_t reference_node_id,
                                     uint64_t* replaced_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // One group of RunClusterPass; *done: every member visited (the group can be settled).
  absl::StatusOr<uint32_t> SettleClusterGroup(const std::vector<uint64_t>& ids, uint32_t budget,
                                              bool* done) ABSL_LOCKS_EXCLUDED(write_mu_, mu_);
  // Codes `members` (of one group) against `elected`, each when smaller than what it stores now
  // (its exact reconstruction, losslessly). When `elected` is itself a residual (lossless) it is
  // first re-encoded standalone, and only when the group's bytes fall overall, or to swap with
  // the block alone in its group it is coded against at an offset (that block then goes to
  // recheck_); each change is published alone. Members that are centroids follow once their
  // dependents moved; the dependents they had outside the group go to recheck_. Returns the
  // encodings spent.
  absl::StatusOr<uint32_t> ConvergeGroup(uint64_t elected, const std::vector<uint64_t>& members)
      ABSL_LOCKS_EXCLUDED(write_mu_, mu_);
  // A lossless block without dependents that a cluster move left standalone (a swap in
  // ConvergeGroup) or coded against the best window it found then: its exact reconstruction
  // coded against the candidates the Put path finds now (aligned, or at any position offset),
  // kept when smaller. Returns the encodings spent.
  absl::StatusOr<uint32_t> RecheckLocked(uint64_t node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ClusterViewLocked(const TrieNode& node, NodeView* view) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A read of node `n` as listed now: the hot copy or else `*snapshot` (taken when first needed),
  // and the learned predictors' context (tokens, position, previous token, version held for the
  // read; shared with `previous`, the read listed before it, when it names the same version).
  BlockRead ListLocked(const TrieNode& n, const BlockRead* previous,
                       std::shared_ptr<const ReadSnapshot>* snapshot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the versions a released hold left unused, off the caller's path (the LearnQueue).
  void ScheduleFreeUnusedPredictors();
  // Decodes `payload` of `block` as the next block of `chain`, with the learned state it names.
  // DATA_LOSS when that state is unreadable or gone; INTERNAL, with `undecodable` set, when the
  // bytes (checksummed) do not decode.
  absl::Status DecodeNext(const BlockRead& block, const std::string& payload, DecodeChain* chain,
                          absl::Span<uint8_t> out, bool* undecodable);
  // Reads a persisted version of this shard back (for the registry's non-resident versions).
  PredictorRegistry::Loader PredictorLoader();
  // The LearnQueue job of QueueLearning: decodes an encoded block (false: it did not decode,
  // logged), then observes (counting an encoded block as observed), refits when due, persists
  // and publishes.
  bool Learn(const std::shared_ptr<PredictorRegistry>& registry, uint32_t block_index,
             const std::vector<int32_t>& tokens, int32_t previous_token, const LearnBlock& block);

  // The reconstruction of node `node_id` kept by a compact-profile Put that ended with it (null:
  // not kept), and keeping one: this shard's oldest go while the store's kept reconstructions
  // (ShardContext::put_parent_bytes) would pass StoreOptions::put_parent_cache_bytes; when the
  // other shards' alone fill it, none is kept.
  std::shared_ptr<const std::vector<uint8_t>> FindPutParent(uint64_t node_id);
  void KeepPutParent(uint64_t node_id, absl::Span<const uint8_t> reconstruction);

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
  std::shared_ptr<RetiredReferences> retired_ ABSL_GUARDED_BY(mu_) =
      std::make_shared<RetiredReferences>();
  // Centroids dropped because their payload failed its checksum: their members are DATA_LOSS.
  absl::flat_hash_set<uint64_t> corrupt_centroids_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // The nodes marked retained ("Retained centroids" above).
  absl::flat_hash_set<uint64_t> retained_ids_ ABSL_GUARDED_BY(mu_);
  // Blocks a cluster move left for the pass to look at again (RecheckLocked).
  // Memory only: after a restart they stay as they are (stored bytes, not correctness).
  absl::flat_hash_set<uint64_t> recheck_ ABSL_GUARDED_BY(mu_);
  // Totals over the trie, kept as nodes come and go.
  uint64_t bytes_logical_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_stored_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t lossy_nodes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t client_reported_nodes_ ABSL_GUARDED_BY(mu_) = 0;  // error_client_reported nodes
  double sum_rel_rms_k_ ABSL_GUARDED_BY(mu_) = 0;
  double sum_rel_rms_v_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<float, uint64_t> lossy_errors_ ABSL_GUARDED_BY(mu_);  // max(k, v) -> nodes
  std::vector<uint64_t> nodes_at_depth_ ABSL_GUARDED_BY(mu_);
  // Put parents: the reconstructions (what a reader decodes) of the last block of recent
  // compact-profile Puts, newest last, so a Put that continues one predicts from it without
  // decoding its path again (reading it from RocksDB when cold). A node's reconstruction never
  // changes (a Delete re-encodes its dependents bit-exactly) and ids are not reused.
  absl::Mutex parents_mu_ ABSL_ACQUIRED_AFTER(mu_);  // guards put_parents_ (a leaf lock)
  std::deque<std::pair<uint64_t, std::shared_ptr<const std::vector<uint8_t>>>> put_parents_
      ABSL_GUARDED_BY(parents_mu_);
  // Counters since start (relaxed atomics: statistics only).
  std::atomic<uint64_t> blocks_stored_{0}, blocks_deduplicated_{0}, lookups_{0}, lookup_hits_{0},
      gets_{0}, puts_{0}, deletes_{0}, evictions_disk_{0}, evicted_bytes_{0},
      evictions_data_loss_{0}, evictions_deleted_{0}, centroids_reelected_{0},
      cluster_pass_recoded_{0}, cluster_pass_bytes_saved_{0}, cluster_pass_reelected_{0};
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_MODEL_SHARD_H_
