#include "trie/kv_store.h"

#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trie/store_records.pb.h"

namespace kvtrie {
namespace {

constexpr char kModelsCf[] = "models";
constexpr char kNodesCf[] = "nodes";
constexpr char kPayloadsCf[] = "payloads";

std::string NodeKey(uint64_t id) {
  std::string k(8, '\0');
  for (int i = 0; i < 8; ++i) k[i] = static_cast<char>((id >> (56 - 8 * i)) & 0xff);
  return k;
}

uint64_t DecodeNodeKey(const rocksdb::Slice& k) {
  uint64_t id = 0;
  for (size_t i = 0; i < 8 && i < k.size(); ++i) id = id << 8 | static_cast<uint8_t>(k[i]);
  return id;
}

std::string ModelKeyString(const std::string& ns, const std::string& model_id) {
  return absl::StrCat(ns, std::string(1, '\0'), model_id);
}

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", s.ToString());
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError() || s.IsBusy() || s.IsTryAgain()) return absl::UnavailableError(msg);
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

// Field-by-field comparison so the error names the field that differs.
absl::Status CheckSameModel(const std::string& ns, const ModelInfo& stored,
                            const ModelInfo& request) {
  const BlockGeometry& a = stored.geometry;
  const BlockGeometry& b = request.geometry;
  auto mismatch = [&](absl::string_view field, std::string have, std::string want) {
    return absl::InvalidArgumentError(absl::StrCat("model.", field, ": namespace '", ns,
                                                   "' stores model '", stored.model_id, "' with ",
                                                   field, "=", have, ", request has ", want));
  };
  if (a.num_layers != b.num_layers)
    return mismatch("num_layers", absl::StrCat(a.num_layers), absl::StrCat(b.num_layers));
  if (a.num_kv_heads != b.num_kv_heads)
    return mismatch("num_kv_heads", absl::StrCat(a.num_kv_heads), absl::StrCat(b.num_kv_heads));
  if (a.head_dim != b.head_dim)
    return mismatch("head_dim", absl::StrCat(a.head_dim), absl::StrCat(b.head_dim));
  if (a.dtype != b.dtype)
    return mismatch("dtype", std::string(DTypeName(a.dtype)), std::string(DTypeName(b.dtype)));
  if (a.block_tokens != b.block_tokens)
    return mismatch("block_tokens", absl::StrCat(a.block_tokens), absl::StrCat(b.block_tokens));
  return absl::OkStatus();
}

NodeView ToView(const TrieNode& n) {
  NodeView v;
  v.node_id = n.id;
  v.parent_id = n.parent ? n.parent->id : 0;
  v.depth = n.depth;
  v.token_offset = n.depth == 0 ? 0 : n.token_offset();
  v.token_ids = n.token_ids;
  v.surprisal_bits = n.surprisal_bits;
  v.path_surprisal_bits = n.path_surprisal_bits;
  v.bytes_logical = n.bytes_logical;
  v.bytes_stored = n.bytes_stored;
  v.encoding = n.encoding;
  v.rel_rms_error_k = n.rel_rms_error_k;
  v.rel_rms_error_v = n.rel_rms_error_v;
  v.num_children = static_cast<uint32_t>(n.num_children());
  v.hits = n.hits;
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// KvStore

KvStore::KvStore(const StoreOptions& options) : options_(options) {}

KvStore::~KvStore() {
  if (background_) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    background_->join();
  }
  if (db_) {
    // Memtables to SST and blob files, so the next start replays no WAL.
    rocksdb::Status s = db_->Flush(rocksdb::FlushOptions(), handles_);
    if (!s.ok()) spdlog::warn("flush at close: {}", s.ToString());
    for (auto* h : handles_) db_->DestroyColumnFamilyHandle(h);
    db_->Close();
  }
}

absl::StatusOr<std::unique_ptr<KvStore>> KvStore::Open(const StoreOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("data_dir: cannot create '", options.data_dir, "': ", ec.message()));
  }
  std::unique_ptr<KvStore> store(new KvStore(options));
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_background_jobs = 2;
  // RSS: one small block cache for every column family; payload memtables are bounded.
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = rocksdb::NewLRUCache(8 << 20);
  rocksdb::ColumnFamilyOptions meta;
  meta.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::ColumnFamilyOptions payloads = meta;
  payloads.compression = rocksdb::kNoCompression;  // blocks are already entropy-coded
  // BlobDB: payloads (KiBs to MiBs) go to blob files at flush and the LSM holds only small
  // references, so compaction never rewrites KV bytes (write amplification ~1 instead of the
  // LSM's ~10) and evicted payloads are reclaimed by blob garbage collection.
  payloads.enable_blob_files = true;
  payloads.min_blob_size = 512;
  payloads.blob_file_size = 64 << 20;
  payloads.blob_compression_type = rocksdb::kNoCompression;
  payloads.enable_blob_garbage_collection = true;
  payloads.blob_garbage_collection_age_cutoff = 0.5;
  payloads.write_buffer_size = options.memtable_bytes;
  payloads.max_write_buffer_number = 2;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, meta},
      {kModelsCf, meta},
      {kNodesCf, meta},
      {kPayloadsCf, payloads},
  };
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options.data_dir, cfs, &store->handles_, &db);
  if (!s.ok()) return FromRocks(s, absl::StrCat("data_dir '", options.data_dir, "'"));
  store->db_.reset(db);
  store->cf_models_ = store->handles_[1];
  store->cf_nodes_ = store->handles_[2];
  store->cf_payloads_ = store->handles_[3];
  if (auto st = store->Recover(); !st.ok()) return st;
  if (options.background) {
    store->background_ = std::make_unique<std::thread>([s = store.get()] { s->BackgroundLoop(); });
  }
  return store;
}

