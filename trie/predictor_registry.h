// trie/predictor_registry.h
//
// PredictorRegistry: the learned predictor states (codec/predictor_state.h) of ONE (namespace,
// model), owned by its ModelShard (trie/model_shard.h); never shared across namespaces, since a
// table learned from one tenant's prompts would leak them. It holds
//   - the learner, fed with the blocks of committed Puts on the store's background LearnQueue
//     (never on a Put's critical path), bounded by PredictorOptions::memory_bytes: dense blocks as
//     they came, and blocks their client encoded (an encoded Put) decoded there first, each
//     against the version it names (held until then). A large Put is sampled across its whole
//     length (SpreadSample), as much of it as the queue has room for;
//   - every published version: immutable, numbered 1, 2, ... per (namespace, model), each with the
//     count of stored blocks coded against it ("dependents", from BlockHeader::predictor_version
//     kept in the node record) and of Puts encoding against it now ("pending").
// Life of a version: fitted -> persisted by the shard (RecordStore, inside the disk budget) ->
// Publish (now the latest: new kResidual blocks code against it) -> kept while it is the latest,
// has dependents, pending Puts or readers -> TakeUnused hands it to the shard, which deletes it on
// disk and then Forgets it. A reader (a Get, a reconstruction) that listed a block naming a
// version holds it (Hold) until its BlockRead goes, as a RocksDB iterator holds its Version: a
// block re-encoded meanwhile (a Delete's near-duplicates) still decodes from the reader's
// snapshot. Recovery restores every persisted version (RecoverVersion); one whose
// bytes are unreadable stays listed with its error, and Find returns that DATA_LOSS, so only its
// dependents fail. Memory: the latest version and the PredictorOptions::resident_versions most
// recently used others stay in memory; the rest are read back from the record layer (through the
// shard's Loader) when a block needs them.
//
// Thread-safe: mu_ guards everything but the learner; the learner is used only by the one
// LearnQueue thread (learn_mu_ documents and checks that). Lock order: ModelShard::mu_ -> mu_,
// and learn_mu_ -> mu_ (no shard lock is held while learning).
//
// LearnQueue: one background thread for the whole store running jobs in order, bounded by the
// bytes they hold; Push refuses (and the caller counts a drop) past the bound. The thread is named
// "kvtrie-learn" and runs at nice +kLearnerNice (Linux nice is per thread), so on a busy core the
// scheduler gives Puts and Gets the CPU first and learning takes what is left.
#ifndef KVTRIE_TRIE_PREDICTOR_REGISTRY_H_
#define KVTRIE_TRIE_PREDICTOR_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/predictor_state.h"
#include "trie/store_types.h"

namespace kvtrie {

class PredictorRegistry : public std::enable_shared_from_this<PredictorRegistry> {
 public:
  // Reads a persisted version back (RocksDB, then PredictorState::Parse). Called with no lock.
  using Loader =
      std::function<absl::StatusOr<std::shared_ptr<const PredictorState>>(uint32_t version)>;

  PredictorRegistry(const BlockGeometry& geometry, const PredictorOptions& options, Loader loader);
  PredictorRegistry(const PredictorRegistry&) = delete;
  PredictorRegistry& operator=(const PredictorRegistry&) = delete;

  // --- Recovery (before the store serves) ---
  // A persisted version: its parsed state, or the error reading or parsing it (DATA_LOSS).
  void RecoverVersion(uint32_t version, absl::StatusOr<std::shared_ptr<const PredictorState>> state,
                      uint64_t state_bytes, uint64_t tokens_learned);

  // --- Dependents ---
  // A stored block coded against `version` was added (+1) or removed (-1). 0 is ignored.
  void AddDependent(uint32_t version, int sign);
  // A block coded against `version` was stored; `bytes` is its EncodedBlock::learned_bytes_saved
  // (Stats predictor_bytes_saved, Inspect bytes_saved). 0 or an unknown version is ignored.
  void AddBytesSaved(uint32_t version, double bytes);
  bool HasVersion(uint32_t version) const;

