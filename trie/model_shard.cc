#include "trie/model_shard.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trie/cluster_policy.h"
#include "trie/put_encoder.h"
#include "trie/put_session.h"
#include "trie/shard_learning.h"

namespace kvtrie {
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

namespace {

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
  v.predictor_version = n.predictor_version;
  v.error_client_reported = n.error_client_reported;
  v.retained = n.retained;
  v.lossy = n.lossy;
  v.target_rel_rms = n.target_rel_rms;
  return v;
}

// Corruption of RocksDB's own files (an SST of the index, the MANIFEST) is not a bad payload:
// the payload may be fine and readable after a repair or restart. A blob or value log record
// whose bytes fail their checksum is a bad payload.
bool IsBadPayloadBytes(const absl::Status& s) {
  if (!absl::IsDataLoss(s)) return false;
  const absl::string_view m = s.message();
  return (!absl::StrContains(m, ".sst") && absl::StrContains(absl::AsciiStrToLower(m), "blob")) ||
         absl::StrContains(m, "value log segment");
}

// A node's rel RMS error as kept and aggregated: in [0, 4] (PutSession::kMaxClientRelRmsError),
// so no stored value (a record written before the bound, or a learner's outlier) can make Stats'
// sums and maximum read inf or nan; nan counts as the bound.
float BoundedError(double e) {
  constexpr double kMax = PutSession::kMaxClientRelRmsError;
  if (std::isnan(e)) return static_cast<float>(kMax);
  return static_cast<float>(std::clamp(e, 0.0, kMax));
}

}  // namespace

ModelShard::ModelShard(ShardContext* context, std::string ns, ModelInfo model, uint64_t shard_id,
                       bool committed)
    : context_(context),
      ns_(std::move(ns)),
      shard_id_(shard_id),
      model_(std::move(model)),
      committed_(committed),
      trie_(
          std::make_unique<BlockTrie>(model_.geometry.block_tokens, context->options->token_hash)),
      clusters_(context->options->near_dup),
      predictors_(std::make_shared<PredictorRegistry>(
          model_.geometry, context->options->predictors,
          PersistedPredictorLoader(context->records, shard_id))),
      retired_(std::make_shared<RetiredReferences>()),
      learning_(std::make_unique<ShardLearning>(this)),
      put_encoder_(std::make_unique<PutEncoder>(this)),
      cluster_policy_(std::make_unique<ClusterPolicy>(this)) {}

bool ModelShard::committed() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

ModelInfo ModelShard::model() const {
  absl::MutexLock lock(&mu_);
  return model_;
}

ModelShard::~ModelShard() = default;

absl::Status ModelShard::CheckModel(const ModelInfo& request) const {
  absl::MutexLock lock(&mu_);
  if (!committed_) return absl::OkStatus();
  return CheckSameModel(ns_, model_, request);
}

absl::Status ModelShard::NoModel() const {
  return absl::NotFoundError(
      absl::StrCat("model_id: '", model_.model_id, "' has no KV in namespace '", ns_, "'"));
}

TrieNode* ModelShard::FindLive(uint64_t id) {
  TrieNode* n = trie_->Find(id);
  return n == nullptr || n->removing ? nullptr : n;
}

TrieNode* ModelShard::FindVisible(uint64_t id) {
  TrieNode* n = FindLive(id);
  return n == nullptr || n->retained ? nullptr : n;
}

absl::StatusOr<TrieNode*> ModelShard::FindNodeOrNotFound(uint64_t node_id) {
  if (!committed_) return NoModel();
  TrieNode* n = FindLive(node_id);  // a retained one too: it is named by a member
  if (n == nullptr) {
    return absl::NotFoundError(absl::StrCat("node_id: ", node_id, " is not a node of '",
                                            model_.model_id, "' in namespace '", ns_, "'"));
  }
  return n;
}

std::vector<TrieNode*> ModelShard::MatchLive(absl::Span<const uint32_t> token_ids,
                                             size_t max_blocks, bool through_retained) {
  std::vector<TrieNode*> path = trie_->Match(token_ids, max_blocks);
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i]->removing || (path[i]->retained && !through_retained)) {
      path.resize(i);
      break;
    }
  }
  return path;
}

