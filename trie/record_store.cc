#include "trie/record_store.h"

#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/listener.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/transaction_log.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "codec/envelope.h"
#include "trie/rocksdb_crc32c.h"
#include "trie/store_records.pb.h"
#include "trie/value_log.h"

#if defined(__SANITIZE_THREAD__)
#define KVTRIE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVTRIE_TSAN 1
#endif
#endif
#ifndef KVTRIE_TSAN
#define KVTRIE_TSAN 0
#endif

namespace kvtrie {
namespace {

constexpr char kModelsCf[] = "models";
constexpr char kNodesCf[] = "nodes";
constexpr char kPayloadsCf[] = "payloads";
constexpr char kPredictorIndexCf[] = "predictor_index";
constexpr char kPredictorsCf[] = "predictors";

uint64_t DecodeBigEndian(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = v << 8 | static_cast<uint8_t>(p[i]);
  return v;
}

std::string ModelKey(const std::string& ns, const std::string& model_id) {
  return absl::StrCat(ns, std::string(1, '\0'), model_id);
}

internal::NodeRecord ToRecord(const NodeMeta& m) {
  internal::NodeRecord r;
  r.set_namespace_(m.ns);
  r.set_model_id(m.model_id);
  r.set_parent_id(m.parent_id);
  r.mutable_token_ids()->Add(m.token_ids.begin(), m.token_ids.end());
  r.mutable_surprisal_bits()->Add(m.surprisal_bits.begin(), m.surprisal_bits.end());
  r.set_encoding(static_cast<uint32_t>(m.encoding));
  r.set_bytes_logical(m.bytes_logical);
  r.set_bytes_stored(m.bytes_stored);
  r.set_rel_rms_error_k(m.rel_rms_error_k);
  r.set_rel_rms_error_v(m.rel_rms_error_v);
  r.set_pinned_until(m.pinned_until);
  r.set_reference_node_id(m.reference_node_id);
  r.set_predictor_version(m.predictor_version);
  r.set_error_client_reported(m.error_client_reported);
  r.set_retained(m.retained);
  r.set_lossy(m.lossy);
  r.set_recheck(m.recheck);
  r.set_offset_look(m.offset_look);
  r.set_target_rel_rms(m.target_rel_rms);
  return r;
}

absl::StatusOr<NodeMeta> FromRecord(const rocksdb::Slice& value) {
  internal::NodeRecord r;
  if (!r.ParseFromArray(value.data(), static_cast<int>(value.size()))) {
    return absl::DataLossError("node record does not parse");
  }
  if (!IsValidEncoding(r.encoding())) {
    return absl::DataLossError(absl::StrCat("node record: unknown encoding ", r.encoding()));
  }
  NodeMeta m;
  m.ns = r.namespace_();
  m.model_id = r.model_id();
  m.parent_id = r.parent_id();
  m.token_ids.assign(r.token_ids().begin(), r.token_ids().end());
  m.surprisal_bits.assign(r.surprisal_bits().begin(), r.surprisal_bits().end());
  m.encoding = static_cast<Encoding>(r.encoding());
  m.bytes_logical = r.bytes_logical();
  m.bytes_stored = r.bytes_stored();
  m.rel_rms_error_k = r.rel_rms_error_k();
  m.rel_rms_error_v = r.rel_rms_error_v();
  m.pinned_until = r.pinned_until();
  m.reference_node_id = r.reference_node_id();
  m.predictor_version = r.predictor_version();
  m.error_client_reported = r.error_client_reported();
  m.retained = r.retained();
  // Records written before the field: a block the cluster pass re-coded LOSSLESS kept its error.
  m.lossy =
      r.lossy() || IsLossyEncoding(m.encoding) || m.rel_rms_error_k > 0 || m.rel_rms_error_v > 0;
  m.recheck = r.recheck();
  m.offset_look = r.offset_look();
  m.target_rel_rms = r.target_rel_rms();
  return m;
}

// Syncs the value log before every RocksDB flush: an SST's pointer never outlives its bytes.
class SyncValueLogBeforeFlush : public rocksdb::EventListener {
 public:
  explicit SyncValueLogBeforeFlush(ValueLog* vlog) : vlog_(vlog) {}
  void OnFlushBegin(rocksdb::DB*, const rocksdb::FlushJobInfo&) override {
    if (absl::Status s = vlog_->Sync(); !s.ok()) spdlog::error("before a flush: {}", s.ToString());
  }

