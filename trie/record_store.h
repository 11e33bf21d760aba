// trie/record_store.h
//
// RecordStore: the only code of kvtrie that touches RocksDB. It owns the database under
// `data_dir`, the key encoding, the conversion between on-disk records (trie/store_records.proto)
// and the structs below, write batches, snapshots, the one mapping of RocksDB statuses to absl
// statuses, and a sticky error.
//
// Column families and keys (NodeKey is the one node-key encoder):
//   models    namespace \0 model_id             -> ModelRecord (with the model's shard id)
//   nodes     shard id (8 bytes BE) + node id (8 bytes BE) -> NodeRecord
//   payloads  the same key                       -> the encoded block (self-checksummed)
//   predictor_index  shard id + version (8 bytes BE each) -> PredictorRecord (a learned state)
//   predictors       the same key                  -> the serialized state (BlobDB, like payloads)
// Node ids are per (namespace, model): a shard numbers its own nodes 1, 2, ... so ids tell one
// namespace nothing of another. Keys sort by shard, then id: a parent (smaller id) is met
// before its children in a scan.
//
// Status mapping (FromRocks): Corruption -> DATA_LOSS, IOError / Busy / TryAgain / TimedOut ->
// UNAVAILABLE, NoSpace -> RESOURCE_EXHAUSTED, anything else -> INTERNAL; each message names what
// was being done and ends with RocksDB's own words.
//
// Sticky error (as LevelDB's bg_error_): the first failed Write, or a Fail() call, records the
// error. A failed write may have reached the WAL without being acknowledged, so memory and disk
// may disagree; from then on every Write returns UNAVAILABLE "store failed: <first error>" and
// health() returns that error until the process restarts (recovery then rebuilds memory from
// what is on disk). Reads go on.
//
// Payloads live in a value log (trie/value_log.h, `<data_dir>/vlog/NNNNNN.seg`), written once:
// RecordStore::Write appends the batch's payloads to the active segment as one group (one
// write(2) per piece, no copy; fdatasync'd when Options::sync), then writes the RocksDB batch —
// node records and, in the payloads column family, a 28-byte ValuePointer per payload (segment,
// offset, length, CRC-32C) — to the WAL (fsynced too when Options::sync). Write returns OK only
// when both are durable to the same level. Before every RocksDB flush the active segment is
// synced (so an SST's pointer never outlives its bytes on a power loss). A crash while appending
// leaves a torn record at a segment's tail: no pointer was written to it (its Put was never
// acknowledged), its CRC fails, and it is garbage; at open, live bytes per segment are rebuilt
// from the pointers in RocksDB alone and segments with none are deleted (the orphans of a torn
// Put or of a crash in the middle of a collection). Payloads stored inline by an older kvtrie
// (the envelope itself in the payloads column family) are read as they are.
//
// Value-log GC (CollectValueLog; WiscKey, Titan and BadgerDB are the references): a sealed
// segment whose live bytes are at most `max_live_ratio` of its size has its live records (a
// header scan, each checked against RocksDB's current pointer) appended to the active segment,
// then the pointers are swapped in one batch, under gc_mu_ held exclusively (Writes hold it
// shared while they read the pointers they replace and write theirs, so a pointer a Write
// replaced is never swapped back). The old segment is deleted once no snapshot older than the
// swap remains (a Get holding a snapshot still reads its bytes; a read without a snapshot that
// finds its segment gone reads the pointer again); a failed delete is retried at the next
// collection, the segment still counted. The background pass collects at 50 %
// (kValueLogGcRatio).
//
// Disk usage: DiskUsage() is what RocksDB accounts of the data folder: SST and blob files of every
// column family and the WAL files, plus every value log segment (obsolete ones not yet deleted
// included). The WAL is bounded: the column families flush together (atomic_flush; the small
// ones would otherwise never flush and RocksDB would keep every WAL file for them) and
// max_total_wal_size forces a flush; it holds pointers, not payloads. The rest of the folder —
// LOG files (2 x 256 KiB), the MANIFEST (rolled at 512 KiB), OPTIONS, CURRENT, LOCK — is at most
// kFolderSlackBytes. Payload bytes are bounded by disk_bytes (trie/tier_manager.h); segments are
// disk_bytes / 8 (256 KiB to 64 MiB) with a budget, so collected at 50 % live they hold at most
// about 2 x the live payloads plus one active segment; garbage is collected (CollectGarbage)
// when the folder passes payloads + disk_bytes / 4, checked every 100 ms and every disk_bytes /
// 16 evicted. Stated bound: the folder stays under FolderBound(disk_bytes) = 3 x disk_bytes +
// kFolderSlackBytes. Measured by TierTest.DiskBudgetBoundsTheWholeDataFolder (20 MiB of
// one-block Puts at a 4 MiB budget).
//
// Without Options::sync a Put acknowledged by Write survives a crash or SIGKILL of the process
// (segment and WAL bytes are in the page cache), not a power loss; with it, a power loss too.
// Predictor states stay in RocksDB (BlobDB), as before.
//
// Thread-safe (RocksDB is); the sticky error has its own mutex, taken last.
#ifndef KVTRIE_TRIE_RECORD_STORE_H_
#define KVTRIE_TRIE_RECORD_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "trie/store_types.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
class Snapshot;
class Status;
class WriteBatch;
class EventListener;
}  // namespace rocksdb