NodeMeta ModelShard::MetaOf(const TrieNode& n) const {
  NodeMeta m;
  m.ns = ns_;
  m.model_id = model_.model_id;
  m.parent_id = n.parent ? n.parent->id : 0;
  m.token_ids = n.token_ids;
  m.surprisal_bits = n.surprisal_bits;
  m.encoding = n.encoding;
  m.bytes_logical = n.bytes_logical;
  m.bytes_stored = n.bytes_stored;
  m.rel_rms_error_k = n.rel_rms_error_k;
  m.rel_rms_error_v = n.rel_rms_error_v;
  m.pinned_until = context_->tiers->PinnedUntil(Ref(n.id));
  m.reference_node_id = n.reference_node_id;
  m.predictor_version = n.predictor_version;
  m.error_client_reported = n.error_client_reported;
  m.retained = n.retained;  // a re-encoding of a retained node keeps it retained
  m.lossy = n.lossy;        // and a lossy one lossy, however it is coded
  m.recheck = n.recheck;
  m.offset_look = n.offset_look;
  m.target_rel_rms = n.target_rel_rms;
  return m;
}

bool ModelShard::EvictableLocked(const TrieNode& n) const {
  // A centroid is evictable like any leaf when its members can re-elect (Evict re-encodes them
  // bit-exactly first); not while one is lossy (re-encoding it would cost more than the centroid
  // frees, ReelectLocked: the members go first) or retained (it can not be elected, and goes
  // only with its own last dependent, SweepRetainedLocked).
  if (n.depth == 0 || !n.children.empty() || n.removing || n.retained) return false;
  for (uint64_t d : clusters_.Dependents(n.id)) {
    const TrieNode* m = trie_->Find(d);
    if (m != nullptr && (m->lossy || m->retained)) return false;
  }
  return true;
}

void ModelShard::UpdateEvictableLocked(TrieNode* n) {
  if (n != nullptr && n->depth > 0) context_->tiers->SetEvictable(Ref(n->id), EvictableLocked(*n));
}

void ModelShard::CountNodeLocked(const TrieNode& n, int sign) {
  const auto add = [sign](uint64_t* v, uint64_t d) { *v = sign > 0 ? *v + d : *v - d; };
  add(&bytes_logical_, n.bytes_logical);
  add(&bytes_stored_, n.bytes_stored);
  if (nodes_at_depth_.size() <= n.depth) nodes_at_depth_.resize(n.depth + 1, 0);
  add(&nodes_at_depth_[n.depth], 1);
  if (n.error_client_reported) add(&client_reported_nodes_, 1);
  if (n.lossy && !IsLossyEncoding(n.encoding)) add(&lossy_recoded_nodes_, 1);
  if (n.lossy || n.rel_rms_error_k > 0 || n.rel_rms_error_v > 0) {
    add(&lossy_nodes_, 1);
    sum_rel_rms_k_ += sign * static_cast<double>(n.rel_rms_error_k);
    sum_rel_rms_v_ += sign * static_cast<double>(n.rel_rms_error_v);
    const float e = std::max(n.rel_rms_error_k, n.rel_rms_error_v);
    if (sign > 0) {
      ++lossy_errors_[e];
    } else if (auto it = lossy_errors_.find(e); it != lossy_errors_.end() && --it->second == 0) {
      lossy_errors_.erase(it);
    }
  }
}

