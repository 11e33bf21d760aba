// trie/store_types.h
//
// The values KvStore (trie/kv_store.h) takes and returns: options, the model of a trie, match
// and Get results, Put reports, node views and statistics. Plain structs, no behaviour.
#ifndef KVTRIE_TRIE_STORE_TYPES_H_
#define KVTRIE_TRIE_STORE_TYPES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "trie/block_trie.h"
#include "trie/cluster_index.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace kvtrie {

// The learned predictor state of each (namespace, model) (trie/predictor_registry.h).
struct PredictorOptions {
  // Learn from committed Puts and code new kResidual blocks against the latest fitted state.
  bool learn = false;
  // Refit (a new version) after this many new tokens were learned from.
  uint64_t refit_every_tokens = 16384;
  // Per (namespace, model): the learner's accumulators and the state it fits (bytes).
  uint64_t memory_bytes = 64ull << 20;
  // Also fit the cross-layer ridge predictors and the per-plane decorrelating transforms
  // (LearnerOptions::fit_linear / fit_klt). Off by default: on the held-out texts they save 2.2 %
  // of the bits at the TQ3 error (0.551 -> 0.539 bits/component) but the fast encoder runs at
  // 0.26x and the decoder at 0.43x of the token-mean state's (bench/learned.md), and speed is the
  // Put path's first problem. Turn on for namespaces that are written once and read rarely.
  bool cross_layer = false;
  // Versions kept in memory besides the latest (the most recently used); older ones are read back
  // from disk when a block needs them.
  uint32_t resident_versions = 4;
  // KV bytes waiting to be learned from, all models together (a client-encoded block counts at its
  // dense size: the learner decodes it). A Put's new blocks are sampled across the whole Put, as
  // many as the free bytes hold; the others are not learned from (counted in
  // StoreStats::predictor_observations_dropped). Server flag --learn_queue_bytes.
  uint64_t queue_bytes = 64ull << 20;
};

// How much of a client-encoded Put block (PutSession::AddEncodedBlock) the store checks.
enum class VerifyEncoded : uint8_t {
  kStructure = 0,  // codec/block_verify.h: CRC, geometry, encoding, every length and lane bound
  kSample = 1,     // ... and decodes one block in 8 (which ones drawn per Put), checking its
                   // content checksum and state fingerprint (block_codec.h)
  kAll = 2,        // ... and decodes every block
};

struct StoreOptions {
  std::string data_dir;  // created if missing
  bool sync = false;     // fsync the WAL before acknowledging a write
  // Dense bytes one Put may buffer, and all unfinished Puts together (RESOURCE_EXHAUSTED past
  // either). A Put holds its blocks until its commit (encoded ones only, for the encodings that
  // encode on arrival: trie/put_session.h).
  uint64_t max_put_bytes = 256ull << 20;
  uint64_t max_inflight_put_bytes = 1ull << 30;
  EncodeOptions default_encoding;  // used when a Put does not name one
  VerifyEncoded verify_encoded_puts = VerifyEncoded::kStructure;
  // Threads that encode Put blocks as they arrive (trie/put_session.h); 0 = on each stream's
  // own thread.
  int codec_threads = 0;
  // The whole store's bound (bytes, on top of memory_bytes) on the reconstructions of the last
  // block of recent compact-profile Puts, kept per (namespace, model) so that a Put continuing
  // one predicts from it without decoding (and reading from RocksDB) the stored prefix again.
  // 0 = none kept. Server flag --put_parent_cache_bytes.
  uint64_t put_parent_cache_bytes = 16ull << 20;
  BlockTrie::TokenHash token_hash = BlockTrie::DefaultTokenHash;  // a seam for collision tests
  NearDupOptions near_dup;  // near-duplicate clusters (trie/cluster_index.h)
  // Every Delete erases (as KvStore::Delete with erase set): --delete_erases.
  bool delete_erases = false;
  // The background cluster pass (trie/cluster_pass.h): every cluster_pass_interval_ms it codes
  // standalone near-duplicates (e.g. client-encoded Put blocks) against their elected centroid,
  // at most cluster_pass_blocks_per_round encodings per round. 0 = off (the library's default;
  // the server's flags --cluster_pass_interval_ms, --cluster_pass_blocks_per_round turn it on).
  uint32_t cluster_pass_interval_ms = 0;
  uint32_t cluster_pass_blocks_per_round = 64;
  PredictorOptions predictors;
  // Tiers (trie/tier_manager.h). 0 = unbounded.
  uint64_t memory_bytes = 1ull << 30;  // hot payload bytes in memory
  // The data folder: payloads, node records, RocksDB's WAL, memtables and files, within the
  // slack stated in trie/record_store.h.
  uint64_t disk_bytes = 0;
  uint32_t promote_after_cold_reads = 2;
  uint64_t memtable_bytes = 32ull << 20;  // RocksDB write buffer of the payloads (x2 in flight)
  bool verify_payloads_on_open = false;   // read and CRC-check every payload in Open (slow)
  bool background = true;                 // run the background demotion / TTL / disk thread
  // Seam for TTL tests: the wall clock in unix seconds.
  std::function<uint64_t()> now_seconds;
  // Seam for fault injection: the RocksDB Env (files, clock); null = rocksdb::Env::Default().
  // Not owned; must outlive the store.
  rocksdb::Env* env = nullptr;
};

