// KvStore: near-duplicate clusters (see trie/cluster_index.h and the cluster section of
// kv_store.h). Encoding a Put's new block against a centroid, re-encoding a centroid's dependents
// before it leaves, trie distance and the cluster part of Stats and Inspect.
#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "trie/kv_store.h"
#include "trie/store_records.pb.h"

namespace kvtrie {
namespace {

std::string ClusterNodeKey(uint64_t id) {
  std::string k(8, '\0');
  for (int i = 0; i < 8; ++i) k[i] = static_cast<char>((id >> (56 - 8 * i)) & 0xff);
  return k;
}

bool Clusterable(Encoding e) { return e == Encoding::kLossless || e == Encoding::kResidual; }

}  // namespace

// The tiered store keeps a centroid while TierState::dependents > 0 (never evictable).
void KvStore::ClusterAddLocked(Model* model, TrieNode* node) {
  model->clusters.Add(*node);
  if (node->reference_node_id == 0) return;
  if (TrieNode* c = model->trie->Find(node->reference_node_id)) {
    ++c->tier.dependents;
    evict_queue_.SetMember(c, model, Evictable(*c));
  }
}

void KvStore::ClusterRemoveLocked(Model* model, const TrieNode& node) {
  model->clusters.Remove(node);
  if (node.reference_node_id == 0) return;
  TrieNode* c = model->trie->Find(node.reference_node_id);
  if (c != nullptr && c->tier.dependents > 0) {
    --c->tier.dependents;
    evict_queue_.SetMember(c, model, Evictable(*c));
  }
}

absl::Status KvStore::ReleaseDependentsOfPrefix(const std::string& ns, const std::string& model_id,
                                                absl::Span<const uint32_t> token_ids) {
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    Model* m = FindModel(ns, model_id);
    if (m == nullptr) return absl::OkStatus();  // Delete reports it
    std::vector<TrieNode*> path = m->trie->Match(token_ids);
    if (path.empty() || path.size() * m->info.geometry.block_tokens != token_ids.size()) {
      return absl::OkStatus();
    }
    id = path.back()->id;
  }
  return ReleaseDependents(ns, model_id, id);
}

bool KvStore::SubtreeHasOutsideDependentsLocked(Model* model, TrieNode* root) {
  std::vector<TrieNode*> stack = {root};
  while (!stack.empty()) {
    TrieNode* n = stack.back();
    stack.pop_back();
    for (uint64_t d : model->clusters.Dependents(n->id)) {
      const TrieNode* a = model->trie->Find(d);
      while (a != nullptr && a != root) a = a->parent;
      if (a == nullptr) return true;
    }
    for (const auto& [h, bucket] : n->children)
      stack.insert(stack.end(), bucket.begin(), bucket.end());
  }
  return false;
}

absl::StatusOr<KvStore::NearDupEncoded> KvStore::EncodeNewBlock(
    const std::string& ns, const ModelInfo& model, uint64_t anchor_id, uint32_t block_index,
    absl::Span<const uint32_t> token_ids, absl::Span<const float> surprisal_bits,
    absl::Span<const uint8_t> kv, const EncodeOptions& options, const PredictionContext& context) {
  const BlockGeometry& g = model.geometry;
  const uint32_t bt = g.block_tokens;
  NearDupEncoded out;
  absl::StatusOr<EncodedBlock> standalone = EncodeBlock(g, kv, options, context);
  if (!standalone.ok()) return standalone.status();
  out.encoded = *std::move(standalone);
  const NearDupOptions& nd = options_.near_dup;
  if (!nd.enabled || !Clusterable(options.encoding)) return out;

  std::vector<ClusterIndex::Candidate> candidates;
  {
    absl::MutexLock lock(&mu_);
    Model* m = FindModel(ns, model.model_id);
    TrieNode* anchor = m ? m->trie->Find(anchor_id) : nullptr;
    if (anchor == nullptr) return out;  // changed concurrently: CommitBlocks will retry
    double path = anchor->path_surprisal_bits;
    for (size_t i = static_cast<size_t>(anchor->depth) * bt;
         i < static_cast<size_t>(block_index + 1) * bt && i < surprisal_bits.size(); ++i) {
      path += surprisal_bits[i];
    }
    candidates =
        m->clusters.FindCandidates(m->trie.get(), anchor, block_index + 1,
                                   token_ids.subspan(static_cast<size_t>(block_index) * bt, bt),
                                   path, nd.max_distance_bits, nd.max_candidates);
    m->clusters.CountTried(candidates.size());
  }
  if (candidates.empty()) return out;

  bool found = false;
  std::vector<uint8_t> reference(g.num_bytes());
  for (const ClusterIndex::Candidate& c : candidates) {
    absl::Status s = ReconstructNode(ns, model.model_id, c.node_id, absl::MakeSpan(reference));
    if (!s.ok()) continue;  // gone meanwhile: not a candidate any more
    PredictionContext ctx = context;
    ctx.reference = reference;
    EncodeOptions o = options;
    o.reference_node_id = c.node_id;
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, kv, o, ctx);
    if (!e.ok()) return e.status();
    absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
    if (!h.ok() || h->reference_node_id != c.node_id) continue;  // did not use the centroid
    if (e->bytes.size() < out.encoded.bytes.size()) {
      out.encoded = *std::move(e);
      out.reference_node_id = c.node_id;
      out.reference = reference;
      found = true;
    }
  }
  if (!found) {
    absl::MutexLock lock(&mu_);
    if (Model* m = FindModel(ns, model.model_id)) m->clusters.CountNotSmaller();
  }
  return out;
}

bool KvStore::HasDependents(const std::string& ns, const std::string& model_id, uint64_t node_id) {
  absl::MutexLock lock(&mu_);
  Model* m = FindModel(ns, model_id);
  return m != nullptr && m->clusters.HasDependents(node_id);
}