TrieNode* ModelShard::PublishLocked(TrieNode* parent, uint64_t id, const NodeMeta& meta,
                                    std::shared_ptr<const std::string> payload) {
  TrieNode* n = trie_->AddChild(parent, id, meta.token_ids, meta.surprisal_bits);
  n->encoding = meta.encoding;
  n->bytes_logical = meta.bytes_logical;
  n->bytes_stored = meta.bytes_stored;
  n->rel_rms_error_k = BoundedError(meta.rel_rms_error_k);
  n->rel_rms_error_v = BoundedError(meta.rel_rms_error_v);
  n->reference_node_id = meta.reference_node_id;
  n->predictor_version = meta.predictor_version;
  n->error_client_reported = meta.error_client_reported;
  n->lossy = meta.lossy || IsLossyEncoding(meta.encoding) || n->rel_rms_error_k > 0 ||
             n->rel_rms_error_v > 0;
  trie_->SetRetained(n, meta.retained);
  if (n->retained) retained_ids_.insert(id);
  n->target_rel_rms = BoundedError(meta.target_rel_rms);
  n->recheck = meta.recheck;  // recovery: the pass's recheck, as it was
  if (n->recheck) cluster_policy_->RecheckLaterLocked(id);
  n->offset_look = meta.offset_look;  // recovery: not looked at yet
  if (n->offset_look) cluster_policy_->LookLaterLocked(id);
  predictors_->AddDependent(n->predictor_version, +1);
  next_id_ = std::max(next_id_, id + 1);
  clusters_.Add(*n);
  CountNodeLocked(*n, +1);
  context_->tiers->Add(Ref(id), n->depth, n->bytes_stored, std::move(payload), EvictableLocked(*n),
                       meta.pinned_until);
  UpdateEvictableLocked(parent);  // no longer a leaf
  if (n->reference_node_id != 0) UpdateEvictableLocked(trie_->Find(n->reference_node_id));
  return n;
}

void ModelShard::FinishRecovery(RecoveryStats* stats, RecordBatch* drop) {
  absl::MutexLock lock(&mu_);
  for (;;) {  // until no member lacks its centroid (a dropped subtree may hold centroids)
    std::vector<TrieNode*> roots;
    absl::flat_hash_set<const TrieNode*> dropped;
    for (TrieNode* n : SubtreeLocked(trie_->root())) {  // parents before children
      if (n->depth == 0) continue;
      if (dropped.contains(n->parent)) {
        dropped.insert(n);
      } else if (n->reference_node_id != 0 && trie_->Find(n->reference_node_id) == nullptr) {
        roots.push_back(n);
        dropped.insert(n);
      }
    }
    if (roots.empty()) break;
    for (const TrieNode* n : dropped) drop->DeleteNode(shard_id_, n->id);
    stats->dropped_missing_parent += dropped.size();
    RemoveLocked(roots, DropReason::kDataLoss);
  }
  // Retained nodes nothing needs any more (a crash after the last dependent went, before the
  // sweep): leaves first.
  for (;;) {
    std::vector<TrieNode*> unused;
    for (uint64_t id : retained_ids_) {
      TrieNode* n = trie_->Find(id);
      if (n != nullptr && n->children.empty() && !clusters_.HasDependents(id)) unused.push_back(n);
    }
    if (unused.empty()) return;
    for (const TrieNode* n : unused) drop->DeleteNode(shard_id_, n->id);
    RemoveLocked(unused, DropReason::kDeleted);
  }
}

void ModelShard::Recover(uint64_t id, absl::StatusOr<NodeMeta> meta, const std::string* payload,
                         bool verified, RecoveryStats* stats, RecordBatch* drop) {
  absl::MutexLock lock(&mu_);
  next_id_ = std::max(next_id_, id + 1);
  TrieNode* parent = meta.ok() ? trie_->Find(meta->parent_id) : nullptr;
  if (!meta.ok() || parent == nullptr || meta->token_ids.size() != trie_->block_tokens() ||
      trie_->FindChild(parent, meta->token_ids) != nullptr) {
    ++stats->dropped_missing_parent;
    drop->DeleteNode(shard_id_, id);
    return;
  }
  if (meta->predictor_version != 0 && !predictors_->HasVersion(meta->predictor_version)) {
    // Its learned state is gone from disk: it can never be decoded.
    spdlog::warn("recovery: dropping node {} of '{}'/'{}': predictor state version {} is missing",
                 id, ns_, model_.model_id, meta->predictor_version);
    ++stats->dropped_bad_payload;
    drop->DeleteNode(shard_id_, id);
    return;
  }
  // With verified payloads, the bytes are parsed (CRC-checked); otherwise they are checked when
  // first read.
  std::shared_ptr<const std::string> hot;
  absl::Status bad;
  if (verified) {
    if (payload == nullptr) {
      bad = absl::DataLossError("payload missing");
    } else if (absl::StatusOr<BlockHeader> h = ParseBlock(*payload); !h.ok()) {
      bad = h.status();
    } else if (!(h->geometry == model_.geometry)) {
      bad = absl::DataLossError("geometry differs from the model");
    } else {
      meta->encoding = h->encoding;
      meta->bytes_stored = payload->size();
      hot = std::make_shared<const std::string>(*payload);
    }
  } else if (meta->bytes_stored == 0) {
    bad = absl::DataLossError("record has no payload");
  }
  if (!bad.ok()) {
    spdlog::warn("recovery: dropping node {} of '{}'/'{}': {}", id, ns_, model_.model_id,
                 std::string(bad.message()));
    ++stats->dropped_bad_payload;
    drop->DeleteNode(shard_id_, id);
    return;
  }
  TrieNode* n = PublishLocked(parent, id, *meta, std::move(hot));
  n->unverified = meta->error_client_reported && meta->encoding != Encoding::kRaw;
  ++stats->nodes;
}