absl::Status KvStore::Recover() {
  absl::MutexLock lock(&mu_);
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cf_models_));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      internal::ModelRecord r;
      if (!r.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
        return absl::DataLossError(absl::StrCat("models: unreadable record"));
      }
      Model m;
      m.info.model_id = r.model_id();
      m.info.geometry = {r.num_layers(), r.num_kv_heads(), r.block_tokens(), r.head_dim(),
                         static_cast<DType>(r.dtype())};
      if (auto st = m.info.geometry.Validate(); !st.ok()) {
        return absl::DataLossError(absl::StrCat("models: bad record: ", st.message()));
      }
      m.trie = std::make_unique<BlockTrie>(m.info.geometry.block_tokens, options_.token_hash);
      models_.emplace(ModelKey(r.namespace_(), r.model_id()), std::move(m));
      ++recovery_.models;
    }
    if (!it->status().ok()) return FromRocks(it->status(), "models");
  }
  rocksdb::WriteBatch drop;
  std::unique_ptr<rocksdb::Iterator> nodes(db_->NewIterator(rocksdb::ReadOptions(), cf_nodes_));
  std::unique_ptr<rocksdb::Iterator> payloads;
  if (options_.verify_payloads_on_open) {
    recovery_.payloads_verified = true;
    payloads.reset(db_->NewIterator(rocksdb::ReadOptions(), cf_payloads_));
    payloads->SeekToFirst();
  }
  const uint64_t now = NowSeconds();
  for (nodes->SeekToFirst(); nodes->Valid(); nodes->Next()) {
    const uint64_t id = DecodeNodeKey(nodes->key());
    next_node_id_ = std::max(next_node_id_, id + 1);
    internal::NodeRecord r;
    Model* model = nullptr;
    TrieNode* parent = nullptr;
    bool ok = r.ParseFromArray(nodes->value().data(), static_cast<int>(nodes->value().size()));
    if (ok) model = FindModel(r.namespace_(), r.model_id());
    if (model) parent = model->trie->Find(r.parent_id());
    if (!ok || !parent || r.token_ids_size() != static_cast<int>(model->trie->block_tokens()) ||
        model->trie->FindChild(parent, r.token_ids()) != nullptr ||
        (r.reference_node_id() != 0 && model->trie->Find(r.reference_node_id()) == nullptr)) {
      ++recovery_.dropped_missing_parent;
      drop.Delete(cf_nodes_, nodes->key());
      drop.Delete(cf_payloads_, nodes->key());
      continue;
    }
    // Payloads iterate in the same key order; skip orphans (a node dropped earlier). Only with
    // verify_payloads_on_open: otherwise a payload is checked when it is first read.
    std::shared_ptr<std::string> encoded;
    absl::StatusOr<BlockHeader> h = absl::DataLossError("payload missing");
    if (payloads) {
      while (payloads->Valid() && DecodeNodeKey(payloads->key()) < id) payloads->Next();
      if (!payloads->status().ok()) {
        // A read error is not a missing payload: dropping every later node for it would turn one
        // bad disk block into the loss of the store. Refuse to start instead.
        return FromRocks(payloads->status(), "payloads (refusing to start; nothing was dropped)");
      }
      if (payloads->Valid() && DecodeNodeKey(payloads->key()) == id) {
        encoded = std::make_shared<std::string>(payloads->value().ToString());
        h = ParseBlock(*encoded);
      }
    } else if (IsValidEncoding(r.encoding()) && r.bytes_stored() > 0) {
      h = BlockHeader{};
      h->geometry = model->info.geometry;
      h->encoding = static_cast<Encoding>(r.encoding());
    }
    if (!h.ok() || !(h->geometry == model->info.geometry)) {
      spdlog::warn("recovery: dropping node {} of '{}'/'{}': {}", id, r.namespace_(), r.model_id(),
                   h.ok() ? std::string("geometry differs from the model")
                          : std::string(h.status().message()));
      ++recovery_.dropped_bad_payload;
      drop.Delete(cf_nodes_, nodes->key());
      drop.Delete(cf_payloads_, nodes->key());
      continue;
    }
    TrieNode* node = model->trie->AddChild(
        parent, id, r.token_ids(),
        absl::MakeConstSpan(r.surprisal_bits().data(), r.surprisal_bits_size()));
    node->encoding = h->encoding;
    node->bytes_logical = r.bytes_logical();
    node->bytes_stored = encoded ? encoded->size() : r.bytes_stored();
    node->rel_rms_error_k = static_cast<float>(r.rel_rms_error_k());
    node->rel_rms_error_v = static_cast<float>(r.rel_rms_error_v());
    node->reference_node_id = r.reference_node_id();  // its centroid (a smaller id: seen before)
    ClusterAddLocked(model, node);
    if (r.pinned_until() > now) {
      node->tier.pinned_until = r.pinned_until();
      pinned_[id] = {model, node};
    }
    TierAddLocked(model, node, std::move(encoded));
    model->bytes_logical += node->bytes_logical;
    model->bytes_stored += node->bytes_stored;
    ++recovery_.nodes;
  }
  if (!nodes->status().ok()) return FromRocks(nodes->status(), "nodes");
  if (drop.Count() > 0) {
    if (auto st = FromRocks(db_->Write(rocksdb::WriteOptions(), &drop), "recovery"); !st.ok()) {
      return st;
    }
  }
  if (recovery_.dropped_missing_parent + recovery_.dropped_bad_payload > 0) {
    spdlog::warn("recovery: dropped {} nodes with a missing parent and {} with a bad payload",
                 recovery_.dropped_missing_parent, recovery_.dropped_bad_payload);
  }
  return absl::OkStatus();
}

