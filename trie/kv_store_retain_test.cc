// Retained centroids (trie/cluster_policy.h, "Retained centroids"; issue 20): a Delete of the
// centroids of lossy near-duplicates keeps them, unnamed, for their members. On the real
// near-duplicate dumps of tests/data (n0..n3 share a prefix and differ by a word): what stays,
// what no lookup sees, what survives a restart and a failed write, when they go (their last
// member deleted or evicted), a Put of the deleted prefix again, and eviction.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "codec/decode_chain.h"
#include "gtest/gtest.h"
#include "trie/fault_injection_testing.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::ExpectWithin;
using testing_store::PutDump;
using testing_store::StoredBlocks;

using Blocks = std::vector<std::vector<uint8_t>>;

constexpr double kTarget = 0.1;
constexpr size_t kFirstDeleted = 8;  // n0's blocks from here on are the others' centroids
// The block of n1, n2, n3 holding their changed word (n0's index 0 unused).
constexpr size_t kDivergence[4] = {0, 2, 7, 5};

class RetainTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("kv_store_retain_test");
    ASSERT_NO_FATAL_FAILURE(testing_store::LoadTestDumps(
        std::vector<const char*>{"neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}, &n_));
    fs_ = std::make_shared<FaultFs>();
    env_ = FaultFs::NewEnv(fs_);
    Open();
    for (const KvDump& d : n_) ASSERT_TRUE(PutDump(store_.get(), "ns", d, kLossy).ok());
    for (size_t i = 1; i < n_.size(); ++i) before_.push_back(ReadAll(n_[i]));
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open() {
    store_.reset();
    StoreOptions o;
    o.data_dir = dir_.string();
    o.env = env_.get();
    o.background = false;
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  // n_[i]'s blocks from `first` on (their prefix through block `first`).
  std::vector<uint32_t> Branch(size_t i, size_t first) const {
    return {n_[i].token_ids.begin(), n_[i].token_ids.begin() + (first + 1) * 16};
  }
  absl::StatusOr<DeleteSummary> DeleteN0Branch() {
    return store_->Delete("ns", n_[0].model_id, Branch(0, kFirstDeleted));
  }
  Blocks ReadAll(const KvDump& d) { return testing_store::ReadAllBlocks(store_.get(), "ns", d); }
  // Puts the first `blocks` blocks of `d` into "ns".
  void PutPrefix(const KvDump& d, size_t blocks, const EncodeOptions& enc) {
    const ModelInfo m = testing_store::DumpModel(d);
    const std::vector<uint32_t> tokens(d.token_ids.begin(), d.token_ids.begin() + blocks * 16);
    const std::vector<float> bits(d.surprisal_bits.begin(), d.surprisal_bits.begin() + blocks * 16);
    auto session = store_->BeginPut("ns", m, tokens, bits, enc);
    ASSERT_TRUE(session.ok()) << session.status();
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (size_t b = 0; b < blocks; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      ASSERT_TRUE((*session)->AddLayers(b, 0, 0, block).ok());
    }
    ASSERT_TRUE((*session)->Finish().ok());
  }
  // n1..n3 read back exactly as before the Delete (so within their target).
  void ExpectMembersUnchanged() {
    for (size_t i = 1; i < n_.size(); ++i) {
      EXPECT_TRUE(ReadAll(n_[i]) == before_[i - 1]) << "n" << i << " changed";
    }
  }

  static constexpr EncodeOptions kLossy{.encoding = Encoding::kResidual, .target_rel_rms = kTarget};
  std::filesystem::path dir_;
  std::vector<KvDump> n_;
  std::vector<Blocks> before_;  // n1..n3 as read before any Delete
  std::shared_ptr<FaultFs> fs_;
  std::unique_ptr<rocksdb::Env> env_;
  std::unique_ptr<KvStore> store_;
};

TEST_F(RetainTest, RetainedCentroidsAreInvisibleSurviveARestartAndServeTheirMembers) {
  const uint64_t bytes_before = store_->Stats("ns").bytes_stored;
  auto del = DeleteN0Branch();
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_GT(del->centroids_retained, 20u);
  EXPECT_EQ(del->nodes_rewritten, 0u);
  StoreStats st = store_->Stats("ns");
  EXPECT_EQ(st.retained_nodes, del->nodes_retained);
  EXPECT_EQ(st.bytes_stored, bytes_before - del->bytes_freed);
  // No token lookup reaches the deleted blocks: Lookup, Get, Pin and Delete stop before them.
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), kFirstDeleted);
  auto got = store_->Get("ns", n_[0].model_id, n_[0].token_ids, 0);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->blocks.size(), kFirstDeleted);
  EXPECT_EQ(store_->Pin("ns", n_[0].model_id, n_[0].token_ids, 0, false).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(DeleteN0Branch().status().code(), absl::StatusCode::kNotFound);
  ExpectMembersUnchanged();
  for (size_t i = 1; i < n_.size(); ++i) ExpectWithin(store_.get(), "ns", n_[i], kTarget);

  // The cluster pass leaves them be (no group elects or moves a retained block).
  while (KvStoreTestPeer::RunClusterPass(store_.get()).encodings > 0) {
  }
  EXPECT_EQ(store_->Stats("ns").retained_nodes, del->nodes_retained);
  ExpectMembersUnchanged();
  Open();  // the marks are on disk
  st = store_->Stats("ns");
  EXPECT_EQ(st.retained_nodes, del->nodes_retained);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), kFirstDeleted);
  ExpectMembersUnchanged();
  EXPECT_EQ(st.evictions_data_loss, 0u);
}

