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
// Disk usage: DiskUsage() is what RocksDB accounts of the data folder: SST and blob files of every
// column family (live and not yet collected blobs) and the WAL files. The WAL is bounded: the
// column families flush together (atomic_flush; the small ones would otherwise never flush and
// RocksDB would keep every WAL file for them) and max_total_wal_size forces a flush. The rest of
// the folder — LOG files (2 x 256 KiB), the MANIFEST (rolled at 512 KiB), OPTIONS, CURRENT, LOCK —
// is at most kFolderSlackBytes. Payload bytes are bounded by disk_bytes (trie/tier_manager.h);
// the WAL by max_total_wal_size (disk_bytes / 4); garbage of evicted payloads is collected
// (CollectGarbage) when the folder passes payloads + disk_bytes / 4, checked every 100 ms and
// every disk_bytes / 16 evicted. Stated bound: the folder stays under FolderBound(disk_bytes) =
// 3 x disk_bytes + kFolderSlackBytes (the rest is obsolete files RocksDB has not deleted yet
// and blob garbage between two collections, which grows when the collections lag on a busy
// machine); measured peaks at 4 MiB: 1.4-2.4 x disk_bytes, and 3.1 x (12.9 MB) once under ASan
// with two test processes per core. Measured by TierTest.DiskBudgetBoundsTheWholeDataFolder (20 MiB
// of one-block Puts at a 4 MiB budget); the folder was unbounded before (1.29 GB, 39 WAL files).
//
// Layout and durability of a payload: one RocksDB value (the encoded block, with kvtrie's own
// CRC-32C in its envelope) in the payloads column family, written with its node record in one
// WriteBatch: appended to the WAL first (write(2) before Write returns; fsynced too when
// Options::sync), then the memtable; at flush BlobDB moves it to a blob file (so each payload
// byte is written twice: WAL, then blob file). RocksDB checksums the WAL record and the blob
// record with CRC-32C; that CRC is kvtrie's hardware one (trie/rocksdb_crc32c.h; Debian's
// librocksdb would use a software loop). Without Options::sync a Put acknowledged by Write
// survives a crash or SIGKILL of the process (the WAL bytes are in the page cache), not a power
// loss; with it, a power loss too.
//
// Thread-safe (RocksDB is); the sticky error has its own mutex, taken last.
#ifndef KVTRIE_TRIE_RECORD_STORE_H_
#define KVTRIE_TRIE_RECORD_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
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
}  // namespace rocksdb

namespace kvtrie {

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
  bool retained = false;  // deleted, kept as a centroid of lossy near-duplicates (TrieNode)
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
  // The node record, and the payload unless `payload` is null (a record-only update).
  void PutNode(uint64_t shard_id, uint64_t node_id, const NodeMeta& meta,
               const std::string* payload);
  void DeleteNode(uint64_t shard_id, uint64_t node_id);  // record and payload
  // A learned predictor state: its index record and its serialized bytes.
  void PutPredictor(uint64_t shard_id, const PredictorMeta& meta, const std::string& state);
  void DeletePredictor(uint64_t shard_id, uint32_t version);
  size_t count() const;

 private:
  friend class RecordStore;
  const RecordStore* const store_;
  std::unique_ptr<rocksdb::WriteBatch> batch_;
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
  };
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
  // payloads are freed now (I/O proportional to the live payloads; for the disk budget).
  absl::Status CollectGarbage();
  // Forces memtables to files (the WAL can then be recycled).
  absl::Status Flush();
  // Flushes, then rewrites every column family (bottommost level forced, every live blob
  // relocated), so the bytes of deleted records leave the folder: the WAL files that held them
  // and the SST and blob files they were in are obsolete and deleted (an erasing Delete). A record
  // a live snapshot (a Get that started before the Delete) still sees stays until it is released
  // and the next compaction. I/O proportional to the whole store.
  absl::Status Compact();

 private:
  friend class RecordBatch;
  explicit RecordStore(const Options& options);

  const Options options_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* cf_models_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_nodes_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_payloads_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_predictor_index_ = nullptr;
  rocksdb::ColumnFamilyHandle* cf_predictors_ = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;

  mutable absl::Mutex error_mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(error_mu_);  // the first failed write
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_RECORD_STORE_H_