struct ModelInfo {
  std::string model_id;
  BlockGeometry geometry;  // block_tokens included
};

struct RecoveryStats {
  uint64_t models = 0;
  uint64_t nodes = 0;
  uint64_t dropped_missing_parent = 0;
  uint64_t dropped_bad_payload = 0;            // missing or failed its checksum
  bool payloads_verified = false;              // verify_payloads_on_open was set
  uint64_t predictor_versions = 0;             // learned predictor states restored
  uint64_t predictor_versions_unreadable = 0;  // of which DATA_LOSS (their dependents fail)
};

struct MatchResult {
  uint32_t block_tokens = 0;  // 0 if the model is unknown
  std::vector<uint64_t> node_ids;
};

// A RocksDB snapshot (trie/record_store.h); opaque outside the record store.
struct ReadSnapshot;
// Centroids deleted after a read was listed, kept for it (trie/model_shard.h).
struct RetiredReferences;

// A block of a Get, in order from the root.
struct BlockRead {
  uint64_t node_id = 0;
  std::shared_ptr<const std::string> encoded;  // the hot copy; null when cold
  Encoding encoding = Encoding::kRaw;
  uint64_t reference_node_id = 0;
  // The learned predictor state its payload was coded against (0 = none), and what the learned
  // predictors condition on: the block's tokens, the absolute position of the first (block index
  // * block_tokens), the token before it (-1 at the root).
  uint32_t predictor_version = 0;
  std::vector<int32_t> tokens;
  uint32_t first_position = 0;
  int32_t previous_token = -1;
  // Set when the payload was cold at Get time: the RocksDB view in which it is read, so a
  // concurrent eviction cannot take it away mid-stream.
  std::shared_ptr<const ReadSnapshot> snapshot;
  // The node's payload generation when listed (TierManager::HotCopy): a cold payload is promoted
  // to memory only while it is still the node's.
  uint64_t tier_generation = 0;
  // Keeps predictor_version readable (not freed) while this read, or a copy of it, exists — also
  // when a Delete re-encodes the block meanwhile (PredictorRegistry::Hold). Null when none.
  std::shared_ptr<const void> predictor_hold;
  // For a block coded against a centroid: the reconstructions of the centroids a Delete removed
  // after this read was listed, so the block still decodes as listed. Null otherwise.
  std::shared_ptr<RetiredReferences> retired;
};

struct GetResult {
  ModelInfo model;
  std::vector<BlockRead> blocks;
};

