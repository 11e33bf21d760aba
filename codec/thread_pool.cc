#include "codec/thread_pool.h"

#include <atomic>

namespace kvtrie {

struct ThreadPool::Job {
  const std::function<void(size_t)>* fn = nullptr;
  size_t n = 0;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
};

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunJob(Job* job) {
  for (;;) {
    const size_t i = job->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job->n) return;
    (*job->fn)(i);
    job->done.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    Job* job;
    {
      absl::MutexLock l(&mu_);
      auto woken = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return stop_ || generation_ != seen; };
      mu_.Await(absl::Condition(&woken));
      if (stop_) return;
      seen = generation_;
      job = job_;
      if (job == nullptr) continue;
      ++active_;
    }
    RunJob(job);
    absl::MutexLock l(&mu_);
    --active_;
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  absl::MutexLock run(&run_mu_);
  Job job;
  job.fn = &fn;
  job.n = n;
  {
    absl::MutexLock l(&mu_);
    job_ = &job;
    ++generation_;
  }
  RunJob(&job);
  absl::MutexLock l(&mu_);
  // No worker may still hold `job` when it goes out of scope.
  auto finished = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return job.done.load(std::memory_order_acquire) == n && active_ == 0;
  };
  mu_.Await(absl::Condition(&finished));
  job_ = nullptr;
}

}  // namespace kvtrie
