// ModelShard: near-duplicate clusters (trie/cluster_index.h). Encoding a Put's new block
// against a centroid, re-encoding a centroid's dependents before it leaves, and the cluster part
// of Inspect.
#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "trie/model_shard.h"

namespace kvtrie {
namespace {

bool Clusterable(Encoding e) { return e == Encoding::kLossless || e == Encoding::kResidual; }

}  // namespace

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
  // FP8 / uint8 blocks are never coded against a centroid (the cluster pass skips them too).
  if (!nd.enabled || !Clusterable(options.encoding) || options.profile == Profile::kFast ||
      IsByteDType(g.dtype)) {
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

  absl::StatusOr<bool> found =
      EncodeAgainstCandidates(g, kv, options, context, candidates, &out, nullptr);
  if (!found.ok()) return found.status();
  absl::MutexLock lock(&mu_);
  if (!*found) clusters_.CountNotSmaller();
  if (candidates.front().shifted) clusters_.CountShifted(*found);
  return out;
}

absl::StatusOr<bool> ModelShard::EncodeAgainstCandidates(
    const BlockGeometry& g, absl::Span<const uint8_t> kv, const EncodeOptions& options,
    const PredictionContext& context, const std::vector<ClusterIndex::Candidate>& candidates,
    NearDupEncoded* out, std::vector<Corrupt>* corrupt) {
  // With write_mu_ held (corrupt set) a bad block is left for the caller to drop.
  const auto reconstruct = [&](uint64_t id, absl::Span<uint8_t> block) {
    return corrupt != nullptr ? ReconstructInternal(id, block, corrupt)
                              : ReconstructNode(id, block);
  };
  bool found = false;
  std::vector<uint8_t> reference(g.num_bytes());
  std::vector<uint8_t> reference_parent;
  for (const ClusterIndex::Candidate& c : candidates) {
    absl::Status s = reconstruct(c.node_id, absl::MakeSpan(reference));
    if (!s.ok()) continue;  // gone meanwhile: not a candidate any more
    PredictionContext ctx = context;
    ctx.reference = reference;
    EncodeOptions o = options;
    o.reference_node_id = c.node_id;
    if (c.shifted) {  // the centroid's window at a position offset (codec/reference_shift.h)
      reference_parent.resize(g.num_bytes());
      if (c.reference_parent_id != 0 &&
          !reconstruct(c.reference_parent_id, absl::MakeSpan(reference_parent)).ok()) {
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
    if (e->bytes.size() < out->encoded.bytes.size()) {
      out->encoded = *std::move(e);
      out->reference_node_id = c.node_id;
      out->reference = reference;
      out->reference_parent_id = h->reference_shift.reference_parent_node_id;
      out->reference_parent = out->reference_parent_id ? reference_parent : std::vector<uint8_t>();
      found = true;
    }
  }
  return found;
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

absl::Status ModelShard::ReleaseDependentsLocked(absl::Span<const uint64_t> roots,
                                                 DeleteSummary* summary,
                                                 absl::flat_hash_set<uint64_t>* retain,
                                                 bool erasing) {
  // The clusters whose centroid is inside a root's subtree, with their members outside them all.
  std::map<uint64_t, std::vector<uint64_t>> clusters;  // centroid -> members outside, by id
  absl::flat_hash_set<uint64_t> leaving;               // the subtrees: never a new centroid
  absl::flat_hash_set<uint64_t> lossy;                 // clusters with a lossy or retained member
  {
    absl::MutexLock lock(&mu_);
    std::vector<TrieNode*> going;
    for (uint64_t id : roots) {
      TrieNode* root = FindLive(id);
      if (root == nullptr) continue;  // nothing left to protect
      for (TrieNode* n : SubtreeLocked(root)) {
        if (leaving.insert(n->id).second) going.push_back(n);
      }
    }
    for (TrieNode* n : going) {
      for (uint64_t d : clusters_.Dependents(n->id)) {
        const TrieNode* m = FindLive(d);
        if (m == nullptr || leaving.contains(d)) continue;
        clusters[n->id].push_back(d);
        if (IsLossyEncoding(m->encoding) || m->retained) lossy.insert(n->id);
      }
    }
  }
  for (auto& [centroid, members] : clusters) {
    if (retain != nullptr && lossy.contains(centroid)) {
      retain->insert(centroid);
      ++summary->centroids_retained;
      continue;
    }
    std::sort(members.begin(), members.end());  // ids grow with depth along a path
    const uint64_t rewritten = summary->bytes_rewritten;
    if (auto s = ReelectLocked(centroid, members, leaving, summary); !s.ok()) return s;
    if (erasing && lossy.contains(centroid)) {
      summary->erase_bytes_rewritten += summary->bytes_rewritten - rewritten;
    }
  }
  return absl::OkStatus();
}

absl::Status ModelShard::ReelectLocked(uint64_t centroid_id, const std::vector<uint64_t>& members,
                                       const absl::flat_hash_set<uint64_t>& leaving,
                                       DeleteSummary* summary) {
  // The election: among the members at the old centroid's position (if any: the others found it
  // at a position offset), the one whose path is most probable (the paper's "most probable
  // prefix"), then the most read, then the one with the most dependents of its own, the oldest.
  struct Vote {
    bool shifted;  // not at the old centroid's position: its members would need a shifted window
    double path_bits;
    uint64_t hits;
    size_t dependents;
    uint64_t id;
  };
  std::vector<Vote> votes;
  {
    absl::MutexLock lock(&mu_);
    const TrieNode* old = FindLive(centroid_id);
    for (uint64_t id : members) {
      const TrieNode* n = FindVisible(id);  // a retained member is re-encoded, never elected
      if (n == nullptr) continue;
      const bool aligned =
          old != nullptr && n->depth == old->depth && n->token_ids == old->token_ids;
      votes.push_back({!aligned, n->path_surprisal_bits, n->hits, clusters_.NumDependents(id), id});
    }
  }
  std::sort(votes.begin(), votes.end(), [](const Vote& a, const Vote& b) {
    if (a.shifted != b.shifted) return b.shifted;
    if (a.path_bits != b.path_bits) return a.path_bits < b.path_bits;
    if (a.hits != b.hits) return a.hits > b.hits;
    if (a.dependents != b.dependents) return a.dependents > b.dependents;
    return a.id < b.id;
  });
  uint64_t elected = 0;
  for (const Vote& v : votes) {  // the first still there
    bool replaced = false;
    if (auto s = RecodeMemberLocked(v.id, 0, leaving, summary, &replaced); !s.ok()) return s;
    if (replaced) {
      elected = v.id;
      break;
    }
  }
  if (elected == 0) {
    // No member can be elected (each went meanwhile, or is retained: retention off now, or an
    // eviction): each one left is stored standalone, bit-exact.
    for (uint64_t id : members) {
      bool replaced = false;
      if (auto s = RecodeMemberLocked(id, 0, leaving, summary, &replaced); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  ++summary->centroids_reelected;
  centroids_reelected_.fetch_add(1, std::memory_order_relaxed);
  for (uint64_t id : members) {
    if (id == elected) continue;
    bool replaced = false;
    if (auto s = RecodeMemberLocked(id, elected, leaving, summary, &replaced); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ModelShard::RecodeMemberLocked(uint64_t node_id, uint64_t centroid_id,
                                            const absl::flat_hash_set<uint64_t>& leaving,
                                            DeleteSummary* summary, bool* replaced) {
  *replaced = false;
  // The member's exact current reconstruction is what is stored again, bit-exact (lossless),
  // standalone or against a centroid: every value a reader gets (and every descendant's
  // prediction context, and a kept Put parent) stays the same, so the error target it met still
  // holds and nothing below it needs re-encoding. The learned state it was coded against loses a
  // dependent only once the new encoding is published, and stays while a reader that listed the
  // old encoding holds it (PredictorRegistry::Hold).
  BlockGeometry g;
  {
    absl::MutexLock lock(&mu_);
    g = model_.geometry;
  }
  std::vector<uint8_t> recon;
  if (absl::Status s = ReconstructExactLocked(node_id, g, &recon); !s.ok()) {
    return absl::IsAborted(s) ? absl::OkStatus() : s;  // aborted: dropped meanwhile
  }
  const EncodeOptions lossless{.encoding = Encoding::kLossless};
  const PredictionContext ctx;  // bit-exact coding reads only the centroid's reconstruction
  NearDupEncoded out;
  absl::StatusOr<EncodedBlock> standalone = EncodeBlock(g, recon, lossless, ctx);
  if (!standalone.ok()) return standalone.status();
  out.encoded = *std::move(standalone);
  if (centroid_id != 0) {
    // The candidates the Put path would try now (the new centroid is indexed standalone), none
    // inside the subtree that goes, and the new centroid itself at the same position.
    std::vector<ClusterIndex::Candidate> candidates;
    {
      absl::MutexLock lock(&mu_);
      TrieNode* n = FindLive(node_id);
      if (n == nullptr) return absl::OkStatus();
      candidates = StoredCandidatesLocked(*n, leaving);
      const TrieNode* c = FindLive(centroid_id);
      const bool listed = std::any_of(candidates.begin(), candidates.end(),
                                      [&](const auto& x) { return x.node_id == centroid_id; });
      if (c != nullptr && !listed && c->depth == n->depth && c->token_ids == n->token_ids) {
        candidates.insert(candidates.begin(), {.node_id = centroid_id});
      }
    }
    std::vector<Corrupt> corrupt;
    absl::StatusOr<bool> found =
        EncodeAgainstCandidates(g, recon, lossless, ctx, candidates, &out, &corrupt);
    DropCorruptLocked(corrupt);
    if (!found.ok()) return found.status();
  }
  uint64_t bytes = 0;
  if (auto st = ReplaceEncodingLocked(node_id, out.encoded, Encoding::kLossless,
                                      out.reference_node_id, &bytes);
      !st.ok()) {
    return st;
  }
  if (bytes == 0) return absl::OkStatus();  // deleted meanwhile
  *replaced = true;
  summary->bytes_freed += bytes;
  summary->bytes_rewritten += out.encoded.bytes.size();
  ++summary->nodes_rewritten;
  return absl::OkStatus();
}

std::vector<ClusterIndex::Candidate> ModelShard::StoredCandidatesLocked(
    const TrieNode& n, const absl::flat_hash_set<uint64_t>& leaving) {
  const NearDupOptions& nd = context_->options->near_dup;
  // Never the node itself or below it (a window of its own text and its child's): decoding such
  // a centroid (or its parent) walks up to the node again, without end.
  auto own = [&](uint64_t id) {
    for (const TrieNode* a = id != 0 ? FindLive(id) : nullptr; a != nullptr; a = a->parent) {
      if (a == &n) return true;
    }
    return false;
  };
  std::vector<ClusterIndex::Candidate> out;
  for (const ClusterIndex::Candidate& c :
       clusters_.FindCandidates(trie_.get(), n.parent, n.depth, n.token_ids, n.path_surprisal_bits,
                                nd.max_distance_bits, nd.max_candidates, n.id)) {
    if (own(c.node_id) || own(c.reference_parent_id) || leaving.contains(c.node_id) ||
        leaving.contains(c.reference_parent_id) || (c.shifted && !nd.position_shifted)) {
      continue;
    }
    out.push_back(c);
  }
  return out;
}

absl::Status ModelShard::ReconstructExactLocked(uint64_t node_id, const BlockGeometry& g,
                                                std::vector<uint8_t>* recon) {
  recon->assign(g.num_bytes(), 0);
  std::vector<Corrupt> corrupt;
  absl::Status s = ReconstructInternal(node_id, absl::MakeSpan(*recon), &corrupt);
  DropCorruptLocked(corrupt);
  return s;
}

absl::StatusOr<uint64_t> ModelShard::RecodeAgainstCentroid(uint64_t node_id, uint64_t centroid_id) {
  absl::MutexLock writer(&write_mu_);
  BlockGeometry g;
  uint64_t current = 0;
  {
    absl::MutexLock lock(&mu_);
    const TrieNode* n = FindVisible(node_id);
    const TrieNode* c = FindVisible(centroid_id);
    if (n == nullptr) return absl::NotFoundError(absl::StrCat("node_id: no node ", node_id));
    if (c == nullptr)
      return absl::NotFoundError(absl::StrCat("centroid_id: no node ", centroid_id));
    if (n->reference_node_id != 0 || clusters_.HasDependents(node_id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("node_id: ", node_id, " is not a standalone block without dependents"));
    }
    if (c->reference_node_id != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("centroid_id: ", centroid_id, " is itself a residual"));
    }
    if (n == c || n->depth != c->depth || n->token_ids != c->token_ids) {
      return absl::FailedPreconditionError(absl::StrCat(
          "centroid_id: ", centroid_id, " does not hold node ", node_id, "'s tokens at its depth"));
    }
    g = model_.geometry;
    current = n->bytes_stored;
  }
  return RecodeIfSmallerLocked(node_id, g, current, {{.node_id = centroid_id}});
}

absl::StatusOr<uint64_t> ModelShard::RecodeIfSmallerLocked(
    uint64_t node_id, const BlockGeometry& g, uint64_t current,
    const std::vector<ClusterIndex::Candidate>& candidates) {
  std::vector<uint8_t> recon;
  if (absl::Status s = ReconstructExactLocked(node_id, g, &recon); !s.ok()) return s;
  NearDupEncoded out;
  out.encoded.bytes.assign(current, '\0');  // only an encoding smaller than the stored one wins
  std::vector<Corrupt> corrupt;
  absl::StatusOr<bool> found = EncodeAgainstCandidates(
      g, recon, {.encoding = Encoding::kLossless}, PredictionContext{}, candidates, &out, &corrupt);
  DropCorruptLocked(corrupt);
  if (!found.ok()) return found.status();
  if (!*found) return 0;
  uint64_t replaced = 0;
  if (auto st = ReplaceEncodingLocked(node_id, out.encoded, Encoding::kLossless,
                                      out.reference_node_id, &replaced);
      !st.ok()) {
    return st;
  }
  return replaced - std::min(replaced, out.encoded.bytes.size());
}

absl::Status ModelShard::ReplaceEncodingLocked(uint64_t node_id, const EncodedBlock& encoded,
                                               Encoding encoding, uint64_t reference_node_id,
                                               uint64_t* replaced_bytes) {
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
    m.reference_node_id = reference_node_id;
    m.predictor_version = 0;  // re-encoded bit-exact, with no learned state
    batch.PutNode(shard_id_, node_id, m, &encoded.bytes);
  }
  // The disk budget may be passed by the growth of a re-encoded block until the Delete that
  // asked for it frees its subtree (and the background pass evicts).
  if (auto s = context_->records->Write(batch); !s.ok()) return s;
  if (context_->replace_hook_for_test) context_->replace_hook_for_test();
  absl::MutexLock lock(&mu_);
  TrieNode* n = trie_->Find(node_id);  // write_mu_: still there
  const uint64_t old_centroid = n->reference_node_id;
  *replaced_bytes = n->bytes_stored;
  clusters_.Remove(*n);
  CountNodeLocked(*n, -1);
  n->bytes_stored = encoded.bytes.size();
  n->encoding = encoding;
  n->reference_node_id = reference_node_id;
  predictors_->AddDependent(n->predictor_version, -1);
  n->predictor_version = 0;
  CountNodeLocked(*n, +1);
  clusters_.Add(*n);
  // Hot copy swapped (making room like a Put: the memory bound holds); disk bytes follow.
  context_->tiers->Replace(Ref(node_id), std::make_shared<const std::string>(encoded.bytes));
  UpdateEvictableLocked(FindLive(old_centroid));
  UpdateEvictableLocked(FindLive(reference_node_id));
  return absl::OkStatus();
}

}  // namespace kvtrie
