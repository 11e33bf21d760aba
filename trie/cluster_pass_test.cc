// The background cluster pass (trie/cluster_pass.h) on the real near-duplicate dumps
// (tests/data/neardup/n0..n3: the GPL-3 preamble with one word changed, then the same text).
#include "trie/cluster_pass.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "codec/block_codec.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::DumpModel;
using testing_store::ExpectBitExact;
using testing_store::FreshTestDir;
using testing_store::LoadTestDumps;
using testing_store::PutDump;

constexpr const char* kNearDups[] = {"neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"};

class ClusterPassTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("kvtrie_cluster_pass");
    LoadTestDumps(kNearDups, &dumps_);
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  // (Re)opens the store on dir_ (the pass's thread off unless interval_ms is set).
  void Open(uint32_t interval_ms = 0, uint32_t blocks_per_round = 64) {
    store_.reset();
    StoreOptions o;
    o.data_dir = dir_.string();
    o.background = false;
    o.cluster_pass_interval_ms = interval_ms;
    o.cluster_pass_blocks_per_round = blocks_per_round;
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  // Puts every full block of `d` encoded here as a worker does (fast profile, no context:
  // PutOptions::encode_on_client), through PutSession::AddEncodedBlock: stored standalone.
  void PutEncoded(const KvDump& d, const EncodeOptions& eo) {
    const ModelInfo m = DumpModel(d);
    auto session = store_->BeginPut("ns", m, d.token_ids, d.surprisal_bits, eo);
    ASSERT_TRUE(session.ok()) << session.status();
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (size_t b = 0; b < d.num_tokens() / 16; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      absl::StatusOr<EncodedBlock> e = EncodeBlock(m.geometry, block, eo, PredictionContext{});
      ASSERT_TRUE(e.ok()) << e.status();
      PutSession::ClientError err{e->rel_rms_error_k, e->rel_rms_error_v, e->max_abs_error};
      ASSERT_TRUE(
          (*session)->AddEncodedBlock(static_cast<uint32_t>(b), std::move(e->bytes), err).ok());
    }
    auto summary = (*session)->Finish();
    ASSERT_TRUE(summary.ok()) << summary.status();
  }
  // Runs rounds until one encodes nothing; returns the encodings of all of them.
  uint64_t RunToCompletion() {
    uint64_t total = 0;
    for (int i = 0; i < 1000; ++i) {
      const ClusterPassRound r = KvStoreTestPeer::RunClusterPass(store_.get());
      total += r.encodings;
      if (r.encodings == 0) break;
    }
    return total;
  }
  uint64_t Bytes() { return store_->Stats("ns").bytes_stored; }

  std::filesystem::path dir_;
  std::vector<KvDump> dumps_;
  std::unique_ptr<KvStore> store_;
};

// Encoded Puts arrive standalone; the pass codes them against their centroid, bit-exact.
TEST_F(ClusterPassTest, EncodedLosslessPutsAreCodedAgainstTheirCentroid) {
  Open();
  const EncodeOptions eo{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  for (const KvDump& d : dumps_) PutEncoded(d, eo);
  const uint64_t before = Bytes();
  ASSERT_EQ(store_->Stats("ns").cluster.residual_nodes, 0u);  // stored as their clients sent them
  EXPECT_GT(RunToCompletion(), 0u);
  const uint64_t after = Bytes();
  const StoreStats st = store_->Stats("ns");
  RecordProperty("bytes_before", std::to_string(before));
  RecordProperty("bytes_after", std::to_string(after));
  EXPECT_GE(st.cluster_pass_recoded, 40u);
  EXPECT_EQ(st.cluster.residual_nodes, st.cluster_pass_recoded);
  EXPECT_EQ(before - after, st.cluster_pass_bytes_saved);
  EXPECT_LE(after, before * 0.75) << before << " -> " << after;
  EXPECT_GE(st.cluster_pass_rounds, 1u);
  for (const KvDump& d : dumps_) {
    EXPECT_EQ(ExpectBitExact(store_.get(), "ns", d), d.num_tokens() / 16);
  }
  // Settled: a round now visits nothing and encodes nothing.
  const ClusterPassRound idle = KvStoreTestPeer::RunClusterPass(store_.get());
  EXPECT_EQ(idle.groups, 0u);
  EXPECT_EQ(idle.encodings, 0u);
}

// A round spends at most its budget; the groups it could not finish are visited by the next.
TEST_F(ClusterPassTest, RoundsAreBoundedAndResume) {
  Open(0, 4);
  const EncodeOptions eo{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[1], eo);
  const ClusterPassRound first = KvStoreTestPeer::RunClusterPass(store_.get());
  EXPECT_EQ(first.encodings, 4u);
  EXPECT_LE(store_->Stats("ns").cluster_pass_recoded, 4u);
  const uint64_t rest = RunToCompletion();
  EXPECT_GT(rest, 10u);
  EXPECT_GT(store_->Stats("ns").cluster_pass_recoded, 10u);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[1]), dumps_[1].num_tokens() / 16);
}

// After a restart every group of near-duplicates is dirty again: a pass that never ran (or
// crashed) finds them.
TEST_F(ClusterPassTest, AfterARestartThePassFindsEveryGroup) {
  Open();
  const EncodeOptions eo{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[1], eo);
  const uint64_t before = Bytes();
  Open();  // restart
  ASSERT_EQ(Bytes(), before);
  EXPECT_GT(RunToCompletion(), 10u);
  EXPECT_LT(Bytes(), before * 0.85);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[1]), dumps_[1].num_tokens() / 16);
  Open();  // and what it did is durable
  EXPECT_LT(Bytes(), before * 0.85);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[1]), dumps_[1].num_tokens() / 16);
}

// The background thread does the same on its own.
TEST_F(ClusterPassTest, TheBackgroundThreadRecodes) {
  Open(/*interval_ms=*/10, /*blocks_per_round=*/8);
  const EncodeOptions eo{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[1], eo);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (store_->Stats("ns").cluster_pass_recoded < 10 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const StoreStats st = store_->Stats("ns");
  EXPECT_GE(st.cluster_pass_recoded, 10u);
  EXPECT_GE(st.cluster_pass_rounds, 2u);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[1]), dumps_[1].num_tokens() / 16);
}

}  // namespace
}  // namespace kvtrie
