// End-to-end: a real kvtrie-server killed with SIGKILL in the middle of the Delete of
// near-duplicate centroids (n0's own blocks of tests/data/neardup, the centroids of n1..n3's),
// while it re-elects a centroid per cluster and re-encodes the members one by one
// (ModelShard::Delete). After each restart every member reads back exactly as before the Delete
// (the re-election keeps each reconstruction bit-exact, so lossless members are bit-exact and lossy
// ones within their target), and n0 is either whole or cut at the deleted block — never a member
// whose centroid is gone, never a wrong byte. KVTRIE_CRASH_ROUNDS (default 6) sets the kills.
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
constexpr uint32_t kBlockTokens = 16;
constexpr size_t kFirstDeleted = 8;  // n0's blocks from 8 on are its own (n1..n3 diverge before)

struct Namespace {
  std::string ns;
  PutOptions put;
  std::vector<KvDump> before;  // Gets of n0..n3 before the Delete
  uint64_t bytes_before = 0;   // the namespace's stored bytes before the Delete
  bool delete_acked = false;
};

std::vector<uint32_t> DeletedPrefix(const KvDump& n0) {
  return {n0.token_ids.begin(), n0.token_ids.begin() + (kFirstDeleted + 1) * kBlockTokens};
}

// Puts n0..n3 into `n.ns` and keeps what a Get returns of each.
void Fill(const std::string& target, const std::vector<KvDump>& dumps, Namespace* n) {
  auto c = Client::Create({.target = target, .ns = n->ns});
  for (const KvDump& d : dumps) {
    auto r = c->Put(d, n->put);
    ASSERT_TRUE(r.ok()) << n->ns << ": " << r.status();
  }
  for (const KvDump& d : dumps) {
    auto got = c->Get(d.model_id, d.token_ids);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->num_tokens(), d.num_tokens() / kBlockTokens * kBlockTokens);
    n->before.push_back(*std::move(got));
  }
  auto st = c->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  n->bytes_before = st->bytes_stored();
}

uint64_t BytesStored(const std::string& target, const std::string& ns) {
  auto st = Client::Create({.target = target, .ns = ns})->Stats();
  EXPECT_TRUE(st.ok()) << st.status();
  return st.ok() ? st->bytes_stored() : 0;
}

// n1..n3 read back as before; n0 whole (the Delete did not land) or cut at kFirstDeleted, and the
// same bytes as before over what is there. Returns whether n0 is still whole.
bool Check(const std::string& target, const std::vector<KvDump>& dumps, const Namespace& n) {
  auto c = Client::Create({.target = target, .ns = n.ns});
  bool whole = false;
  for (size_t i = 0; i < dumps.size(); ++i) {
    auto got = c->Get(dumps[i].model_id, dumps[i].token_ids);
    EXPECT_TRUE(got.ok()) << n.ns << " n" << i << ": " << got.status();
    if (!got.ok()) return false;
    const KvDump& want = n.before[i];
    if (i == 0) {
      whole = got->num_tokens() == want.num_tokens();
      EXPECT_TRUE(whole || got->num_tokens() == kFirstDeleted * kBlockTokens)
          << n.ns << ": n0 has " << got->num_tokens() << " tokens";
      EXPECT_FALSE(whole && n.delete_acked) << n.ns << ": an acknowledged Delete came back";
      // Sequence layout [layers][heads][tokens][dim]: compare the stored tokens of each row.
      const size_t rows = size_t{want.num_layers} * want.num_kv_heads;
      const size_t have_row = got->num_tokens() * want.head_dim * 2;
      const size_t want_row = want.num_tokens() * want.head_dim * 2;
      for (size_t r = 0; r < rows; ++r) {
        for (const auto& [g, w] : {std::pair(&got->k, &want.k), std::pair(&got->v, &want.v)}) {
          if (!std::equal(g->begin() + r * have_row, g->begin() + (r + 1) * have_row,
                          w->begin() + r * want_row)) {
            ADD_FAILURE() << n.ns << ": n0 reads back wrong in row " << r;
            return whole;
          }
        }
      }
      continue;
    }
    EXPECT_EQ(got->num_tokens(), want.num_tokens()) << n.ns << " n" << i << " lost blocks";
    EXPECT_TRUE(got->k == want.k && got->v == want.v) << n.ns << " n" << i << " reads back wrong";
  }
  return whole;
}

