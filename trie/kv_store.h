// trie/kv_store.h
//
// KvStore: every (namespace, model) trie of a server, their block payloads, and their persistence
// in an embedded RocksDB. The gRPC service is a thin layer over this class.
//
// Data model. A model is identified by (namespace, model_id) and has a fixed BlockGeometry (the
// first Put creates it; later requests must match it). Its blocks form a BlockTrie. A block is
// [num_layers][2][num_kv_heads][block_tokens][head_dim] in the model's dtype and is stored encoded
// (codec/block_codec.h). Namespaces never share anything: no match, dedup or node crosses them.
//
// Persistence (RocksDB under `data_dir`), column families:
//   models    namespace\0model_id -> ModelRecord
//   nodes     node id (8 bytes big-endian) -> NodeRecord (metadata, tokens, surprisal)
//   payloads  node id -> encoded block (self-checksummed)
// A block's node and payload are written in one WriteBatch, then the node is published in memory;
// so a reader sees a whole block or nothing. On Open the tries are rebuilt from "nodes"; a node
// whose parent or payload is missing, or whose payload fails its CRC, is dropped with its subtree
// and counted (RecoveryStats). Durability: with `sync` every Put's batches are fsynced in the WAL
// before they are acknowledged; without it, a crash of the machine (not of the process) may lose
// the last acknowledged Puts, never corrupt older ones.
//
// Tiers (trie/kv_store_tier.cc, trie/tier_policy.h). Payloads are written through: every
// acknowledged block is in RocksDB, so the hot tier is a bounded in-memory copy. A node is hot
// (TrieNode::encoded set) or cold (null; read from RocksDB on demand). Hot payload bytes never
// exceed `memory_bytes`: publishing a block first demotes the lowest-GDSF hot payloads (a pointer
// drop, no I/O); a background thread keeps hot bytes under 90% of the budget so Puts rarely pay
// for that, and RocksDB flushes memtables to blob files in its own background threads. A cold
// node read `promote_after_cold_reads` times is promoted back. Payload bytes in RocksDB never
// exceed `disk_bytes`: before a Put is written, the lowest-GDSF evictable leaves (unpinned, no
// dependents) are deleted until it fits, no more; RESOURCE_EXHAUSTED if pins prevent that. Node
// metadata is always in memory and in RocksDB. Open reads node records only (payloads are
// checked by their CRC-32C when read, and a bad one is DATA_LOSS and dropped) unless
// `verify_payloads_on_open`.
//
// Thread-safe. One mutex guards the tries; encoding, decoding and cold reads run outside it.
#ifndef KVTRIE_TRIE_KV_STORE_H_
#define KVTRIE_TRIE_KV_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "codec/block_codec.h"
#include "trie/block_trie.h"
#include "trie/cluster_index.h"
#include "trie/tier_policy.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
class Snapshot;
class WriteBatch;
}  // namespace rocksdb

