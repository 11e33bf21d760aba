// ClusterPolicy (trie/cluster_policy.h): re-election when centroids leave, retained centroids
// (retain, revive, sweep) and the explicit re-encoding of a block against a centroid. The
// background pass's per-group work is in cluster_policy_pass.cc.
#include "trie/cluster_policy.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "trie/put_encoder.h"
#include "trie/shard_learning.h"

namespace kvtrie {

bool ClusterPolicy::RetireReferencesLocked(uint64_t node_id) {
  std::vector<uint64_t> ids;
  std::shared_ptr<RetiredReferences> epoch;
  BlockGeometry g;
  {
    absl::MutexLock lock(&shard_->mu_);
    TrieNode* root = shard_->FindLive(node_id);
    // Only reads listed in this epoch can need them; none holds it (but this shard): nothing to do.
    if (root == nullptr || shard_->retired_.use_count() <= 1) return false;
    epoch = shard_->retired_;
    g = shard_->model_.geometry;
    for (TrieNode* n : shard_->SubtreeLocked(root)) {
      if (!shard_->clusters_.HasDependents(n->id)) continue;
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
    std::vector<ModelShard::Corrupt> corrupt;  // the subtree goes anyway: nothing to drop
    if (!shard_->ReconstructInternal(id, absl::MakeSpan(block), &corrupt).ok()) continue;
    epoch->Add(id, std::move(block));
    added = true;
  }
  return added;
}

absl::Status ClusterPolicy::ReleaseDependentsLocked(absl::Span<const uint64_t> roots,
                                                    DeleteSummary* summary,
                                                    absl::flat_hash_set<uint64_t>* retain,
                                                    bool erasing) {
  // The clusters whose centroid is inside a root's subtree, with their members outside them all.
  std::map<uint64_t, std::vector<uint64_t>> clusters;  // centroid -> members outside, by id
  absl::flat_hash_set<uint64_t> leaving;               // the subtrees: never a new centroid
  absl::flat_hash_set<uint64_t> lossy;                 // clusters with a lossy or retained member
  {
    absl::MutexLock lock(&shard_->mu_);
    std::vector<TrieNode*> going;
    for (uint64_t id : roots) {
      TrieNode* root = shard_->FindLive(id);
      if (root == nullptr) continue;  // nothing left to protect
      for (TrieNode* n : shard_->SubtreeLocked(root)) {
        if (leaving.insert(n->id).second) going.push_back(n);
      }
    }
    for (TrieNode* n : going) {
      for (uint64_t d : shard_->clusters_.Dependents(n->id)) {
        const TrieNode* m = shard_->FindLive(d);
        if (m == nullptr || leaving.contains(d)) continue;
        clusters[n->id].push_back(d);
        // Lossy by what it reconstructs, not by how it is coded (the pass codes a lossy block's
        // reconstruction LOSSLESS against its centroid).
        if (m->lossy || m->retained) lossy.insert(n->id);
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

absl::Status ClusterPolicy::ReelectLocked(uint64_t centroid_id,
                                          const std::vector<uint64_t>& members,
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
    absl::MutexLock lock(&shard_->mu_);
    const TrieNode* old = shard_->FindLive(centroid_id);
    for (uint64_t id : members) {
      const TrieNode* n =
          shard_->FindVisible(id);  // a retained member is re-encoded, never elected
      if (n == nullptr) continue;
      const bool aligned =
          old != nullptr && n->depth == old->depth && n->token_ids == old->token_ids;
      votes.push_back(
          {!aligned, n->path_surprisal_bits, n->hits, shard_->clusters_.NumDependents(id), id});
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
  shard_->centroids_reelected_.fetch_add(1, std::memory_order_relaxed);
  for (uint64_t id : members) {
    if (id == elected) continue;
    bool replaced = false;
    if (auto s = RecodeMemberLocked(id, elected, leaving, summary, &replaced); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ClusterPolicy::RecodeMemberLocked(uint64_t node_id, uint64_t centroid_id,
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
    absl::MutexLock lock(&shard_->mu_);
    g = shard_->model_.geometry;
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
      absl::MutexLock lock(&shard_->mu_);
      TrieNode* n = shard_->FindLive(node_id);
      if (n == nullptr) return absl::OkStatus();
      candidates = StoredCandidatesLocked(*n, leaving);
      const TrieNode* c = shard_->FindLive(centroid_id);
      const bool listed = std::any_of(candidates.begin(), candidates.end(),
                                      [&](const auto& x) { return x.node_id == centroid_id; });
      if (c != nullptr && !listed && c->depth == n->depth && c->token_ids == n->token_ids) {
        candidates.insert(candidates.begin(), {.node_id = centroid_id});
      }
    }
    std::vector<ModelShard::Corrupt> corrupt;
    absl::StatusOr<bool> found = shard_->put_encoder_->EncodeAgainstCandidates(
        g, recon, lossless, ctx, candidates, &out, &corrupt);
    shard_->DropCorruptLocked(corrupt);
    if (!found.ok()) return found.status();
  }
  uint64_t bytes = 0;
  if (auto st = shard_->ReplaceEncodingLocked(node_id, out.encoded, Encoding::kLossless,
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

std::vector<ClusterIndex::Candidate> ClusterPolicy::StoredCandidatesLocked(
    const TrieNode& n, const absl::flat_hash_set<uint64_t>& leaving) {
  const NearDupOptions& nd = shard_->context_->options->near_dup;
  // Never the node itself or below it (a window of its own text and its child's): decoding such
  // a centroid (or its parent) walks up to the node again, without end.
  auto own = [&](uint64_t id) {
    for (const TrieNode* a = id != 0 ? shard_->FindLive(id) : nullptr; a != nullptr;
         a = a->parent) {
      if (a == &n) return true;
    }
    return false;
  };
  std::vector<ClusterIndex::Candidate> out;
  for (const ClusterIndex::Candidate& c : shard_->clusters_.FindCandidates(
           shard_->trie_.get(), n.parent, n.depth, n.token_ids, n.path_surprisal_bits,
           nd.max_distance_bits, nd.max_candidates, n.id)) {
    if (own(c.node_id) || own(c.reference_parent_id) || leaving.contains(c.node_id) ||
        leaving.contains(c.reference_parent_id) || (c.shifted && !nd.position_shifted)) {
      continue;
    }
    out.push_back(c);
  }
  return out;
}

absl::Status ClusterPolicy::ReconstructExactLocked(uint64_t node_id, const BlockGeometry& g,
                                                   std::vector<uint8_t>* recon) {
  recon->assign(g.num_bytes(), 0);
  std::vector<ModelShard::Corrupt> corrupt;
  absl::Status s = shard_->ReconstructInternal(node_id, absl::MakeSpan(*recon), &corrupt);
  shard_->DropCorruptLocked(corrupt);
  return s;
}

absl::StatusOr<uint64_t> ClusterPolicy::RecodeAgainstCentroid(uint64_t node_id,
                                                              uint64_t centroid_id) {
  absl::MutexLock writer(&shard_->write_mu_);
  BlockGeometry g;
  uint64_t current = 0;
  {
    absl::MutexLock lock(&shard_->mu_);
    const TrieNode* n = shard_->FindVisible(node_id);
    const TrieNode* c = shard_->FindVisible(centroid_id);
    if (n == nullptr) return absl::NotFoundError(absl::StrCat("node_id: no node ", node_id));
    if (c == nullptr)
      return absl::NotFoundError(absl::StrCat("centroid_id: no node ", centroid_id));
    if (n->reference_node_id != 0 || shard_->clusters_.HasDependents(node_id)) {
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
    g = shard_->model_.geometry;
    current = n->bytes_stored;
  }
  return RecodeIfSmallerLocked(node_id, g, current, {{.node_id = centroid_id}});
}

absl::StatusOr<uint64_t> ClusterPolicy::RecodeIfSmallerLocked(
    uint64_t node_id, const BlockGeometry& g, uint64_t current,
    const std::vector<ClusterIndex::Candidate>& candidates) {
  std::vector<uint8_t> recon;
  if (absl::Status s = ReconstructExactLocked(node_id, g, &recon); !s.ok()) return s;
  NearDupEncoded out;
  out.encoded.bytes.assign(current, '\0');  // only an encoding smaller than the stored one wins
  std::vector<ModelShard::Corrupt> corrupt;
  absl::StatusOr<bool> found = shard_->put_encoder_->EncodeAgainstCandidates(
      g, recon, {.encoding = Encoding::kLossless}, PredictionContext{}, candidates, &out, &corrupt);
  shard_->DropCorruptLocked(corrupt);
  if (!found.ok()) return found.status();
  if (!*found) return 0;
  uint64_t replaced = 0;
  if (auto st = shard_->ReplaceEncodingLocked(node_id, out.encoded, Encoding::kLossless,
                                              out.reference_node_id, &replaced);
      !st.ok()) {
    return st;
  }
  return replaced - std::min(replaced, out.encoded.bytes.size());
}

absl::Status ClusterPolicy::RemoveRetainingLocked(uint64_t root_id,
                                                  const absl::flat_hash_set<uint64_t>& retain,
                                                  DeleteSummary* summary) {
  RecordBatch batch(shard_->context_->records);
  std::vector<TrieNode*> kept, marked, roots;
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&shard_->mu_);
    TrieNode* root = shard_->FindLive(root_id);
    if (root == nullptr) return absl::OkStatus();
    const std::vector<TrieNode*> subtree = shard_->SubtreeLocked(root);
    const absl::flat_hash_set<const TrieNode*> inside(subtree.begin(), subtree.end());
    // The retained centroids, their ancestors up to the root (a block's parent predicts it), and
    // what a kept block is itself coded against inside the subtree, with its ancestors.
    absl::flat_hash_set<const TrieNode*> keep;
    std::vector<TrieNode*> work;
    for (uint64_t id : retain) work.push_back(shard_->FindLive(id));
    while (!work.empty()) {
      TrieNode* n = work.back();
      work.pop_back();
      for (; n != nullptr && inside.contains(n) && keep.insert(n).second; n = n->parent) {
        if (TrieNode* r = n->reference_node_id ? shard_->FindLive(n->reference_node_id) : nullptr) {
          work.push_back(r);
        }
      }
    }
    // Nothing that goes may have a dependent that stays, here or outside.
    for (TrieNode* n : subtree) {
      if (keep.contains(n)) continue;
      for (uint64_t d : shard_->clusters_.Dependents(n->id)) {
        const TrieNode* m = shard_->trie_->Find(d);
        if (m != nullptr && (!inside.contains(m) || keep.contains(m))) {
          return absl::InternalError(absl::StrCat(
              "token_ids: node ", d, " is still coded against node ", n->id, " of this prefix"));
        }
      }
    }
    for (TrieNode* n : subtree) {
      if (keep.contains(n)) {
        if (n->retained) continue;  // kept already (an earlier Delete)
        NodeMeta m = shard_->MetaOf(*n);
        m.retained = true;
        batch.PutNode(shard_->shard_id_, n->id, m, nullptr);
        shard_->trie_->SetRetained(n, true);  // readers stop here from now on
        kept.push_back(n);
        continue;
      }
      if (n->removing) continue;
      if (n == root || keep.contains(n->parent)) roots.push_back(n);
      shard_->trie_->SetRemoving(n, true);
      marked.push_back(n);
      batch.DeleteNode(shard_->shard_id_, n->id);
      bytes += n->bytes_stored;
    }
    for (TrieNode* n : marked) shard_->context_->tiers->SetEvictable(shard_->Ref(n->id), false);
    for (TrieNode* n : kept) shard_->context_->tiers->SetEvictable(shard_->Ref(n->id), false);
  }
  if (marked.empty() && kept.empty()) return absl::OkStatus();
  absl::Status s = shard_->context_->records->Write(batch);
  {
    absl::MutexLock lock(&shard_->mu_);
    if (!s.ok()) {  // nothing changed in memory: it agrees with the disk
      for (TrieNode* n : marked) shard_->trie_->SetRemoving(n, false);
      for (TrieNode* n : kept) shard_->trie_->SetRetained(n, false);
      for (TrieNode* n : marked) shard_->UpdateEvictableLocked(n);
      for (TrieNode* n : kept) shard_->UpdateEvictableLocked(n);
      return s;
    }
    for (TrieNode* n : kept) shard_->retained_ids_.insert(n->id);
    shard_->RemoveLocked(roots, ModelShard::DropReason::kDeleted);
  }
  shard_->learning_->FreeUnusedPredictors();
  summary->nodes_deleted += marked.size();
  summary->bytes_freed += bytes;
  summary->nodes_retained += kept.size();
  return absl::OkStatus();
}

void ClusterPolicy::SweepRetainedLocked() {
  for (;;) {  // leaves first, then the parents they leave childless
    std::vector<uint64_t> unused;
    {
      absl::MutexLock lock(&shard_->mu_);
      for (uint64_t id : shard_->retained_ids_) {
        const TrieNode* n = shard_->trie_->Find(id);
        if (n != nullptr && n->children.empty() && !shard_->clusters_.HasDependents(id)) {
          unused.push_back(id);
        }
      }
    }
    if (unused.empty()) return;
    if (absl::Status s =
            shard_->RemoveSubtrees(unused, ModelShard::DropReason::kDeleted, nullptr, nullptr);
        !s.ok()) {
      spdlog::error("removing {} retained centroids of '{}'/'{}' no block needs: {}", unused.size(),
                    shard_->ns_, shard_->model_.model_id, s.ToString());
      return;
    }
  }
}

absl::StatusOr<bool> ClusterPolicy::ReviveRetainedLocked(uint64_t parent_id,
                                                         absl::Span<const uint32_t> token_ids,
                                                         uint32_t first_block) {
  RecordBatch batch(shard_->context_->records);
  std::vector<TrieNode*> revived;
  {
    absl::MutexLock lock(&shard_->mu_);
    if (shard_->retained_ids_.empty() || !shard_->committed_) return false;
    const size_t bt = shard_->trie_->block_tokens();
    TrieNode* at = shard_->FindVisible(parent_id);
    for (size_t b = first_block; at != nullptr && (b + 1) * bt <= token_ids.size(); ++b) {
      at = shard_->trie_->FindChild(at, token_ids.subspan(b * bt, bt));
      if (at == nullptr || !at->retained || at->removing) break;
      NodeMeta m = shard_->MetaOf(*at);
      m.retained = false;
      batch.PutNode(shard_->shard_id_, at->id, m, nullptr);
      revived.push_back(at);
    }
  }
  if (revived.empty()) return false;
  if (auto s = shard_->context_->records->Write(batch); !s.ok()) return s;
  absl::MutexLock lock(&shard_->mu_);
  for (TrieNode* n : revived) {  // shard_->write_mu_: still there
    shard_->trie_->SetRetained(n, false);
    shard_->retained_ids_.erase(n->id);
  }
  for (TrieNode* n : revived) shard_->UpdateEvictableLocked(n);
  shard_->UpdateEvictableLocked(revived.front()->parent);
  return true;
}

}  // namespace kvtrie
