// server/put_limits.h
//
// PutLimits: what one tenant's Put streams may hold of the server (issue 12, item 4). Each Put
// stream is admitted before its first message and holds:
//   - a slot of `max_concurrent_streams` (0 = unbounded): past it a new stream is refused with
//     RESOURCE_EXHAUSTED, so idle streams cannot grow the server's memory without bound (a
//     stream holds no thread: server/guarded_service.h serves Put as a callback reactor);
//   - the dense KV bytes of the Put, reserved whole from its header (ReserveWhole: the full
//     blocks of its token ids) against `max_inflight_bytes` (all streams; the store's
//     --max_inflight_put_bytes) and its namespace's `max_inflight_bytes_per_namespace` (0 =
//     unbounded each). A stream whose Put does not fit now waits (up to `admit_wait`, while
//     its client stays) for others to finish, so concurrent Puts queue at their header instead
//     of being refused mid-stream; one that waited `admit_wait` is refused with
//     RESOURCE_EXHAUSTED naming the flags. The wait holds no thread (ReserveWholeAsync: the
//     stream is queued and called back when a released stream makes room, oldest first, or at
//     its deadline); ReserveWhole is the blocking form of it. A reservation is at most
//     `max_put_bytes` and each limit; blocks past it are charged one by one (Reserve) and refused
//     past a limit;
//   - a share of the slots per peer: one peer (a client host, or a tenant; the caller names it)
//     holds at most `max_streams_per_peer` (0 = no per-peer bound), so one client cannot take
//     every slot and starve the rest; past it RESOURCE_EXHAUSTED naming
//     --max_put_stream_share_per_peer;
//   - an idle deadline: a stream whose server waits for its client's next message for
//     `idle_timeout` (0 = none) is cancelled through its `cancel` callback
//     (grpc::ServerContextBase::TryCancel; the client sees CANCELLED), so its handler (or
//     reactor) ends and its buffered bytes are released. Only time spent waiting for the client
//     counts (from AwaitClient to Touch): not a message being handled or queued behind other
//     calls' work, not a wait for memory, not the commit — a busy server slows a client down
//     (it reads the next message only when the last is handled), it never cancels it.
// Everything a Stream holds is released when it is destroyed.
//
// Thread-safe. One background thread checks idle and wait deadlines (when idle_timeout or
// admit_wait > 0); the cancel callbacks run on it, under the mutex, so they must not call back
// into PutLimits. The `done` callbacks of ReserveWholeAsync run without the mutex held.
#ifndef KVTRIE_SERVER_PUT_LIMITS_H_
#define KVTRIE_SERVER_PUT_LIMITS_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvtrie {

struct PutLimitOptions {
  uint32_t max_concurrent_streams = 0;            // 0 = unbounded
  uint64_t max_inflight_bytes = 0;                // all streams; 0 = unbounded
  uint64_t max_inflight_bytes_per_namespace = 0;  // 0 = unbounded
  absl::Duration admit_wait = absl::Seconds(60);  // ReserveWhole's longest wait
  uint64_t max_put_bytes = 0;                     // ReserveWhole reserves at most this (0 = no cap)
  absl::Duration idle_timeout = absl::ZeroDuration();  // 0 = none
  uint32_t max_streams_per_peer = 0;                   // 0 = no per-peer bound
  // Tests: the clock of the idle and wait deadlines (Unix nanoseconds; null: the wall clock) and
  // whether a background thread checks them (false: the test calls CheckDeadlines after it steps
  // its clock), so that no test races a wall-clock deadline.
  std::function<int64_t()> clock_ns = nullptr;
  bool watchdog_thread = true;
};

class PutLimits {
 public:
  class Stream;

  explicit PutLimits(const PutLimitOptions& options);
  ~PutLimits();  // every Stream must be gone
  PutLimits(const PutLimits&) = delete;
  PutLimits& operator=(const PutLimits&) = delete;

  // Admits a new stream of `peer` (counted against max_streams_per_peer; "" = not counted).
  // `cancel` cancels it (called at most once, from the watchdog thread). Errors:
  // RESOURCE_EXHAUSTED when max_concurrent_streams are open, or `peer` holds its share.
  absl::StatusOr<std::unique_ptr<Stream>> Admit(std::function<void()> cancel,
                                                const std::string& peer = "");

  // One pass of the watchdog: cancels the streams idle past idle_timeout and fails the waits past
  // admit_wait (the background thread calls it every quarter of the shorter one).
  void CheckDeadlines();

  int open_streams() const;
  uint64_t inflight_bytes(const std::string& ns) const;
  uint64_t total_inflight_bytes() const;

