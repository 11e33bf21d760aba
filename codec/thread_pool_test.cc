#include "codec/thread_pool.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(ThreadPool, EveryIndexRunsExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](size_t i) { hits[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << i;
    }
  }
}

TEST(ThreadPool, UsesMoreThanOneThread) {
  ThreadPool pool(2);
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> inside{0};
  std::atomic<bool> overlapped{false};
  pool.ParallelFor(64, [&](size_t) {
    if (inside.fetch_add(1) > 0) overlapped = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    inside.fetch_sub(1);
    std::lock_guard<std::mutex> l(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_TRUE(overlapped.load());
}

TEST(ThreadPool, ConcurrentCallersEachGetTheirOwnJob) {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 20; ++r) pool.ParallelFor(100, [&](size_t i) { sum += i; });
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4L * 20 * 4950);
}

}  // namespace
}  // namespace kvtrie
