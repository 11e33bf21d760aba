// ModelShard's writers: Put commits, Delete, Pin, evictions and drops. Each takes write_mu_,
// prepares under mu_, writes with no lock but write_mu_, and publishes under mu_ only after the
// write succeeded (trie/model_shard.h).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "trie/cluster_policy.h"
#include "trie/model_shard.h"
#include "trie/shard_learning.h"

namespace kvtrie {

std::vector<TrieNode*> ModelShard::SubtreeLocked(TrieNode* node) {
  std::vector<TrieNode*> order = {node};
  for (size_t i = 0; i < order.size(); ++i) {
    for (const auto& [h, bucket] : order[i]->children) {
      order.insert(order.end(), bucket.begin(), bucket.end());
    }
  }
  return order;
}

void ModelShard::RemoveLocked(const std::vector<TrieNode*>& roots, DropReason reason) {
  uint64_t removed = 0, bytes = 0;
  for (TrieNode* root : roots) {
    for (TrieNode* n : SubtreeLocked(root)) {
      clusters_.Remove(*n);  // near-duplicate index and dependency edges
      if (n->retained) retained_ids_.erase(n->id);
      cluster_policy_->ForgetLocked(n->id);
      predictors_->AddDependent(n->predictor_version, -1);
      context_->tiers->Remove(Ref(n->id));
      CountNodeLocked(*n, -1);
      bytes += n->bytes_stored;
    }
    std::vector<uint64_t> centroids;  // evictable again once their last dependent is gone
    for (TrieNode* n : SubtreeLocked(root)) {
      if (n->reference_node_id != 0) centroids.push_back(n->reference_node_id);
    }
    TrieNode* parent = root->parent;
    std::vector<uint64_t> ids;
    trie_->RemoveSubtree(root, &ids);
    removed += ids.size();
    UpdateEvictableLocked(parent);
    for (uint64_t c : centroids) UpdateEvictableLocked(FindLive(c));
  }
  switch (reason) {
    case DropReason::kDeleted:
      evictions_deleted_.fetch_add(removed, std::memory_order_relaxed);
      break;
    case DropReason::kDataLoss:
      evictions_data_loss_.fetch_add(removed, std::memory_order_relaxed);
      break;
    case DropReason::kDisk:
      evictions_disk_.fetch_add(removed, std::memory_order_relaxed);
      evicted_bytes_.fetch_add(bytes, std::memory_order_relaxed);
      break;
  }
}

absl::Status ModelShard::RemoveSubtrees(const std::vector<uint64_t>& roots, DropReason reason,
                                        uint64_t* removed_nodes, uint64_t* removed_bytes) {
  std::vector<uint64_t> sorted(roots);
  std::sort(sorted.begin(), sorted.end());  // an ancestor (smaller id) before its descendants
  RecordBatch batch(context_->records);
  std::vector<TrieNode*> marked_roots;
  std::vector<TrieNode*> marked;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : sorted) {
      TrieNode* root = FindLive(id);
      if (root == nullptr) continue;  // gone meanwhile (a root inside another's subtree)
      marked_roots.push_back(root);
      for (TrieNode* n : SubtreeLocked(root)) {
        if (n->removing) continue;
        trie_->SetRemoving(n, true);  // readers stop here from now on
        marked.push_back(n);
        batch.DeleteNode(shard_id_, n->id);
        if (removed_bytes) *removed_bytes += n->bytes_stored;
      }
    }
    for (TrieNode* n : marked) context_->tiers->SetEvictable(Ref(n->id), false);
  }
  if (removed_nodes) *removed_nodes = marked.size();
  if (marked.empty()) return absl::OkStatus();
  absl::Status s = context_->records->Write(batch);
  {
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {  // nothing changed in memory: it agrees with the disk
      for (TrieNode* n : marked) trie_->SetRemoving(n, false);
      for (TrieNode* n : marked) UpdateEvictableLocked(n);
      return s;
    }
    RemoveLocked(marked_roots, reason);
  }
  learning_->FreeUnusedPredictors();  // a version whose last dependent just went
  return absl::OkStatus();
}

void ModelShard::DropCorruptLocked(const std::vector<Corrupt>& corrupt) {
  if (corrupt.empty()) return;
  std::vector<uint64_t> ids;
  for (const Corrupt& c : corrupt) {
    spdlog::error("node {} of '{}'/'{}' is unreadable, dropping it and its subtree: {}", c.node_id,
                  ns_, model_.model_id, c.why);
    ids.push_back(c.node_id);
  }
  if (absl::Status s = RemoveSubtrees(ids, DropReason::kDataLoss, nullptr, nullptr); !s.ok()) {
    spdlog::error("dropping {} unreadable nodes: {}", ids.size(), s.ToString());
  }
}