KvStore::Model* KvStore::FindModel(const std::string& ns, const std::string& model_id) {
  auto it = models_.find(ModelKey(ns, model_id));
  return it == models_.end() ? nullptr : &it->second;
}

absl::StatusOr<KvStore::Model*> KvStore::FindModelOrNotFound(const std::string& ns,
                                                             const std::string& model_id) {
  Model* m = FindModel(ns, model_id);
  if (m == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("model_id: '", model_id, "' has no KV in namespace '", ns, "'"));
  }
  return m;
}

absl::StatusOr<TrieNode*> KvStore::FindNodeOrNotFound(Model* model, const std::string& ns,
                                                      uint64_t node_id) {
  TrieNode* n = model->trie->Find(node_id);
  if (n == nullptr) {
    return absl::NotFoundError(absl::StrCat("node_id: ", node_id, " is not a node of '",
                                            model->info.model_id, "' in namespace '", ns, "'"));
  }
  return n;
}

MatchResult KvStore::Lookup(const std::string& ns, const std::string& model_id,
                            absl::Span<const uint32_t> token_ids) {
  lookups_.fetch_add(1, std::memory_order_relaxed);
  MatchResult result;
  absl::MutexLock lock(&mu_);
  Model* m = FindModel(ns, model_id);
  if (m == nullptr) return result;
  result.block_tokens = m->info.geometry.block_tokens;
  for (TrieNode* n : m->trie->Match(token_ids)) result.node_ids.push_back(n->id);
  if (!result.node_ids.empty()) lookup_hits_.fetch_add(1, std::memory_order_relaxed);
  return result;
}