 private:
  friend class Stream;
  using Done = std::function<void(absl::Status)>;
  void Release(Stream* stream);
  void WatchdogLoop();
  int64_t NowNs() const {
    return options_.clock_ns ? options_.clock_ns() : absl::GetCurrentTimeNanos();
  }
  // Whether `bytes` more fit for `stream` now; Charge charges them (and ends the idle time).
  bool FitsLocked(const Stream* stream, uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ChargeLocked(Stream* stream, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WaitedTooLongLocked(const Stream* stream, uint64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Grants the waiters that fit now (oldest first); their callbacks go to `granted`.
  void GrantWaitersLocked(std::vector<Done>* granted) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PutLimitOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(mu_);  // every admitted, live stream
  absl::flat_hash_map<std::string, uint64_t> ns_bytes_ ABSL_GUARDED_BY(mu_);  // by namespace
  uint64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;                             // all namespaces
  std::deque<Stream*> waiters_ ABSL_GUARDED_BY(mu_);  // in ReserveWholeAsync, oldest first
  absl::flat_hash_map<std::string, uint32_t> peer_streams_ ABSL_GUARDED_BY(mu_);  // by peer
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

// One admitted Put stream. Not thread-safe (one handler), except that the watchdog reads its
// last activity and cancels it.
class PutLimits::Stream {
 public:
  ~Stream();  // releases the slot and the bytes
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // The server asks the client for its next message: the idle deadline runs from now.
  void AwaitClient();
  // A message arrived: no idle deadline until the next AwaitClient (handling it, or waiting for
  // a handler thread, is the server's time). Any thread (a reactor calls it from OnReadDone).
  void Touch();
  // The namespace bytes are charged to (set once, from the header).
  void SetNamespace(const std::string& ns);
  // Reserves the whole Put's `bytes` (capped as above; after SetNamespace), waiting while they
  // do not fit yet (up to admit_wait; `cancelled` is polled and ends the wait with CANCELLED).
  // Errors: RESOURCE_EXHAUSTED naming the flags after the wait; nothing is charged then.
  absl::Status ReserveWhole(uint64_t bytes, const std::function<bool()>& cancelled);
  // The same without blocking: `done` is called exactly once with the outcome (OK: charged) —
  // at once on this thread when the bytes fit or admit_wait is 0, else later from the thread
  // that released a stream (room made) or from the watchdog (RESOURCE_EXHAUSTED at the
  // deadline), never with the mutex held — unless CancelWait() takes the wait back first. One
  // wait at a time per stream; destroying the stream drops a pending wait without calling it.
  void ReserveWholeAsync(uint64_t bytes, std::function<void(absl::Status)> done);
  // Ends a pending ReserveWholeAsync: true if it was pending (`done` will not be called), false
  // if there was none or its `done` has been (or is being) called.
  bool CancelWait();
  // A block of `bytes` arrived: taken from the whole reservation while it lasts, else charged
  // to the namespace and the total. Errors: RESOURCE_EXHAUSTED naming the namespace and the
  // flag, with nothing charged.
  absl::Status Reserve(uint64_t bytes);
  // The commit arrived: the idle deadline no longer applies (encoding may take a while).
  void Committed() { committed_.store(true, std::memory_order_relaxed); }
  // True once the watchdog cancelled this stream for its idle deadline.
  bool idle_cancelled() const { return idle_cancelled_.load(std::memory_order_acquire); }

 private:
  friend class PutLimits;
  Stream(PutLimits* owner, std::function<void()> cancel);

  PutLimits* const owner_;
  const std::function<void()> cancel_;
  std::string peer_;  // counted in owner_->peer_streams_ ("" = not counted); set at Admit
  std::string ns_;
  uint64_t bytes_ = 0;   // charged to ns_ (guarded by owner_->mu_ for the map, written here only)
  uint64_t unused_ = 0;  // of bytes_, reserved by ReserveWhole and not yet taken by Reserve
  // A pending ReserveWholeAsync (guarded by owner_->mu_): what it waits for, until when.
  bool waiting_ = false;
  uint64_t wait_bytes_ = 0;
  absl::Time wait_deadline_;
  std::function<void(absl::Status)> wait_done_;
  // absl::GetCurrentTimeNanos() when the server last asked for a message (or charged bytes).
  std::atomic<int64_t> last_activity_ns_;
  std::atomic<bool> awaiting_client_{true};  // a read is asked for and has not arrived
  std::atomic<bool> idle_cancelled_{false};
  std::atomic<bool> committed_{false};
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_PUT_LIMITS_H_