namespace kvtrie {

class ValueLog;

// What a node record holds (the payload is stored beside it under the same key).
struct NodeMeta {
  std::string ns;
  std::string model_id;
  uint64_t parent_id = 0;  // 0 = the root
  std::vector<uint32_t> token_ids;
  std::vector<float> surprisal_bits;
  Encoding encoding = Encoding::kRaw;
  uint64_t bytes_logical = 0;
  uint64_t bytes_stored = 0;
  double rel_rms_error_k = 0;
  double rel_rms_error_v = 0;
  uint64_t pinned_until = 0;  // unix seconds; 0 = not pinned, UINT64_MAX = until unpinned
  uint64_t reference_node_id = 0;
  uint32_t predictor_version = 0;      // the learned state the payload was coded against (0 = none)
  bool error_client_reported = false;  // rel_rms_error_* came from the client that encoded it
  bool retained = false;      // deleted, kept as a centroid of lossy near-duplicates (TrieNode)
  bool lossy = false;         // its reconstruction is not what its Put sent (TrieNode::lossy)
  bool recheck = false;       // the cluster pass looks at it again (TrieNode::recheck)
  bool offset_look = false;   // the cluster pass looks at it at any offset (TrieNode::offset_look)
  double target_rel_rms = 0;  // a RESIDUAL block's Put's error target (TrieNode)
};

// What a predictor index record holds (its serialized state is stored beside it).
struct PredictorMeta {
  std::string ns;
  std::string model_id;
  uint32_t version = 0;
  uint64_t state_bytes = 0;
  uint32_t state_crc32c = 0;
  uint64_t tokens_learned = 0;
};

// The one node-key encoder: shard id and node id, 8 bytes big-endian each.
std::string NodeKey(uint64_t shard_id, uint64_t node_id);

// The one RocksDB -> absl status mapping (see the top of this file).
absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what);

struct ReadSnapshot {
  const rocksdb::Snapshot* snapshot = nullptr;
};

class RecordStore;

// Records to write together, atomically (one RocksDB WriteBatch).
class RecordBatch {
 public:
  // `reserve_bytes`: about how many bytes the batch will hold (its buffer is allocated once
  // instead of grown by doubling, each growth a copy of what it holds).
  explicit RecordBatch(const RecordStore* store, size_t reserve_bytes = 0);
  ~RecordBatch();
  RecordBatch(const RecordBatch&) = delete;
  RecordBatch& operator=(const RecordBatch&) = delete;

  void PutModel(uint64_t shard_id, const std::string& ns, const ModelInfo& model);
  // The node record, and the payload unless `payload` is null (a record-only update). The
  // payload goes to the value log at Write; `*payload` must stay alive until then (not copied).
  void PutNode(uint64_t shard_id, uint64_t node_id, const NodeMeta& meta,
               const std::string* payload);
  void DeleteNode(uint64_t shard_id, uint64_t node_id);  // record and payload
  // A learned predictor state: its index record and its serialized bytes.
  void PutPredictor(uint64_t shard_id, const PredictorMeta& meta, const std::string& state);
  void DeletePredictor(uint64_t shard_id, uint32_t version);
  size_t count() const;

 private:
  friend class RecordStore;
  struct Pending {
    std::string key;
    const std::string* payload;
  };
  const RecordStore* const store_;
  std::unique_ptr<rocksdb::WriteBatch> batch_;
  std::vector<Pending> payloads_;                   // for the value log, in order
  absl::flat_hash_set<std::string> replaced_keys_;  // payload keys put or deleted
};

class RecordStore {
 public:
  // The folder beyond what DiskUsage() counts: LOG files, MANIFEST, OPTIONS, CURRENT, LOCK.
  static constexpr uint64_t kFolderSlackBytes = 2ull << 20;
  static constexpr uint64_t FolderBound(uint64_t disk_bytes) {
    return disk_bytes * 3 + kFolderSlackBytes;
  }

  struct Options {
    std::string data_dir;
    bool sync = false;
    uint64_t memtable_bytes = 32ull << 20;  // payloads' write buffer
    uint64_t disk_bytes = 0;                // 0 = unbounded; bounds the WAL and memtables too
    rocksdb::Env* env = nullptr;
    uint64_t segment_bytes = 0;  // value log segments; 0 = from disk_bytes (see above)
  };
  // The background pass's value-log GC threshold (live bytes / segment bytes).
  static constexpr double kValueLogGcRatio = 0.5;
  // Errors: UNAVAILABLE if the folder cannot be created or another process holds it; the
  // database's.
  static absl::StatusOr<std::unique_ptr<RecordStore>> Open(const Options& options);
  ~RecordStore();  // flushes memtables and closes
  RecordStore(const RecordStore&) = delete;
  RecordStore& operator=(const RecordStore&) = delete;

