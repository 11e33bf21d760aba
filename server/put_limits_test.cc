#include "server/put_limits.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvtrie {
namespace {

TEST(PutLimits, RefusesStreamsPastTheBoundAndAdmitsAgainWhenOneEnds) {
  PutLimits limits({.max_concurrent_streams = 2});
  auto a = limits.Admit([] {});
  auto b = limits.Admit([] {});
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = limits.Admit([] {});
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("--max_concurrent_put_streams=2"), std::string::npos);
  a->reset();
  EXPECT_EQ(limits.open_streams(), 1);
  EXPECT_TRUE(limits.Admit([] {}).ok());
}

TEST(PutLimits, ChargesBytesPerNamespaceAndReleasesThemWithTheStream) {
  PutLimits limits({.max_inflight_bytes_per_namespace = 100});
  auto a = *limits.Admit([] {});
  auto b = *limits.Admit([] {});
  auto other = *limits.Admit([] {});
  a->SetNamespace("t");
  b->SetNamespace("t");
  other->SetNamespace("u");
  ASSERT_TRUE(a->Reserve(60).ok());
  absl::Status s = b->Reserve(50);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("namespace 't' has 60 bytes"), std::string::npos) << s;
  EXPECT_TRUE(other->Reserve(100).ok());  // another namespace has its own budget
  EXPECT_TRUE(b->Reserve(40).ok());
  EXPECT_EQ(limits.inflight_bytes("t"), 100u);
  a.reset();
  EXPECT_EQ(limits.inflight_bytes("t"), 40u);
  EXPECT_TRUE(b->Reserve(60).ok());
  b.reset();
  other.reset();
  EXPECT_EQ(limits.inflight_bytes("t"), 0u);
  EXPECT_EQ(limits.inflight_bytes("u"), 0u);
}

TEST(PutLimits, CancelsAnIdleStreamButNotABusyOrCommittedOne) {
  PutLimits limits({.idle_timeout = absl::Milliseconds(200)});
  std::atomic<int> idle_cancels{0}, busy_cancels{0}, committed_cancels{0};
  auto idle = *limits.Admit([&] { ++idle_cancels; });
  auto busy = *limits.Admit([&] { ++busy_cancels; });
  auto committed = *limits.Admit([&] { ++committed_cancels; });
  committed->Committed();
  for (int i = 0; i < 12; ++i) {  // 600 ms: three idle deadlines
    busy->Touch();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(idle_cancels.load(), 1);  // once, not once per check
  EXPECT_TRUE(idle->idle_cancelled());
  EXPECT_EQ(busy_cancels.load(), 0);
  EXPECT_FALSE(busy->idle_cancelled());
  EXPECT_EQ(committed_cancels.load(), 0);
}

TEST(PutLimits, ManyThreadsNeverPassTheBounds) {
  PutLimits limits({.max_concurrent_streams = 4, .max_inflight_bytes_per_namespace = 1000});
  std::atomic<int> max_open{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        auto s = limits.Admit([] {});
        if (!s.ok()) continue;
        (*s)->SetNamespace("n");
        (void)(*s)->Reserve(300);
        const int open = limits.open_streams();
        int seen = max_open.load();
        while (open > seen && !max_open.compare_exchange_weak(seen, open)) {
        }
        EXPECT_LE(limits.inflight_bytes("n"), 1000u);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(max_open.load(), 4);
  EXPECT_EQ(limits.open_streams(), 0);
  EXPECT_EQ(limits.inflight_bytes("n"), 0u);
}

}  // namespace
}  // namespace kvtrie