 private:
  ValueLog* const vlog_;
};

}  // namespace

std::string NodeKey(uint64_t shard_id, uint64_t node_id) {
  std::string k(16, '\0');
  for (int i = 0; i < 8; ++i) {
    k[i] = static_cast<char>((shard_id >> (56 - 8 * i)) & 0xff);
    k[8 + i] = static_cast<char>((node_id >> (56 - 8 * i)) & 0xff);
  }
  return k;
}

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": RocksDB: ", s.ToString());
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(msg);
  if (s.IsIOError() || s.IsBusy() || s.IsTryAgain() || s.IsTimedOut()) {
    return absl::UnavailableError(msg);
  }
  return absl::InternalError(msg);
}

// ---------------------------------------------------------------------------------------------
// RecordBatch

RecordBatch::RecordBatch(const RecordStore* store, size_t reserve_bytes)
    : store_(store), batch_(std::make_unique<rocksdb::WriteBatch>(reserve_bytes)) {}
RecordBatch::~RecordBatch() = default;

size_t RecordBatch::count() const { return batch_->Count() + payloads_.size(); }

void RecordBatch::PutModel(uint64_t shard_id, const std::string& ns, const ModelInfo& model) {
  internal::ModelRecord r;
  r.set_namespace_(ns);
  r.set_model_id(model.model_id);
  r.set_num_layers(model.geometry.num_layers);
  r.set_num_kv_heads(model.geometry.num_kv_heads);
  r.set_head_dim(model.geometry.head_dim);
  r.set_dtype(static_cast<uint32_t>(model.geometry.dtype));
  r.set_block_tokens(model.geometry.block_tokens);
  r.set_shard_id(shard_id);
  batch_->Put(store_->cf_models_, ModelKey(ns, model.model_id), r.SerializeAsString());
}

void RecordBatch::PutNode(uint64_t shard_id, uint64_t node_id, const NodeMeta& meta,
                          const std::string* payload) {
  const std::string key = NodeKey(shard_id, node_id);
  batch_->Put(store_->cf_nodes_, key, ToRecord(meta).SerializeAsString());
  if (payload == nullptr) return;
  // The pointer is added at Write (after the batch's other records: a Delete of this key earlier
  // in the batch stays before it). A second payload for the key replaces the first.
  for (auto it = payloads_.begin(); it != payloads_.end(); ++it) {
    if (it->key == key) {
      payloads_.erase(it);
      break;
    }
  }
  payloads_.push_back(Pending{key, payload});
  replaced_keys_.insert(key);
}

void RecordBatch::DeleteNode(uint64_t shard_id, uint64_t node_id) {
  const std::string key = NodeKey(shard_id, node_id);
  batch_->Delete(store_->cf_nodes_, key);
  batch_->Delete(store_->cf_payloads_, key);
  for (auto it = payloads_.begin(); it != payloads_.end(); ++it) {
    if (it->key == key) {
      payloads_.erase(it);
      break;
    }
  }
  replaced_keys_.insert(key);
}

void RecordBatch::PutPredictor(uint64_t shard_id, const PredictorMeta& meta,
                               const std::string& state) {
  internal::PredictorRecord r;
  r.set_namespace_(meta.ns);
  r.set_model_id(meta.model_id);
  r.set_version(meta.version);
  r.set_state_bytes(meta.state_bytes);
  r.set_state_crc32c(meta.state_crc32c);
  r.set_tokens_learned(meta.tokens_learned);
  const std::string key = NodeKey(shard_id, meta.version);
  batch_->Put(store_->cf_predictor_index_, key, r.SerializeAsString());
  batch_->Put(store_->cf_predictors_, key, state);
}

void RecordBatch::DeletePredictor(uint64_t shard_id, uint32_t version) {
  const std::string key = NodeKey(shard_id, version);
  batch_->Delete(store_->cf_predictor_index_, key);
  batch_->Delete(store_->cf_predictors_, key);
}

