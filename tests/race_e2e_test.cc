// End-to-end (issue 18, rows 1 and 4) through a real kvtrie-server learning predictor states:
// Gets of a near-duplicate sequence run while the branch holding its centroids is deleted (and
// the learner refits and frees states at the same time); every Get ends OK or ABORTED (never
// DATA_LOSS), and afterwards the sequence that was never deleted reads back whole and
// bit-identical. The Delete's answer says what it freed and what it rewrote.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
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

KvDump Load(const std::string& name) {
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : KvDump{};
}

size_t DivergenceBlock(const KvDump& a, const KvDump& b) {
  size_t i = 0;
  while (i < a.num_tokens() && i < b.num_tokens() && a.token_ids[i] == b.token_ids[i]) ++i;
  return i / 16;
}

// The first `tokens` tokens of `d` ([layers][heads][tokens][head_dim] planes cut).
KvDump Slice(const KvDump& d, size_t tokens) {
  KvDump out = d;
  out.token_ids.resize(tokens);
  out.surprisal_bits.resize(tokens);
  const size_t row = d.head_dim * DTypeBytes(d.dtype);
  const size_t planes = static_cast<size_t>(d.num_layers) * d.num_kv_heads;
  out.k.resize(planes * tokens * row);
  out.v.resize(planes * tokens * row);
  for (size_t p = 0; p < planes; ++p) {
    std::copy_n(d.k.begin() + p * d.num_tokens() * row, tokens * row,
                out.k.begin() + p * tokens * row);
    std::copy_n(d.v.begin() + p * d.num_tokens() * row, tokens * row,
                out.v.begin() + p * tokens * row);
  }
  return out;
}

class RaceEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    // These rows race reads with a Delete that re-encodes lossy members: retention off (with it,
    // a lossy cluster's Delete re-encodes nothing: cluster_e2e_test.cc).
    auto s =
        ServerProcess::Start(dir_ + "/data", {"--learn_predictors", "--predictor_refit_tokens=512",
                                              "--cluster_retain_deleted_centroids=false"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    n0_ = Load("neardup/n0");
    n1_ = Load("neardup/n1");
    genesis_ = Load("genesis_1-3");
    div_ = DivergenceBlock(n0_, n1_);
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<Client> NewClient(const std::string& ns) {
    return Client::Create({.target = server_->target(), .ns = ns});
  }
  void WaitForFits(Client* client, uint64_t fits) {
    for (int i = 0; i < 400; ++i) {
      absl::StatusOr<v1::StatsResponse> s = client->Stats();
      ASSERT_TRUE(s.ok()) << s.status();
      if (s->predictor_fits() >= fits) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "fewer than " << fits << " predictor versions were published";
  }
  // n0 (RESIDUAL, no state yet: version 1 is learned from it), n1's prefix to its divergence
  // (lossless), then n1 RESIDUAL: n1's members are residuals of n0's centroids coded against
  // version 1, and its only blocks on it.
  void Store(Client* client) {
    const PutOptions residual{.encoding = v1::ENCODING_RESIDUAL,
                              .target_rel_rms = 0.05,
                              .profile = v1::EncodingSpec::PROFILE_COMPACT};
    ASSERT_TRUE(client->Put(n0_, residual).ok());
    ASSERT_NO_FATAL_FAILURE(WaitForFits(client, 1));
    ASSERT_TRUE(
        client
            ->Put(Slice(n1_, (div_ + 1) * 16),
                  {.encoding = v1::ENCODING_LOSSLESS, .profile = v1::EncodingSpec::PROFILE_COMPACT})
            .ok());
    absl::StatusOr<v1::PutResponse> r = client->Put(n1_, residual);
    ASSERT_TRUE(r.ok()) << r.status();
    int members = 0;
    for (const v1::BlockResult& b : r->blocks()) {
      members += b.disposition() == v1::BLOCK_RESIDUAL_OF_CENTROID;
    }
    ASSERT_GT(members, 20);
  }
  std::vector<uint32_t> N0Branch() const {
    return std::vector<uint32_t>(n0_.token_ids.begin(), n0_.token_ids.begin() + (div_ + 1) * 16);
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump n0_, n1_, genesis_;
  size_t div_ = 0;
};

TEST_F(RaceEndToEnd, GetsRacingTheDeleteOfTheCentroidsNeverLoseTheMembers) {
  for (int cycle = 0; cycle < 8; ++cycle) {
    SCOPED_TRACE("cycle " + std::to_string(cycle));
    const std::string ns = "c" + std::to_string(cycle);
    auto client = NewClient(ns);
    ASSERT_NO_FATAL_FAILURE(Store(client.get()));
    absl::StatusOr<KvDump> want = client->Get(n1_.model_id, n1_.token_ids);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(want->num_tokens(), 512u);

    // Readers Get n1 (the server decodes, as the service does) until the Delete is done and each
    // has read 3 more times; the learner refits (Genesis) and frees states meanwhile.
    std::atomic<bool> deleted{false};
    std::mutex mu;
    std::map<std::string, int> errors;  // status code name -> count (ABORTED is allowed)
    int wrong = 0, gets = 0;
    std::vector<std::thread> readers;
    for (int t = 0; t < 3; ++t) {
      readers.emplace_back([&] {
        auto c = NewClient(ns);
        for (int after = 0; after < 3;) {
          absl::StatusOr<KvDump> got = c->Get(n1_.model_id, n1_.token_ids);
          if (deleted) ++after;
          std::lock_guard<std::mutex> lock(mu);
          ++gets;
          if (!got.ok()) {
            ++errors[absl::StatusCodeToString(got.status().code()) + ": " +
                     std::string(got.status().message().substr(0, 80))];
          } else if (got->k != want->k || got->v != want->v) {
            ++wrong;
          }
        }
      });
    }
    std::thread learner([&] {
      auto c = NewClient(ns);
      EXPECT_TRUE(c->Put(genesis_, {.encoding = v1::ENCODING_LOSSLESS,
                                    .profile = v1::EncodingSpec::PROFILE_COMPACT})
                      .ok());
    });
    absl::StatusOr<v1::DeleteResponse> del = client->Delete(n0_.model_id, N0Branch());
    deleted = true;
    learner.join();
    for (std::thread& t : readers) t.join();
    ASSERT_TRUE(del.ok()) << del.status();
    EXPECT_EQ(del->nodes_deleted(), 32 - div_);
    for (const auto& [what, n] : errors) {
      EXPECT_EQ(what.rfind("ABORTED", 0), 0u) << n << " Gets ended " << what;
    }
    EXPECT_EQ(wrong, 0) << "of " << gets;
    // n1 was never deleted: all of it is there and reads back the same, in both modes.
    EXPECT_EQ(client->Lookup(n1_.model_id, n1_.token_ids)->matched_tokens(), 512u);
    absl::StatusOr<KvDump> after = client->Get(n1_.model_id, n1_.token_ids);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_TRUE(after->k == want->k && after->v == want->v);
    absl::StatusOr<KvDump> residual =
        client->Get(n1_.model_id, n1_.token_ids, {.mode = v1::GET_MODE_RESIDUAL});
    ASSERT_TRUE(residual.ok()) << residual.status();
    EXPECT_TRUE(residual->k == want->k && residual->v == want->v);
    absl::StatusOr<v1::StatsResponse> st = client->Stats();
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->evictions_data_loss(), 0u);
  }
}

// Row 4: bytes_freed and bytes_rewritten, and the namespace's stored bytes change by their
// difference (here the store grows: the members' lossless copies are larger than what went).
TEST_F(RaceEndToEnd, DeleteAnswersFreedAndRewrittenBytes) {
  auto client = NewClient("ns");
  ASSERT_NO_FATAL_FAILURE(Store(client.get()));
  absl::StatusOr<v1::StatsResponse> before = client->Stats();
  ASSERT_TRUE(before.ok());
  absl::StatusOr<v1::DeleteResponse> del = client->Delete(n0_.model_id, N0Branch());
  ASSERT_TRUE(del.ok()) << del.status();
  absl::StatusOr<v1::StatsResponse> after = client->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_GT(del->bytes_rewritten(), 0u);
  EXPECT_EQ(
      static_cast<int64_t>(before->bytes_stored()) - static_cast<int64_t>(after->bytes_stored()),
      static_cast<int64_t>(del->bytes_freed()) - static_cast<int64_t>(del->bytes_rewritten()))
      << "stored " << before->bytes_stored() << " -> " << after->bytes_stored() << ", freed "
      << del->bytes_freed() << ", rewritten " << del->bytes_rewritten();
}

}  // namespace
}  // namespace kvtrie