absl::StatusOr<double> KvStore::TrieDistance(const std::string& ns, const std::string& model_id,
                                             uint64_t a, uint64_t b) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Model*> found = FindModelOrNotFound(ns, model_id);
  if (!found.ok()) return found.status();
  Model* m = *found;
  absl::StatusOr<TrieNode*> na = FindNodeOrNotFound(m, ns, a);
  if (!na.ok()) return na.status();
  absl::StatusOr<TrieNode*> nb = FindNodeOrNotFound(m, ns, b);
  if (!nb.ok()) return nb.status();
  return TrieDistanceBits(*na, *nb);
}

void KvStore::ClusterViewLocked(Model* model, const TrieNode& node, NodeView* view) {
  view->reference_node_id = node.reference_node_id;
  view->dependents = static_cast<uint32_t>(model->clusters.NumDependents(node.id));
  if (node.reference_node_id != 0) {
    if (const TrieNode* c = model->trie->Find(node.reference_node_id)) {
      view->distance_to_reference_bits = TrieDistanceBits(&node, c);
    }
  }
}

void KvStore::ClusterStatsLocked(const Model& model, ClusterStats* out) {
  model.clusters.AddStats(model.trie.get(), out);
}

absl::Status KvStore::ReleaseDependents(const std::string& ns, const std::string& model_id,
                                        uint64_t node_id) {
  constexpr int kAttempts = 4;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    // Dependents outside node_id's subtree of any node inside it, parents first.
    std::vector<uint64_t> outside;
    BlockGeometry g;
    {
      absl::MutexLock lock(&mu_);
      Model* m = FindModel(ns, model_id);
      TrieNode* root = m ? m->trie->Find(node_id) : nullptr;
      if (root == nullptr) return absl::OkStatus();  // nothing left to protect
      g = m->info.geometry;
      std::vector<TrieNode*> stack = {root};
      while (!stack.empty()) {
        TrieNode* n = stack.back();
        stack.pop_back();
        for (uint64_t d : m->clusters.Dependents(n->id)) {
          const TrieNode* dn = m->trie->Find(d);
          if (dn == nullptr) continue;
          const TrieNode* a = dn;
          while (a != nullptr && a != root) a = a->parent;
          if (a == nullptr) outside.push_back(d);
        }
        for (const auto& [h, bucket] : n->children)
          stack.insert(stack.end(), bucket.begin(), bucket.end());
      }
    }
    if (outside.empty()) return absl::OkStatus();
    std::sort(outside.begin(), outside.end());  // ids grow with depth along a path
    for (uint64_t d : outside) {
      // Store the dependent's exact current reconstruction bit-exact and standalone: every value
      // a reader gets (and every descendant's prediction context) stays the same, so the error
      // target it met still holds and nothing below it needs re-encoding.
      std::vector<uint8_t> recon(g.num_bytes());
      absl::Status s = ReconstructNode(ns, model_id, d, absl::MakeSpan(recon));
      if (absl::IsAborted(s)) continue;  // deleted meanwhile
      if (!s.ok()) return s;
      absl::StatusOr<EncodedBlock> e = EncodeBlock(g, recon, {.encoding = Encoding::kLossless});
      if (!e.ok()) return e.status();
      if (auto st = ReplaceEncodingOf(ns, model_id, d, *e, Encoding::kLossless); !st.ok()) {
        return st;
      }
    }
  }
  return absl::AbortedError(
      absl::StrCat("node_id: ", node_id, " kept gaining near-duplicate dependents; retry"));
}

absl::Status KvStore::ReplaceEncodingOf(const std::string& ns, const std::string& model_id,
                                        uint64_t node_id, const EncodedBlock& encoded,
                                        Encoding encoding) {
  absl::MutexLock lock(&mu_);
  Model* m = FindModel(ns, model_id);
  TrieNode* n = m ? m->trie->Find(node_id) : nullptr;
  if (n == nullptr) return absl::OkStatus();  // deleted meanwhile
  const std::string key = ClusterNodeKey(node_id);
  std::string record;
  rocksdb::Status rs = db_->Get(rocksdb::ReadOptions(), cf_nodes_, key, &record);
  internal::NodeRecord r;
  if (!rs.ok() || !r.ParseFromString(record)) {
    return absl::InternalError(
        absl::StrCat("node ", node_id, ": cannot read its record: ", rs.ToString()));
  }
  r.set_encoding(static_cast<uint32_t>(encoding));
  r.set_bytes_stored(encoded.bytes.size());
  r.set_reference_node_id(0);
  rocksdb::WriteBatch batch;
  batch.Put(cf_nodes_, key, r.SerializeAsString());
  batch.Put(cf_payloads_, key, encoded.bytes);
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync;
  rs = db_->Write(wo, &batch);
  if (!rs.ok()) return absl::UnavailableError(absl::StrCat("re-encode: ", rs.ToString()));
  ClusterRemoveLocked(m, *n);
  m->bytes_stored = m->bytes_stored - n->bytes_stored + encoded.bytes.size();
  disk_bytes_ = disk_bytes_ - n->bytes_stored + encoded.bytes.size();
  if (n->encoded) {  // hot: swap the in-memory copy; cold: RocksDB already has the new one
    hot_bytes_ = hot_bytes_ - n->encoded->size() + encoded.bytes.size();
    n->encoded = std::make_shared<const std::string>(encoded.bytes);
  }
  n->bytes_stored = encoded.bytes.size();
  n->encoding = encoding;
  n->reference_node_id = 0;
  ClusterAddLocked(m, n);
  return absl::OkStatus();
}

}  // namespace kvtrie