// ---------------------------------------------------------------------------------------------
// RecordStore

absl::StatusOr<std::unique_ptr<RecordStore>> RecordStore::Open(const Options& options) {
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("data_dir: cannot create '", options.data_dir, "': ", ec.message()));
  }
  std::unique_ptr<RecordStore> store(new RecordStore(options));
  rocksdb::Env* env = options.env != nullptr ? options.env : rocksdb::Env::Default();
  ValueLog::Options vo;
  vo.env = env;
  vo.dir = options.data_dir + "/vlog";
  vo.sync = options.sync;
  vo.segment_bytes = options.segment_bytes;
  if (vo.segment_bytes == 0) {
    vo.segment_bytes = options.disk_bytes == 0
                           ? 64ull << 20
                           : std::clamp<uint64_t>(options.disk_bytes / 8, 256 << 10, 64ull << 20);
  }
  absl::StatusOr<std::unique_ptr<ValueLog>> vlog = ValueLog::Open(vo);
  if (!vlog.ok()) return vlog.status();
  store->vlog_ = *std::move(vlog);
  store->flush_listener_ = std::make_shared<SyncValueLogBeforeFlush>(store->vlog_.get());
  // RocksDB's WAL and blob CRC-32C: kvtrie's hardware one (trie/rocksdb_crc32c.h), or, if the
  // interposition did not take, librocksdb's software loop (correct, ~40 % of a RAW Put's CPU).
  static const bool kLogged = [] {
    if (RocksDbCrc32cIsKvtries()) {
      spdlog::info("RocksDB CRC-32C: kvtrie's (SSE4.2 when the CPU has it)");
    } else {
      spdlog::warn("RocksDB CRC-32C: librocksdb's own (software) loop; Puts are slower");
    }
    return true;
  }();
  (void)kLogged;
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_background_jobs = 2;
  if (options.env != nullptr) db_options.env = options.env;
  db_options.listeners.push_back(store->flush_listener_);
  // The folder stays bounded: all column families flush together (the small ones would otherwise
  // never flush and RocksDB would keep every WAL file for them), and the WAL is capped.
  db_options.atomic_flush = true;
  db_options.max_log_file_size = 256 << 10;  // LOG and one LOG.old.*: at most 512 KiB
  db_options.keep_log_file_num = 2;
  db_options.max_manifest_file_size = 512 << 10;
  uint64_t memtable = options.memtable_bytes;
  if (options.disk_bytes != 0)
    memtable = std::clamp<uint64_t>(options.disk_bytes / 16, 64 << 10, memtable);
  db_options.max_total_wal_size = 4 * memtable;
  // RSS: one small block cache for every column family; payload memtables are bounded.
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = rocksdb::NewLRUCache(8 << 20);
  rocksdb::ColumnFamilyOptions meta;
  meta.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  meta.write_buffer_size = std::min<uint64_t>(memtable, 4 << 20);
  rocksdb::ColumnFamilyOptions payloads = meta;
  payloads.compression = rocksdb::kNoCompression;  // blocks are already entropy-coded
  // BlobDB: payloads (KiBs to MiBs) go to blob files at flush and the LSM holds only small
  // references, so compaction never rewrites KV bytes (write amplification ~1 instead of the
  // LSM's ~10) and evicted payloads are reclaimed by blob garbage collection.
  payloads.enable_blob_files = true;
  payloads.min_blob_size = 512;
  payloads.blob_file_size = std::min<uint64_t>(64 << 20, std::max<uint64_t>(memtable, 1 << 20));
  payloads.blob_compression_type = rocksdb::kNoCompression;
  payloads.enable_blob_garbage_collection = true;
  payloads.blob_garbage_collection_age_cutoff = 0.5;
  if (options.disk_bytes != 0) {
    // A bounded folder: relocate live blobs out of files that are mostly garbage (evicted
    // payloads) soon, so dead bytes do not hold the budget.
    payloads.blob_garbage_collection_age_cutoff = 0.75;
    payloads.blob_garbage_collection_force_threshold = 0.5;
  }
  payloads.write_buffer_size = memtable;
  payloads.max_write_buffer_number = 2;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, meta},
      {kModelsCf, meta},
      {kNodesCf, meta},
      {kPayloadsCf, payloads},
      {kPredictorIndexCf, meta},
      {kPredictorsCf, payloads},  // MiBs each, uncompressed, in blob files as payloads are
  };
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options.data_dir, cfs, &store->handles_, &db);
  if (!s.ok()) return FromRocks(s, absl::StrCat("data_dir '", options.data_dir, "'"));
  store->db_.reset(db);
  store->cf_models_ = store->handles_[1];
  store->cf_nodes_ = store->handles_[2];
  store->cf_payloads_ = store->handles_[3];
  store->cf_predictor_index_ = store->handles_[4];
  store->cf_predictors_ = store->handles_[5];
  // Recovery of the value log from the records alone: live bytes per segment from the pointers;
  // a sealed segment with none (a torn Put's, a GC's copy whose swap never happened, a GC's source
  // whose delete never happened) is deleted.
  {
    std::unique_ptr<rocksdb::Iterator> it(
        store->db_->NewIterator(rocksdb::ReadOptions(), store->cf_payloads_));
    ValuePointer p;
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (DecodeValuePointer(it->value().ToString(), &p)) store->vlog_->AddLive(p);
    }
    if (!it->status().ok()) {
      // The pointers cannot all be read (a corrupt payloads SST): live bytes are unknown, so no
      // segment is deleted or collected until a restart reads them all. Reads refuse by name.
      store->vlog_accounting_ = FromRocks(it->status(), "payloads (value log accounting)");
      spdlog::error("value log GC off until restart: {}", store->vlog_accounting_.ToString());
      return store;
    }
  }
  for (const ValueLog::SegmentInfo& seg : store->vlog_->Segments()) {
    if (seg.live == 0) store->vlog_->MarkObsolete(seg.number, 0);
  }
  if (absl::Status s = store->vlog_->DeleteObsolete(UINT64_MAX); !s.ok()) {
    spdlog::warn("value log at open: {}", s.ToString());
  }
  return store;
}

