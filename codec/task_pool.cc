#include "codec/task_pool.h"

#include <utility>

namespace kvtrie {

TaskPool::TaskPool(int threads) {
  for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

TaskPool::~TaskPool() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
}

void TaskPool::Schedule(std::function<void()> task) {
  absl::MutexLock l(&mu_);
  queue_.push_back(std::move(task));
}

void TaskPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void TaskGroup::Run(std::function<void()> task) {
  {
    absl::MutexLock l(&mu_);
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ < max_pending_; };
    mu_.Await(absl::Condition(&room));
    ++pending_;
  }
  pool_->Schedule([this, task = std::move(task)] {
    task();
    absl::MutexLock l(&mu_);
    --pending_;
  });
}

void TaskGroup::Wait() {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

}  // namespace kvtrie