namespace kvtrie {

struct StoreOptions {
  std::string data_dir;  // created if missing
  bool sync = false;     // fsync the WAL before acknowledging a Put
  // Dense bytes one Put may buffer, and all unfinished Puts together (RESOURCE_EXHAUSTED past
  // either): a Put holds its blocks until its commit, about 3x their size at the peak.
  uint64_t max_put_bytes = 256ull << 20;
  uint64_t max_inflight_put_bytes = 1ull << 30;
  EncodeOptions default_encoding;  // used when a Put does not name one
  BlockTrie::TokenHash token_hash = BlockTrie::DefaultTokenHash;  // a seam for collision tests
  NearDupOptions near_dup;  // near-duplicate clusters (trie/cluster_index.h)
  // Tiers (see the top of this file). 0 = unbounded.
  uint64_t memory_bytes = 1ull << 30;  // hot payload bytes in memory
  uint64_t disk_bytes = 0;             // payload bytes in RocksDB
  uint32_t promote_after_cold_reads = 2;
  uint64_t memtable_bytes = 32ull << 20;  // RocksDB write buffer of the payloads (x2 in flight)
  bool verify_payloads_on_open = false;   // read and CRC-check every payload in Open (slow)
  bool background = true;                 // run the background demotion / TTL thread
  // Seam for TTL tests: the wall clock in unix seconds.
  std::function<uint64_t()> now_seconds;
};

struct ModelInfo {
  std::string model_id;
  BlockGeometry geometry;  // block_tokens included
};

struct RecoveryStats {
  uint64_t models = 0;
  uint64_t nodes = 0;
  uint64_t dropped_missing_parent = 0;
  uint64_t dropped_bad_payload = 0;  // missing or failed its checksum
  bool payloads_verified = false;    // verify_payloads_on_open was set
};

struct MatchResult {
  uint32_t block_tokens = 0;  // 0 if the model is unknown
  std::vector<uint64_t> node_ids;
};

// A block of a Get, in order from the root.
struct BlockRead {
  uint64_t node_id = 0;
  std::shared_ptr<const std::string> encoded;
  Encoding encoding = Encoding::kRaw;
  uint64_t reference_node_id = 0;
  // Set when the payload was cold at Get time (then `encoded` is null): the RocksDB view in
  // which it is read, so a concurrent eviction cannot take it away mid-stream.
  std::shared_ptr<const rocksdb::Snapshot> snapshot;
};

struct GetResult {
  ModelInfo model;
  std::vector<BlockRead> blocks;
};

enum class BlockOutcome { kStored, kDeduplicated, kResidualOfCentroid };

struct BlockReport {
  uint32_t block_index = 0;
  BlockOutcome outcome = BlockOutcome::kStored;
  uint64_t node_id = 0;
  uint64_t bytes_logical = 0;
  uint64_t bytes_stored = 0;
  Encoding encoding = Encoding::kRaw;
  double bits_per_component = 0;
  double rel_rms_error_k = 0;
  double rel_rms_error_v = 0;
  double max_abs_error = 0;
  uint64_t reference_node_id = 0;  // kResidualOfCentroid: the centroid node
};

struct PutSummary {
  uint32_t stored_tokens = 0;
  uint32_t tail_tokens_ignored = 0;
  std::vector<BlockReport> blocks;  // one per full block, in order
};

struct NodeView {
  uint64_t node_id = 0;
  uint64_t parent_id = 0;
  uint32_t depth = 0;
  uint32_t token_offset = 0;
  std::vector<uint32_t> token_ids;
  std::vector<float> surprisal_bits;
  double path_surprisal_bits = 0;
  uint64_t bytes_logical = 0;
  uint64_t bytes_stored = 0;
  Encoding encoding = Encoding::kRaw;
  double rel_rms_error_k = 0;
  double rel_rms_error_v = 0;
  uint32_t num_children = 0;
  uint64_t hits = 0;
  uint64_t reference_node_id = 0;         // the centroid this block is a residual of (0 = none)
  uint32_t dependents = 0;                // blocks stored as residuals of this one
  double distance_to_reference_bits = 0;  // trie distance to the centroid (bits)
};

struct InspectResult {
  ModelInfo model;
  NodeView node;
  std::vector<NodeView> children;
};

struct StoreStats {
  uint64_t namespaces = 0;
  uint64_t models = 0;
  uint64_t nodes = 0;
  uint64_t bytes_logical = 0;
  uint64_t bytes_stored = 0;
  uint64_t max_depth = 0;
  uint64_t elements = 0;  // stored KV components
  uint64_t lossy_nodes = 0;
  double sum_rel_rms_error_k = 0;  // over lossy nodes
  double sum_rel_rms_error_v = 0;
  double max_rel_rms_error = 0;
  // Counters since this process started.
  uint64_t blocks_stored = 0;
  uint64_t blocks_deduplicated = 0;
  uint64_t lookups = 0;
  uint64_t lookup_hits = 0;
  uint64_t gets = 0;
  uint64_t puts = 0;
  uint64_t deletes = 0;
  // Tiers (nodes and payload bytes of `ns`, or of all; the budgets are server-wide).
  uint64_t hot_nodes = 0;
  uint64_t hot_bytes = 0;  // payload bytes in memory
  uint64_t cold_nodes = 0;
  uint64_t cold_bytes = 0;  // payload bytes only in RocksDB
  uint64_t disk_bytes = 0;  // payload bytes in RocksDB (hot and cold: written through)
  uint64_t pinned_nodes = 0;
  uint64_t memory_budget_bytes = 0;
  uint64_t disk_budget_bytes = 0;
  // Tier counters since start (server-wide).
  uint64_t demotions = 0;  // hot -> cold, for the memory budget
  uint64_t demoted_bytes = 0;
  uint64_t promotions = 0;  // cold -> hot, read often enough
  uint64_t cold_reads = 0;  // payloads read from RocksDB
  uint64_t cold_read_bytes = 0;
  uint64_t evictions_disk = 0;  // nodes deleted for the disk budget
  uint64_t evicted_bytes = 0;
  uint64_t evictions_data_loss = 0;  // nodes dropped because a payload failed its check
  uint64_t evictions_deleted = 0;    // nodes removed by Delete
  uint64_t pins_expired = 0;
  uint64_t puts_rejected_disk_full = 0;  // RESOURCE_EXHAUSTED: pins hold the disk budget
  ClusterStats cluster;  // near-duplicate clusters and the surprisal / distance histograms
};

class KvStore;

// One Put stream. Blocks may arrive whole or as layer ranges, in any order; they are buffered
// (at most max_put_bytes) and, at Finish, encoded and committed together in one RocksDB batch, so
// a Put is all or nothing: a failed or truncated stream stores nothing. Not thread-safe (one
// stream, one caller).
class PutSession {
 public:
  PutSession(const PutSession&) = delete;
  PutSession& operator=(const PutSession&) = delete;
  ~PutSession();