absl::StatusOr<std::unique_ptr<PutSession>> KvStore::BeginPut(const std::string& ns,
                                                              const ModelInfo& model,
                                                              std::vector<uint32_t> token_ids,
                                                              std::vector<float> surprisal_bits,
                                                              const EncodeOptions& encode) {
  if (model.model_id.empty()) return absl::InvalidArgumentError("model.model_id: required");
  if (auto s = model.geometry.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model.", s.message()));
  }
  if (!surprisal_bits.empty() && surprisal_bits.size() != token_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("surprisal_bits: ", surprisal_bits.size(),
                                                   " values for ", token_ids.size(),
                                                   " token_ids (send one per token, or none)"));
  }
  if (surprisal_bits.empty()) surprisal_bits.assign(token_ids.size(), 0.0f);
  for (size_t i = 0; i < surprisal_bits.size(); ++i) {
    if (!(surprisal_bits[i] >= 0) || std::isinf(surprisal_bits[i])) {
      return absl::InvalidArgumentError(absl::StrCat("surprisal_bits: value ", i, " is ",
                                                     surprisal_bits[i],
                                                     "; bits must be finite and >= 0"));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    // A new model is created by the commit of its first blocks (CommitBlocks), in the same
    // batch: a Put that fails or is cut short leaves no model behind to pin a wrong geometry.
    Model* m = FindModel(ns, model.model_id);
    if (m != nullptr) {
      if (auto s = CheckSameModel(ns, m->info, model); !s.ok()) return s;
    }
  }
  return std::unique_ptr<PutSession>(
      new PutSession(this, ns, model, std::move(token_ids), std::move(surprisal_bits), encode));
}