TEST_F(RetainTest, TheLastMembersDeleteTakesTheRetainedCentroidsWithIt) {
  ASSERT_TRUE(DeleteN0Branch().ok());
  const StoreStats kept = store_->Stats("ns");
  ASSERT_GT(kept.retained_nodes, 20u);
  // n1's and n2's own branches (from their divergence blocks) go: n3 still needs some of them.
  ASSERT_TRUE(store_->Delete("ns", n_[1].model_id, Branch(1, kDivergence[1])).ok());
  ASSERT_TRUE(store_->Delete("ns", n_[2].model_id, Branch(2, kDivergence[2])).ok());
  EXPECT_GT(store_->Stats("ns").retained_nodes, 0u);
  EXPECT_TRUE(ReadAll(n_[3]) == before_[2]);
  // n3's own branch goes: nothing is coded against what was retained any more; it all goes.
  ASSERT_TRUE(store_->Delete("ns", n_[3].model_id, Branch(3, kDivergence[3])).ok());
  const StoreStats after = store_->Stats("ns");
  EXPECT_EQ(after.retained_nodes, 0u);
  EXPECT_EQ(after.retained_bytes, 0u);
  EXPECT_LT(after.bytes_stored, kept.bytes_stored / 2);
  EXPECT_EQ(after.nodes, kFirstDeleted);  // n0's blocks before its branch, shared by all four
  Open();
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 0u);
  EXPECT_EQ(store_->Stats("ns").nodes, after.nodes);
}

TEST_F(RetainTest, APutOfTheDeletedPrefixRevivesItsRetainedBlocks) {
  ASSERT_TRUE(DeleteN0Branch().ok());
  const uint64_t retained = store_->Stats("ns").retained_nodes;
  ASSERT_GT(retained, 20u);
  auto again = PutDump(store_.get(), "ns", n_[0], kLossy);
  ASSERT_TRUE(again.ok()) << again.status();
  size_t deduplicated = 0;
  for (const BlockReport& r : again->blocks)
    deduplicated += r.outcome == BlockOutcome::kDeduplicated;
  EXPECT_EQ(deduplicated, kFirstDeleted + retained);  // the retained ones are n0's KV still
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), n_[0].num_tokens() / 16);
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 0u);
  ExpectWithin(store_.get(), "ns", n_[0], kTarget);
  ExpectMembersUnchanged();
  Open();
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), n_[0].num_tokens() / 16);
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 0u);
}

TEST_F(RetainTest, AFailedWriteLeavesThePrefixAsItWas) {
  fs_->fail_wal_append = true;
  auto del = DeleteN0Branch();
  fs_->fail_wal_append = false;
  EXPECT_EQ(del.status().code(), absl::StatusCode::kUnavailable) << del.status();
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 0u);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), n_[0].num_tokens() / 16);
  ExpectMembersUnchanged();
  Open();  // a restart clears the failed state; nothing was marked on disk
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 0u);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), n_[0].num_tokens() / 16);
  ExpectMembersUnchanged();
  ExpectWithin(store_.get(), "ns", n_[0], kTarget);
}

