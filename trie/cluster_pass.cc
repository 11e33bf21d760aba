// ClusterPass (trie/cluster_pass.h), and the shard's part of it: ModelShard::RunClusterPass and
// its helpers (declared in trie/model_shard.h, kept here with the pass they serve).
#include "trie/cluster_pass.h"

#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/time/time.h"
#include "trie/model_shard.h"

namespace kvtrie {

ClusterPass::ClusterPass(Options options, std::function<std::vector<ModelShard*>()> shards)
    : options_(options), shards_(std::move(shards)) {}

ClusterPass::~ClusterPass() { Stop(); }

void ClusterPass::Start() {
  if (options_.interval_ms == 0 || thread_.joinable()) return;
  {
    absl::MutexLock lock(&mu_);
    stop_ = false;
  }
  thread_ = std::thread([this] { Loop(); });
}

void ClusterPass::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ClusterPass::Loop() {
  // Linux applies nice per thread: the pass yields the cores to Puts and Gets.
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10) != 0) {
    spdlog::warn("cluster pass: setpriority failed (errno {})", errno);
  }
  const absl::Duration interval = absl::Milliseconds(options_.interval_ms);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), interval);
      if (stop_) return;
    }
    RunRound();
  }
}

ClusterPass::Round ClusterPass::RunRound() {
  absl::MutexLock round(&round_mu_);
  Round r;
  const uint32_t budget = std::max<uint32_t>(options_.blocks_per_round, 1);
  for (ModelShard* shard : shards_()) {
    if (r.encodings >= budget) break;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
    }
    uint64_t groups = 0;
    absl::StatusOr<uint32_t> spent =
        shard->RunClusterPass(static_cast<uint32_t>(budget - r.encodings), &groups);
    r.groups += groups;
    if (!spent.ok()) {
      spdlog::error("cluster pass: namespace '{}': {}", shard->ns(), spent.status().ToString());
      continue;
    }
    r.encodings += *spent;
  }
  if (r.groups > 0) rounds_.fetch_add(1, std::memory_order_relaxed);
  return r;
}

// --- ModelShard's part ----------------------------------------------------------------------

namespace {

// The groups one shard's round looks at, at most (the budget usually ends it first).
constexpr size_t kMaxGroupsPerRound = 4096;

bool Retry(const absl::Status& s) {  // a member that changed meanwhile: skip it, not an error
  return absl::IsNotFound(s) || absl::IsFailedPrecondition(s) || absl::IsAborted(s);
}

}  // namespace

absl::StatusOr<uint32_t> ModelShard::RunClusterPass(uint32_t budget, uint64_t* groups) {
  std::vector<std::pair<uint64_t, std::vector<uint64_t>>> dirty;
  {
    absl::MutexLock lock(&mu_);
    if (!committed_ || !context_->options->near_dup.enabled) return 0;
    dirty = clusters_.DirtyGroups(kMaxGroupsPerRound);
  }
  uint32_t spent = 0;
  for (auto& [key, ids] : dirty) {
    if (spent >= budget) break;
    bool done = false;
    absl::StatusOr<uint32_t> s = SettleClusterGroup(ids, budget - spent, &done);
    if (!s.ok()) return s.status();
    spent += *s;
    ++*groups;
    if (done) {
      absl::MutexLock lock(&mu_);
      clusters_.SettleGroup(key, ids);
    }
  }
  return spent;
}