absl::StatusOr<std::vector<uint64_t>> KvStore::CommitBlocks(const std::string& ns,
                                                            const ModelInfo& model,
                                                            uint64_t parent_id,
                                                            absl::Span<const uint32_t> token_ids,
                                                            absl::Span<const float> surprisal_bits,
                                                            const std::vector<NewBlock>& blocks) {
  const uint32_t bt = model.geometry.block_tokens;
  absl::MutexLock lock(&mu_);
  const ModelKey key(ns, model.model_id);
  Model* m = FindModel(ns, model.model_id);
  bool created = false;  // this commit creates the model; undone if it fails
  if (m == nullptr) {
    if (parent_id != 0) return absl::AbortedError("put: the model was deleted concurrently; retry");
    Model fresh;
    fresh.info = model;
    fresh.trie = std::make_unique<BlockTrie>(model.geometry.block_tokens, options_.token_hash);
    m = &models_.emplace(key, std::move(fresh)).first->second;
    created = true;
  } else if (auto s = CheckSameModel(ns, m->info, model); !s.ok()) {
    return s;  // created concurrently by a Put with another geometry
  }
  auto undo_create = absl::MakeCleanup([&] {
    if (created) models_.erase(key);
  });
  TrieNode* parent = m->trie->Find(parent_id);
  if (parent == nullptr || parent->depth != blocks.front().block_index) {
    return absl::AbortedError("prefix changed concurrently");
  }
  if (m->trie->FindChild(parent, token_ids.subspan(blocks.front().block_index * bt, bt))) {
    return absl::AbortedError("block stored concurrently");
  }
  for (const NewBlock& b : blocks) {  // a centroid deleted since the block was coded against it
    if (b.reference_node_id != 0 && m->trie->Find(b.reference_node_id) == nullptr) {
      return absl::AbortedError("centroid deleted concurrently");
    }
  }
  // Disk budget: evict leaves (never `parent`, which is about to have a child) until this fits.
  uint64_t incoming = 0;
  for (const NewBlock& b : blocks) incoming += b.encoded.bytes.size();
  const bool parent_was_candidate = parent->tier.disk.member;
  evict_queue_.SetMember(parent, m, false);
  absl::Status room = MakeDiskRoomLocked(incoming);
  if (!room.ok()) {
    evict_queue_.SetMember(parent, m, parent_was_candidate && Evictable(*parent));
    return room;
  }
  rocksdb::WriteBatch batch;
  if (created) {
    internal::ModelRecord r;
    r.set_namespace_(ns);
    r.set_model_id(model.model_id);
    r.set_num_layers(model.geometry.num_layers);
    r.set_num_kv_heads(model.geometry.num_kv_heads);
    r.set_head_dim(model.geometry.head_dim);
    r.set_dtype(static_cast<uint32_t>(model.geometry.dtype));
    r.set_block_tokens(model.geometry.block_tokens);
    batch.Put(cf_models_, ModelKeyString(ns, model.model_id), r.SerializeAsString());
  }
  std::vector<uint64_t> ids;
  uint64_t prev = parent_id;
  for (const NewBlock& b : blocks) {
    const uint64_t id = next_node_id_ + ids.size();
    internal::NodeRecord r;
    r.set_namespace_(ns);
    r.set_model_id(model.model_id);
    r.set_parent_id(prev);
    const size_t off = static_cast<size_t>(b.block_index) * bt;
    r.mutable_token_ids()->Add(token_ids.begin() + off, token_ids.begin() + off + bt);
    r.mutable_surprisal_bits()->Add(surprisal_bits.begin() + off,
                                    surprisal_bits.begin() + off + bt);
    r.set_encoding(static_cast<uint32_t>(b.encoding));
    r.set_bytes_logical(model.geometry.num_bytes());
    r.set_bytes_stored(b.encoded.bytes.size());
    r.set_rel_rms_error_k(b.encoded.rel_rms_error_k);
    r.set_rel_rms_error_v(b.encoded.rel_rms_error_v);
    r.set_reference_node_id(b.reference_node_id);
    const std::string key = NodeKey(id);
    batch.Put(cf_nodes_, key, r.SerializeAsString());
    batch.Put(cf_payloads_, key, b.encoded.bytes);
    ids.push_back(id);
    prev = id;
  }
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  if (auto s = FromRocks(db_->Write(wo, &batch), "put"); !s.ok()) return s;
  std::move(undo_create).Cancel();
  next_node_id_ += ids.size();
  // Durable (as promised); now publish, parents first.
  TrieNode* at = parent;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const size_t off = static_cast<size_t>(blocks[i].block_index) * bt;
    TrieNode* n =
        m->trie->AddChild(at, ids[i], token_ids.subspan(off, bt), surprisal_bits.subspan(off, bt));
    n->encoding = blocks[i].encoding;
    n->bytes_logical = model.geometry.num_bytes();
    n->bytes_stored = blocks[i].encoded.bytes.size();
    n->rel_rms_error_k = static_cast<float>(blocks[i].encoded.rel_rms_error_k);
    n->rel_rms_error_v = static_cast<float>(blocks[i].encoded.rel_rms_error_v);
    n->reference_node_id = blocks[i].reference_node_id;
    ClusterAddLocked(m, n);
    TierAddLocked(m, n, std::make_shared<const std::string>(blocks[i].encoded.bytes));
    m->bytes_logical += n->bytes_logical;
    m->bytes_stored += n->bytes_stored;
    at = n;
  }
  return ids;
}