  // --- Encoding ---
  // The latest readable state, counted as pending until Release (so it is not dropped between
  // the encode and the commit); null when there is none or learning is off.
  std::shared_ptr<const PredictorState> AcquireLatest();
  void Release(uint32_t version);
  // For a block its client encoded against `version` (an encoded Put): counted as pending until
  // Release, like AcquireLatest, and returned (read back when not resident). Errors:
  // FAILED_PRECONDITION naming `predictor_version` and the latest version when it is not kept
  // (or is being freed); DATA_LOSS when its persisted bytes are unreadable.
  absl::StatusOr<std::shared_ptr<const PredictorState>> AcquireVersion(uint32_t version);
  // The latest readable version (0 = none).
  uint32_t latest_version() const;

  // --- Readers ---
  // Keeps `version` from being freed (TakeUnused skips it) until the returned handle and every
  // copy of it are gone. Null for 0 or a version not kept. Take it with the owning shard's lock
  // held while listing a block that names `version`, so no version leaves between the listing
  // and the hold. REQUIRES: this registry is owned by a shared_ptr.
  std::shared_ptr<const void> Hold(uint32_t version);
  // True once since a released hold left a version that nothing needs any more: the shard's next
  // Get then frees it on the LearnQueue (ShardLearning::FreeUnusedPredictors; a Delete, an
  // eviction, a refit or a restart frees it too).
  bool TakeFreeHint() { return free_hint_.exchange(false, std::memory_order_acq_rel); }

  // --- Decoding ---
  // Reads it back when it is not resident. Errors: NOT_FOUND naming the version when it is not
  // kept; DATA_LOSS when its persisted bytes are unreadable; the loader's I/O errors.
  absl::StatusOr<std::shared_ptr<const PredictorState>> Find(uint32_t version);
  // Find's NOT_FOUND or DATA_LOSS, without reading the state back; OK if it is kept and readable.
  absl::Status Check(uint32_t version) const;

  // --- Learning (the LearnQueue thread only) ---
  // Adds one committed block (see PredictorLearner::Observe). Returns true when a refit is due.
  absl::StatusOr<bool> Observe(absl::Span<const uint8_t> kv, absl::Span<const int32_t> tokens,
                               uint32_t first_position, int32_t previous_token);
  // Fits the next version (not yet published).
  absl::StatusOr<std::shared_ptr<const PredictorState>> Fit();
  // Makes a persisted state the latest.
  void Publish(std::shared_ptr<const PredictorState> state, uint64_t state_bytes);

  // --- Freeing ---
  // Versions that are not the latest and have no dependents, pending Puts or readers, marked so
  // that they are not handed out again; the caller deletes them on disk, then calls Forget (or
  // Unmark when the delete failed).
  std::vector<uint32_t> TakeUnused();
  void Forget(const std::vector<uint32_t>& versions);
  void Unmark(const std::vector<uint32_t>& versions);
  uint64_t StateBytes(uint32_t version) const;

  // --- Observability ---
  std::vector<PredictorVersionView> Versions() const;  // oldest first
  void AddStats(StoreStats* s) const;
  // `n` committed blocks were not learned from (not in their Put's sample, no room in the queue,
  // or, for one its client encoded, it did not decode); `encoded` of them were client-encoded.
  void CountDropped(uint64_t n, uint64_t encoded) {
    observations_dropped_.fetch_add(n, std::memory_order_relaxed);
    encoded_dropped_.fetch_add(encoded, std::memory_order_relaxed);
  }
  // A client-encoded block was decoded on the LearnQueue thread and learned from.
  void CountEncodedObserved() { encoded_observed_.fetch_add(1, std::memory_order_relaxed); }