RecordStore::RecordStore(const Options& options) : options_(options) {}

RecordStore::~RecordStore() {
  if (!db_) return;
  // Memtables to SST and blob files, so the next start replays no WAL.
  if (health().ok()) {
    rocksdb::Status s = db_->Flush(rocksdb::FlushOptions(), handles_);
    if (!s.ok()) spdlog::warn("flush at close: {}", s.ToString());
  }
  for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
  rocksdb::Status s = db_->Close();
  if (!s.ok()) spdlog::warn("close: {}", s.ToString());
}

absl::Status RecordStore::ForEachModel(
    const std::function<absl::Status(uint64_t, const std::string&, const ModelInfo&)>& fn) {
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cf_models_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    internal::ModelRecord r;
    if (!r.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
      return absl::DataLossError("models: unreadable record");
    }
    if (r.shard_id() == 0) {
      return absl::FailedPreconditionError(
          "data_dir: written by an older kvtrie (one global node id sequence); this version "
          "numbers nodes per model: start it on an empty --data_dir");
    }
    ModelInfo m;
    m.model_id = r.model_id();
    m.geometry = {r.num_layers(), r.num_kv_heads(), r.block_tokens(), r.head_dim(),
                  static_cast<DType>(r.dtype())};
    if (auto st = m.geometry.Validate(); !st.ok()) {
      return absl::DataLossError(absl::StrCat("models: bad record: ", st.message()));
    }
    if (auto st = fn(r.shard_id(), r.namespace_(), m); !st.ok()) return st;
  }
  return FromRocks(it->status(), "models");
}

