// trie/cluster_pass.h
//
// ClusterPass: the store's background near-duplicate pass (issue 20). Blocks that arrive
// standalone although they repeat a stored block at the same depth (client-encoded Put blocks,
// which the server stores as their client encoded them; blocks put with clusters off) and
// clusters whose centroid is not the most probable member are settled here, off the Put path.
//
// Every `interval_ms` the pass visits each (namespace, model) shard's dirty near-duplicate
// groups (ClusterIndex::DirtyGroups: those that gained a node since the pass last settled them;
// after a restart every group of two or more nodes, so a crashed pass resumes) and, per group,
// ClusterPolicy::RunClusterPass (trie/cluster_policy.h): elects the centroid (the most probable
// path, i.e. the lowest path surprisal, then the most hits), moves a lossless cluster to it and
// codes the other standalone members against it when that is smaller. Each re-encoding keeps the
// block's exact reconstruction and is published alone (one RecordBatch); a centroid is only
// re-encoded here, never removed, so a Get listed before a move still decodes.
//
// Bounded CPU: at most `blocks_per_round` encodings per round over all shards (a group left
// unfinished stays dirty for the next round); the thread lowers its own priority (nice 10, per
// thread on Linux). No lock is held across rounds; the shard methods follow the store's locking
// (write_mu_ only across their own writes). When nothing changed a round costs one look at each
// shard's dirty set.
//
// Thread-safe. The shards the lister returns must outlive Stop().
#ifndef KVTRIE_TRIE_CLUSTER_PASS_H_
#define KVTRIE_TRIE_CLUSTER_PASS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtrie {

class ModelShard;

class ClusterPass {
 public:
  struct Options {
    uint32_t interval_ms = 1000;     // 0 = no background thread (RunRound still works)
    uint32_t blocks_per_round = 64;  // encodings per round, all shards together (>= 1)
  };
  // What one round did.
  struct Round {
    uint64_t groups = 0;     // dirty groups visited
    uint64_t encodings = 0;  // blocks encoded (tried against a centroid, or moved)
  };

  // `shards` lists the shards to visit now (empty while the store must not write).
  ClusterPass(Options options, std::function<std::vector<ModelShard*>()> shards);
  ~ClusterPass();  // Stop()
  ClusterPass(const ClusterPass&) = delete;
  ClusterPass& operator=(const ClusterPass&) = delete;

  // Starts the background thread (no-op when interval_ms is 0 or already started).
  void Start();
  // Stops and joins it; a round in progress finishes its current encoding first.
  void Stop();
  // One round now, on the caller's thread (tests, and the thread's loop).
  Round RunRound();
  // Rounds that visited at least one dirty group, since start.
  uint64_t rounds() const { return rounds_.load(std::memory_order_relaxed); }

 private:
  void Loop();

  const Options options_;
  const std::function<std::vector<ModelShard*>()> shards_;
  absl::Mutex round_mu_;  // serializes rounds (the thread's and RunRound's); guards nothing else
  absl::Mutex mu_;        // guards stop_
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started and joined by the owner's thread only
  std::atomic<uint64_t> rounds_{0};
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_CLUSTER_PASS_H_