// ---------------------------------------------------------------------------------------------
// Reads

MatchResult ModelShard::Match(absl::Span<const uint32_t> token_ids) {
  MatchResult result;
  absl::ReaderMutexLock lock(&mu_);  // reads only: Lookups of a shard run side by side
  if (!committed_) return result;
  result.block_tokens = model_.geometry.block_tokens;
  // One walk over the compressed edges: ids copied from the chains, stopping at a node being
  // removed.
  result.node_ids.reserve(token_ids.size() / model_.geometry.block_tokens);
  trie_->MatchIds(token_ids, 0, &result.node_ids);
  return result;
}

MatchResult ModelShard::Lookup(absl::Span<const uint32_t> token_ids) {
  lookups_.fetch_add(1, std::memory_order_relaxed);
  MatchResult result = Match(token_ids);
  if (!result.node_ids.empty()) lookup_hits_.fetch_add(1, std::memory_order_relaxed);
  return result;
}

GetResult ModelShard::Get(absl::Span<const uint32_t> token_ids, size_t max_blocks,
                          bool through_retained) {
  gets_.fetch_add(1, std::memory_order_relaxed);
  GetResult result;
  std::shared_ptr<PredictorRegistry> registry;
  {
    absl::MutexLock lock(&mu_);
    registry = predictors_;
    if (!committed_) return result;  // a miss, not an error
    result.model = model_;
    std::shared_ptr<const ReadSnapshot> snapshot;  // one for every cold block of this Get
    for (TrieNode* n : MatchLive(token_ids, max_blocks, through_retained)) {
      ++n->hits;
      context_->tiers->Touch(Ref(n->id));
      result.blocks.push_back(
          ListLocked(*n, result.blocks.empty() ? nullptr : &result.blocks.back(), &snapshot));
    }
  }
  if (registry->TakeFreeHint())
    learning_->ScheduleFreeUnusedPredictors();  // left by an earlier reader
  return result;
}

std::shared_ptr<PredictorRegistry> ModelShard::predictors() const {
  absl::MutexLock lock(&mu_);
  return predictors_;
}

BlockRead ModelShard::ListLocked(const TrieNode& n, const BlockRead* previous,
                                 std::shared_ptr<const ReadSnapshot>* snapshot) {
  BlockRead r;
  r.node_id = n.id;
  r.encoded = context_->tiers->HotCopy(Ref(n.id), &r.tier_generation);
  r.encoding = n.encoding;
  r.reference_node_id = n.reference_node_id;
  if (n.reference_node_id != 0) r.retired = retired_;
  if (!r.encoded) {
    if (!*snapshot) *snapshot = context_->records->Snapshot();
    r.snapshot = *snapshot;
  }
  r.predictor_version = n.predictor_version;
  if (previous != nullptr && previous->predictor_version == r.predictor_version) {
    r.predictor_hold = previous->predictor_hold;
  } else {
    r.predictor_hold = predictors_->Hold(r.predictor_version);  // under mu_: no gap
  }
  r.tokens.assign(n.token_ids.begin(), n.token_ids.end());
  r.first_position = n.depth == 0 ? 0 : (n.depth - 1) * model_.geometry.block_tokens;
  r.previous_token = n.parent != nullptr && !n.parent->token_ids.empty()
                         ? static_cast<int32_t>(n.parent->token_ids.back())
                         : -1;
  return r;
}

