// End-to-end, the default path (issue 33): a real kvtrie-server killed with SIGKILL while its
// background cluster pass codes client-encoded blocks against their centroids (the same-depth
// groups of tests/data/neardup n0..n3, and n3's position-shifted blocks against n0's window at
// the offset), with Gets running the whole time. The pass stores each block's exact
// reconstruction again, so every Get that succeeds, before, during and after the kill and the
// restart, returns what the first Get did: the dumps themselves (lossless) or the client's
// reconstruction (lossy, RESIDUAL at 0.1). After the restart the pass picks up what it had not
// done (groups are dirty again, blocks not looked at yet are marked in their records) and the
// namespaces reach the bytes of an uninterrupted pass. KVTRIE_CRASH_ROUNDS (default 4) sets the
// kills.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;
using Clock = std::chrono::steady_clock;

struct Namespace {
  std::string ns;
  PutOptions put;
  std::vector<KvDump> first;  // the first Get of n0..n3
  uint64_t bytes_sent = 0;    // stored bytes right after the Puts (before any pass work landed)
};

uint64_t BytesStored(const std::string& target, const std::string& ns) {
  auto st = Client::Create({.target = target, .ns = ns})->Stats();
  EXPECT_TRUE(st.ok()) << st.status();
  return st.ok() ? st->bytes_stored() : 0;
}

// Polls the namespace's bytes until they have not changed for `quiet`; returns the time of the
// last change after `from`, and the bytes.
std::pair<double, uint64_t> Settle(const std::string& target, const std::string& ns,
                                   Clock::time_point from, std::chrono::milliseconds quiet) {
  uint64_t bytes = BytesStored(target, ns);
  Clock::time_point changed = from;
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() - changed < quiet && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const uint64_t now = BytesStored(target, ns);
    if (now != bytes) {
      bytes = now;
      changed = Clock::now();
    }
  }
  return {std::chrono::duration<double, std::milli>(changed - from).count(), bytes};
}

// Puts n0..n3 client-encoded and keeps what the first Get of each returns.
void Fill(const std::string& target, const std::vector<KvDump>& dumps, Namespace* n) {
  auto c = Client::Create({.target = target, .ns = n->ns});
  for (const KvDump& d : dumps) {
    auto r = c->Put(d, n->put);
    ASSERT_TRUE(r.ok()) << n->ns << ": " << r.status();
  }
  n->bytes_sent = BytesStored(target, n->ns);
  for (const KvDump& d : dumps) {
    auto got = c->Get(d.model_id, d.token_ids);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->num_tokens(), d.num_tokens() / 16 * 16);
    if (n->put.encoding == v1::ENCODING_LOSSLESS) {
      ASSERT_TRUE(got->k == d.k && got->v == d.v) << n->ns << ": lossless Put not bit-exact";
    }
    n->first.push_back(*std::move(got));
  }
}

// Every dump reads back as its first Get did, in both Get modes.
void Check(const std::string& target, const std::vector<KvDump>& dumps, const Namespace& n) {
  auto c = Client::Create({.target = target, .ns = n.ns});
  for (size_t i = 0; i < dumps.size(); ++i) {
    for (v1::GetMode mode : {v1::GET_MODE_RECONSTRUCTED, v1::GET_MODE_RESIDUAL}) {
      auto got = c->Get(dumps[i].model_id, dumps[i].token_ids, {.mode = mode});
      ASSERT_TRUE(got.ok()) << n.ns << " n" << i << ": " << got.status();
      EXPECT_TRUE(got->k == n.first[i].k && got->v == n.first[i].v)
          << n.ns << " n" << i << " (mode " << mode << ") reads back changed";
    }
  }
}

