#include "server/put_limits.h"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
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

// The idle deadline on a clock the test steps, checked when the test says (no watchdog thread):
// nothing depends on how fast the machine runs the test (issue 30, row 7).
struct SteppedClock {
  std::atomic<int64_t> ns{int64_t{1} << 50};
  void Advance(absl::Duration d) { ns += absl::ToInt64Nanoseconds(d); }
};

PutLimitOptions SteppedIdle(SteppedClock& clock, absl::Duration idle) {
  PutLimitOptions o;
  o.idle_timeout = idle;
  o.clock_ns = [&clock] { return clock.ns.load(); };
  o.watchdog_thread = false;
  return o;
}

TEST(PutLimits, CancelsAnIdleStreamButNotABusyOrCommittedOne) {
  SteppedClock clock;
  PutLimits limits(SteppedIdle(clock, absl::Milliseconds(200)));
  std::atomic<int> idle_cancels{0}, busy_cancels{0}, committed_cancels{0};
  auto idle = *limits.Admit([&] { ++idle_cancels; });
  auto busy = *limits.Admit([&] { ++busy_cancels; });
  auto committed = *limits.Admit([&] { ++committed_cancels; });
  idle->AwaitClient();
  busy->AwaitClient();
  committed->AwaitClient();
  committed->Committed();
  for (int i = 0; i < 12; ++i) {  // 600 ms: three idle deadlines, checked every 50 ms
    busy->Touch();
    busy->AwaitClient();
    clock.Advance(absl::Milliseconds(50));
    limits.CheckDeadlines();
    EXPECT_EQ(idle_cancels.load(), i >= 3 ? 1 : 0) << "at " << (i + 1) * 50 << " ms";
  }
  EXPECT_EQ(idle_cancels.load(), 1);  // once, not once per check
  EXPECT_TRUE(idle->idle_cancelled());
  EXPECT_EQ(busy_cancels.load(), 0);
  EXPECT_FALSE(busy->idle_cancelled());
  EXPECT_EQ(committed_cancels.load(), 0);
}

TEST(PutLimits, TimeTheServerSpendsOnAMessageIsNeverIdle) {
  // Issue 18: a reactor reads the next message only when the last is handled, so while the
  // server is busy (or the message waits for a handler thread) the client cannot send: only the
  // time from AwaitClient (a read asked for) to Touch (it arrived) counts.
  SteppedClock clock;
  PutLimits limits(SteppedIdle(clock, absl::Milliseconds(200)));
  std::atomic<int> cancels{0};
  auto stream = *limits.Admit([&] { ++cancels; });
  stream->Touch();  // a message arrived; the server takes 600 ms (three deadlines) on it
  clock.Advance(absl::Milliseconds(600));
  limits.CheckDeadlines();
  EXPECT_EQ(cancels.load(), 0);
  EXPECT_FALSE(stream->idle_cancelled());
  stream->AwaitClient();  // now the server waits for the client, which sends nothing
  clock.Advance(absl::Milliseconds(199));
  limits.CheckDeadlines();
  EXPECT_EQ(cancels.load(), 0);
  clock.Advance(absl::Milliseconds(1));
  limits.CheckDeadlines();
  EXPECT_EQ(cancels.load(), 1);
  EXPECT_TRUE(stream->idle_cancelled());
}

TEST(PutLimits, TheBackgroundWatchdogCancelsAnIdleStream) {
  // The thread that runs CheckDeadlines in a server: only that it fires (no bound on when).
  PutLimits limits({.idle_timeout = absl::Milliseconds(50)});
  absl::Notification cancelled;
  auto stream = *limits.Admit([&] { cancelled.Notify(); });
  stream->AwaitClient();
  EXPECT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(60)));
}