// What a Delete did. The store's payload bytes changed by bytes_freed - bytes_rewritten (negative
// when re-encoding the near-duplicates that were coded against the deleted blocks made it grow).
struct DeleteSummary {
  uint64_t nodes_deleted = 0;
  // Payload bytes removed: the deleted blocks' and the replaced encodings of the near-duplicates
  // outside the prefix that were re-encoded because they were coded against a deleted block.
  uint64_t bytes_freed = 0;
  uint64_t bytes_rewritten = 0;  // payload bytes written for those re-encoded near-duplicates
  uint64_t nodes_rewritten = 0;  // how many were re-encoded
  // Centroids removed with surviving members for which one member was elected the new centroid
  // (re-encoded standalone) and the others re-encoded against it (ModelShard::Delete).
  uint64_t centroids_reelected = 0;
  // Centroids with lossy members that stay, unnamed, as their reference (ModelShard, "Retained
  // centroids"), and the nodes kept for them: those centroids and their ancestors in the prefix.
  uint64_t centroids_retained = 0;
  uint64_t nodes_retained = 0;
  // An erasing Delete (KvStore::Delete): payload bytes written to re-code the members of the
  // centroids with a lossy member that a Delete without erase would have retained (their replaced
  // encodings are in bytes_freed); 0 without erase or with retention off.
  uint64_t erase_bytes_rewritten = 0;
  bool compacted = false;  // an erasing Delete: RocksDB was flushed and compacted after it
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
  uint32_t predictor_version = 0;         // the learned state it was coded against (0 = none)
  bool error_client_reported = false;     // rel_rms_error_* came from the client that encoded it
  uint32_t dependents = 0;                // blocks stored as residuals of this one
  double distance_to_reference_bits = 0;  // trie distance to the centroid (bits)
  // Its prefix was deleted; kept as the centroid (or a centroid's parent) of lossy members.
  bool retained = false;
  // Its reconstruction is not what its Put sent (rel_rms_error_* by how much), however it is
  // coded now (a lossy block the cluster pass re-coded LOSSLESS against a centroid stays lossy).
  bool lossy = false;
  // A RESIDUAL block's error target as its Put asked, kept however it is re-coded (0 = none).
  double target_rel_rms = 0;
};

// One learned predictor state version of a (namespace, model).
struct PredictorVersionView {
  uint32_t version = 0;
  uint64_t state_bytes = 0;     // serialized (on disk and as GetPredictor sends it)
  uint64_t memory_bytes = 0;    // in memory (0 when unreadable or not resident)
  uint64_t tokens_learned = 0;  // tokens of KV it was fitted on
  uint64_t dependents = 0;      // stored blocks coded against it
  // Since start: estimated bytes the learned predictors saved on the blocks stored against it
  // (EncodedBlock::learned_bytes_saved: vs the best non-learned predictors).
  uint64_t bytes_saved = 0;
  bool latest = false;      // new blocks are coded against it
  std::string error;        // set when the persisted state is unreadable (DATA_LOSS)
  std::string description;  // PredictorState::Describe()
};

struct InspectResult {
  ModelInfo model;
  NodeView node;
  std::vector<NodeView> children;
  std::vector<PredictorVersionView> predictors;  // the model's learned states, oldest first
};