absl::Status RecordStore::ForEachNode(
    bool with_payloads,
    const std::function<void(uint64_t, uint64_t, absl::StatusOr<NodeMeta>, const std::string*)>&
        fn) {
  std::unique_ptr<rocksdb::Iterator> nodes(db_->NewIterator(rocksdb::ReadOptions(), cf_nodes_));
  std::unique_ptr<rocksdb::Iterator> payloads;
  if (with_payloads) {
    payloads.reset(db_->NewIterator(rocksdb::ReadOptions(), cf_payloads_));
    payloads->SeekToFirst();
  }
  std::string payload;
  for (nodes->SeekToFirst(); nodes->Valid(); nodes->Next()) {
    const rocksdb::Slice key = nodes->key();
    if (key.size() != 16) {
      return absl::FailedPreconditionError(
          "data_dir: node keys of an older kvtrie; start it on an empty --data_dir");
    }
    const uint64_t shard = DecodeBigEndian(key.data());
    const uint64_t id = DecodeBigEndian(key.data() + 8);
    const std::string* found = nullptr;
    if (payloads) {
      // Payloads iterate in the same key order; skip orphans (a node dropped earlier).
      while (payloads->Valid() && payloads->key().compare(key) < 0) payloads->Next();
      if (!payloads->status().ok()) {
        // A read error is not a missing payload: dropping every later node for it would turn one
        // bad disk block into the loss of the store. Refuse to start instead.
        return FromRocks(payloads->status(), "payloads (refusing to start; nothing was dropped)");
      }
      if (payloads->Valid() && payloads->key() == key) {
        ValuePointer p;
        if (DecodeValuePointer(payloads->value().ToString(), &p)) {
          absl::StatusOr<std::string> bytes = vlog_->Read(key.ToString(), p);
          if (absl::IsUnavailable(bytes.status())) {
            return absl::Status(bytes.status().code(),
                                absl::StrCat(bytes.status().message(),
                                             " (refusing to start; nothing was dropped)"));
          }
          // A torn, rotten or missing record reads as bytes that fail the payload's check.
          payload = bytes.ok() ? *std::move(bytes) : std::string();
        } else {
          payload = payloads->value().ToString();  // inline (an older kvtrie's folder)
        }
        found = &payload;
      }
    }
    fn(shard, id, FromRecord(nodes->value()), found);
  }
  return FromRocks(nodes->status(), "nodes (refusing to start; nothing was dropped)");
}

absl::Status RecordStore::ForEachPredictor(
    const std::function<void(uint64_t, uint32_t, absl::StatusOr<PredictorMeta>)>& fn) {
  std::unique_ptr<rocksdb::Iterator> it(
      db_->NewIterator(rocksdb::ReadOptions(), cf_predictor_index_));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const rocksdb::Slice key = it->key();
    if (key.size() != 16) return absl::DataLossError("predictor_index: bad key");
    const uint64_t shard = DecodeBigEndian(key.data());
    const uint64_t version = DecodeBigEndian(key.data() + 8);
    if (version == 0 || version > UINT32_MAX) {
      return absl::DataLossError(absl::StrCat("predictor_index: bad version ", version));
    }
    internal::PredictorRecord r;
    if (!r.ParseFromArray(it->value().data(), static_cast<int>(it->value().size())) ||
        r.version() != version) {
      fn(shard, static_cast<uint32_t>(version),
         absl::DataLossError(
             absl::StrCat("predictor record of version ", version, " does not parse")));
      continue;
    }
    PredictorMeta m;
    m.ns = r.namespace_();
    m.model_id = r.model_id();
    m.version = r.version();
    m.state_bytes = r.state_bytes();
    m.state_crc32c = r.state_crc32c();
    m.tokens_learned = r.tokens_learned();
    fn(shard, static_cast<uint32_t>(version), std::move(m));
  }
  return FromRocks(it->status(), "predictor_index (refusing to start; nothing was dropped)");
}

absl::StatusOr<std::string> RecordStore::ReadPredictor(uint64_t shard_id, uint32_t version) {
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  std::string value;
  rocksdb::Status s = db_->Get(ro, cf_predictors_, NodeKey(shard_id, version), &value);
  if (s.IsNotFound()) {
    return absl::NotFoundError(absl::StrCat("predictor state version ", version, " is missing"));
  }
  if (!s.ok()) return FromRocks(s, absl::StrCat("reading predictor state version ", version));
  return value;
}