// A retained block that is itself a residual of a block outside the deleted prefix (kept as the
// parent of a retained centroid) is re-encoded when that centroid goes (retention off by then,
// so its cluster re-elects): it stays retained, on disk too, and the blocks below it keep reading
// back.
TEST_F(RetainTest, AReencodedRetainedBlockStaysRetainedAcrossARestart) {
  store_.reset();
  std::filesystem::remove_all(dir_);
  Open();
  // n1's first 20 blocks lossless (standalone); n0 lossy: blocks 3-19 residuals of n1's, 20-31
  // standalone; n2 lossy: its blocks 8-19 members of n1's, 20-31 of n0's.
  ASSERT_NO_FATAL_FAILURE(PutPrefix(n_[1], 20, {.encoding = Encoding::kLossless}));
  ASSERT_TRUE(PutDump(store_.get(), "ns", n_[0], kLossy).ok());
  ASSERT_TRUE(PutDump(store_.get(), "ns", n_[2], kLossy).ok());
  const Blocks n2 = ReadAll(n_[2]);
  auto del = DeleteN0Branch();  // n0's 20-31 retained for n2, with their parents 8-19
  ASSERT_TRUE(del.ok()) << del.status();
  ASSERT_EQ(del->nodes_retained, 24u);
  // Retention off: n1's branch goes, its clusters re-elect n2's blocks, and n0's retained blocks
  // 8-19 (members of n1's) are re-encoded against them.
  StoreOptions o;
  o.data_dir = dir_.string();
  o.env = env_.get();
  o.background = false;
  o.near_dup.retain_lossy_centroids = false;
  store_.reset();
  auto reopened = KvStore::Open(o);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  store_ = *std::move(reopened);
  auto gone = store_->Delete("ns", n_[1].model_id, Branch(1, kDivergence[1]));
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_GE(gone->nodes_rewritten, 12u);
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 24u);
  Open();
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 24u);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), kFirstDeleted);
  EXPECT_TRUE(ReadAll(n_[2]) == n2);
}

// A centroid with lossy members is not evicted (evicting it would re-encode them larger than it
// frees); its members are, and then it is. Retained nodes are never evicted.
TEST_F(RetainTest, EvictionTakesLossyMembersBeforeTheirCentroid) {
  auto leaf = [&](size_t i) {
    return store_->Lookup("ns", n_[i].model_id, n_[i].token_ids).node_ids.back();
  };
  const uint64_t centroid = leaf(0);
  ASSERT_TRUE(KvStoreTestPeer::HasDependents(store_.get(), "ns", n_[0].model_id, centroid));
  auto freed = KvStoreTestPeer::Evict(store_.get(), "ns", n_[0].model_id, {centroid});
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 0u);
  EXPECT_EQ(store_->Stats("ns").evictions_disk, 0u);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), n_[0].num_tokens() / 16);
  // Its members are the other leaves (n3's as a tail window) and n3's block before its leaf (its
  // window 4 tokens earlier): they go, leaves first, then it can.
  const uint64_t n3_before_leaf =
      store_->Lookup("ns", n_[3].model_id, n_[3].token_ids).node_ids.at(30);
  std::vector<uint64_t> members;
  for (size_t i = 1; i < n_.size(); ++i) members.push_back(leaf(i));
  freed = KvStoreTestPeer::Evict(store_.get(), "ns", n_[0].model_id, members);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GT(*freed, 0u);
  freed = KvStoreTestPeer::Evict(store_.get(), "ns", n_[0].model_id, {n3_before_leaf});
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GT(*freed, 0u);
  EXPECT_EQ(store_->Stats("ns").evictions_disk, 4u);
  ASSERT_FALSE(KvStoreTestPeer::HasDependents(store_.get(), "ns", n_[0].model_id, centroid));
  freed = KvStoreTestPeer::Evict(store_.get(), "ns", n_[0].model_id, {centroid});
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GT(*freed, 0u);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), n_[0].num_tokens() / 16 - 1);
}

TEST_F(RetainTest, RetainedNodesAreNeverEvicted) {
  const std::vector<uint64_t> n0_ids =
      store_->Lookup("ns", n_[0].model_id, n_[0].token_ids).node_ids;
  ASSERT_TRUE(DeleteN0Branch().ok());
  const StoreStats kept = store_->Stats("ns");
  ASSERT_GT(kept.retained_nodes, 20u);
  const std::vector<uint64_t> deleted(n0_ids.begin() + kFirstDeleted, n0_ids.end());
  auto freed = KvStoreTestPeer::Evict(store_.get(), "ns", n_[0].model_id, deleted);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 0u);
  EXPECT_EQ(store_->Stats("ns").retained_nodes, kept.retained_nodes);
  EXPECT_EQ(store_->Stats("ns").evictions_disk, 0u);
  ExpectMembersUnchanged();
}

}  // namespace
}  // namespace kvtrie
