// trie/kv_store_testing.h — test-only access to a KvStore's internals.
#ifndef KVTRIE_TRIE_KV_STORE_TESTING_H_
#define KVTRIE_TRIE_KV_STORE_TESTING_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "trie/kv_store.h"

namespace kvtrie {

// What one round of the background cluster pass did (trie/cluster_pass.h).
struct ClusterPassRound {
  uint64_t groups = 0;     // dirty near-duplicate groups visited
  uint64_t encodings = 0;  // blocks encoded
};

class KvStoreTestPeer {
 public:
  // One background pass now: memory demotion to the low watermark, expired pins, disk budget.
  static void RunTierMaintenance(KvStore* store);
  // True if some stored block is a residual of `node_id`.
  static bool HasDependents(KvStore* store, const std::string& ns, const std::string& model_id,
                            uint64_t node_id);
  // The data folder as RocksDB accounts it (trie/record_store.h).
  static uint64_t DiskUsage(KvStore* store);
  // Waits until every block queued for learning was learned from (and any refit published).
  static void DrainLearning(KvStore* store);
  // Runs `hook` in every Delete between re-encoding the near-duplicates coded against the prefix
  // and removing the prefix, with the shard's writer lock held (it may read, not write or
  // Delete). Set it before the store is used concurrently.
  static void SetDeleteHook(KvStore* store, std::function<void()> hook);
  // Runs `hook` whenever a re-election's new encoding of a block is on disk and not yet published
  // (ModelShard::ReplaceEncodingLocked), with the shard's writer lock held (it may read).
  static void SetReplaceHook(KvStore* store, std::function<void()> hook);
  // Frees the learned states nothing needs any more, as the learner does after each refit.
  static void FreeUnusedPredictors(KvStore* store, const std::string& ns,
                                   const std::string& model_id);
  // Evicts those of `node_ids` that are evictable leaves, as the disk budget does (a centroid's
  // members re-elect first). Returns the bytes freed net of the members' growth.
  static absl::StatusOr<uint64_t> Evict(KvStore* store, const std::string& ns,
                                        const std::string& model_id,
                                        const std::vector<uint64_t>& node_ids);
  // One round of the background cluster pass now (trie/cluster_pass.h), with the store's
  // StoreOptions::cluster_pass_blocks_per_round, whether or not its thread runs.
  static ClusterPassRound RunClusterPass(KvStore* store);
  // ClusterPolicy::RecodeAgainstCentroid of (ns, model_id) (trie/cluster_policy.h).
  static absl::StatusOr<uint64_t> RecodeAgainstCentroid(KvStore* store, const std::string& ns,
                                                        const std::string& model_id,
                                                        uint64_t node_id, uint64_t centroid_id);
  // The blocks the cluster pass of (ns, model_id) will look at again once its groups are settled
  // (ClusterPolicy's recheck), ascending; empty for an unknown model.
  static std::vector<uint64_t> PendingRechecks(KvStore* store, const std::string& ns,
                                               const std::string& model_id);
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_KV_STORE_TESTING_H_