  // Recovery scans. ForEachModel calls fn(shard_id, namespace, model) for every model record;
  // DATA_LOSS on an unreadable one. ForEachNode calls fn for every node record in key order with
  // the record parsed (or its parse error), and with the payload when `with_payloads` (null if
  // missing). A read error of RocksDB's own files stops the scan with its status.
  absl::Status ForEachModel(
      const std::function<absl::Status(uint64_t, const std::string&, const ModelInfo&)>& fn);
  absl::Status ForEachNode(
      bool with_payloads,
      const std::function<void(uint64_t shard_id, uint64_t node_id, absl::StatusOr<NodeMeta>,
                               const std::string* payload)>& fn);

  // Calls fn for every predictor index record in key order (shard, then version), parsed or
  // with its parse error (DATA_LOSS). A read error of RocksDB's own files stops the scan.
  absl::Status ForEachPredictor(const std::function<void(uint64_t shard_id, uint32_t version,
                                                         absl::StatusOr<PredictorMeta>)>& fn);
  // The serialized state of predictor `version` of a shard, checksummed by RocksDB. Errors:
  // NOT_FOUND if missing; DATA_LOSS when a checksum fails; UNAVAILABLE on an I/O error.
  absl::StatusOr<std::string> ReadPredictor(uint64_t shard_id, uint32_t version);

  // Writes `batch` (fsynced when Options::sync). Errors: the sticky error if set; otherwise the
  // write's, "store failed: ..." with its own code (which then sets the sticky error).
  absl::Status Write(RecordBatch& batch);

  // The payload of a node, in `snapshot` if set. Errors: NOT_FOUND if there is none; DATA_LOSS
  // naming RocksDB when its own checksums fail; UNAVAILABLE on an I/O error.
  absl::StatusOr<std::string> ReadPayload(uint64_t shard_id, uint64_t node_id,
                                          const ReadSnapshot* snapshot);

  // A consistent view, released when the last holder lets go.
  std::shared_ptr<const ReadSnapshot> Snapshot();

  // OK, or the sticky error.
  absl::Status health() const;
  // Records `error` as the sticky error (if none yet).
  void Fail(const absl::Status& error);

  // Bytes of the data folder as RocksDB accounts them (see the top of this file).
  uint64_t DiskUsage();
  // Rewrites the payloads' index and relocates every live blob, so the blob files of deleted
  // payloads are freed now (I/O proportional to the live payloads; for the disk budget). The value
  // log's segments too, unless its accounting failed at open (its GC is then off until a restart).
  absl::Status CollectGarbage();
  // Forces memtables to files (the WAL can then be recycled).
  absl::Status Flush();
  // Flushes, then rewrites every column family (bottommost level forced, every live blob
  // relocated), so the bytes of deleted records leave the folder: the WAL files that held them
  // and the SST and blob files they were in are obsolete and deleted (an erasing Delete). A record
  // a live snapshot (a Get that started before the Delete) still sees stays until it is released
  // and the next compaction. I/O proportional to the whole store.
  absl::Status Compact();
  // Value-log GC (see the top of this file) of every sealed segment whose live ratio is at most
  // `max_live_ratio` (1.0: every segment with any garbage); `roll` seals the active segment
  // first. Then deletes the obsolete segments no snapshot still needs. Errors: the value log's or
  // RocksDB's (a failed delete included, the segment kept); nothing acknowledged is lost.
  absl::Status CollectValueLog(double max_live_ratio, bool roll = false);

  // Value log figures, for tests and benchmarks.
  struct ValueLogStats {
    uint64_t segments = 0;
    uint64_t bytes = 0;  // segment files
    uint64_t live_bytes = 0;
    uint64_t bytes_appended = 0;  // payload bytes appended since Open (GC copies included)
    uint64_t segments_deleted = 0;
  };
  ValueLogStats value_log_stats() const;
  // Test-only: called in CollectValueLog after the live records are copied, before the pointers
  // are swapped; a non-OK status stops the collection there (a crash in the middle of a GC).
  std::function<absl::Status()> gc_after_copy_for_testing;

 private:
  friend class RecordBatch;
  explicit RecordStore(const Options& options);
  // The sequence number of the oldest live snapshot (UINT64_MAX for none).
  uint64_t OldestSnapshot() const;
  // Deletes the obsolete value log segments no live snapshot needs.
  absl::Status DeleteObsoleteSegments();

  const Options options_;
  std::unique_ptr<ValueLog> vlog_;
  std::shared_ptr<rocksdb::EventListener> flush_listener_;
  absl::Status vlog_accounting_;  // not OK: live bytes unknown, value-log GC off
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* cf_models_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_nodes_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_payloads_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_predictor_index_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_predictors_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;

  // Shared by Write (pointer reads, append, batch), exclusive for a GC's pointer swap.
  absl::Mutex gc_mu_;
  absl::Mutex collect_mu_;  // one CollectValueLog at a time
  mutable absl::Mutex snap_mu_;
  std::multiset<uint64_t> snapshots_ ABSL_GUARDED_BY(snap_mu_);  // their sequence numbers

  mutable absl::Mutex error_mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(error_mu_);  // the first failed write
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_RECORD_STORE_H_
