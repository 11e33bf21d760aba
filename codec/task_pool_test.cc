#include "codec/task_pool.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(TaskPool, EveryTaskRunsOnceAndWaitSeesThem) {
  for (int threads : {1, 2, 4}) {
    TaskPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    std::vector<std::atomic<int>> hits(500);
    TaskGroup group(&pool, 8);
    for (size_t i = 0; i < hits.size(); ++i) group.Run([&hits, i] { hits[i].fetch_add(1); });
    group.Wait();
    for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << i;
  }
}

TEST(TaskPool, RunsOnSeveralThreadsWhileTheCallerGoesOn) {
  TaskPool pool(2);
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> inside{0};
  std::atomic<bool> overlapped{false};
  TaskGroup group(&pool, 64);
  for (int i = 0; i < 32; ++i) {
    group.Run([&] {
      if (inside.fetch_add(1) > 0) overlapped = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      inside.fetch_sub(1);
      std::lock_guard<std::mutex> l(mu);
      ids.insert(std::this_thread::get_id());
    });
  }
  // Run returned before the tasks did: the caller was free meanwhile.
  EXPECT_GT(inside.load() + 1, 0);
  group.Wait();
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_TRUE(overlapped.load());
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u);
}

TEST(TaskPool, MaxPendingBoundsTheQueue) {
  TaskPool pool(1);
  std::atomic<int> pending{0};
  std::atomic<int> most{0};
  TaskGroup group(&pool, 3);
  for (int i = 0; i < 40; ++i) {
    const int now = pending.fetch_add(1) + 1;
    int m = most.load();
    while (now > m && !most.compare_exchange_weak(m, now)) {
    }
    group.Run([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      pending.fetch_sub(1);
    });
  }
  group.Wait();
  EXPECT_EQ(pending.load(), 0);
  EXPECT_LE(most.load(), 4);  // 3 in the group, plus the one being added
}

TEST(TaskPool, GroupsOfSeveralOwnersAreSeparate) {
  TaskPool pool(2);
  std::atomic<long> a{0}, b{0};
  std::thread other([&] {
    TaskGroup g(&pool, 4);
    for (int i = 0; i < 100; ++i) g.Run([&] { b += 2; });
  });  // the destructor waits
  {
    TaskGroup g(&pool, 4);
    for (int i = 0; i < 100; ++i) g.Run([&] { a += 1; });
    g.Wait();
    EXPECT_EQ(a.load(), 100);
  }
  other.join();
  EXPECT_EQ(b.load(), 200);
}

}  // namespace
}  // namespace kvtrie
