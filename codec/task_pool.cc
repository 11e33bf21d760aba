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

TaskGroup::TaskGroup(TaskPool* pool, int max_pending)
    : pool_(pool),
      max_pending_(max_pending < 1 ? 1 : max_pending),
      state_(std::make_shared<State>()) {}

void TaskGroup::Run(std::function<void()> task) {
  State* st = state_.get();
  {
    absl::MutexLock l(&st->mu);
    const int most = max_pending_;
    auto room = [st, most]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->pending < most; };
    st->mu.Await(absl::Condition(&room));
    ++st->pending;
  }
  pool_->Schedule([state = state_, task = std::move(task)] {
    task();
    absl::MutexLock l(&state->mu);
    --state->pending;
  });
}

void TaskGroup::Wait() {
  State* st = state_.get();
  absl::MutexLock l(&st->mu);
  auto idle = [st]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(st->mu) { return st->pending == 0; };
  st->mu.Await(absl::Condition(&idle));
}

}  // namespace kvtrie
