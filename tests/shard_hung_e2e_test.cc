// End-to-end: a shard that stops answering without closing its connection (issue 30, row 5).
// Real kvtrie-server processes on loopback, one SIGSTOPped (not killed: its socket stays open
// and the kernel keeps accepting connections), the repository's real KV caches (tests/data).
// Before the sharded client's health checks, the first call routed to it waited for the whole
// call deadline (60 s by default) and every call after a backoff paid it again.
#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/sharded_client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;

constexpr char kNs[] = "hung";
// The call deadline: what a hung shard cost each call before. Far above any bound below, so a
// test that waits for it fails on its bound (and its time shows that it waited).
constexpr absl::Duration kCallDeadline = absl::Seconds(60);
// The health checks' deadline here: 1 s, not the default 250 ms, so that a live shard on a loaded
// 2-core machine under TSan answers its checks (a missed check would make its calls misses).
constexpr absl::Duration kProbeDeadline = absl::Seconds(1);
// What a call routed to a hung shard may cost: ~2 x the probe deadline, with a margin for a
// loaded machine. Still a sixth of the call deadline.
constexpr absl::Duration kBound = absl::Seconds(10);

const std::vector<std::string>& DumpNames() {
  static const std::vector<std::string> names = {"sessions/s0", "genesis_1-3", "GPL-3",
                                                 "story_prompt", "neardup/n1"};
  return names;
}

std::string DumpDir(const std::string& name) {
  return std::string(KVTRIE_TESTDATA_DIR) + "/" + name;
}