  // Adds layers [layer_begin, layer_end) of block `block_index` (layer_end 0 = num_layers).
  // Blocks already stored are checked for size and otherwise ignored (deduplicated).
  // Errors: INVALID_ARGUMENT naming `block_index`, `layer_end` or `kv` (size, layers sent twice);
  // RESOURCE_EXHAUSTED past max_put_bytes. After an error the session is unusable.
  absl::Status AddLayers(uint32_t block_index, uint32_t layer_begin, uint32_t layer_end,
                         absl::Span<const uint8_t> kv);

  // Ends the stream: encodes and commits every new block. Errors: INVALID_ARGUMENT if a block is
  // incomplete (`kv: block 3 is missing layers [2, 5)`) or a full block of token_ids is neither
  // stored nor sent (`kv: ... never sent`); ABORTED if the prefix changed concurrently and kept
  // changing; the database's errors. Nothing is stored unless this returns OK.
  absl::StatusOr<PutSummary> Finish();

 private:
  friend class KvStore;
  struct Pending {
    std::vector<uint8_t> kv;  // the dense block
    std::vector<bool> have;   // one flag per layer
    uint32_t layers_missing = 0;
  };
  PutSession(KvStore* store, std::string ns, ModelInfo model, std::vector<uint32_t> token_ids,
             std::vector<float> surprisal_bits, EncodeOptions encode);

  KvStore* const store_;
  const std::string ns_;
  const ModelInfo model_;
  const std::vector<uint32_t> token_ids_;
  const std::vector<float> surprisal_bits_;
  const EncodeOptions encode_;
  const uint32_t num_blocks_;  // full blocks in token_ids_
  uint64_t buffered_bytes_ = 0;
  std::map<uint32_t, Pending> pending_;  // by block index
  bool failed_ = false;
};

class KvStore {
 public:
  // Opens (creating if needed) the store under options.data_dir and rebuilds the tries.
  // Errors: the database's (e.g. UNAVAILABLE if another process holds the lock).
  static absl::StatusOr<std::unique_ptr<KvStore>> Open(const StoreOptions& options);
  ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  const RecoveryStats& recovery() const { return recovery_; }