absl::Status RecordStore::Write(RecordBatch& batch) {
  if (absl::Status h = health(); !h.ok()) return h;
  if (batch.count() == 0) return absl::OkStatus();
  absl::ReaderMutexLock gc_lock(&gc_mu_);
  // The pointers this batch replaces (their bytes become garbage once it is written).
  std::vector<ValuePointer> replaced;
  {
    std::string value;
    ValuePointer p;
    for (const std::string& key : batch.replaced_keys_) {
      rocksdb::Status g = db_->Get(rocksdb::ReadOptions(), cf_payloads_, key, &value);
      if (g.ok() && DecodeValuePointer(value, &p)) replaced.push_back(p);
    }
  }
  std::vector<ValuePointer> written;
  if (!batch.payloads_.empty()) {
    std::vector<ValueLog::Entry> entries;
    entries.reserve(batch.payloads_.size());
    for (const auto& e : batch.payloads_) entries.push_back({e.key, *e.payload});
    if (absl::Status s = vlog_->Append(entries, &written); !s.ok()) {
      Fail(s);
      return absl::Status(s.code(), absl::StrCat("store failed: ", s.message()));
    }
    for (size_t i = 0; i < written.size(); ++i) {
      batch.batch_->Put(cf_payloads_, batch.payloads_[i].key, EncodeValuePointer(written[i]));
    }
    batch.payloads_.clear();
  }
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
#if KVTRIE_TSAN
  // TSan builds only: RocksDB's group commit has a leader thread append the followers' batches,
  // handed over through atomics inside the uninstrumented librocksdb, and TSan (unwinding no
  // frame of it) reports that as a race on the batch. One write at a time keeps every batch on
  // its own thread; production builds keep RocksDB's group commit.
  static std::mutex* const tsan_write_mu = new std::mutex;
  std::lock_guard<std::mutex> one_writer(*tsan_write_mu);
#endif
  absl::Status s = FromRocks(db_->Write(wo, batch.batch_.get()), "write");
  if (s.ok()) {
    for (const ValuePointer& p : written) vlog_->AddLive(p);
    for (const ValuePointer& p : replaced) vlog_->RemoveLive(p);
    return s;
  }
  Fail(s);
  // This write keeps its own code (RESOURCE_EXHAUSTED for ENOSPC, UNAVAILABLE for I/O); the
  // ones after it get the sticky UNAVAILABLE.
  return absl::Status(s.code(), absl::StrCat("store failed: ", s.message()));
}

absl::StatusOr<std::string> RecordStore::ReadPayload(uint64_t shard_id, uint64_t node_id,
                                                     const ReadSnapshot* snapshot) {
  rocksdb::ReadOptions ro;
  ro.snapshot = snapshot ? snapshot->snapshot : nullptr;
  ro.verify_checksums = true;
  const std::string key = NodeKey(shard_id, node_id);
  for (int attempt = 0;; ++attempt) {
    std::string value;
    rocksdb::Status s = db_->Get(ro, cf_payloads_, key, &value);
    if (s.IsNotFound()) {
      return absl::NotFoundError(absl::StrCat("payload of node ", node_id, " is missing"));
    }
    if (!s.ok()) return FromRocks(s, absl::StrCat("reading the payload of node ", node_id));
    ValuePointer p;
    if (!DecodeValuePointer(value, &p)) return value;  // inline (an older kvtrie's folder)
    absl::StatusOr<std::string> bytes = vlog_->Read(key, p);
    // Without a snapshot, a GC may have moved the payload and deleted its segment since the
    // pointer was read: read the pointer again. (A snapshot holds its segments.)
    if (absl::IsNotFound(bytes.status()) && ro.snapshot == nullptr && attempt < 3) continue;
    if (!bytes.ok()) {
      return absl::Status(bytes.status().code(), absl::StrCat("the payload of node ", node_id, ": ",
                                                              bytes.status().message()));
    }
    return bytes;
  }
}