class HungShard : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<std::unique_ptr<ServerProcess>> s =
          ServerProcess::Start(dir_ + "/kvtrie-" + std::to_string(i), {});
      ASSERT_TRUE(s.ok()) << s.status();
      servers_.push_back(*std::move(s));
    }
    for (const std::string& name : DumpNames()) {
      absl::StatusOr<KvDump> d = ReadKvDump(DumpDir(name));
      ASSERT_TRUE(d.ok()) << d.status();
      dumps_.push_back(*std::move(d));
    }
  }
  void TearDown() override {
    for (pid_t pid : stopped_) kill(pid, SIGCONT);  // a stopped server ignores SIGTERM
    servers_.clear();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  // SIGSTOPs server i and waits until every thread of it is stopped (kill returns before).
  void Stop(int i) {
    const pid_t pid = servers_[i]->pid();
    ASSERT_EQ(kill(pid, SIGSTOP), 0);
    stopped_.push_back(pid);
    const std::string tasks = absl::StrCat("/proc/", pid, "/task");
    for (int tries = 0; tries < 2000; ++tries) {
      bool all = true;
      for (const auto& task : std::filesystem::directory_iterator(tasks)) {
        std::ifstream f(task.path() / "stat");
        std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
        const size_t paren = stat.rfind(')');
        if (paren == std::string::npos || paren + 2 >= stat.size()) continue;  // gone
        const char state = stat[paren + 2];
        all = all && (state == 'T' || state == 't');
      }
      if (all) return;
      absl::SleepFor(absl::Milliseconds(5));
    }
    FAIL() << "server " << i << " did not stop";
  }
  void Continue(int i) { ASSERT_EQ(kill(servers_[i]->pid(), SIGCONT), 0); }
  std::string ShardList() {
    return absl::StrCat("kvtrie-0=", servers_[0]->target(), ",kvtrie-1=", servers_[1]->target());
  }
  std::unique_ptr<ShardedClient> NewClient() {
    ShardedClientOptions o;
    o.client.ns = kNs;
    o.client.timeout = kCallDeadline;
    o.client.retry.max_attempts = 1;
    o.shards = ShardList();
    o.down_initial_backoff = absl::Milliseconds(200);  // short: later calls pass backoffs
    o.down_max_backoff = absl::Milliseconds(400);
    o.health.probe_deadline = kProbeDeadline;
    absl::StatusOr<std::unique_ptr<ShardedClient>> c = ShardedClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  // Stores every dump (lossless) and returns the index of a shard that owns some.
  int PutAllAndPickVictim(ShardedClient& c) {
    PutOptions lossless;
    lossless.encoding = v1::ENCODING_LOSSLESS;
    std::map<std::string, int> owned;
    for (const KvDump& d : dumps_) {
      absl::StatusOr<v1::PutResponse> r = c.Put(d, lossless);
      EXPECT_TRUE(r.ok()) << r.status();
      ++owned[c.OwnerOf(d.model_id, d.token_ids).name];
    }
    EXPECT_EQ(owned.size(), 2u) << "the dumps should spread over both shards";
    return owned.count("kvtrie-1") ? 1 : 0;
  }

  std::string dir_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<pid_t> stopped_;
  std::vector<KvDump> dumps_;
};

TEST_F(HungShard, FirstCallCostsTheProbeDeadlineNotTheCallDeadlineAndLaterCallsNothing) {
  std::unique_ptr<ShardedClient> c = NewClient();
  ASSERT_NE(c, nullptr);
  const int victim = PutAllAndPickVictim(*c);
  const std::string victim_name = "kvtrie-" + std::to_string(victim);
  Stop(victim);  // its connection stays open: calls are sent and never answered

  // The first call routed to it: a miss within the bound (it waited 60 s before).
  double first_s = 0, later_max_s = 0;
  int later_calls = 0;
  for (const KvDump& d : dumps_) {
    const bool lost = c->OwnerOf(d.model_id, d.token_ids).name == victim_name;
    const absl::Time t0 = absl::Now();
    absl::StatusOr<v1::LookupResponse> l = c->Lookup(d.model_id, d.token_ids);
    const absl::Duration took = absl::Now() - t0;
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->matched_tokens() == 0, lost) << d.token_ids.size();
    if (lost && first_s == 0) {
      first_s = absl::ToDoubleSeconds(took);
      EXPECT_LT(took, kBound) << "the first call to the stopped shard";
    }
  }
  ASSERT_GT(first_s, 0);
  EXPECT_TRUE(c->IsDown(victim_name));
  EXPECT_GE(c->counters().calls_cancelled, 1u);
  EXPECT_GE(c->counters().probe_failures, 1u);

  // Past several backoffs (200-400 ms): still misses at once, the prober keeps it down.
  const absl::Time until = absl::Now() + absl::Seconds(2);
  while (absl::Now() < until) {
    for (const KvDump& d : dumps_) {
      if (c->OwnerOf(d.model_id, d.token_ids).name != victim_name) continue;
      const absl::Time t0 = absl::Now();
      absl::StatusOr<KvDump> g = c->Get(d.model_id, d.token_ids);
      const absl::Duration took = absl::Now() - t0;
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_TRUE(g->token_ids.empty());
      later_max_s = std::max(later_max_s, absl::ToDoubleSeconds(took));
      EXPECT_LT(took, kBound) << "a later call to the stopped shard";
      ++later_calls;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  std::printf(
      "[ hung ] first call to the stopped shard %.3f s; %d later calls, slowest %.3f s "
      "(call deadline %.0f s)\n",
      first_s, later_calls, later_max_s, absl::ToDoubleSeconds(kCallDeadline));

  // Continued: a check answers, and its prefixes hit again (bit-exact) within the bound.
  Continue(victim);
  const absl::Time back_by = absl::Now() + kBound;
  bool hit = false;
  while (!hit && absl::Now() < back_by) {
    for (const KvDump& d : dumps_) {
      if (c->OwnerOf(d.model_id, d.token_ids).name != victim_name) continue;
      absl::StatusOr<KvDump> g = c->Get(d.model_id, d.token_ids);
      ASSERT_TRUE(g.ok()) << g.status();
      if (!g->token_ids.empty()) {
        hit = true;
        EXPECT_EQ(g->token_ids.size(), d.num_tokens() / 16 * 16);
      }
    }
    if (!hit) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(hit) << "the continued shard serves again";
  EXPECT_FALSE(c->IsDown(victim_name));
}

TEST_F(HungShard, CallsInFlightWhenItStopsAreCancelledAndOtherShardsKeepServing) {
  std::unique_ptr<ShardedClient> c = NewClient();
  ASSERT_NE(c, nullptr);
  const int victim = PutAllAndPickVictim(*c);
  const std::string victim_name = "kvtrie-" + std::to_string(victim);
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0}, other_hits{0}, other_misses{0};
  std::atomic<int64_t> slowest_ms{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&, t] {
      for (size_t n = t; !stop.load(); ++n) {
        const KvDump& d = dumps_[n % dumps_.size()];
        const absl::Time t0 = absl::Now();
        absl::StatusOr<KvDump> g = c->Get(d.model_id, d.token_ids);
        const int64_t ms = absl::ToInt64Milliseconds(absl::Now() - t0);
        int64_t seen = slowest_ms.load();
        while (ms > seen && !slowest_ms.compare_exchange_weak(seen, ms)) {
        }
        if (!g.ok()) {
          ++errors;
        } else if (c->OwnerOf(d.model_id, d.token_ids).name != victim_name) {
          ++(g->token_ids.empty() ? other_misses : other_hits);
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  Stop(victim);
  absl::SleepFor(absl::Seconds(2));
  stop = true;
  for (std::thread& t : readers) t.join();  // joins only because no call waits for 60 s
  std::printf("[ hung ] readers: slowest call %lld ms with a shard stopped under them\n",
              static_cast<long long>(slowest_ms.load()));
  EXPECT_EQ(errors.load(), 0);
  EXPECT_LT(slowest_ms.load(), absl::ToInt64Milliseconds(kBound));
  EXPECT_GT(other_hits.load(), 0);
  EXPECT_EQ(other_misses.load(), 0) << "the live shard's prefixes are never lost with the other";
}

TEST_F(HungShard, CliLookupWithOneOfTwoShardsStoppedAnswersAMissQuickly) {
  std::unique_ptr<ShardedClient> c = NewClient();
  ASSERT_NE(c, nullptr);
  const int victim = PutAllAndPickVictim(*c);
  const std::string victim_name = "kvtrie-" + std::to_string(victim);
  Stop(victim);
  const std::string cli = testing::BinaryPath("client/kvtrie");
  int lost = 0;
  for (size_t i = 0; i < dumps_.size(); ++i) {
    const bool on_victim = c->OwnerOf(dumps_[i].model_id, dumps_[i].token_ids).name == victim_name;
    std::string out, err;
    std::fflush(stdout);
    const absl::Time t0 = absl::Now();
    // No --timeout: the CLI's call deadline is the default 60 s.
    const int rc = testing::RunCommand(
        {cli, "--shards=" + ShardList(), std::string("--namespace=") + kNs, "--retry_attempts=1",
         absl::StrCat("--shard_probe_deadline_ms=", absl::ToInt64Milliseconds(kProbeDeadline)),
         "lookup", DumpDir(DumpNames()[i])},
        &out, &err);
    const absl::Duration took = absl::Now() - t0;
    ASSERT_EQ(rc, 0) << err;
    const uint64_t matched = nlohmann::json::parse(out).value("matched_tokens", uint64_t{0});
    EXPECT_EQ(matched == 0, on_victim) << DumpNames()[i] << ": " << out;
    if (on_victim) {
      ++lost;
      std::printf("[ hung ] cli lookup of %s on the stopped shard: %.3f s\n",
                  DumpNames()[i].c_str(), absl::ToDoubleSeconds(took));
      std::fflush(stdout);  // before the next fork
      EXPECT_LT(took, kBound) << DumpNames()[i];
    }
  }
  std::fflush(stdout);
  EXPECT_GT(lost, 0);
}

}  // namespace
}  // namespace kvtrie
