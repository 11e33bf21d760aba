// codec/task_pool.h
//
// TaskPool: a fixed set of threads that run scheduled tasks in the order they were scheduled
// (FIFO), for codec work that overlaps with the caller (a Put's blocks are encoded while its
// stream goes on: trie/put_session.h). Unlike ThreadPool::ParallelFor (codec/thread_pool.h),
// Schedule returns at once; the caller waits for its own tasks (e.g. with a TaskGroup).
// TaskGroup: counts the tasks one owner scheduled and waits for them (Wait, or its destructor).
// Thread-safe. The destructor of TaskPool runs every task still queued, then joins its threads.
#ifndef KVTRIE_CODEC_TASK_POOL_H_
#define KVTRIE_CODEC_TASK_POOL_H_

#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvtrie {

class TaskPool {
 public:
  explicit TaskPool(int threads);  // threads >= 1
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()); }
  void Schedule(std::function<void()> task);

 private:
  void WorkerLoop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

// The tasks of one owner on a TaskPool: Run schedules one, Wait returns once every task Run so
// far has returned; at most `max_pending` run or wait in the queue at once (Run blocks past it:
// backpressure on the producer). The destructor waits.
class TaskGroup {
 public:
  TaskGroup(TaskPool* pool, int max_pending);
  ~TaskGroup() { Wait(); }
  TaskGroup(const TaskGroup&) = delete;
  TaskGroup& operator=(const TaskGroup&) = delete;

  void Run(std::function<void()> task);
  void Wait();

 private:
  // Shared with the running tasks, so a task still unlocking it when Wait returns does not
  // touch a destroyed mutex.
  struct State {
    absl::Mutex mu;
    int pending ABSL_GUARDED_BY(mu) = 0;
  };
  TaskPool* const pool_;
  const int max_pending_;
  const std::shared_ptr<State> state_;
};

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_TASK_POOL_H_
