// trie/kv_store.h
//
// KvStore: every (namespace, model) trie of a server, their block payloads, and their persistence
// in an embedded RocksDB. The gRPC service is a thin layer over this class.
//
// Data model. A model is identified by (namespace, model_id) and has a fixed BlockGeometry (the
// first Put creates it; later requests must match it). Its blocks form a BlockTrie. A block is
// [num_layers][2][num_kv_heads][block_tokens][head_dim] in the model's dtype and is stored encoded
// (codec/block_codec.h). Namespaces never share anything: no match, dedup, node id sequence or
// counter crosses them.
//
// Architecture (README "Architecture"): this facade validates and routes each request to the
// ModelShard of its (namespace, model) (trie/model_shard.h: trie, near-duplicate index, counters,
// its own locks); a TierManager (trie/tier_manager.h) owns the budgets, hot copies, GDSF queues,
// pins and the background thread; a RecordStore (trie/record_store.h) is the only code that
// touches RocksDB; a ClusterPass (trie/cluster_pass.h, its own nice'd thread, off unless
// StoreOptions::cluster_pass_interval_ms) codes standalone near-duplicates against their
// elected centroid in the background. Lock order: KvStore::shards_mu_ (only to find a shard) |
// ModelShard::write_mu_ -> ModelShard::mu_ -> TierManager::mu_ -> RecordStore::error_mu_. No
// lock that a reader takes is held across a RocksDB write or fsync.
//
// Durability. A Put's new blocks (node records and payloads) are written in one batch, then
// published in memory, so a reader sees a whole block or nothing and a Put is all or nothing.
// With `sync` every write is fsynced in the WAL before it is acknowledged; without it a crash of
// the machine (not of the process) may lose the last acknowledged writes, never corrupt older
// ones. A failed write makes the store fail (health() turns to UNAVAILABLE "store failed: ...",
// every later write is refused) and memory is left as it was before that write. On Open the
// tries are rebuilt from node records; a node whose parent is missing is dropped with its
// subtree (RecoveryStats); payloads are CRC-checked when read, and a bad one is DATA_LOSS and
// dropped with its subtree; a read error of RocksDB's own files refuses the request and drops
// nothing. A read never deletes anything else: an inconsistency (a missing centroid or learned
// state, a payload that passes its checksum but does not decode) is ABORTED or INTERNAL and
// leaves the data (trie/model_shard.h).
//
// Snapshot reads. A Get reads what it matched when it started, like a RocksDB snapshot iterator:
// its blocks are read from their hot copies or from a RocksDB snapshot taken then, and it holds
// the learned states they name and (RetiredReferences, trie/model_shard.h) the reconstructions of
// the centroids a Delete removes meanwhile, so a Delete, an eviction or a re-encode after it
// started does not change what it returns.
//
// Tiers. Payloads are written through: every acknowledged block is in RocksDB, and the hot tier
// is a bounded in-memory copy (memory_bytes, never exceeded). Past disk_bytes the lowest-GDSF
// evictable leaves (unpinned; a centroid's members re-elect first) are deleted before a Put is
// written, no more; RESOURCE_EXHAUSTED if pins prevent that.
//
// Thread-safe.
#ifndef KVTRIE_TRIE_KV_STORE_H_
#define KVTRIE_TRIE_KV_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "codec/decode_chain.h"
#include "codec/thread_pool.h"
#include "trie/block_reader.h"
#include "trie/put_session.h"
#include "trie/store_types.h"

namespace kvtrie {

class KvStore {
 public:
  // Opens (creating if needed) the store under options.data_dir and rebuilds the tries.
  // Errors: the database's (e.g. UNAVAILABLE if another process holds the lock).
  static absl::StatusOr<std::unique_ptr<KvStore>> Open(const StoreOptions& options);
  ~KvStore();
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  const RecoveryStats& recovery() const;
  // OK while the store accepts writes; UNAVAILABLE "store failed: ..." once a write failed.
  absl::Status health() const;

  // Longest stored prefix. An unknown namespace or model matches nothing (not an error).
  MatchResult Lookup(const std::string& ns, const std::string& model_id,
                     absl::Span<const uint32_t> token_ids);

  // Starts a Put. Errors: INVALID_ARGUMENT naming the field (`model.head_dim: ... stored with
  // head_dim=8, request has 16`, `surprisal_bits`, `token_ids`); the store's failure.
  absl::StatusOr<std::unique_ptr<PutSession>> BeginPut(const std::string& ns,
                                                       const ModelInfo& model,
                                                       std::vector<uint32_t> token_ids,
                                                       std::vector<float> surprisal_bits,
                                                       const EncodeOptions& encode);

  // The blocks of the longest stored prefix (at most max_blocks, 0 = all), root first. An unknown
  // (namespace, model_id) is a miss: no blocks and an empty model.
  absl::StatusOr<GetResult> Get(const std::string& ns, const std::string& model_id,
                                absl::Span<const uint32_t> token_ids, size_t max_blocks);

  // The one read path of a Get (trie/block_reader.h, as LevelDB's DB::NewIterator): lists the
  // longest stored prefix of `token_ids` as Get does (at most max_blocks, 0 = all) and returns a
  // reader of its blocks, each payload read once: their stored envelopes (kStored) or their dense
  // reconstructions (kReconstructed), decoded in windows on `pool` (the caller's, e.g. the
  // service's Get pool; null: on the caller's thread). An unknown (namespace, model_id) is a miss:
  // a reader with no blocks and an empty model. The store must outlive the reader.
  // through_retained: list through retained nodes too (the path to a node named by id, as a
  // member's centroid is: trie/cluster_policy.h "Retained centroids").
  absl::StatusOr<std::unique_ptr<BlockReader>> NewReader(
      const std::string& ns, const std::string& model_id, absl::Span<const uint32_t> token_ids,
      size_t max_blocks, BlockReader::Mode mode, ThreadPool* pool, bool through_retained = false);