 private:
  struct Version {
    std::shared_ptr<const PredictorState> state;  // null when unreadable or not resident
    absl::Status error;                           // why it is unreadable (OK: readable)
    std::string description;                      // PredictorState::Describe()
    uint64_t memory_bytes = 0;                    // PredictorState::memory_bytes()
    uint64_t last_use = 0;                        // for residency
    uint64_t state_bytes = 0;
    uint64_t tokens_learned = 0;
    uint64_t dependents = 0;
    uint64_t pending = 0;
    uint64_t readers = 0;    // Hold handles alive
    double bytes_saved = 0;  // since start
    bool freeing = false;
  };

  // Hold's release: a reader of `version` is done.
  void ReleaseHold(uint32_t version);
  // Drops from memory the least recently used versions past resident_versions (never the latest).
  void TrimResidentLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Check's answer: NOT_FOUND if `version` is not kept, DATA_LOSS if it is unreadable.
  absl::Status CheckLocked(uint32_t version) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetStateLocked(Version* v, std::shared_ptr<const PredictorState> state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const BlockGeometry geometry_;
  const PredictorOptions options_;
  const Loader loader_;

  mutable absl::Mutex mu_;
  std::map<uint32_t, Version> versions_ ABSL_GUARDED_BY(mu_);
  uint32_t latest_ ABSL_GUARDED_BY(mu_) = 0;  // the latest readable version (0 = none)
  uint32_t max_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t learner_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // the learner's, as of its last Observe
  uint64_t uses_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex learn_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // the LearnQueue thread's
  std::unique_ptr<PredictorLearner> learner_ ABSL_GUARDED_BY(learn_mu_);
  absl::Status learner_error_ ABSL_GUARDED_BY(learn_mu_);
  uint64_t tokens_since_fit_ ABSL_GUARDED_BY(learn_mu_) = 0;

  double bytes_saved_ ABSL_GUARDED_BY(mu_) = 0;  // since start, every version (freed ones too)
  std::atomic<uint64_t> fits_{0}, observations_{0}, observations_dropped_{0}, freed_{0};
  std::atomic<uint64_t> encoded_observed_{0}, encoded_dropped_{0};  // client-encoded blocks
  std::atomic<bool> free_hint_{false};                              // see TakeFreeHint
};

inline constexpr int kLearnerNice = 10;

// Which `k` of a Put's `n` new blocks to learn from, spread over the whole Put rather than its
// first k: min(n, k) distinct indices in [0, n), ascending, one in each of min(n, k) equal strides
// of [0, n), at the same offset `seed` picks inside every stride (so the first is in the first
// stride and the last in the last: a Put contributes its start, middle and end). Deterministic.
std::vector<uint32_t> SpreadSample(uint32_t n, uint32_t k, uint64_t seed);

class LearnQueue {
 public:
  explicit LearnQueue(uint64_t max_bytes);
  ~LearnQueue();  // Stop()
  LearnQueue(const LearnQueue&) = delete;
  LearnQueue& operator=(const LearnQueue&) = delete;

  using Job = std::pair<uint64_t, std::function<void()>>;  // (bytes it holds, the job)

  // Queues `job` holding `bytes`; false (job dropped) when that passes the bound or after Stop.
  bool Push(uint64_t bytes, std::function<void()> job);
  // Queues a sample of `jobs` (the blocks of one Put, in order) spread over all of them
  // (SpreadSample with `seed`): as many as the free bytes hold at their mean size. Returns which
  // were queued (one flag per job); the others are destroyed, with no lock held. None after Stop.
  std::vector<bool> PushSample(std::vector<Job> jobs, uint64_t seed);
  uint64_t max_bytes() const { return max_bytes_; }
  // Waits until every queued job has run (tests).
  void Drain();
  // Runs no more jobs (those queued are dropped) and joins the thread.
  void Stop();

 private:
  void Run();

  const uint64_t max_bytes_;
  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool running_job_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_PREDICTOR_REGISTRY_H_
