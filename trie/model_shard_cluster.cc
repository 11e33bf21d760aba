// ModelShard: near-duplicate clusters (trie/cluster_index.h). Encoding a Put's new block
// against a centroid, re-encoding a centroid's dependents before it leaves, and the cluster part
// of Inspect.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "trie/model_shard.h"

namespace kvtrie {
namespace {

bool Clusterable(Encoding e) { return e == Encoding::kLossless || e == Encoding::kResidual; }

}  // namespace

bool ModelShard::SubtreeHasOutsideDependentsLocked(TrieNode* root) {
  for (TrieNode* n : SubtreeLocked(root)) {
    for (uint64_t d : clusters_.Dependents(n->id)) {
      const TrieNode* a = trie_->Find(d);
      while (a != nullptr && a != root) a = a->parent;
      if (a == nullptr) return true;
    }
  }
  return false;
}

absl::StatusOr<ModelShard::NearDupEncoded> ModelShard::EncodeNewBlock(
    const ModelInfo& model, uint64_t anchor_id, uint32_t block_index,
    absl::Span<const uint32_t> token_ids, absl::Span<const float> surprisal_bits,
    absl::Span<const uint8_t> kv, const EncodeOptions& options, const PredictionContext& context) {
  const BlockGeometry& g = model.geometry;
  const uint32_t bt = g.block_tokens;
  NearDupEncoded out;
  absl::StatusOr<EncodedBlock> standalone = EncodeBlock(g, kv, options, context);
  if (!standalone.ok()) return standalone.status();
  out.encoded = *std::move(standalone);
  const NearDupOptions& nd = context_->options->near_dup;
  // The fast profile ignores a reference context: no candidate could be smaller.
  if (!nd.enabled || !Clusterable(options.encoding) || options.profile == Profile::kFast) {
    return out;
  }

  std::vector<ClusterIndex::Candidate> candidates;
  {
    absl::MutexLock lock(&mu_);
    if (!committed_) return out;
    TrieNode* anchor = anchor_id == 0 ? trie_->root() : FindLive(anchor_id);
    if (anchor == nullptr) return out;  // changed concurrently: Commit will retry
    double path = anchor->path_surprisal_bits;
    for (size_t i = static_cast<size_t>(anchor->depth) * bt;
         i < static_cast<size_t>(block_index + 1) * bt && i < surprisal_bits.size(); ++i) {
      path += surprisal_bits[i];
    }
    candidates =
        clusters_.FindCandidates(trie_.get(), anchor, block_index + 1,
                                 token_ids.subspan(static_cast<size_t>(block_index) * bt, bt), path,
                                 nd.max_distance_bits, nd.max_candidates);
    if (!nd.position_shifted && !candidates.empty() && candidates.front().shifted) {
      clusters_.CountShifted(false);
      candidates.clear();
    }
    clusters_.CountTried(candidates.size());
  }
  if (candidates.empty()) return out;

  bool found = false;
  std::vector<uint8_t> reference(g.num_bytes());
  std::vector<uint8_t> reference_parent;
  for (const ClusterIndex::Candidate& c : candidates) {
    absl::Status s = ReconstructNode(c.node_id, absl::MakeSpan(reference));
    if (!s.ok()) continue;  // gone meanwhile: not a candidate any more
    PredictionContext ctx = context;
    ctx.reference = reference;
    EncodeOptions o = options;
    o.reference_node_id = c.node_id;
    if (c.shifted) {  // the centroid's window at a position offset (codec/reference_shift.h)
      reference_parent.resize(g.num_bytes());
      if (c.reference_parent_id != 0 &&
          !ReconstructNode(c.reference_parent_id, absl::MakeSpan(reference_parent)).ok()) {
        continue;
      }
      ctx.reference_parent = reference_parent;
      o.reference_shift = {.enabled = true,
                           .token_shift = c.token_shift,
                           .rotation = c.rotation,
                           .log_rope_base = -1,  // detected from the block and the window
                           .reference_parent_node_id = c.reference_parent_id,
                           .tail = c.tail};
    }
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, kv, o, ctx);
    if (!e.ok()) return e.status();
    absl::StatusOr<BlockHeader> h = ParseBlock(e->bytes);
    if (!h.ok() || h->reference_node_id != c.node_id) continue;  // did not use the centroid
    if (e->bytes.size() < out.encoded.bytes.size()) {
      out.encoded = *std::move(e);
      out.reference_node_id = c.node_id;
      out.reference = reference;
      out.reference_parent_id = h->reference_shift.reference_parent_node_id;
      out.reference_parent = out.reference_parent_id ? reference_parent : std::vector<uint8_t>();
      found = true;
    }
  }
  absl::MutexLock lock(&mu_);
  if (!found) clusters_.CountNotSmaller();
  if (candidates.front().shifted) clusters_.CountShifted(found);
  return out;
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

bool ModelShard::RetireReferencesLocked(uint64_t node_id) {
  std::vector<uint64_t> ids;
  std::shared_ptr<RetiredReferences> epoch;
  BlockGeometry g;
  {
    absl::MutexLock lock(&mu_);
    TrieNode* root = FindLive(node_id);
    // Only reads listed in this epoch can need them; none holds it (but this shard): nothing to do.
    if (root == nullptr || retired_.use_count() <= 1) return false;
    epoch = retired_;
    g = model_.geometry;
    for (TrieNode* n : SubtreeLocked(root)) {
      if (!clusters_.HasDependents(n->id)) continue;
      ids.push_back(n->id);
      // A member coded against it at a position offset also needs its parent (reference_shift.h);
      // the root's parent stays.
      if (n != root && n->parent != nullptr) ids.push_back(n->parent->id);
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  // Bounded: dense blocks held by slow readers must not take the memory a budget promises.
  ids.resize(std::min<size_t>(ids.size(), kMaxRetiredBytes / std::max<size_t>(g.num_bytes(), 1)));
  bool added = false;
  for (uint64_t id : ids) {
    std::vector<uint8_t> block(g.num_bytes());
    std::vector<Corrupt> corrupt;  // the subtree goes anyway: nothing to drop
    if (!ReconstructInternal(id, absl::MakeSpan(block), &corrupt).ok()) continue;
    epoch->Add(id, std::move(block));
    added = true;
  }
  return added;
}

absl::Status ModelShard::ReleaseDependentsLocked(uint64_t node_id, DeleteSummary* summary) {
  // Dependents outside node_id's subtree of any node inside it, parents first.
  std::vector<uint64_t> outside;
  BlockGeometry g;
  {
    absl::MutexLock lock(&mu_);
    TrieNode* root = FindLive(node_id);
    if (root == nullptr) return absl::OkStatus();  // nothing left to protect
    g = model_.geometry;
    for (TrieNode* n : SubtreeLocked(root)) {
      for (uint64_t d : clusters_.Dependents(n->id)) {
        const TrieNode* dn = FindLive(d);
        if (dn == nullptr) continue;
        const TrieNode* a = dn;
        while (a != nullptr && a != root) a = a->parent;
        if (a == nullptr) outside.push_back(d);
      }
    }
  }
  std::sort(outside.begin(), outside.end());  // ids grow with depth along a path
  for (uint64_t d : outside) {
    // Store the dependent's exact current reconstruction bit-exact and standalone: every value a
    // reader gets (and every descendant's prediction context) stays the same, so the error
    // target it met still holds and nothing below it needs re-encoding. The learned state it was
    // coded against loses a dependent only once the new encoding is published, and stays while
    // a reader that listed the old encoding holds it (PredictorRegistry::Hold).
    std::vector<uint8_t> recon(g.num_bytes());
    std::vector<Corrupt> corrupt;
    absl::Status s = ReconstructInternal(d, absl::MakeSpan(recon), &corrupt);
    DropCorruptLocked(corrupt);
    if (absl::IsAborted(s)) continue;  // dropped meanwhile
    if (!s.ok()) return s;
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, recon, {.encoding = Encoding::kLossless});
    if (!e.ok()) return e.status();
    uint64_t replaced = 0;
    if (auto st = ReplaceEncodingLocked(d, *e, Encoding::kLossless, &replaced); !st.ok()) {
      return st;
    }
    if (replaced == 0) continue;  // deleted meanwhile
    summary->bytes_freed += replaced;
    summary->bytes_rewritten += e->bytes.size();
    ++summary->nodes_rewritten;
  }
  return absl::OkStatus();
}

absl::Status ModelShard::ReplaceEncodingLocked(uint64_t node_id, const EncodedBlock& encoded,
                                               Encoding encoding, uint64_t* replaced_bytes) {
  *replaced_bytes = 0;
  RecordBatch batch(context_->records);
  {
    absl::MutexLock lock(&mu_);
    TrieNode* n = FindLive(node_id);
    if (n == nullptr) return absl::OkStatus();  // deleted meanwhile
    NodeMeta m = MetaOf(*n);
    m.encoding = encoding;
    m.bytes_stored = encoded.bytes.size();
    m.rel_rms_error_k = n->rel_rms_error_k;
    m.rel_rms_error_v = n->rel_rms_error_v;
    m.reference_node_id = 0;
    m.predictor_version = 0;  // re-encoded standalone and bit-exact
    batch.PutNode(shard_id_, node_id, m, &encoded.bytes);
  }
  // The disk budget may be passed by the growth of a re-encoded block until the Delete that
  // asked for it frees its subtree (and the background pass evicts).
  if (auto s = context_->records->Write(batch); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  TrieNode* n = trie_->Find(node_id);  // write_mu_: still there
  const uint64_t old_centroid = n->reference_node_id;
  *replaced_bytes = n->bytes_stored;
  clusters_.Remove(*n);
  CountNodeLocked(*n, -1);
  n->bytes_stored = encoded.bytes.size();
  n->encoding = encoding;
  n->reference_node_id = 0;
  predictors_->AddDependent(n->predictor_version, -1);
  n->predictor_version = 0;
  CountNodeLocked(*n, +1);
  clusters_.Add(*n);
  // Hot copy swapped (making room like a Put: the memory bound holds); disk bytes follow.
  context_->tiers->Replace(Ref(node_id), std::make_shared<const std::string>(encoded.bytes));
  UpdateEvictableLocked(FindLive(old_centroid));
  return absl::OkStatus();
}

}  // namespace kvtrie