TEST(PutLimits, OnePeerHoldsAtMostItsShareOfTheSlots) {
  PutLimits limits({.max_concurrent_streams = 4, .max_streams_per_peer = 2});
  auto a1 = limits.Admit([] {}, "ipv4:10.0.0.1");
  auto a2 = limits.Admit([] {}, "ipv4:10.0.0.1");
  ASSERT_TRUE(a1.ok() && a2.ok());
  absl::StatusOr<std::unique_ptr<PutLimits::Stream>> a3 = limits.Admit([] {}, "ipv4:10.0.0.1");
  EXPECT_EQ(a3.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(a3.status().message().find("--max_put_stream_share_per_peer"), std::string::npos)
      << a3.status();
  EXPECT_NE(a3.status().message().find("ipv4:10.0.0.1"), std::string::npos) << a3.status();
  // Another peer still gets a slot, and so does a stream of no named peer.
  EXPECT_TRUE(limits.Admit([] {}, "ipv4:10.0.0.2").ok());
  auto unnamed = limits.Admit([] {});
  EXPECT_TRUE(unnamed.ok());
  // A slot the first peer gives back is its own again.
  a1->reset();
  EXPECT_TRUE(limits.Admit([] {}, "ipv4:10.0.0.1").ok());
}

TEST(PutLimits, ReserveWholeWaitsForOtherStreamsInsteadOfFailing) {
  PutLimits limits({.max_inflight_bytes = 100, .max_inflight_bytes_per_namespace = 80});
  auto a = *limits.Admit([] {});
  auto b = *limits.Admit([] {});
  a->SetNamespace("t");
  b->SetNamespace("t");
  ASSERT_TRUE(a->ReserveWhole(60, [] { return false; }).ok());
  EXPECT_EQ(limits.inflight_bytes("t"), 60u);
  std::atomic<bool> admitted{false};
  std::thread waiter([&] {
    EXPECT_TRUE(b->ReserveWhole(50, [] { return false; }).ok());
    admitted = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(admitted.load());  // 60 + 50 > 80: it waits
  // The reserved bytes pay for the blocks as they arrive; only past them is more charged.
  EXPECT_TRUE(a->Reserve(30).ok());
  EXPECT_TRUE(a->Reserve(30).ok());
  EXPECT_EQ(limits.inflight_bytes("t"), 60u);
  a.reset();  // the first stream ends: the second gets its bytes
  waiter.join();
  EXPECT_TRUE(admitted.load());
  EXPECT_EQ(limits.inflight_bytes("t"), 50u);
  EXPECT_EQ(limits.total_inflight_bytes(), 50u);
  b.reset();
  EXPECT_EQ(limits.total_inflight_bytes(), 0u);
}

TEST(PutLimits, ReserveWholeGivesUpAfterItsWaitOrWhenCancelled) {
  PutLimits limits({.max_inflight_bytes = 100, .admit_wait = absl::Milliseconds(200)});
  auto a = *limits.Admit([] {});
  auto b = *limits.Admit([] {});
  a->SetNamespace("t");
  b->SetNamespace("u");
  ASSERT_TRUE(a->ReserveWhole(90, [] { return false; }).ok());
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = b->ReserveWhole(20, [] { return false; });
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(150));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max_inflight_put_bytes=100"), std::string::npos) << s;
  EXPECT_EQ(limits.inflight_bytes("u"), 0u);  // nothing charged
  s = b->ReserveWhole(20, [] { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  // Blocks past a reservation are charged one by one, and refused past the limit.
  EXPECT_TRUE(b->Reserve(10).ok());
  s = b->Reserve(10);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max_inflight_put_bytes=100"), std::string::npos) << s;
  EXPECT_EQ(limits.total_inflight_bytes(), 100u);
}

TEST(PutLimits, ReserveWholeAsyncCallsBackWhenRoomIsMadeAtItsDeadlineOrNotWhenTakenBack) {
  PutLimits limits({.max_inflight_bytes = 100, .admit_wait = absl::Milliseconds(300)});
  auto a = *limits.Admit([] {});
  auto b = *limits.Admit([] {});
  auto c = *limits.Admit([] {});
  auto d = *limits.Admit([] {});
  for (auto* s : {a.get(), b.get(), c.get(), d.get()}) s->SetNamespace("t");
  std::vector<absl::Status> got;   // outcomes, in the order called back
  std::vector<std::string> names;  // whose
  absl::Mutex mu;
  auto record = [&](std::string name) {
    return [&, name](absl::Status s) {
      absl::MutexLock lock(&mu);
      got.push_back(s);
      names.push_back(name);
    };
  };
  a->ReserveWholeAsync(80, record("a"));  // fits: called back at once, on this thread
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].ok());
  b->ReserveWholeAsync(50, record("b"));  // waits; no thread does
  c->ReserveWholeAsync(60, record("c"));  // waits, then is taken back
  EXPECT_TRUE(c->CancelWait());
  EXPECT_FALSE(c->CancelWait());
  EXPECT_EQ(got.size(), 1u);
  a.reset();  // room: the waiter is charged and called back from here
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(got[1].ok());
    EXPECT_EQ(names[1], "b");
  }
  EXPECT_EQ(limits.total_inflight_bytes(), 50u);
  EXPECT_FALSE(b->CancelWait());  // nothing pending
  // One that never fits is refused by the watchdog at its deadline, charged nothing.
  d->ReserveWholeAsync(60, record("d"));
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    {
      absl::MutexLock lock(&mu);
      if (got.size() == 3) break;
    }
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(250));
  EXPECT_EQ(got[2].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(limits.total_inflight_bytes(), 50u);
  // A stream destroyed while it waits is dropped without a call.
  auto e = *limits.Admit([] {});
  e->SetNamespace("t");
  e->ReserveWholeAsync(60, record("e"));
  e.reset();
  b.reset();
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(limits.total_inflight_bytes(), 0u);
}

TEST(PutLimits, ReserveWholeIsCappedByTheLimitsAndTheLargestPut) {
  PutLimits limits(
      {.max_inflight_bytes = 1000, .max_inflight_bytes_per_namespace = 500, .max_put_bytes = 300});
  auto a = *limits.Admit([] {});
  a->SetNamespace("t");
  // A Put naming a long prefix (most of it stored) reserves at most max_put_bytes, at once.
  ASSERT_TRUE(a->ReserveWhole(1ull << 40, [] { return false; }).ok());
  EXPECT_EQ(limits.inflight_bytes("t"), 300u);
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
