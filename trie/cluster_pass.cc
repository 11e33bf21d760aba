// ClusterPass (trie/cluster_pass.h): the rounds. Each shard's part is ClusterPolicy::RunClusterPass
// (trie/cluster_policy_pass.cc).
#include "trie/cluster_pass.h"

#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/time/time.h"
#include "trie/cluster_policy.h"
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
    absl::StatusOr<uint32_t> spent = shard->cluster_policy().RunClusterPass(
        static_cast<uint32_t>(budget - r.encodings), &groups);
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

}  // namespace kvtrie