  // Longest stored prefix. An unknown namespace or model matches nothing (not an error).
  MatchResult Lookup(const std::string& ns, const std::string& model_id,
                     absl::Span<const uint32_t> token_ids);

  // Starts a Put. Creates the model on first use. Errors: INVALID_ARGUMENT naming the field
  // (`model.head_dim: ... stored with head_dim=8, request has 16`, `surprisal_bits`, `token_ids`).
  absl::StatusOr<std::unique_ptr<PutSession>> BeginPut(const std::string& ns,
                                                       const ModelInfo& model,
                                                       std::vector<uint32_t> token_ids,
                                                       std::vector<float> surprisal_bits,
                                                       const EncodeOptions& encode);

  // The encoded blocks of the longest stored prefix (at most max_blocks, 0 = all), root first;
  // decode them with DecodeBlock one by one. An unknown (namespace, model_id) is a miss: no
  // blocks and an empty model.
  absl::StatusOr<GetResult> Get(const std::string& ns, const std::string& model_id,
                                absl::Span<const uint32_t> token_ids, size_t max_blocks);

  // Decodes one block of a Get into `out` (model geometry bytes); `parent` is the previous
  // block's reconstruction (empty for the first). On DATA_LOSS the node and its subtree are
  // dropped from the store (and the error returned), so a corrupt block is never served twice.
  absl::Status DecodeBlock(const std::string& ns, const std::string& model_id,
                           const BlockRead& block, absl::Span<const uint8_t> parent,
                           absl::Span<uint8_t> out);

  // Deletes the node at the end of `token_ids` (block-aligned, stored) and its subtree.
  // Errors: NOT_FOUND naming `token_ids` if that prefix is not stored; INVALID_ARGUMENT if not
  // block-aligned.
  absl::StatusOr<std::pair<uint64_t, uint64_t>> Delete(const std::string& ns,
                                                       const std::string& model_id,
                                                       absl::Span<const uint32_t> token_ids);

  // The token ids of the prefix that ends with node `node_id` (depth * block_tokens ids, root
  // first). Errors: NOT_FOUND naming `model_id` or `node_id`.
  absl::StatusOr<std::vector<uint32_t>> PathTokens(const std::string& ns,
                                                   const std::string& model_id, uint64_t node_id);

  // One node (0 = root) and its children. Errors: NOT_FOUND naming `model_id` or `node_id`.
  absl::StatusOr<InspectResult> Inspect(const std::string& ns, const std::string& model_id,
                                        uint64_t node_id);

  // Totals over one namespace, or all when `ns` is empty.
  StoreStats Stats(const std::string& ns);

  // --- Tiers (trie/kv_store_tier.cc) ---

  // Pins the node of the last full block of `token_ids` (stored; a tail is ignored) for
  // `ttl_seconds` (0 = until unpinned), or unpins it: a pinned node and so its ancestors are never
  // evicted for the disk budget (they may still leave memory). Persisted. Returns the pinned node's
  // id. Errors as Delete's.
  absl::StatusOr<uint64_t> Pin(const std::string& ns, const std::string& model_id,
                               absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                               bool unpin);

  // The payload of a block of a Get: the hot copy, or read from RocksDB (in the Get's snapshot)
  // and CRC-checked. Errors: DATA_LOSS if missing or corrupt (the node and its subtree are then
  // dropped); the database's.
  absl::StatusOr<std::shared_ptr<const std::string>> Payload(const std::string& ns,
                                                             const std::string& model_id,
                                                             const BlockRead& block);

  // Centroid hook (near-duplicate clusters): a node with dependents is never evicted, even as a
  // leaf. AddDependents(id, +n) / (id, -n). NOT_FOUND if `node_id` is not stored.
  absl::Status AddDependents(uint64_t node_id, int delta);

  // Runs one background pass now (demotion to the low watermark, expired pins, disk budget).
  void RunTierMaintenance();