TEST(ReclusterCrash, SigkillDuringACentroidDeleteLosesNothingAndServesNothingWrong) {
  std::vector<KvDump> dumps;
  for (const char* name : {"neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}) {
    auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
    ASSERT_TRUE(d.ok()) << d.status();
    dumps.push_back(*std::move(d));
  }
  const char* env = std::getenv("KVTRIE_CRASH_ROUNDS");
  const int rounds = env ? std::atoi(env) : 6;
  const std::string dir = testing::FreshDir("recluster_crash");
  // --sync: every member's re-encoding is its own fsynced batch, so the Delete lasts long
  // enough to be killed in the middle of.
  const std::vector<std::string> flags = {"--sync"};
  const PutOptions lossless{.encoding = v1::ENCODING_LOSSLESS,
                            .profile = v1::EncodingSpec::PROFILE_COMPACT};
  const PutOptions lossy{.encoding = v1::ENCODING_RESIDUAL,
                         .target_rel_rms = 0.1,
                         .profile = v1::EncodingSpec::PROFILE_COMPACT};

  // How long an uninterrupted Delete takes here: the kills are spread over it.
  auto server = ServerProcess::Start(dir, flags);
  ASSERT_TRUE(server.ok()) << server.status();
  Namespace timing{.ns = "timing", .put = lossless};
  Fill((*server)->target(), dumps, &timing);
  const auto t0 = std::chrono::steady_clock::now();
  auto timed = Client::Create({.target = (*server)->target(), .ns = "timing"})
                   ->Delete(dumps[0].model_id, DeletedPrefix(dumps[0]));
  ASSERT_TRUE(timed.ok()) << timed.status();
  const double delete_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  timing.delete_acked = true;
  EXPECT_FALSE(Check((*server)->target(), dumps, timing));

  std::vector<Namespace> done;
  int killed_before = 0, killed_in_the_middle = 0;
  for (int round = 0; round < rounds; ++round) {
    Namespace n{.ns = "r" + std::to_string(round), .put = round % 2 == 0 ? lossless : lossy};
    Fill((*server)->target(), dumps, &n);
    std::atomic<bool> acked{false};
    std::thread deleter([&] {
      auto c = Client::Create({.target = (*server)->target(), .ns = n.ns});
      acked = c->Delete(dumps[0].model_id, DeletedPrefix(dumps[0])).ok();
    });
    // Spread over the Delete (a lossy one re-encodes as many members).
    const double delay_ms = delete_ms * (round + 0.5) / rounds;
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(delay_ms * 1000)));
    (*server)->Kill();
    deleter.join();
    n.delete_acked = acked;
    done.push_back(n);

    server = ServerProcess::Start(dir, flags);
    ASSERT_TRUE(server.ok()) << server.status();
    for (const Namespace& m : done) {
      const bool whole = Check((*server)->target(), dumps, m);
      if (&m != &done.back() || !whole) continue;
      // n0 whole: killed before the prefix went; members re-encoded already change the bytes.
      if (BytesStored((*server)->target(), m.ns) == m.bytes_before) {
        ++killed_before;
      } else {
        ++killed_in_the_middle;
      }
    }
    Check((*server)->target(), dumps, timing);
  }
  // A Delete that did not land runs again after the restart and completes.
  for (Namespace& n : done) {
    auto c = Client::Create({.target = (*server)->target(), .ns = n.ns});
    auto r = c->Delete(dumps[0].model_id, DeletedPrefix(dumps[0]));
    if (r.ok()) n.delete_acked = true;
    EXPECT_TRUE(r.ok() || r.status().code() == absl::StatusCode::kNotFound) << r.status();
    EXPECT_FALSE(Check((*server)->target(), dumps, n)) << n.ns;
  }
  // The kills are spread over the Delete: some land while members are being re-encoded.
  EXPECT_GT(killed_in_the_middle, 0);
  std::printf(
      "recluster crash: an uninterrupted Delete took %.0f ms; %d kills: %d before any member was "
      "re-encoded, %d in the middle of the re-encoding, %d after the prefix went; every member "
      "read back as before\n",
      delete_ms, rounds, killed_before, killed_in_the_middle,
      rounds - killed_before - killed_in_the_middle);
}

}  // namespace
}  // namespace kvtrie
