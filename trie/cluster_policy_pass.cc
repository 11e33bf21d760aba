// ClusterPolicy's part of the background cluster pass (trie/cluster_pass.h runs the rounds):
// per shard, the dirty groups' elections and convergence, and the recheck of blocks a move left.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "trie/cluster_policy.h"
#include "trie/put_encoder.h"

namespace kvtrie {

namespace {

// The groups one shard's round looks at, at most (the budget usually ends it first).
constexpr size_t kMaxGroupsPerRound = 4096;
// The queued blocks one shard's round looks at for any offset, at most.
constexpr size_t kMaxLooksPerRound = 4096;

}  // namespace

absl::StatusOr<uint32_t> ClusterPolicy::RunClusterPass(uint32_t budget, uint64_t* groups) {
  std::vector<std::pair<uint64_t, std::vector<uint64_t>>> dirty;
  bool sweep = false;
  {
    absl::MutexLock lock(&shard_->mu_);
    if (!shard_->committed_ || !shard_->context_->options->near_dup.enabled) return 0;
    // FP8 / uint8 models: no centroids (their blocks stay RAW or LOSSLESS, standalone).
    if (IsByteDType(shard_->model_.geometry.dtype)) return 0;
    dirty = shard_->clusters_.DirtyGroups(kMaxGroupsPerRound);
    sweep = !shard_->retained_ids_.empty();
  }
  if (sweep) {  // a retained centroid whose last member a round (or a Put) moved away
    absl::MutexLock writer(&shard_->write_mu_);
    SweepRetainedLocked();
  }
  uint32_t spent = 0;
  // Every group dirty when the round began was settled (Puts may have dirtied others since: a
  // busy shard is never without one).
  bool settled_all = dirty.size() < kMaxGroupsPerRound;
  for (auto& [key, ids] : dirty) {
    if (spent >= budget) {
      settled_all = false;
      break;
    }
    bool done = false;
    absl::StatusOr<uint32_t> s = SettleClusterGroup(ids, budget - spent, &done);
    if (!s.ok()) return s.status();
    spent += *s;
    ++*groups;
    settled_all = settled_all && done;
    if (done) {
      absl::MutexLock lock(&shard_->mu_);
      shard_->clusters_.SettleGroup(key, ids);
    }
  }
  // The blocks a move left for later, once the groups are settled (the paths they repeat are
  // then standalone): each coded against what the Put path would find, when smaller.
  std::vector<uint64_t> recheck;
  if (settled_all) {
    absl::MutexLock lock(&shard_->mu_);
    recheck.assign(recheck_.begin(), recheck_.end());
  }
  std::sort(recheck.begin(), recheck.end());  // parents first
  for (uint64_t id : recheck) {
    if (spent >= budget) break;
    absl::MutexLock writer(&shard_->write_mu_);
    absl::StatusOr<uint32_t> s = RecheckLocked(id);
    if (!s.ok()) return s.status();
    spent += *s;
    if (auto m = MarkRecheckLocked(id, false); !m.ok()) return m;
  }
  // The blocks stored without a near-duplicate search, oldest first (so each is looked at after
  // the blocks it may repeat had theirs): any offset, against the blocks stored before it. A look
  // that finds no candidate costs no encoding (a few n-gram lookups); at most kMaxLooksPerRound.
  std::vector<uint64_t> looks;
  if (settled_all) looks = PendingLooks();
  if (looks.size() > kMaxLooksPerRound) looks.resize(kMaxLooksPerRound);
  std::vector<uint64_t> looked;
  for (uint64_t id : looks) {
    if (spent >= budget) break;
    absl::MutexLock writer(&shard_->write_mu_);
    absl::StatusOr<uint32_t> s = LookAtOffsetsLocked(id);
    if (!s.ok()) return s.status();
    spent += *s;
    looked.push_back(id);
  }
  if (!looked.empty()) {
    absl::MutexLock writer(&shard_->write_mu_);
    if (auto s = ClearOffsetLooksLocked(looked); !s.ok()) return s;
  }
  return spent;
}

absl::Status ClusterPolicy::ClearOffsetLooksLocked(const std::vector<uint64_t>& ids) {
  RecordBatch batch(shard_->context_->records);
  std::vector<uint64_t> marked;
  {
    absl::MutexLock lock(&shard_->mu_);
    for (uint64_t id : ids) {
      TrieNode* n = shard_->FindLive(id);
      if (n == nullptr || !n->offset_look) {
        unlooked_.erase(id);  // gone meanwhile, or not marked: nothing to write
        continue;
      }
      NodeMeta m = shard_->MetaOf(*n);
      m.offset_look = false;
      batch.PutNode(shard_->shard_id_, id, m, nullptr);  // the record only
      marked.push_back(id);
    }
  }
  if (marked.empty()) return absl::OkStatus();
  if (auto s = shard_->context_->records->Write(batch); !s.ok()) return s;  // looked at again
  absl::MutexLock lock(&shard_->mu_);
  for (uint64_t id : marked) {
    if (TrieNode* n = shard_->trie_->Find(id)) n->offset_look = false;  // write_mu_: still there
    unlooked_.erase(id);
  }
  return absl::OkStatus();
}

bool ClusterPolicy::LooksAtOffsets(const BlockGeometry& g, Encoding encoding) const {
  const NearDupOptions& nd = shard_->context_->options->near_dup;
  // LOSSLESS only: a lossy block's reconstruction, coded exactly against a window of another lossy
  // reconstruction whose keys RoPE turned, was never smaller than its lossy encoding (0 of the 145
  // in the insertion rows of bench/cluster_bench.md when tried), so a look would only spend
  // encodings.
  return nd.enabled && nd.position_shifted && encoding == Encoding::kLossless &&
         !IsByteDType(g.dtype);
}

void ClusterPolicy::LookLaterLocked(uint64_t node_id) {
  if (unlooked_.size() < kMaxUnlooked) unlooked_.insert(node_id);
}

std::vector<uint64_t> ClusterPolicy::PendingLooks() {
  absl::MutexLock lock(&shard_->mu_);
  std::vector<uint64_t> ids(unlooked_.begin(), unlooked_.end());
  std::sort(ids.begin(), ids.end());
  return ids;
}

absl::StatusOr<uint32_t> ClusterPolicy::LookAtOffsetsLocked(uint64_t node_id) {
  BlockGeometry g;
  uint64_t current = 0;
  std::vector<ClusterIndex::Candidate> candidates;
  bool shifted = false;
  {
    absl::MutexLock lock(&shard_->mu_);
    const TrieNode* n = shard_->FindVisible(node_id);
    if (n == nullptr || n->reference_node_id != 0 ||
        (n->encoding != Encoding::kLossless && n->encoding != Encoding::kResidual) ||
        shard_->clusters_.HasDependents(node_id) || shard_->clusters_.GroupSize(*n) > 1) {
      return 0;  // coded against another, a centroid, or a group's member: not ours to move
    }
    for (const ClusterIndex::Candidate& c : StoredCandidatesLocked(*n, {})) {
      // Only what was stored before it (ids grow): a repeat is coded against what it repeats.
      if (c.node_id < node_id && c.reference_parent_id < node_id) candidates.push_back(c);
    }
    if (candidates.empty()) return 0;
    shifted = candidates.front().shifted;
    g = shard_->model_.geometry;
    current = n->bytes_stored;
  }
  absl::StatusOr<uint64_t> saved = RecodeAndCountLocked(node_id, g, current, candidates, true);
  if (!saved.ok()) return saved.status();
  absl::MutexLock lock(&shard_->mu_);
  if (shifted) shard_->clusters_.CountShifted(*saved > 0);
  return static_cast<uint32_t>(candidates.size());
}

absl::StatusOr<uint64_t> ClusterPolicy::RecodeAndCountLocked(
    uint64_t node_id, const BlockGeometry& g, uint64_t current,
    const std::vector<ClusterIndex::Candidate>& candidates, bool standalone) {
  absl::StatusOr<uint64_t> saved = RecodeIfSmallerLocked(node_id, g, current, candidates);
  if (!saved.ok()) return absl::IsAborted(saved.status()) ? 0 : saved;  // aborted: it went
  if (*saved > 0) {
    shard_->cluster_pass_bytes_saved_.fetch_add(*saved, std::memory_order_relaxed);
    // Stats' "standalone blocks it re-encoded as residuals" (a residual moved is not another).
    if (standalone) shard_->cluster_pass_recoded_.fetch_add(1, std::memory_order_relaxed);
  }
  return saved;
}

std::vector<uint64_t> ClusterPolicy::PendingRechecks() {
  absl::MutexLock lock(&shard_->mu_);
  std::vector<uint64_t> ids(recheck_.begin(), recheck_.end());
  std::sort(ids.begin(), ids.end());
  return ids;
}

absl::Status ClusterPolicy::MarkRecheckLocked(uint64_t node_id, bool on) {
  RecordBatch batch(shard_->context_->records);
  {
    absl::MutexLock lock(&shard_->mu_);
    TrieNode* n = shard_->FindLive(node_id);
    if (n == nullptr || n->recheck == on) {
      if (on && n != nullptr) {
        recheck_.insert(node_id);
      } else {
        recheck_.erase(node_id);
      }
      return absl::OkStatus();
    }
    NodeMeta m = shard_->MetaOf(*n);
    m.recheck = on;
    batch.PutNode(shard_->shard_id_, node_id, m, nullptr);  // the record only
  }
  if (auto s = shard_->context_->records->Write(batch); !s.ok()) return s;
  absl::MutexLock lock(&shard_->mu_);
  TrieNode* n = shard_->trie_->Find(node_id);  // write_mu_: still there
  if (n != nullptr) n->recheck = on;
  if (on) {
    recheck_.insert(node_id);
  } else {
    recheck_.erase(node_id);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> ClusterPolicy::SettleClusterGroup(const std::vector<uint64_t>& ids,
                                                           uint32_t budget, bool* done) {
  *done = false;
  struct Vote {
    uint64_t id;
    double path_bits;
    uint64_t hits;
    bool centroid;       // standalone with dependents
    bool lossless;       // bit-exact: coded LOSSLESS and its reconstruction what its Put sent
    uint64_t reference;  // its centroid (0 = standalone)
  };
  std::vector<Vote> votes;
  {
    absl::MutexLock lock(&shard_->mu_);
    const TrieNode* first = nullptr;
    for (uint64_t id : ids) {
      const TrieNode* n = shard_->FindVisible(id);
      // RAW (and baseline) blocks stay as their Put asked: only lossless and residual cluster.
      if (n == nullptr ||
          (n->encoding != Encoding::kLossless && n->encoding != Encoding::kResidual)) {
        continue;
      }
      if (first == nullptr) first = n;
      // Same (depth, tokens) (the group key is a hash of them).
      if (n->depth != first->depth || n->token_ids != first->token_ids) continue;
      votes.push_back({id, n->path_surprisal_bits, n->hits,
                       n->reference_node_id == 0 && shard_->clusters_.HasDependents(id),
                       n->encoding == Encoding::kLossless && !n->lossy, n->reference_node_id});
    }
  }
  if (votes.size() < 2) {
    *done = true;
    return 0;
  }
  // One pass over the group encodes each member at most once (a group may pass the budget by
  // its size when it is the round's first).
  if (budget < votes.size() && budget < shard_->context_->options->cluster_pass_blocks_per_round) {
    return 0;  // the next round starts with it
  }
  // The most probable path (the paper's "most probable prefix"), then the most read; ties keep
  // the current centroid, then a standalone block, then the oldest. A lossy residual is not
  // eligible: stored standalone its reconstruction would be coded losslessly. (A lossy block
  // already re-coded LOSSLESS against a centroid is, but moves only when the group's bytes fall.)
  std::sort(votes.begin(), votes.end(), [](const Vote& a, const Vote& b) {
    if (a.path_bits != b.path_bits) return a.path_bits < b.path_bits;
    if (a.hits != b.hits) return a.hits > b.hits;
    if (a.centroid != b.centroid) return a.centroid;
    if ((a.reference == 0) != (b.reference == 0)) return a.reference == 0;
    return a.id < b.id;
  });
  uint64_t elected = 0;
  for (const Vote& v : votes) {
    if (v.reference == 0 || v.lossless) {
      elected = v.id;
      break;
    }
  }
  if (elected == 0) {
    *done = true;
    return 0;
  }
  std::vector<uint64_t> members;
  for (const Vote& v : votes) {
    if (v.id != elected) members.push_back(v.id);
  }
  absl::StatusOr<uint32_t> spent = ConvergeGroup(elected, members);
  if (!spent.ok()) return spent.status();
  *done = true;
  return *spent;
}

absl::StatusOr<uint32_t> ClusterPolicy::ConvergeGroup(uint64_t elected,
                                                      const std::vector<uint64_t>& members) {
  absl::MutexLock writer(&shard_->write_mu_);  // nothing else re-encodes them meanwhile
  struct Member {
    uint64_t id = 0;
    uint64_t parent = 0;  // 0 = the root
    uint64_t bytes = 0;   // stored now
    uint64_t reference = 0;
    bool centroid = false;  // has dependents
    bool movable = false;   // a centroid whose dependents are all in the group
    bool forced = false;    // a dependent of a movable centroid: moves with it
    bool won = false;       // encoded (smaller, unless forced) in `encoded`
    bool lossless = false;  // stored bit-exact (not a lossy reconstruction coded LOSSLESS)
    EncodedBlock encoded;   // the trial encoding
    uint64_t encoded_reference = 0;
  };
  BlockGeometry g;
  Member e;
  std::vector<Member> others;
  std::vector<std::pair<uint64_t, uint64_t>> outside;  // (dependent, its movable centroid)
  bool e_centroid_in_group = false;
  // e's centroid is a block alone in its group (e repeats it at a position offset), standalone,
  // lossless, and everything coded against it is in this group, at least two blocks: the two
  // swap. This group moves to e (the others' offset residuals become aligned ones, ~26 % of
  // standalone instead of ~36 % on tests/data), and that block is coded against e's path at the
  // offset (RecheckLocked), as e was against it.
  bool swap = false;
  {
    absl::MutexLock lock(&shard_->mu_);
    const auto get = [&](uint64_t id, Member* m) {
      const TrieNode* n = shard_->FindVisible(id);
      if (n == nullptr) return false;
      m->id = id;
      m->parent = n->parent == shard_->trie_->root() || n->parent == nullptr ? 0 : n->parent->id;
      m->bytes = n->bytes_stored;
      m->reference = n->reference_node_id;
      m->centroid = shard_->clusters_.HasDependents(id);
      m->lossless = n->encoding == Encoding::kLossless && !n->lossy;
      return true;
    };
    const TrieNode* en = shard_->FindVisible(elected);
    if (en == nullptr || (en->reference_node_id != 0 && en->encoding != Encoding::kLossless)) {
      return 0;
    }
    get(elected, &e);
    absl::flat_hash_set<uint64_t> group(members.begin(), members.end());
    group.insert(elected);
    absl::flat_hash_set<uint64_t> movable;
    for (uint64_t id : members) {
      Member m;
      if (!get(id, &m) || m.reference == elected) continue;
      if (m.centroid) {
        const std::vector<uint64_t> deps = shard_->clusters_.Dependents(id);
        // Its dependents outside the group (at a position offset) move too, to the candidates
        // the Put path would find (RecodeMemberLocked), after the group.
        m.movable = m.reference == 0;
        if (m.movable) {
          movable.insert(id);
          for (uint64_t d : deps) {
            if (!group.contains(d)) outside.push_back({d, id});
          }
        }
      }
      others.push_back(std::move(m));
    }
    e_centroid_in_group = movable.contains(e.reference);
    if (const TrieNode* c =
            e.reference != 0 && !e_centroid_in_group ? shard_->FindVisible(e.reference) : nullptr) {
      const std::vector<uint64_t> deps = shard_->clusters_.Dependents(c->id);
      swap = e.lossless && c->reference_node_id == 0 && c->encoding == Encoding::kLossless &&
             !c->lossy && shard_->clusters_.GroupSize(*c) == 1 && deps.size() >= 2;
      for (uint64_t d : deps) swap = swap && group.contains(d);
    }
    // A dependent of a centroid that moves (a movable member, or the swapped block) moves too.
    for (Member& m : others) {
      m.forced =
          !m.centroid && (movable.contains(m.reference) || (swap && m.reference == e.reference));
    }
    g = shard_->model_.geometry;
  }
  std::vector<ModelShard::Corrupt> corrupt;
  const auto reconstruct = [&](uint64_t id, std::vector<uint8_t>* out) {
    out->assign(id == 0 ? 0 : g.num_bytes(), 0);
    if (id == 0) return absl::OkStatus();
    absl::Status s = shard_->ReconstructInternal(id, absl::MakeSpan(*out), &corrupt);
    shard_->DropCorruptLocked(corrupt);
    corrupt.clear();
    return s;
  };
  // Every encoding here is of a block's exact reconstruction, lossless: what readers decode does
  // not change.
  const EncodeOptions exact{.encoding = Encoding::kLossless};
  uint32_t spent = 0;
  std::vector<uint8_t> recon, parent;
  // Encodes m against the elected one: kept when smaller than what m stores now, or (forced)
  // than m standalone, which it then becomes otherwise.
  const auto trial = [&](Member* m, bool standalone) -> absl::Status {
    if (!reconstruct(m->id, &recon).ok() || !reconstruct(m->parent, &parent).ok()) {
      m->won = false;
      return absl::OkStatus();  // changed or bad: left as it is
    }
    PredictionContext ctx;
    ctx.parent = parent;
    NearDupEncoded out;
    if (standalone) {
      absl::StatusOr<EncodedBlock> enc = EncodeBlock(g, recon, exact, ctx);
      ++spent;
      if (!enc.ok()) return enc.status();
      out.encoded = *std::move(enc);
      if (m == &e) {
        m->encoded = std::move(out.encoded);
        m->won = true;
        return absl::OkStatus();
      }
    } else {
      out.encoded.bytes.assign(m->bytes, '\0');  // only an encoding smaller than the stored wins
    }
    ++spent;
    absl::StatusOr<bool> found = shard_->put_encoder_->EncodeAgainstCandidates(
        g, recon, exact, ctx, {{.node_id = e.id}}, &out, &corrupt);
    shard_->DropCorruptLocked(corrupt);
    corrupt.clear();
    if (!found.ok()) return found.status();
    m->won = *found || standalone;
    m->encoded_reference = *found ? e.id : 0;
    if (m->won) m->encoded = std::move(out.encoded);
    return absl::OkStatus();
  };
  const auto delta = [](const Member& m) {
    return m.won ? static_cast<int64_t>(m.bytes) - static_cast<int64_t>(m.encoded.bytes.size()) : 0;
  };
  int64_t gain = 0;
  if (e.reference != 0) {  // the elected one standalone first
    if (auto s = trial(&e, true); !s.ok()) return s;
    if (!e.won) return spent;
    gain += delta(e);
  }
  for (Member& m : others) {  // centroids last: once their dependents moved
    if (m.centroid && !m.movable) continue;
    if (auto s = trial(&m, m.forced); !s.ok()) return s;
  }
  for (const Member& m : others) gain += delta(m);
  // A lossy cluster moves only when the group's bytes fall (its members keep their
  // reconstructions, coded losslessly against the elected one's). With the elected one already
  // standalone, the members that are smaller against it go anyway.
  // A lossless cluster moves to its most probable member in any case (bit-exact, and the bytes
  // of every arrival order end near the best's: cluster_pass_test.cc).
  // When the elected one's centroid is outside the group, at a position offset, only to swap
  // (above: that one is then coded against the elected one's path, RecheckLocked); else that
  // one stays, and the move must pay for itself.
  bool lossless = e.lossless && (e.reference == 0 || e_centroid_in_group || swap);
  for (const Member& m : others) {
    if (m.forced || m.movable) lossless = lossless && m.lossless;
  }
  const bool move = gain > 0 || lossless;
  if (!move && e.reference != 0) return spent;
  const auto publish = [&](const Member& m, uint64_t reference) {
    uint64_t replaced = 0;
    absl::Status s =
        shard_->ReplaceEncodingLocked(m.id, m.encoded, Encoding::kLossless, reference, &replaced);
    if (s.ok() && replaced > m.encoded.bytes.size()) {
      shard_->cluster_pass_bytes_saved_.fetch_add(replaced - m.encoded.bytes.size(),
                                                  std::memory_order_relaxed);
    }
    return s;
  };
  if (e.reference != 0) {
    if (auto s = publish(e, 0); !s.ok()) return s;
    shard_->cluster_pass_reelected_.fetch_add(1, std::memory_order_relaxed);
  }
  for (int centroids = 0; centroids < 2; ++centroids) {
    if (centroids == 1 && move) {
      DeleteSummary summary;  // what RecodeMemberLocked wrote (only counted here)
      for (const auto& [d, c] : outside) {
        bool replaced = false;
        ++spent;
        if (auto s = RecodeMemberLocked(d, e.id, {c}, &summary, &replaced); !s.ok()) return s;
        // Its best window may span a group not settled yet: looked at again once all are.
        if (auto s = MarkRecheckLocked(d, true); !s.ok()) return s;
      }
    }
    for (const Member& m : others) {
      if (!m.won || m.centroid != (centroids == 1) || (!move && (m.forced || m.centroid))) {
        continue;
      }
      if (m.centroid) {
        absl::MutexLock lock(&shard_->mu_);
        if (shard_->clusters_.HasDependents(m.id))
          continue;  // one stayed (not smaller): it stays too
      }
      if (auto s = publish(m, m.encoded_reference); !s.ok()) return s;
      if (m.encoded_reference != 0)
        shard_->cluster_pass_recoded_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (swap && move) {
    // Once every group is settled (RunClusterPass).
    if (auto s = MarkRecheckLocked(e.reference, true); !s.ok()) return s;
  }
  return spent;
}

absl::StatusOr<uint32_t> ClusterPolicy::RecheckLocked(uint64_t node_id) {
  BlockGeometry g;
  uint64_t current = 0;
  bool standalone = false;
  std::vector<ClusterIndex::Candidate> candidates;
  {
    absl::MutexLock lock(&shard_->mu_);
    const TrieNode* n = shard_->FindVisible(node_id);
    if (n == nullptr || n->encoding != Encoding::kLossless ||
        shard_->clusters_.HasDependents(node_id)) {
      return 0;  // changed since: not a lossless block without dependents any more
    }
    candidates = StoredCandidatesLocked(*n, {});
    if (candidates.empty()) return 0;
    g = shard_->model_.geometry;
    current = n->bytes_stored;
    standalone = n->reference_node_id == 0;
  }
  absl::StatusOr<uint64_t> saved =
      RecodeAndCountLocked(node_id, g, current, candidates, standalone);
  if (!saved.ok()) return saved.status();
  return static_cast<uint32_t>(candidates.size());
}

}  // namespace kvtrie