  // --- Near-duplicate clusters (trie/kv_store_cluster.cc, trie/cluster_index.h) ---

  // True if some stored block is a residual of `node_id`: it must not be evicted or deleted
  // before ReleaseDependents.
  bool HasDependents(const std::string& ns, const std::string& model_id, uint64_t node_id);
  // Re-encodes every block outside node_id's subtree that is a residual of a node inside it, as
  // the bit-exact (kLossless) standalone copy of its current reconstruction: readers get exactly
  // the values they got before. Then the subtree can go. ABORTED if new dependents kept coming.
  absl::Status ReleaseDependents(const std::string& ns, const std::string& model_id,
                                 uint64_t node_id);
  // Trie distance (bits) between two nodes of (ns, model_id). NOT_FOUND naming the id.
  absl::StatusOr<double> TrieDistance(const std::string& ns, const std::string& model_id,
                                      uint64_t a, uint64_t b);

 private:
  friend class PutSession;
  struct Model {
    ModelInfo info;
    std::unique_ptr<BlockTrie> trie;
    ClusterIndex clusters;       // near-duplicate index of `trie`
    uint64_t bytes_logical = 0;  // over the trie's nodes
    uint64_t bytes_stored = 0;
  };
  using ModelKey = std::pair<std::string, std::string>;  // (namespace, model_id)