void ModelShard::DropCorrupt(const std::vector<Corrupt>& corrupt) {
  if (corrupt.empty()) return;
  absl::MutexLock lock(&write_mu_);
  DropCorruptLocked(corrupt);
}

absl::StatusOr<std::vector<uint64_t>> ModelShard::Commit(const ModelInfo& model, uint64_t parent_id,
                                                         absl::Span<const uint32_t> token_ids,
                                                         absl::Span<const float> surprisal_bits,
                                                         const std::vector<NewBlock>& blocks) {
  const uint32_t bt = model.geometry.block_tokens;
  // Disk budget first, holding no lock: reserve this Put's bytes, evicting leaves to make room.
  uint64_t incoming = 0;
  for (const NewBlock& b : blocks) incoming += b.encoded->bytes.size();
  TierManager* tiers = context_->tiers;
  for (int attempt = 0; !tiers->Reserve(incoming); ++attempt) {
    absl::Status room = attempt < 4 ? context_->make_disk_room(incoming)
                                    : absl::ResourceExhaustedError("disk budget");
    if (!room.ok()) {
      tiers->CountRejected(this);
      if (!absl::IsResourceExhausted(room)) return room;
      return absl::ResourceExhaustedError(absl::StrCat(
          "disk_bytes: ", incoming, " more payload bytes do not fit in the disk budget of ",
          context_->options->disk_bytes, " bytes (", tiers->stored_bytes(),
          " stored); what remains is pinned, depended on, or the Put is larger than the budget"));
    }
  }
  auto unreserve = absl::MakeCleanup([&] { tiers->Unreserve(incoming); });

  absl::MutexLock writer(&write_mu_);
  // The payloads, and per block its key, record and framing (token ids, surprisal: ~1 KiB).
  RecordBatch batch(context_->records, incoming + blocks.size() * (1024 + 16 * bt));
  std::vector<uint64_t> ids;
  std::vector<NodeMeta> metas;
  bool create = false;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (committed_) {
      if (auto s = CheckSameModel(ns_, model_, model); !s.ok()) return s;
    } else {
      create = true;  // the first blocks of this model: its record goes in the same batch
    }
    TrieNode* parent = create ? nullptr : FindVisible(parent_id);
    if (create ? parent_id != 0 || blocks.front().block_index != 0
               : parent == nullptr || parent->depth != blocks.front().block_index) {
      return absl::AbortedError("prefix changed concurrently");
    }
    const TrieNode* stored =
        parent == nullptr
            ? nullptr
            : trie_->FindChild(parent, token_ids.subspan(blocks.front().block_index * bt, bt));
    if (stored != nullptr && !stored->retained) {
      return absl::AbortedError("block stored concurrently");
    }
    if (stored != nullptr) {
      // A deleted block kept as a centroid: visible again (written with mu_ released), then the
      // Put matches it as stored.
      lock.Release();
      absl::StatusOr<bool> revived =
          cluster_policy_->ReviveRetainedLocked(parent_id, token_ids, blocks.front().block_index);
      if (!revived.ok()) return revived.status();
      return absl::AbortedError("a deleted block kept as a centroid was revived");
    }
    for (const NewBlock& b : blocks) {  // a centroid deleted since the block was coded against it
      if (b.reference_node_id != 0 && FindVisible(b.reference_node_id) == nullptr) {
        return absl::AbortedError("centroid deleted concurrently");
      }
    }
    if (create) batch.PutModel(shard_id_, ns_, model);
    uint64_t prev = parent_id;
    for (const NewBlock& b : blocks) {
      const uint64_t id = next_id_ + ids.size();
      NodeMeta m;
      m.ns = ns_;
      m.model_id = model.model_id;
      m.parent_id = prev;
      const size_t off = static_cast<size_t>(b.block_index) * bt;
      m.token_ids.assign(token_ids.begin() + off, token_ids.begin() + off + bt);
      m.surprisal_bits.assign(surprisal_bits.begin() + off, surprisal_bits.begin() + off + bt);
      m.encoding = b.encoding;
      m.bytes_logical = model.geometry.num_bytes();
      m.bytes_stored = b.encoded->bytes.size();
      m.rel_rms_error_k = b.encoded->rel_rms_error_k;
      m.rel_rms_error_v = b.encoded->rel_rms_error_v;
      m.reference_node_id = b.reference_node_id;
      m.predictor_version = b.predictor_version;
      m.error_client_reported = b.error_client_reported;
      m.lossy = IsLossyEncoding(m.encoding) || m.rel_rms_error_k > 0 || m.rel_rms_error_v > 0;
      m.target_rel_rms = b.target_rel_rms;
      // Stored without a near-duplicate search: the cluster pass looks at it at any offset.
      m.offset_look = !b.near_dup_searched && b.reference_node_id == 0 &&
                      cluster_policy_->LooksAtOffsets(model.geometry, m.encoding);
      batch.PutNode(shard_id_, id, m, &b.encoded->bytes);
      ids.push_back(id);
      metas.push_back(std::move(m));
      prev = id;
    }
  }
  // The write (and with --sync the fsync) with no lock that a reader takes.
  if (auto s = context_->records->Write(batch); !s.ok()) return s;
  // Durable (as promised); now publish, parents first. write_mu_ kept every other writer out, so
  // what was checked above still holds.
  absl::MutexLock lock(&mu_);
  if (create) {
    if (!(model_.geometry == model.geometry)) {
      trie_ = std::make_unique<BlockTrie>(bt, context_->options->token_hash);
      clusters_ = ClusterIndex();
      predictors_ = std::make_shared<PredictorRegistry>(
          model.geometry, context_->options->predictors,
          PersistedPredictorLoader(context_->records, shard_id_));
    }
    model_ = model;
    committed_ = true;
  }
  TrieNode* at = trie_->Find(parent_id);
  for (size_t i = 0; i < blocks.size(); ++i) {
    // The hot tier shares the encoded bytes (no copy).
    const std::shared_ptr<const EncodedBlock>& e = blocks[i].encoded;
    at = PublishLocked(at, ids[i], metas[i], std::shared_ptr<const std::string>(e, &e->bytes));
    at->unverified = blocks[i].unverified;
    predictors_->AddBytesSaved(metas[i].predictor_version, e->learned_bytes_saved);
  }
  return ids;
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