absl::Status ModelShard::DecodeNext(const BlockRead& block, const std::string& payload,
                                    DecodeChain* chain, absl::Span<uint8_t> out,
                                    bool* undecodable) {
  *undecodable = false;
  std::shared_ptr<const PredictorState> learned;
  if (block.predictor_version != 0) {
    absl::StatusOr<std::shared_ptr<const PredictorState>> state =
        predictors()->Find(block.predictor_version);
    if (absl::IsNotFound(state.status())) {  // not kept: a bug (a read holds what it names)
      return absl::NotFoundError(absl::StrCat("its learned predictor state version ",
                                              block.predictor_version, " is not kept"));
    }
    if (absl::IsDataLoss(state.status())) {  // failed its own check: dropped as a state
      return absl::DataLossError(absl::StrCat("its learned predictor state is unreadable: ",
                                              state.status().message(), "; the node is kept"));
    }
    if (!state.ok()) return state.status();
    learned = *std::move(state);
  }
  if (chain->first_position() != block.first_position ||
      chain->previous_token() != block.previous_token) {
    // The caller decodes a path from the middle (or skipped blocks): the chain follows the store.
    const std::vector<uint8_t> parent(chain->parent().begin(), chain->parent().end());
    chain->StartAt(block.first_position, block.previous_token, parent);
  }
  chain->AddPredictor(std::move(learned));
  // ReadPayloadInternal's bytes are verified: a hot copy was checked when it was made (encoded
  // here, or parsed when read from disk), a cold one was just parsed. So a DATA_LOSS here is not
  // of the bytes: they do not decode in this context.
  absl::Status s =
      chain->Next(payload, block.reference_node_id, out, block.tokens, /*verified=*/true);
  if (absl::IsDataLoss(s)) {
    *undecodable = true;
    return absl::InternalError(
        absl::StrCat("it passes its checksum but does not decode: ", s.message()));
  }
  return s;
}