std::shared_ptr<const ReadSnapshot> RecordStore::Snapshot() {
  ReadSnapshot* snap = nullptr;
  {
    // Taken and listed at once: a GC reading the oldest snapshot sees this one, or this one
    // was taken after the GC's swap (and sees the new pointers).
    absl::MutexLock lock(&snap_mu_);
    snap = new ReadSnapshot{db_->GetSnapshot()};
    snapshots_.insert(snap->snapshot->GetSequenceNumber());
  }
  return std::shared_ptr<const ReadSnapshot>(snap, [this](const ReadSnapshot* s) {
    bool was_oldest = false;
    {
      absl::MutexLock lock(&snap_mu_);
      const uint64_t seq = s->snapshot->GetSequenceNumber();
      was_oldest = *snapshots_.begin() == seq;
      snapshots_.erase(snapshots_.find(seq));
    }
    db_->ReleaseSnapshot(s->snapshot);
    delete s;
    if (was_oldest) {
      if (absl::Status st = DeleteObsoleteSegments(); !st.ok()) {
        spdlog::warn("{}", st.ToString());
      }
    }
  });
}

uint64_t RecordStore::OldestSnapshot() const {
  absl::MutexLock lock(&snap_mu_);
  return snapshots_.empty() ? UINT64_MAX : *snapshots_.begin();
}

absl::Status RecordStore::DeleteObsoleteSegments() {
  return vlog_->DeleteObsolete(OldestSnapshot());
}

absl::Status RecordStore::health() const {
  absl::MutexLock lock(&error_mu_);
  return sticky_;
}

void RecordStore::Fail(const absl::Status& error) {
  absl::MutexLock lock(&error_mu_);
  if (!sticky_.ok() || error.ok()) return;
  spdlog::critical("store failed, refusing writes until restart: {}", error.ToString());
  sticky_ = absl::UnavailableError(absl::StrCat("store failed: ", error.message()));
}

uint64_t RecordStore::DiskUsage() {
  uint64_t total = 0, v = 0;
  for (auto* h : handles_) {
    if (db_->GetIntProperty(h, "rocksdb.total-sst-files-size", &v)) total += v;
    if (db_->GetIntProperty(h, "rocksdb.total-blob-file-size", &v)) total += v;
  }
  total += vlog_->Bytes();
  rocksdb::VectorLogPtr wal;
  if (db_->GetSortedWalFiles(wal).ok()) {
    for (const auto& f : wal) total += f->SizeFileBytes();
  }
  return total;
}

absl::Status RecordStore::CollectGarbage() {
  // When the value log's accounting failed at open, its GC is off until a restart (logged once,
  // then): the RocksDB blob files are still collected, and no error is logged at every check.
  if (vlog_accounting_.ok()) {
    if (absl::Status s = CollectValueLog(kValueLogGcRatio); !s.ok()) return s;
  }
  rocksdb::CompactRangeOptions o;
  o.blob_garbage_collection_policy = rocksdb::BlobGarbageCollectionPolicy::kForce;
  o.blob_garbage_collection_age_cutoff = 1.0;
  o.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  return FromRocks(db_->CompactRange(o, cf_payloads_, nullptr, nullptr), "blob garbage collection");
}

absl::Status RecordStore::Flush() {
  return FromRocks(db_->Flush(rocksdb::FlushOptions(), handles_), "flush");
}

absl::Status RecordStore::Compact() {
  // Every segment with a deleted payload's bytes is rewritten (the active one sealed first).
  if (absl::Status s = CollectValueLog(1.0, /*roll=*/true); !s.ok()) return s;
  if (absl::Status s = Flush(); !s.ok()) return s;
  rocksdb::CompactRangeOptions o;
  o.blob_garbage_collection_policy = rocksdb::BlobGarbageCollectionPolicy::kForce;
  o.blob_garbage_collection_age_cutoff = 1.0;
  o.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  for (rocksdb::ColumnFamilyHandle* h : handles_) {
    if (auto s = db_->CompactRange(o, h, nullptr, nullptr); !s.ok()) {
      return FromRocks(s, absl::StrCat("compaction of ", h->GetName()));
    }
  }
  // The compactions' obsolete files (and the WAL files the flush made obsolete) may still be
  // queued for deletion on a background thread: re-enabling deletions scans for obsolete files
  // and deletes them on this thread before it returns.
  if (auto s = db_->DisableFileDeletions(); !s.ok()) return FromRocks(s, "file deletions");
  return FromRocks(db_->EnableFileDeletions(/*force=*/false), "obsolete file deletion");
}