absl::StatusOr<DeleteSummary> ModelShard::Delete(absl::Span<const uint32_t> token_ids, bool erase) {
  absl::MutexLock writer(&write_mu_);
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!committed_) return NoModel();
    const uint32_t bt = model_.geometry.block_tokens;
    if (token_ids.empty() || token_ids.size() % bt != 0) {
      return absl::InvalidArgumentError(absl::StrCat("token_ids: ", token_ids.size(),
                                                     " tokens is not a positive multiple of "
                                                     "block_tokens=",
                                                     bt));
    }
    std::vector<TrieNode*> path = MatchLive(token_ids, 0);
    if (path.size() != token_ids.size() / bt) {
      return absl::NotFoundError(absl::StrCat("token_ids: only ", path.size() * bt, " of ",
                                              token_ids.size(), " tokens are stored"));
    }
    id = path.back()->id;
  }
  // Reads listed before keep what they may need of the centroids that go (RetiredReferences).
  auto new_epoch = absl::MakeCleanup([this, retired = cluster_policy_->RetireReferencesLocked(id)] {
    if (!retired) return;  // else the retired blocks go with the last read listed before
    absl::MutexLock lock(&mu_);
    retired_ = std::make_shared<RetiredReferences>();
  });
  // Near-duplicates coded against a node of the subtree are re-encoded first. Only writers add
  // dependents, and write_mu_ keeps them out until the subtree is gone.
  // Those with a lossy member stay, retained, for them ("Retained centroids",
  // trie/cluster_policy.h), unless the Delete erases.
  DeleteSummary summary;
  absl::flat_hash_set<uint64_t> retain;
  const bool may_retain = context_->options->near_dup.retain_lossy_centroids;
  if (auto s = cluster_policy_->ReleaseDependentsLocked(
          {id}, &summary, may_retain && !erase ? &retain : nullptr, may_retain && erase);
      !s.ok()) {
    return s;
  }
  if (context_->delete_hook_for_test) context_->delete_hook_for_test();
  {
    absl::MutexLock lock(&mu_);
    TrieNode* n = FindLive(id);
    if (n == nullptr) return absl::NotFoundError("token_ids: deleted concurrently");
  }
  // Checks that nothing outside is still coded against a block that goes (else INTERNAL).
  if (auto s = cluster_policy_->RemoveRetainingLocked(id, retain, &summary); !s.ok()) return s;
  deletes_.fetch_add(1, std::memory_order_relaxed);
  cluster_policy_->SweepRetainedLocked();  // retained centroids whose last member this prefix held
  return summary;
}