absl::Status KvStore::ReconstructNode(const std::string& ns, const std::string& model_id,
                                      uint64_t node_id, absl::Span<uint8_t> out) {
  // The node's ancestors, root first, up to the nearest one that needs no parent context.
  std::vector<BlockRead> chain;
  {
    absl::MutexLock lock(&mu_);
    Model* m = FindModel(ns, model_id);
    TrieNode* n = m ? m->trie->Find(node_id) : nullptr;
    if (n == nullptr) return absl::AbortedError("prefix changed concurrently");
    std::shared_ptr<const rocksdb::Snapshot> snapshot;
    for (; n != nullptr && n->depth > 0; n = n->parent) {
      if (!n->encoded && !snapshot) snapshot = SnapshotLocked();
      chain.push_back(
          {n->id, n->encoded, n->encoding, n->reference_node_id, n->encoded ? nullptr : snapshot});
      if (n->encoding == Encoding::kRaw || n->encoding == Encoding::kLossless) break;
    }
  }
  std::reverse(chain.begin(), chain.end());
  std::vector<uint8_t> parent;
  for (const BlockRead& b : chain) {
    if (auto s = DecodeBlock(ns, model_id, b, parent, out); !s.ok()) return s;
    parent.assign(out.begin(), out.end());
  }
  return absl::OkStatus();
}

absl::StatusOr<GetResult> KvStore::Get(const std::string& ns, const std::string& model_id,
                                       absl::Span<const uint32_t> token_ids, size_t max_blocks) {
  gets_.fetch_add(1, std::memory_order_relaxed);
  GetResult result;
  absl::MutexLock lock(&mu_);
  Model* m = FindModel(ns, model_id);
  if (m == nullptr) return result;  // a miss, not an error
  result.model = m->info;
  std::shared_ptr<const rocksdb::Snapshot> snapshot;  // one for every cold block of this Get
  for (TrieNode* n : m->trie->Match(token_ids, max_blocks)) {
    ++n->hits;
    TierTouchLocked(m, n);
    BlockRead r;
    r.node_id = n->id;
    r.encoded = n->encoded;
    r.encoding = n->encoding;
    r.reference_node_id = n->reference_node_id;
    if (!n->encoded) {
      if (!snapshot) snapshot = SnapshotLocked();
      r.snapshot = snapshot;
    }
    result.blocks.push_back(std::move(r));
  }
  return result;
}

absl::Status KvStore::DecodeBlock(const std::string& ns, const std::string& model_id,
                                  const BlockRead& block, absl::Span<const uint8_t> parent,
                                  absl::Span<uint8_t> out) {
  absl::StatusOr<std::shared_ptr<const std::string>> payload = Payload(ns, model_id, block);
  if (!payload.ok()) return payload.status();  // a bad cold payload is dropped there
  PredictionContext ctx;
  ctx.parent = parent;
  std::vector<uint8_t> reference;  // a near-duplicate's centroid, reconstructed
  if (block.reference_node_id != 0) {
    reference.resize(out.size());
    if (auto s = ReconstructNode(ns, model_id, block.reference_node_id, absl::MakeSpan(reference));
        !s.ok()) {
      // The centroid failed its checksum (and was dropped) or is gone. If this member is still
      // coded against it (not re-encoded meanwhile by a Delete), it can never be decoded again.
      absl::MutexLock lock(&mu_);
      Model* m = FindModel(ns, model_id);
      TrieNode* n = m ? m->trie->Find(block.node_id) : nullptr;
      if (n == nullptr || n->reference_node_id != block.reference_node_id ||
          m->trie->Find(block.reference_node_id) != nullptr) {
        return s;
      }
      DropNodeLocked(m, n, DropReason::kDataLoss);
      return absl::DataLossError(absl::StrCat("node ", block.node_id, ": its centroid ",
                                              block.reference_node_id, " is lost (", s.message(),
                                              "); the node and its subtree were dropped"));
    }
    ctx.reference = reference;
  }
  absl::Status s = kvtrie::DecodeBlock(**payload, out, ctx);
  if (!absl::IsDataLoss(s)) return s;
  spdlog::error("node {} of '{}'/'{}' failed to decode, dropping it and its subtree: {}",
                block.node_id, ns, model_id, std::string(s.message()));
  absl::MutexLock lock(&mu_);
  Model* m = FindModel(ns, model_id);
  TrieNode* n = m ? m->trie->Find(block.node_id) : nullptr;
  if (n != nullptr) DropNodeLocked(m, n, DropReason::kDataLoss);  // ids are never reused
  return absl::DataLossError(absl::StrCat("node ", block.node_id, ": ", s.message(),
                                          "; the node and its subtree were dropped"));
}