absl::Status ModelShard::ReadPayloadInternal(const BlockRead& block,
                                             std::shared_ptr<const std::string>* out,
                                             std::vector<Corrupt>* corrupt) {
  if (block.encoded) {
    *out = block.encoded;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> value =
      context_->records->ReadPayload(shard_id_, block.node_id, block.snapshot.get());
  absl::Status bad;
  if (absl::IsNotFound(value.status())) {
    absl::MutexLock lock(&mu_);
    if (FindLive(block.node_id) == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("node_id: ", block.node_id, " was deleted while it was read"));
    }
    bad = value.status();
  } else if (IsBadPayloadBytes(value.status())) {
    bad = value.status();
  } else if (!value.ok()) {
    // RocksDB's own files failed (or I/O): the payload may be good; refuse, drop nothing.
    return absl::Status(value.status().code(),
                        absl::StrCat(value.status().message(), " (nothing was dropped)"));
  } else if (absl::StatusOr<BlockHeader> h = ParseBlock(*value); !h.ok()) {
    bad = h.status();
  }
  // The payload's own bytes are bad (or gone from RocksDB while the node is live): the only case
  // in which a read drops data.
  if (!bad.ok()) {
    corrupt->push_back({block.node_id, std::string(bad.message())});
    return absl::DataLossError(absl::StrCat("node ", block.node_id, ": ", bad.message(),
                                            "; the node and its subtree were dropped"));
  }
  auto payload = std::make_shared<const std::string>(*std::move(value));
  context_->tiers->ColdRead(Ref(block.node_id), payload, block.tier_generation);
  *out = std::move(payload);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const std::string>> ModelShard::ReadPayload(const BlockRead& block) {
  std::vector<Corrupt> corrupt;
  std::shared_ptr<const std::string> payload;
  absl::Status s = ReadPayloadInternal(block, &payload, &corrupt);
  DropCorrupt(corrupt);
  if (!s.ok()) return s;
  return payload;
}

absl::Status ModelShard::NotDecodable(const BlockRead& block, absl::string_view why,
                                      std::vector<Corrupt>* corrupt) {
  bool changed = false;
  {
    absl::MutexLock lock(&mu_);
    const TrieNode* n = FindLive(block.node_id);
    changed = n == nullptr || n->encoding != block.encoding ||
              n->reference_node_id != block.reference_node_id ||
              n->predictor_version != block.predictor_version;
  }
  if (changed) {
    return absl::AbortedError(absl::StrCat("node ", block.node_id, " changed while it was read (",
                                           why, "); read it again"));
  }
  if (corrupt != nullptr) {  // its own bytes: dropped as a checksum failure is (issue 30)
    corrupt->push_back({block.node_id, absl::StrCat("it does not decode: ", why)});
    return absl::DataLossError(
        absl::StrCat("node ", block.node_id, ": ", why, "; the node and its subtree were dropped"));
  }
  spdlog::error("node {} of '{}'/'{}' can not be decoded, nothing was dropped: {}", block.node_id,
                ns_, model_.model_id, std::string(why));
  return absl::InternalError(
      absl::StrCat("node ", block.node_id, ": ", why, " (nothing was dropped)"));
}

absl::Status ModelShard::ReadAndDecodeInternal(const BlockRead& block, DecodeChain* chain,
                                               absl::Span<uint8_t> out,
                                               std::vector<Corrupt>* corrupt) {
  std::shared_ptr<const std::string> payload;
  if (auto s = ReadPayloadInternal(block, &payload, corrupt); !s.ok()) return s;
  return DecodeInternal(block, *payload, chain, out, corrupt);
}

absl::Status ModelShard::DecodeInternal(const BlockRead& block, const std::string& payload,
                                        DecodeChain* chain, absl::Span<uint8_t> out,
                                        std::vector<Corrupt>* corrupt) {
  // A re-election writes a member's new encoding (against another centroid) before it publishes
  // it: a cold read listed in between has the old listing and the new bytes. Read it again.
  if (absl::StatusOr<BlockHeader> h = ParseVerifiedBlock(payload);
      h.ok() && h->reference_node_id != block.reference_node_id) {
    return absl::AbortedError(absl::StrCat("node ", block.node_id,
                                           " was re-encoded while it was read (its bytes name "
                                           "centroid ",
                                           h->reference_node_id, ", its listing ",
                                           block.reference_node_id, "); read it again"));
  }
  // The centroid and, for one used at a position offset, its parent (codec/reference_shift.h).
  const uint64_t needed[2] = {block.reference_node_id,
                              DecodeChain::ReferenceParentOf(payload, block.reference_node_id,
                                                             /*verified=*/true)};
  if (needed[1] != 0) {  // it must be the centroid's parent in the trie
    std::string why;
    {
      absl::MutexLock lock(&mu_);
      const TrieNode* c = FindLive(needed[0]);
      if (c != nullptr && (c->parent == nullptr || c->parent->id != needed[1])) {
        why = absl::StrCat("it names node ", needed[1], " as the parent of its centroid ",
                           needed[0], ", whose parent is ", c->parent ? c->parent->id : 0);
      }
    }
    if (!why.empty()) return NotDecodable(block, why);
  }
  if (needed[0] != 0) chain->ReserveReferences(2);
  for (const uint64_t ref_id : needed) {
    if (ref_id == 0 || chain->HasReference(ref_id)) continue;
    std::vector<uint8_t> reference(out.size());
    const size_t corrupt_before = corrupt->size();
    absl::Status s = ReconstructInternal(ref_id, absl::MakeSpan(reference), corrupt);
    if (absl::IsAborted(s) && block.retired != nullptr) {  // deleted after the block was listed
      if (const std::vector<uint8_t>* kept = block.retired->Find(ref_id)) {
        chain->AddReference(ref_id, *kept);
        continue;
      }
    }
    if (!s.ok()) {
      // The centroid (or what it is decoded from) failed its own check: it is dropped, and this
      // block, which can not be decoded without it, is DATA_LOSS but kept (only bytes that fail
      // their own check are dropped). A centroid dropped so earlier counts the same.
      bool lost = corrupt->size() > corrupt_before || absl::IsDataLoss(s);
      {
        absl::MutexLock lock(&mu_);
        if (corrupt->size() > corrupt_before) corrupt_centroids_.insert(ref_id);
        lost = lost || corrupt_centroids_.contains(ref_id);
      }
      if (lost) {
        return absl::DataLossError(absl::StrCat("node ", block.node_id, ": its centroid ", ref_id,
                                                " can not be read (", s.message(),
                                                "); the node is kept"));
      }
      // Gone (deleted after this Get listed the block, which a Delete re-encoded first), or a
      // bug: list again, or fail naming it.
      return NotDecodable(block,
                          absl::StrCat("its centroid ", ref_id, " is missing (", s.message(), ")"));
    }
    chain->AddReference(ref_id, reference);
  }
  bool undecodable = false;
  absl::Status s = DecodeNext(block, payload, chain, out, &undecodable);
  // The bytes passed their checksum but do not decode (a client may encode anything that passes
  // the structure check): DATA_LOSS, and dropped unless the node changed while it was read.
  if (undecodable) return NotDecodable(block, s.message(), corrupt);
  // The state it names is not kept, or another failure: an inconsistency or a race, never a
  // reason to delete it. (DATA_LOSS: its state failed its own check; the block is kept.)
  if (absl::IsNotFound(s) || absl::IsInternal(s)) return NotDecodable(block, s.message());
  return s;
}

absl::Status ModelShard::ReadAndDecodeBlock(const BlockRead& block, DecodeChain* chain,
                                            absl::Span<uint8_t> out) {
  std::vector<Corrupt> corrupt;
  absl::Status s = ReadAndDecodeInternal(block, chain, out, &corrupt);
  DropCorrupt(corrupt);
  return s;
}

absl::Status ModelShard::DecodeReadBlock(const BlockRead& block, const std::string& payload,
                                         DecodeChain* chain, absl::Span<uint8_t> out) {
  std::vector<Corrupt> corrupt;
  absl::Status s = DecodeInternal(block, payload, chain, out, &corrupt);
  DropCorrupt(corrupt);
  return s;
}

absl::Status ModelShard::ReconstructInternal(uint64_t node_id, absl::Span<uint8_t> out,
                                             std::vector<Corrupt>* corrupt) {
  // The node's ancestors, root first, up to the nearest one that needs no parent context.
  std::vector<BlockRead> path;
  BlockGeometry g;
  {
    absl::MutexLock lock(&mu_);
    TrieNode* n = FindLive(node_id);
    if (n == nullptr) {
      return absl::AbortedError(absl::StrCat("node ", node_id, " is gone (prefix changed)"));
    }
    g = model_.geometry;
    std::shared_ptr<const ReadSnapshot> snapshot;
    for (; n != nullptr && n->depth > 0; n = n->parent) {
      path.push_back(ListLocked(*n, path.empty() ? nullptr : &path.back(), &snapshot));
      if (n->encoding == Encoding::kRaw || n->encoding == Encoding::kLossless) break;
    }
  }
  std::reverse(path.begin(), path.end());
  DecodeChain chain(g, nullptr);  // references are fetched by ReadAndDecodeInternal
  if (!path.empty()) chain.StartAt(path[0].first_position, path[0].previous_token);
  for (const BlockRead& b : path) {
    if (auto s = ReadAndDecodeInternal(b, &chain, out, corrupt); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ModelShard::ReconstructNode(uint64_t node_id, absl::Span<uint8_t> out) {
  std::vector<Corrupt> corrupt;
  absl::Status s = ReconstructInternal(node_id, out, &corrupt);
  DropCorrupt(corrupt);
  return s;
}

absl::StatusOr<std::vector<uint32_t>> ModelShard::PathTokens(uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<TrieNode*> node = FindNodeOrNotFound(node_id);
  if (!node.ok()) return node.status();
  const TrieNode* n = *node;
  const size_t bt = trie_->block_tokens();
  std::vector<uint32_t> tokens(static_cast<size_t>(n->depth) * bt);
  for (; n->depth > 0; n = n->parent) {
    std::copy(n->token_ids.begin(), n->token_ids.end(),
              tokens.begin() + static_cast<ptrdiff_t>((n->depth - 1) * bt));
  }
  return tokens;
}

void ModelShard::ClusterViewLocked(const TrieNode& node, NodeView* view) {
  view->reference_node_id = node.reference_node_id;
  view->dependents = static_cast<uint32_t>(clusters_.NumDependents(node.id));
  if (node.reference_node_id != 0) {
    if (const TrieNode* c = trie_->Find(node.reference_node_id)) {
      view->distance_to_reference_bits = TrieDistanceBits(&node, c);
    }
  }
}

absl::StatusOr<InspectResult> ModelShard::Inspect(uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<TrieNode*> node = FindNodeOrNotFound(node_id);
  if (!node.ok()) return node.status();
  TrieNode* n = *node;
  InspectResult r;
  r.model = model_;
  r.node = ToView(*n);
  ClusterViewLocked(*n, &r.node);
  r.predictors = predictors_->Versions();
  for (const auto& [h, bucket] : n->children) {
    for (const TrieNode* c : bucket) {
      if (c->removing) continue;
      r.children.push_back(ToView(*c));
      ClusterViewLocked(*c, &r.children.back());
    }
  }
  std::sort(r.children.begin(), r.children.end(),
            [](const NodeView& a, const NodeView& b) { return a.node_id < b.node_id; });
  return r;
}

absl::StatusOr<double> ModelShard::TrieDistance(uint64_t a, uint64_t b) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<TrieNode*> na = FindNodeOrNotFound(a);
  if (!na.ok()) return na.status();
  absl::StatusOr<TrieNode*> nb = FindNodeOrNotFound(b);
  if (!nb.ok()) return nb.status();
  return TrieDistanceBits(*na, *nb);
}

bool ModelShard::HasDependents(uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  return clusters_.HasDependents(node_id);
}

void ModelShard::AddTotalsLocked(StoreStats* s) {
  ++s->models;
  s->nodes += trie_->num_nodes();
  s->bytes_logical += bytes_logical_;
  s->bytes_stored += bytes_stored_;
  s->elements += trie_->num_nodes() * model_.geometry.num_elements();
  for (size_t d = nodes_at_depth_.size(); d-- > 1;) {
    if (nodes_at_depth_[d] != 0) {
      s->max_depth = std::max<uint64_t>(s->max_depth, d);
      break;
    }
  }
  s->lossy_nodes += lossy_nodes_;
  s->lossy_recoded_nodes += lossy_recoded_nodes_;
  s->retained_nodes += retained_ids_.size();
  for (uint64_t id : retained_ids_) {
    if (const TrieNode* n = trie_->Find(id)) s->retained_bytes += n->bytes_stored;
  }
  s->client_reported_error_nodes += client_reported_nodes_;
  s->sum_rel_rms_error_k += sum_rel_rms_k_;
  s->sum_rel_rms_error_v += sum_rel_rms_v_;
  if (!lossy_errors_.empty()) {
    s->max_rel_rms_error = std::max<double>(s->max_rel_rms_error, lossy_errors_.rbegin()->first);
  }
  clusters_.AddStats(trie_.get(), &s->cluster);
  predictors_->AddStats(s);
}

void ModelShard::AddStats(StoreStats* s) {
  {
    absl::MutexLock lock(&mu_);
    if (committed_) AddTotalsLocked(s);
  }
  const TierManager::Counters t = context_->tiers->CountersOf(this);
  s->hot_nodes += t.hot_nodes;
  s->hot_bytes += t.hot_bytes;
  s->cold_nodes += t.nodes - t.hot_nodes;
  s->cold_bytes += t.disk_bytes - t.hot_bytes;
  s->disk_bytes += t.disk_bytes;
  s->pinned_nodes += t.pinned_nodes;
  s->demotions += t.demotions;
  s->demoted_bytes += t.demoted_bytes;
  s->promotions += t.promotions;
  s->cold_reads += t.cold_reads;
  s->cold_read_bytes += t.cold_read_bytes;
  s->pins_expired += t.pins_expired;
  s->puts_rejected_disk_full += t.puts_rejected_disk_full;
  const auto get = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  s->blocks_stored += get(blocks_stored_);
  s->blocks_deduplicated += get(blocks_deduplicated_);
  s->lookups += get(lookups_);
  s->lookup_hits += get(lookup_hits_);
  s->gets += get(gets_);
  s->puts += get(puts_);
  s->deletes += get(deletes_);
  s->evictions_disk += get(evictions_disk_);
  s->evicted_bytes += get(evicted_bytes_);
  s->evictions_data_loss += get(evictions_data_loss_);
  s->evictions_deleted += get(evictions_deleted_);
  s->centroids_reelected += get(centroids_reelected_);
  s->cluster_pass_recoded += get(cluster_pass_recoded_);
  s->cluster_pass_bytes_saved += get(cluster_pass_bytes_saved_);
  s->cluster_pass_reelected += get(cluster_pass_reelected_);
}

}  // namespace kvtrie