absl::StatusOr<uint64_t> ModelShard::Pin(absl::Span<const uint32_t> token_ids, uint64_t ttl_seconds,
                                         bool unpin, bool extend_only) {
  absl::MutexLock writer(&write_mu_);
  RecordBatch batch(context_->records);
  uint64_t id = 0, until = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!committed_) return NoModel();
    const uint32_t bt = model_.geometry.block_tokens;
    if (token_ids.size() < bt) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids: ", token_ids.size(), " tokens hold no full block of ", bt));
    }
    std::vector<TrieNode*> path = MatchLive(token_ids, 0);  // full blocks; a tail is ignored
    if (path.size() != token_ids.size() / bt) {
      return absl::NotFoundError(absl::StrCat("token_ids: only ", path.size() * bt, " of ",
                                              token_ids.size(), " tokens are stored"));
    }
    const TrieNode* n = path.back();
    id = n->id;
    const uint64_t now = context_->options->now_seconds
                             ? context_->options->now_seconds()
                             : static_cast<uint64_t>(absl::ToUnixSeconds(absl::Now()));
    until = unpin ? 0 : ttl_seconds == 0 ? TierManager::kPinForever : now + ttl_seconds;
    // A lease never shortens a pin: kPinForever is the largest `until`.
    if (extend_only && !unpin && context_->tiers->PinnedUntil(Ref(id)) >= until) return id;
    NodeMeta m = MetaOf(*n);
    m.pinned_until = until;
    batch.PutNode(shard_id_, id, m, nullptr);
  }
  // Memory changes only once the record is on disk: a failed write leaves both as they were.
  if (auto s = context_->records->Write(batch); !s.ok()) return s;
  context_->tiers->SetPin(Ref(id), until);
  return id;
}

absl::StatusOr<uint64_t> ModelShard::Evict(const std::vector<uint64_t>& ids) {
  absl::MutexLock writer(&write_mu_);
  std::vector<uint64_t> victims;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : ids) {
      TrieNode* n = FindLive(id);
      if (n == nullptr) continue;
      if (EvictableLocked(*n) && context_->tiers->PinnedUntil(Ref(id)) == 0) {
        victims.push_back(id);
      } else {
        UpdateEvictableLocked(n);  // back in the queue if it is still a candidate
      }
    }
  }
  // A centroid goes like any leaf once its members elected a new one (ReleaseDependentsLocked);
  // reads listed before keep its reconstruction (RetiredReferences).
  // All victims at once: a member that goes in this eviction is never elected (its members would
  // be left without their centroid).
  bool retired = false, centroids = false;
  uint64_t grown = 0;
  for (uint64_t id : victims) {
    if (!HasDependents(id)) continue;
    retired |= cluster_policy_->RetireReferencesLocked(id);
    centroids = true;
  }
  if (centroids) {
    DeleteSummary summary;
    absl::Status s = cluster_policy_->ReleaseDependentsLocked(victims, &summary);
    if (summary.bytes_rewritten > summary.bytes_freed) {
      grown += summary.bytes_rewritten - summary.bytes_freed;
    }
    if (!s.ok()) return s;
  }
  auto new_epoch = absl::MakeCleanup([this, retired] {
    if (!retired) return;
    absl::MutexLock lock(&mu_);
    retired_ = std::make_shared<RetiredReferences>();
  });
  {
    // A victim that a block staying is still coded against (one that could not move) stays.
    absl::MutexLock lock(&mu_);
    const absl::flat_hash_set<uint64_t> going(victims.begin(), victims.end());  // leaves
    victims.erase(std::remove_if(victims.begin(), victims.end(),
                                 [&](uint64_t id) {
                                   for (uint64_t d : clusters_.Dependents(id)) {
                                     if (going.contains(d)) continue;
                                     UpdateEvictableLocked(FindLive(id));
                                     return true;
                                   }
                                   return false;
                                 }),
                  victims.end());
  }
  uint64_t bytes = 0;
  if (auto s = RemoveSubtrees(victims, DropReason::kDisk, nullptr, &bytes); !s.ok()) return s;
  cluster_policy_->SweepRetainedLocked();  // a retained centroid whose last member was a victim
  return bytes - std::min(bytes, grown);   // net of the members' growth
}

void ModelShard::CountPut(uint64_t stored, uint64_t deduplicated, uint64_t touched_node) {
  puts_.fetch_add(1, std::memory_order_relaxed);
  blocks_stored_.fetch_add(stored, std::memory_order_relaxed);
  blocks_deduplicated_.fetch_add(deduplicated, std::memory_order_relaxed);
  if (touched_node == 0) return;
  absl::MutexLock lock(&mu_);
  for (TrieNode* n = FindLive(touched_node); n != nullptr && n->depth > 0; n = n->parent) {
    context_->tiers->Touch(Ref(n->id));
  }
}

}  // namespace kvtrie