  explicit KvStore(const StoreOptions& options);
  absl::Status Recover();
  Model* FindModel(const std::string& ns, const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FindModel, or NOT_FOUND naming `model_id`.
  absl::StatusOr<Model*> FindModelOrNotFound(const std::string& ns, const std::string& model_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Node `node_id` of `model` (0 = the root), or NOT_FOUND naming `node_id`.
  absl::StatusOr<TrieNode*> FindNodeOrNotFound(Model* model, const std::string& ns,
                                               uint64_t node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One encoded block of a Put, ready to commit.
  struct NewBlock {
    uint32_t block_index = 0;
    EncodedBlock encoded;
    Encoding encoding = Encoding::kRaw;
    uint64_t reference_node_id = 0;  // the centroid it is a residual of (0 = standalone)
  };
  // Near-duplicate clusters (kv_store_cluster.cc).
  struct NearDupEncoded {
    EncodedBlock encoded;
    uint64_t reference_node_id = 0;  // 0 = standalone
    std::vector<uint8_t> reference;  // the centroid's reconstruction when reference_node_id != 0
  };
  // Encodes block `block_index` of a Put whose stored prefix ends at `anchor_id` (0 = root):
  // standalone, or as a residual of the near-duplicate candidate (cluster_index.h) that makes it
  // smallest, when that is smaller than standalone.
  absl::StatusOr<NearDupEncoded> EncodeNewBlock(
      const std::string& ns, const ModelInfo& model, uint64_t anchor_id, uint32_t block_index,
      absl::Span<const uint32_t> token_ids, absl::Span<const float> surprisal_bits,
      absl::Span<const uint8_t> kv, const EncodeOptions& options, const PredictionContext& context);
  // Stores `encoded` as node_id's new standalone payload (both RocksDB records, then memory).
  absl::Status ReplaceEncodingOf(const std::string& ns, const std::string& model_id,
                                 uint64_t node_id, const EncodedBlock& encoded, Encoding encoding);
  void ClusterAddLocked(Model* model, TrieNode* node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ReleaseDependents of the node at the end of `token_ids`, if stored (for Delete).
  absl::Status ReleaseDependentsOfPrefix(const std::string& ns, const std::string& model_id,
                                         absl::Span<const uint32_t> token_ids);
  bool SubtreeHasOutsideDependentsLocked(Model* model, TrieNode* node)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ClusterRemoveLocked(Model* model, const TrieNode& node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ClusterViewLocked(Model* model, const TrieNode& node, NodeView* view)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ClusterStatsLocked(const Model& model, ClusterStats* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes `blocks` (consecutive, the first a child of `parent_id`) in one batch and publishes
  // them. Returns their node ids. ABORTED if `parent_id` is gone or a block already exists.
  absl::StatusOr<std::vector<uint64_t>> CommitBlocks(const std::string& ns, const ModelInfo& model,
                                                     uint64_t parent_id,
                                                     absl::Span<const uint32_t> token_ids,
                                                     absl::Span<const float> surprisal_bits,
                                                     const std::vector<NewBlock>& blocks);
  // Decodes stored node `node_id` of (ns, model_id) into `out` (sized by the caller), decoding
  // its ancestors first when its encoding predicts from them (O(depth) in that case).
  absl::Status ReconstructNode(const std::string& ns, const std::string& model_id, uint64_t node_id,
                               absl::Span<uint8_t> out);
  enum class DropReason { kDeleted, kDataLoss, kDisk };
  // Removes `node` and its subtree from memory and tier accounting and adds their deletes to
  // `batch`; returns the number of nodes removed.
  uint64_t RemoveNodeLocked(Model* model, TrieNode* node, DropReason reason,
                            rocksdb::WriteBatch* batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropNodeLocked(Model* model, TrieNode* node, DropReason reason = DropReason::kDeleted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tier bookkeeping (kv_store_tier.cc).
  bool Evictable(const TrieNode& n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers a node just published (`encoded` set or not) or recovered.
  void TierAddLocked(Model* model, TrieNode* node, std::shared_ptr<const std::string> encoded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TierTouchLocked(Model* model, TrieNode* node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Demotes hot payloads until hot bytes + `incoming` <= `target`.
  void DemoteLocked(uint64_t incoming, uint64_t target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts leaves until disk bytes + `incoming` <= the disk budget. RESOURCE_EXHAUSTED if it
  // cannot (pins, dependents).
  absl::Status MakeDiskRoomLocked(uint64_t incoming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpirePinsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaintainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a Put that deduplicated against `node_id` and its ancestors.
  void TouchPath(const std::string& ns, const std::string& model_id, uint64_t node_id);
  absl::Status WritePinLocked(Model* model, TrieNode* node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NowSeconds() const;
  // A RocksDB snapshot released when the last holder lets go.
  std::shared_ptr<const rocksdb::Snapshot> SnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BackgroundLoop();

  const StoreOptions options_;
  RecoveryStats recovery_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* cf_models_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_nodes_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_payloads_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;

  mutable absl::Mutex mu_;
  std::map<ModelKey, Model> models_ ABSL_GUARDED_BY(mu_);  // every trie, by (namespace, model_id)
  uint64_t next_node_id_ ABSL_GUARDED_BY(mu_) = 1;

  // Tiers.
  uint64_t hot_bytes_ ABSL_GUARDED_BY(mu_) = 0;                   // payload bytes held in memory
  uint64_t disk_bytes_ ABSL_GUARDED_BY(mu_) = 0;                  // payload bytes in RocksDB
  GdsfQueue hot_queue_ ABSL_GUARDED_BY(mu_){&TierState::hot};     // hot payloads, demotion order
  GdsfQueue evict_queue_ ABSL_GUARDED_BY(mu_){&TierState::disk};  // evictable leaves
  absl::flat_hash_map<uint64_t, std::pair<Model*, TrieNode*>> pinned_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<std::thread> background_;
  std::atomic<uint64_t> demotions_{0}, demoted_bytes_{0}, promotions_{0}, cold_reads_{0},
      cold_read_bytes_{0}, evictions_disk_{0}, evicted_bytes_{0}, evictions_data_loss_{0},
      evictions_deleted_{0}, pins_expired_{0}, puts_rejected_disk_full_{0};

  // Counters since start (relaxed atomics: statistics only).
  std::atomic<uint64_t> blocks_stored_{0}, blocks_deduplicated_{0}, lookups_{0}, lookup_hits_{0},
      gets_{0}, puts_{0}, deletes_{0};
  std::atomic<uint64_t> inflight_put_bytes_{0};  // dense bytes buffered by unfinished Puts
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_KV_STORE_H_