void KvStore::DropNodeLocked(Model* model, TrieNode* node, DropReason reason) {
  rocksdb::WriteBatch batch;
  const uint64_t removed = RemoveNodeLocked(model, node, reason, &batch);
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  rocksdb::Status s = db_->Write(wo, &batch);
  if (!s.ok()) spdlog::error("deleting {} nodes: {}", removed, s.ToString());
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> KvStore::Delete(
    const std::string& ns, const std::string& model_id, absl::Span<const uint32_t> token_ids) {
  // Near-duplicates coded against a node of the subtree are re-encoded first (kv_store_cluster.cc).
  if (auto s = ReleaseDependentsOfPrefix(ns, model_id, token_ids); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Model*> found = FindModelOrNotFound(ns, model_id);
  if (!found.ok()) return found.status();
  Model* m = *found;
  const uint32_t bt = m->info.geometry.block_tokens;
  if (token_ids.empty() || token_ids.size() % bt != 0) {
    return absl::InvalidArgumentError(absl::StrCat("token_ids: ", token_ids.size(),
                                                   " tokens is not a positive multiple of "
                                                   "block_tokens=",
                                                   bt));
  }
  std::vector<TrieNode*> path = m->trie->Match(token_ids);
  if (path.size() != token_ids.size() / bt) {
    return absl::NotFoundError(absl::StrCat("token_ids: only ", path.size() * bt, " of ",
                                            token_ids.size(), " tokens are stored"));
  }
  const uint64_t before_nodes = m->trie->num_nodes();
  const uint64_t before_bytes = m->bytes_stored;
  if (SubtreeHasOutsideDependentsLocked(m, path.back())) {
    return absl::AbortedError(
        "token_ids: a near-duplicate was coded against this prefix "
        "meanwhile; retry the Delete");
  }
  DropNodeLocked(m, path.back());
  deletes_.fetch_add(1, std::memory_order_relaxed);
  return std::make_pair(before_nodes - m->trie->num_nodes(), before_bytes - m->bytes_stored);
}

absl::StatusOr<std::vector<uint32_t>> KvStore::PathTokens(const std::string& ns,
                                                          const std::string& model_id,
                                                          uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Model*> found = FindModelOrNotFound(ns, model_id);
  if (!found.ok()) return found.status();
  Model* m = *found;
  absl::StatusOr<TrieNode*> node = FindNodeOrNotFound(m, ns, node_id);
  if (!node.ok()) return node.status();
  const TrieNode* n = *node;
  const size_t bt = m->trie->block_tokens();
  std::vector<uint32_t> tokens(static_cast<size_t>(n->depth) * bt);
  for (; n->depth > 0; n = n->parent) {
    std::copy(n->token_ids.begin(), n->token_ids.end(),
              tokens.begin() + static_cast<ptrdiff_t>((n->depth - 1) * bt));
  }
  return tokens;
}

absl::StatusOr<InspectResult> KvStore::Inspect(const std::string& ns, const std::string& model_id,
                                               uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Model*> found = FindModelOrNotFound(ns, model_id);
  if (!found.ok()) return found.status();
  Model* m = *found;
  absl::StatusOr<TrieNode*> node = FindNodeOrNotFound(m, ns, node_id);
  if (!node.ok()) return node.status();
  TrieNode* n = *node;
  InspectResult r;
  r.model = m->info;
  r.node = ToView(*n);
  ClusterViewLocked(m, *n, &r.node);
  for (const auto& [h, bucket] : n->children) {
    for (const TrieNode* c : bucket) {
      r.children.push_back(ToView(*c));
      ClusterViewLocked(m, *c, &r.children.back());
    }
  }
  std::sort(r.children.begin(), r.children.end(),
            [](const NodeView& a, const NodeView& b) { return a.node_id < b.node_id; });
  return r;
}

StoreStats KvStore::Stats(const std::string& ns) {
  StoreStats s;
  {
    absl::MutexLock lock(&mu_);
    std::string last_ns;
    bool first = true;
    for (const auto& [key, m] : models_) {
      if (!ns.empty() && key.first != ns) continue;
      if (first || key.first != last_ns) ++s.namespaces;  // models_ is ordered by namespace
      first = false;
      last_ns = key.first;
      ++s.models;
      s.nodes += m.trie->num_nodes();
      s.bytes_logical += m.bytes_logical;
      s.bytes_stored += m.bytes_stored;
      s.elements += m.trie->num_nodes() * m.info.geometry.num_elements();
      ClusterStatsLocked(m, &s.cluster);
      m.trie->ForEach([&](const TrieNode& n) {
        (n.encoded ? s.hot_nodes : s.cold_nodes) += 1;
        (n.encoded ? s.hot_bytes : s.cold_bytes) += n.bytes_stored;
        s.disk_bytes += n.bytes_stored;
        s.pinned_nodes += n.tier.pinned_until != 0;
        s.max_depth = std::max<uint64_t>(s.max_depth, n.depth);
        if (n.rel_rms_error_k > 0 || n.rel_rms_error_v > 0) {
          ++s.lossy_nodes;
          s.sum_rel_rms_error_k += n.rel_rms_error_k;
          s.sum_rel_rms_error_v += n.rel_rms_error_v;
          s.max_rel_rms_error =
              std::max<double>({s.max_rel_rms_error, n.rel_rms_error_k, n.rel_rms_error_v});
        }
      });
    }
  }
  s.blocks_stored = blocks_stored_.load(std::memory_order_relaxed);
  s.blocks_deduplicated = blocks_deduplicated_.load(std::memory_order_relaxed);
  s.lookups = lookups_.load(std::memory_order_relaxed);
  s.lookup_hits = lookup_hits_.load(std::memory_order_relaxed);
  s.gets = gets_.load(std::memory_order_relaxed);
  s.puts = puts_.load(std::memory_order_relaxed);
  s.deletes = deletes_.load(std::memory_order_relaxed);
  s.memory_budget_bytes = options_.memory_bytes;
  s.disk_budget_bytes = options_.disk_bytes;
  s.demotions = demotions_.load(std::memory_order_relaxed);
  s.demoted_bytes = demoted_bytes_.load(std::memory_order_relaxed);
  s.promotions = promotions_.load(std::memory_order_relaxed);
  s.cold_reads = cold_reads_.load(std::memory_order_relaxed);
  s.cold_read_bytes = cold_read_bytes_.load(std::memory_order_relaxed);
  s.evictions_disk = evictions_disk_.load(std::memory_order_relaxed);
  s.evicted_bytes = evicted_bytes_.load(std::memory_order_relaxed);
  s.evictions_data_loss = evictions_data_loss_.load(std::memory_order_relaxed);
  s.evictions_deleted = evictions_deleted_.load(std::memory_order_relaxed);
  s.pins_expired = pins_expired_.load(std::memory_order_relaxed);
  s.puts_rejected_disk_full = puts_rejected_disk_full_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace kvtrie