absl::Status RecordStore::CollectValueLog(double max_live_ratio, bool roll) {
  if (absl::Status h = health(); !h.ok()) return h;
  if (!vlog_accounting_.ok()) return vlog_accounting_;
  absl::MutexLock one(&collect_mu_);
  if (roll) {
    if (absl::Status s = vlog_->Roll(); !s.ok()) return s;
  }
  for (const ValueLog::SegmentInfo& seg : vlog_->Segments()) {
    if (!seg.sealed || seg.obsolete) continue;
    if (seg.bytes != 0 && static_cast<double>(seg.live) > max_live_ratio * seg.bytes) continue;
    if (seg.live == seg.bytes && seg.bytes != 0) continue;  // no garbage
    // The records RocksDB still points at.
    std::vector<std::pair<std::string, ValuePointer>> live;
    std::string value;
    ValuePointer current;
    absl::Status scan = vlog_->Scan(seg.number, [&](absl::string_view key, const ValuePointer& p) {
      rocksdb::Status g = db_->Get(rocksdb::ReadOptions(), cf_payloads_,
                                   rocksdb::Slice(key.data(), key.size()), &value);
      if (g.ok() && DecodeValuePointer(value, &current) && current == p) {
        live.emplace_back(std::string(key), p);
      }
    });
    if (!scan.ok()) return scan;
    // Copies, in groups of about 8 MiB, then one swap per group.
    size_t at = 0;
    while (at < live.size()) {
      std::vector<std::string> bytes;
      std::vector<ValueLog::Entry> entries;
      std::vector<size_t> index;
      uint64_t group = 0;
      for (; at < live.size() && (group < (8u << 20) || entries.empty()); ++at) {
        absl::StatusOr<std::string> b = vlog_->Read(live[at].first, live[at].second);
        if (!b.ok()) {
          // A rotten record is left where it is (its read reports it); anything else stops.
          if (absl::IsDataLoss(b.status()) || absl::IsNotFound(b.status())) continue;
          return b.status();
        }
        group += b->size();
        bytes.push_back(*std::move(b));
        index.push_back(at);
      }
      for (size_t i = 0; i < index.size(); ++i) entries.push_back({live[index[i]].first, bytes[i]});
      if (entries.empty()) continue;
      std::vector<ValuePointer> moved;
      if (absl::Status s = vlog_->Append(entries, &moved); !s.ok()) return s;  // copies: garbage
      if (gc_after_copy_for_testing) {
        if (absl::Status s = gc_after_copy_for_testing(); !s.ok()) return s;
      }
      absl::MutexLock swap(&gc_mu_);
      rocksdb::WriteBatch wb;
      std::vector<std::pair<ValuePointer, ValuePointer>> swapped;
      for (size_t i = 0; i < index.size(); ++i) {
        const auto& [key, old] = live[index[i]];
        rocksdb::Status g = db_->Get(rocksdb::ReadOptions(), cf_payloads_, key, &value);
        if (!g.ok() || !DecodeValuePointer(value, &current) || !(current == old)) continue;
        wb.Put(cf_payloads_, key, EncodeValuePointer(moved[i]));
        swapped.emplace_back(old, moved[i]);
      }
      if (wb.Count() == 0) continue;
      rocksdb::WriteOptions wo;
      wo.sync = options_.sync;
      if (absl::Status s = FromRocks(db_->Write(wo, &wb), "value log GC"); !s.ok()) {
        Fail(s);
        return s;
      }
      for (const auto& [old, moved_to] : swapped) {
        vlog_->RemoveLive(old);
        vlog_->AddLive(moved_to);
      }
    }
    vlog_->MarkObsolete(seg.number, db_->GetLatestSequenceNumber());
  }
  return DeleteObsoleteSegments();
}

RecordStore::ValueLogStats RecordStore::value_log_stats() const {
  ValueLogStats st;
  for (const ValueLog::SegmentInfo& seg : vlog_->Segments()) {
    ++st.segments;
    st.bytes += seg.bytes;
    st.live_bytes += seg.live;
  }
  st.bytes_appended = vlog_->bytes_appended();
  st.segments_deleted = vlog_->segments_deleted();
  return st;
}

}  // namespace kvtrie
