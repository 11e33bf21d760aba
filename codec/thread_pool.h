// codec/thread_pool.h
//
// A fixed-size pool of threads for codec work: ParallelFor(n, fn) runs fn(0..n-1) on the pool's
// workers and the calling thread together, and returns when every call has returned. One
// ParallelFor runs at a time (concurrent callers queue). ThreadPool(1) has no workers: everything
// runs on the caller. Thread-safe.
#ifndef KVTRIE_CODEC_THREAD_POOL_H_
#define KVTRIE_CODEC_THREAD_POOL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtrie {

class ThreadPool {
 public:
  // `threads` >= 1 threads take part in a ParallelFor: the caller and threads - 1 workers.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) once for every i in [0, n), in any order and on any of the threads.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  struct Job;
  void WorkerLoop();
  static void RunJob(Job* job);

  absl::Mutex run_mu_;  // serializes ParallelFor callers
  absl::Mutex mu_;
  Job* job_ ABSL_GUARDED_BY(mu_) = nullptr;       // the running job, or null
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped per job
  int active_ ABSL_GUARDED_BY(mu_) = 0;           // workers inside the current job
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_THREAD_POOL_H_