absl::StatusOr<uint32_t> ModelShard::SettleClusterGroup(const std::vector<uint64_t>& ids,
                                                        uint32_t budget, bool* done) {
  *done = false;
  struct Vote {
    uint64_t id;
    double path_bits;
    uint64_t hits;
    bool centroid;  // standalone with dependents
    bool lossless;
    uint64_t reference;  // its centroid (0 = standalone)
  };
  std::vector<Vote> votes;
  {
    absl::MutexLock lock(&mu_);
    const TrieNode* first = nullptr;
    for (uint64_t id : ids) {
      const TrieNode* n = FindLive(id);
      if (n == nullptr) continue;
      if (first == nullptr) first = n;
      // Same (depth, tokens) (the group key is a hash of them).
      if (n->depth != first->depth || n->token_ids != first->token_ids) continue;
      votes.push_back({id, n->path_surprisal_bits, n->hits,
                       n->reference_node_id == 0 && clusters_.HasDependents(id),
                       n->encoding == Encoding::kLossless, n->reference_node_id});
    }
  }
  if (votes.size() < 2) {
    *done = true;
    return 0;
  }
  // The most probable path (the paper's "most probable prefix"), then the most read; ties keep
  // the current centroid, then a standalone block, then the oldest.
  std::sort(votes.begin(), votes.end(), [](const Vote& a, const Vote& b) {
    if (a.path_bits != b.path_bits) return a.path_bits < b.path_bits;
    if (a.hits != b.hits) return a.hits > b.hits;
    if (a.centroid != b.centroid) return a.centroid;
    if ((a.reference == 0) != (b.reference == 0)) return a.reference == 0;
    return a.id < b.id;
  });
  uint32_t spent = 0;
  uint64_t elected = votes.front().id;
  // A lossless residual elected: its cluster moves to it (bit-exact). A lossy one is not moved
  // (its reconstruction re-encoded losslessly would outgrow what the move saves): the
  // standalone members then go to the most probable standalone member.
  const Vote& e = votes.front();
  if (e.reference != 0) {
    const bool movable = e.lossless && std::any_of(votes.begin(), votes.end(), [&](const Vote& v) {
                           return v.id == e.reference && v.lossless;
                         });
    if (movable) {
      absl::StatusOr<uint32_t> moved = MoveCentroid(e.reference, e.id);
      if (!moved.ok()) return moved.status();
      spent += *moved;
    } else {
      elected = 0;
      for (const Vote& v : votes) {
        if (v.reference == 0) {
          elected = v.id;
          break;
        }
      }
      if (elected == 0) {
        *done = true;
        return spent;
      }
    }
  }
  // Every other standalone member without dependents (an old centroid once moved) against it.
  for (const Vote& v : votes) {
    if (v.id == elected) continue;
    if (spent >= budget) return spent;  // the group stays dirty
    {
      absl::MutexLock lock(&mu_);
      const TrieNode* n = FindLive(v.id);
      if (n == nullptr || n->reference_node_id != 0 || clusters_.HasDependents(v.id)) continue;
    }
    ++spent;
    absl::StatusOr<uint64_t> saved = RecodeAgainstCentroid(v.id, elected);
    if (!saved.ok()) {
      if (Retry(saved.status())) continue;
      return saved.status();
    }
    if (*saved > 0) {
      cluster_pass_recoded_.fetch_add(1, std::memory_order_relaxed);
      cluster_pass_bytes_saved_.fetch_add(*saved, std::memory_order_relaxed);
    }
  }
  *done = true;
  return spent;
}

absl::StatusOr<uint32_t> ModelShard::MoveCentroid(uint64_t old_centroid, uint64_t elected) {
  absl::MutexLock writer(&write_mu_);
  std::vector<uint64_t> members;
  {
    absl::MutexLock lock(&mu_);
    const TrieNode* c = FindLive(old_centroid);
    const TrieNode* e = FindLive(elected);
    // Checked again with write_mu_ held: nothing else re-encodes them now.
    if (c == nullptr || e == nullptr || c->reference_node_id != 0 ||
        e->reference_node_id != old_centroid || e->encoding != Encoding::kLossless ||
        c->encoding != Encoding::kLossless) {
      return 0;
    }
    for (uint64_t d : clusters_.Dependents(old_centroid)) {
      const TrieNode* n = FindLive(d);
      // Lossy members stay on the old centroid (it is kept): moving them would store their
      // reconstruction losslessly.
      if (d != elected && n != nullptr && n->encoding == Encoding::kLossless) members.push_back(d);
    }
  }
  std::sort(members.begin(), members.end());
  DeleteSummary summary;  // what the re-encodings wrote (not a Delete: only counted here)
  const absl::flat_hash_set<uint64_t> leaving = {old_centroid};  // no longer a candidate
  bool replaced = false;
  if (auto s = RecodeMemberLocked(elected, 0, leaving, &summary, &replaced); !s.ok()) return s;
  uint32_t spent = 1;
  if (!replaced) return spent;  // gone meanwhile
  cluster_pass_reelected_.fetch_add(1, std::memory_order_relaxed);
  for (uint64_t id : members) {
    if (auto s = RecodeMemberLocked(id, elected, leaving, &summary, &replaced); !s.ok()) return s;
    ++spent;
  }
  return spent;
}

}  // namespace kvtrie