  // Reads the payload of a block of a Get (the hot copy, or from RocksDB in the Get's snapshot,
  // CRC-checked, promoted to memory when read often). Errors: DATA_LOSS if its bytes fail their
  // checksum or are missing (the node and its subtree are then dropped: the one case in which a
  // read deletes) or if RocksDB's own files fail (nothing dropped); NOT_FOUND if deleted
  // meanwhile and not in the Get's snapshot; UNAVAILABLE on an I/O error.
  absl::StatusOr<std::shared_ptr<const std::string>> ReadPayload(const std::string& ns,
                                                                 const std::string& model_id,
                                                                 const BlockRead& block);
  // Reads a block of a Get and decodes it into `out` (model geometry bytes) as the next block of
  // `chain` (one chain per Get, blocks in order; its fetcher is not used: the store reads the
  // centroids). Errors: ReadPayload's; DATA_LOSS, nothing dropped but the centroid, when its
  // centroid failed its own checksum (the block can never be decoded; recovery drops it) or when
  // the learned state it names is unreadable; ABORTED when the block was re-encoded or deleted
  // since the Get listed it and its old encoding can not be decoded any more (its centroid went
  // with the Delete): Get again and read the block anew; INTERNAL naming what is missing for an
  // inconsistency. Only bytes that fail their own checksum are ever dropped.
  absl::Status ReadAndDecodeBlock(const std::string& ns, const std::string& model_id,
                                  const BlockRead& block, DecodeChain* chain,
                                  absl::Span<uint8_t> out);

  // Deletes the node at the end of `token_ids` (block-aligned, stored) and its subtree, after
  // the near-duplicates outside it coded against a centroid inside it re-elected a centroid
  // among them (each reconstruction bit-exact; ClusterPolicy::ReelectLocked). Returns the nodes
  // deleted, the payload bytes freed and rewritten (DeleteSummary: the store changed by freed -
  // rewritten) and the centroids re-elected. Gets that started before still read what they listed.
  // Errors: NOT_FOUND naming `token_ids` or `model_id`; INVALID_ARGUMENT if not block-aligned;
  // the write's (then nothing is deleted).
  // `erase` (or StoreOptions::delete_erases): nothing of the deleted blocks stays readable or on
  // disk after the call: a centroid with lossy members is re-elected too, never retained (its
  // members are re-coded bit-exact against their own reconstructions:
  // DeleteSummary::erase_bytes_rewritten), then RocksDB is flushed and compacted
  // (RecordStore::Compact; bytes a Get that started before still holds stay until it ends). A
  // failed compaction is its error, the prefix deleted.
  absl::StatusOr<DeleteSummary> Delete(const std::string& ns, const std::string& model_id,
                                       absl::Span<const uint32_t> token_ids, bool erase = false);

  // Pins the node of the last full block of `token_ids` for `ttl_seconds` (0 = until unpinned),
  // or unpins it: a pinned node and so its ancestors are never evicted for the disk budget.
  // Persisted. `extend_only`: never shortens the node's pin (a longer one, or one until
  // unpinned, is kept and nothing is written). Returns the node's id. Errors as Delete's (a
  // failed write changes nothing).
  absl::StatusOr<uint64_t> Pin(const std::string& ns, const std::string& model_id,
                               absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                               bool unpin, bool extend_only = false);

  // Bytes of every file under data_dir now (what the disk bound promises, obsolete files and
  // those a Get's snapshot keeps included). A directory scan: a few stat calls.
  uint64_t DataFolderBytes() const;

  // The token ids of the prefix that ends with node `node_id` (root first). NOT_FOUND naming
  // `model_id` or `node_id`.
  absl::StatusOr<std::vector<uint32_t>> PathTokens(const std::string& ns,
                                                   const std::string& model_id, uint64_t node_id);
  // One node (0 = root) and its children. NOT_FOUND naming `model_id` or `node_id`.
  absl::StatusOr<InspectResult> Inspect(const std::string& ns, const std::string& model_id,
                                        uint64_t node_id);
  // Trie distance (bits) between two nodes of (ns, model_id). NOT_FOUND naming the id.
  absl::StatusOr<double> TrieDistance(const std::string& ns, const std::string& model_id,
                                      uint64_t a, uint64_t b);

  // The serialized learned predictor state `version` of (ns, model_id) (codec/predictor_state.h;
  // PredictorState::Parse reads it), as persisted: what a client needs to decode the kResidual
  // blocks of a Get that name it. Only that namespace's own states. Errors: NOT_FOUND naming
  // `model_id` or `version`; INVALID_ARGUMENT for version 0; DATA_LOSS when it is unreadable.
  absl::StatusOr<std::string> GetPredictor(const std::string& ns, const std::string& model_id,
                                           uint32_t version);
  // The learned states of (ns, model_id), oldest first. NOT_FOUND naming `model_id`.
  absl::StatusOr<std::vector<PredictorVersionView>> PredictorVersions(const std::string& ns,
                                                                      const std::string& model_id);

  // Totals over one namespace (strictly its own), or the whole server when `ns` is empty.
  StoreStats Stats(const std::string& ns);
  // Totals over namespace `ns` alone; "" is the default namespace, not the whole server (what a
  // tenant whose namespace is "" sees).
  StoreStats NamespaceStats(const std::string& ns);

 private:
  friend class KvStoreTestPeer;  // trie/kv_store_testing.h
  class Impl;
  explicit KvStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_KV_STORE_H_