TEST(ClusterPassCrash, SigkillMidPassNeverChangesWhatAGetReturns) {
  std::vector<KvDump> dumps;
  for (const char* name : {"neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}) {
    auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
    ASSERT_TRUE(d.ok()) << d.status();
    dumps.push_back(*std::move(d));
  }
  const char* env = std::getenv("KVTRIE_CRASH_ROUNDS");
  const int rounds = env ? std::atoi(env) : 4;
  const std::string dir = testing::FreshDir("cluster_pass_crash");
  // --sync: every re-encoding is its own fsynced batch; a small budget per round spreads the
  // pass over many rounds, so a kill lands in the middle of it.
  const std::vector<std::string> flags = {"--sync", "--cluster_pass_interval_ms=20",
                                          "--cluster_pass_blocks_per_round=4"};
  const PutOptions lossless{.encoding = v1::ENCODING_LOSSLESS};
  const PutOptions lossy{.encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = 0.1};

  // An uninterrupted pass: how long it takes here (the kills are spread over it), and the bytes
  // it ends at.
  auto server = ServerProcess::Start(dir, flags);
  ASSERT_TRUE(server.ok()) << server.status();
  uint64_t settled[2] = {0, 0};  // lossless, lossy
  double pass_ms = 0;
  for (int lossy_ns = 0; lossy_ns < 2; ++lossy_ns) {
    Namespace t;
    t.ns = lossy_ns ? "timing-lossy" : "timing";
    t.put = lossy_ns ? lossy : lossless;
    Fill((*server)->target(), dumps, &t);
    const auto [ms, bytes] =
        Settle((*server)->target(), t.ns, Clock::now(), std::chrono::milliseconds(1500));
    settled[lossy_ns] = bytes;
    if (!lossy_ns) pass_ms = ms;
    EXPECT_LT(bytes, t.bytes_sent) << t.ns << ": the pass saved nothing";
    Check((*server)->target(), dumps, t);
  }
  ASSERT_GT(pass_ms, 0);

  std::vector<Namespace> done;
  int in_the_middle = 0;
  for (int round = 0; round < rounds; ++round) {
    Namespace n;
    n.ns = "r" + std::to_string(round);
    n.put = round % 2 == 0 ? lossless : lossy;
    Fill((*server)->target(), dumps, &n);
    const Clock::time_point put_end = Clock::now();
    // Gets all the time, through the kill: every one that succeeds reads what the first did.
    std::atomic<bool> stop{false};
    std::atomic<int> reads{0}, changed{0};
    std::thread reader([&, target = (*server)->target()] {
      auto c = Client::Create({.target = target, .ns = n.ns});
      for (size_t i = 0; !stop; i = (i + 1) % dumps.size()) {
        auto got = c->Get(dumps[i].model_id, dumps[i].token_ids);
        if (!got.ok()) continue;  // the server is down
        ++reads;
        if (got->num_tokens() != n.first[i].num_tokens() || got->k != n.first[i].k ||
            got->v != n.first[i].v) {
          ++changed;
        }
      }
    });
    const double delay_ms = pass_ms * (round + 0.5) / rounds;
    std::this_thread::sleep_until(put_end +
                                  std::chrono::microseconds(static_cast<int64_t>(delay_ms * 1000)));
    (*server)->Kill();
    stop = true;
    reader.join();
    EXPECT_EQ(changed.load(), 0) << n.ns << ": " << changed << " of " << reads
                                 << " Gets read other values while the pass ran";
    done.push_back(n);

    server = ServerProcess::Start(dir, flags);
    ASSERT_TRUE(server.ok()) << server.status();
    const uint64_t at_restart = BytesStored((*server)->target(), n.ns);
    for (const Namespace& m : done) Check((*server)->target(), dumps, m);
    // Killed in the middle: some of the pass's work had landed, some had not.
    const auto [ms, after] =
        Settle((*server)->target(), n.ns, Clock::now(), std::chrono::milliseconds(1500));
    if (at_restart < n.bytes_sent && after < at_restart) ++in_the_middle;
    // Resumed after the restart: the bytes of an uninterrupted pass.
    EXPECT_EQ(after, settled[round % 2]) << n.ns << " (at the restart: " << at_restart << ")";
    Check((*server)->target(), dumps, n);
  }
  EXPECT_GT(in_the_middle, 0);
  std::printf(
      "cluster pass crash: an uninterrupted pass took %.0f ms; %d kills, %d in the middle of the "
      "pass; every Get read what the first did\n",
      pass_ms, rounds, in_the_middle);
}

}  // namespace
}  // namespace kvtrie