// Totals of one namespace (every counter strictly of its own models) or of the whole server.
struct StoreStats {
  uint64_t namespaces = 0;
  uint64_t models = 0;
  uint64_t nodes = 0;
  uint64_t bytes_logical = 0;
  uint64_t bytes_stored = 0;
  uint64_t max_depth = 0;
  uint64_t elements = 0;     // stored KV components
  uint64_t lossy_nodes = 0;  // reconstruction not what the Put sent (TrieNode::lossy)
  // Of them: coded LOSSLESS now (their reconstruction, e.g. by the cluster pass against a
  // centroid).
  uint64_t lossy_recoded_nodes = 0;
  double sum_rel_rms_error_k = 0;  // over lossy nodes
  double sum_rel_rms_error_v = 0;
  double max_rel_rms_error = 0;
  uint64_t client_reported_error_nodes = 0;  // of the nodes: error reported by the client
  // Counters since this process started.
  uint64_t blocks_stored = 0;
  uint64_t blocks_deduplicated = 0;
  uint64_t lookups = 0;
  uint64_t lookup_hits = 0;
  uint64_t gets = 0;
  uint64_t puts = 0;
  uint64_t deletes = 0;
  // Tiers: nodes and payload bytes (the budgets are server-wide).
  uint64_t hot_nodes = 0;
  uint64_t hot_bytes = 0;  // payload bytes in memory
  uint64_t cold_nodes = 0;
  uint64_t cold_bytes = 0;  // payload bytes only in RocksDB
  uint64_t disk_bytes = 0;  // payload bytes in RocksDB (hot and cold: written through)
  uint64_t pinned_nodes = 0;
  uint64_t memory_budget_bytes = 0;
  uint64_t disk_budget_bytes = 0;
  // Tier counters since start.
  uint64_t demotions = 0;  // hot -> cold, for the memory budget
  uint64_t demoted_bytes = 0;
  uint64_t promotions = 0;  // cold -> hot, read often enough
  uint64_t cold_reads = 0;  // payloads read from RocksDB
  uint64_t cold_read_bytes = 0;
  uint64_t evictions_disk = 0;  // nodes deleted for the disk budget
  uint64_t evicted_bytes = 0;
  uint64_t evictions_data_loss = 0;  // nodes dropped because a payload failed its check
  uint64_t evictions_deleted = 0;    // nodes removed by Delete
  // Centroids deleted or evicted whose members elected a new centroid among them.
  uint64_t centroids_reelected = 0;
  // Now: nodes of deleted prefixes kept only as the centroids (and their parents) of lossy
  // near-duplicates, and their payload bytes (counted in bytes_stored too).
  uint64_t retained_nodes = 0;
  uint64_t retained_bytes = 0;
  // The background cluster pass (trie/cluster_pass.h), since start: rounds run (server-wide:
  // the same in every namespace's Stats), standalone blocks it re-encoded as residuals of their
  // group's centroid, the payload bytes that saved, and centroids it moved to the elected member.
  uint64_t cluster_pass_rounds = 0;
  uint64_t cluster_pass_recoded = 0;
  uint64_t cluster_pass_bytes_saved = 0;
  uint64_t cluster_pass_reelected = 0;
  uint64_t pins_expired = 0;
  uint64_t puts_rejected_disk_full = 0;  // RESOURCE_EXHAUSTED: pins hold the disk budget
  ClusterStats cluster;  // near-duplicate clusters and the surprisal / distance histograms
  // Learned predictor states (trie/predictor_registry.h), over the models counted.
  uint64_t predictor_versions = 0;      // versions kept (with dependents or readers, or the latest)
  uint64_t predictor_state_bytes = 0;   // their serialized bytes (on disk)
  uint64_t predictor_memory_bytes = 0;  // their in-memory bytes plus the learners'
  uint64_t predictor_tokens_learned = 0;  // tokens the latest versions were fitted on
  uint64_t blocks_on_learned = 0;         // stored blocks coded against a learned state
  // Since start.
  uint64_t predictor_fits = 0;          // versions published
  uint64_t predictor_observations = 0;  // blocks learned from
  // Not learned from: not in its Put's sample (LearnQueue::PushSample) or no room in the queue.
  uint64_t predictor_observations_dropped = 0;
  uint64_t predictor_versions_freed = 0;  // dropped once their last dependent was gone
  // Blocks their client encoded (encoded Puts), decoded on the learning thread and learned from
  // (also in predictor_observations), and not learned from (also in _dropped; or they did not
  // decode there).
  uint64_t predictor_encoded_observations = 0;
  uint64_t predictor_encoded_dropped = 0;
  // Estimated bytes the learned predictors saved on the blocks stored since start (the sum of
  // EncodedBlock::learned_bytes_saved: vs the best non-learned predictor per head).
  uint64_t predictor_bytes_saved = 0;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_STORE_TYPES_H_
