// Near-duplicate clusters in KvStore, on the real neardup dumps (tests/data/neardup/n0..n3: the
// GPL-3 preamble with one word changed, then the same Genesis text).
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"
#include "trie/blob_corruption_testing.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

constexpr uint32_t kBlockTokens = 16;

KvDump Load(const std::string& name) {
  auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

ModelInfo Model(const KvDump& d) {
  return {d.model_id, {d.num_layers, d.num_kv_heads, kBlockTokens, d.head_dim, d.dtype}};
}

// First block index whose tokens differ from n0's.
size_t DivergenceBlock(const KvDump& a, const KvDump& b) {
  size_t i = 0;
  while (i < a.num_tokens() && i < b.num_tokens() && a.token_ids[i] == b.token_ids[i]) ++i;
  return i / kBlockTokens;
}

class ClusterStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvtrie_cluster_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    StoreOptions o;
    o.data_dir = dir_.string();
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }

  absl::StatusOr<PutSummary> Put(const std::string& ns, const KvDump& d, const EncodeOptions& enc) {
    ModelInfo m = Model(d);
    auto session = store_->BeginPut(ns, m, d.token_ids, d.surprisal_bits, enc);
    if (!session.ok()) return session.status();
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (size_t b = 0; b < d.num_tokens() / kBlockTokens; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      if (auto s = (*session)->AddLayers(b, 0, 0, block); !s.ok()) return s;
    }
    return (*session)->Finish();
  }

  // Reads `d` back through Get + ReadAndDecodeBlock; checks every block is bit-exact (max_rel_rms =
  // 0) or within max_rel_rms (K and V). With `whole` false, whatever prefix of `d` is still stored.
  void ExpectReadable(const std::string& ns, const KvDump& d, double max_rel_rms,
                      bool whole = true) {
    ModelInfo m = Model(d);
    auto got = store_->Get(ns, m.model_id, d.token_ids, 0);
    ASSERT_TRUE(got.ok()) << got.status();
    if (whole) ASSERT_EQ(got->blocks.size(), d.num_tokens() / kBlockTokens);
    std::vector<uint8_t> want(m.geometry.num_bytes()), have(m.geometry.num_bytes());
    DecodeChain chain(m.geometry, nullptr);
    for (size_t b = 0; b < got->blocks.size(); ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(want));
      ASSERT_TRUE(
          store_->ReadAndDecodeBlock(ns, m.model_id, got->blocks[b], &chain, absl::MakeSpan(have))
              .ok())
          << "block " << b;
      if (max_rel_rms == 0) {
        ASSERT_EQ(want, have) << "block " << b;
      } else {
        EXPECT_LE(RelRms(m.geometry, want, have, 0), max_rel_rms * 1.0001) << "K, block " << b;
        EXPECT_LE(RelRms(m.geometry, want, have, 1), max_rel_rms * 1.0001) << "V, block " << b;
      }
    }
  }

  std::vector<std::vector<uint8_t>> ReadAll(const KvDump& d) {
    return testing_store::ReadAllBlocks(store_.get(), "ns", d);
  }

  std::filesystem::path dir_;
  std::unique_ptr<KvStore> store_;
};

// After the divergence, every n1 / n2 block is a residual of an n0 block at the same depth.
void ExpectResidualsAfterDivergence(const PutSummary& s, size_t divergence,
                                    const std::string& what) {
  size_t residual = 0, after = 0;
  for (const BlockReport& r : s.blocks) {
    if (r.block_index < divergence) {
      EXPECT_EQ(r.outcome, BlockOutcome::kDeduplicated) << what << " block " << r.block_index;
      continue;
    }
    if (r.block_index == divergence) continue;  // holds the changed word
    ++after;
    if (r.outcome == BlockOutcome::kResidualOfCentroid) ++residual;
  }
  EXPECT_GT(after, 20u) << what;
  EXPECT_EQ(residual, after) << what << ": blocks after the divergence stored as residuals";
}

TEST_F(ClusterStoreTest, LosslessNearDuplicatesAreResidualsOfACentroidAndBitExact) {
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1"), n2 = Load("neardup/n2");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  auto s1 = Put("ns", n1, enc);
  auto s2 = Put("ns", n2, enc);
  ASSERT_TRUE(s1.ok()) << s1.status();
  ASSERT_TRUE(s2.ok()) << s2.status();
  ExpectResidualsAfterDivergence(*s1, DivergenceBlock(n0, n1), "n1");
  ExpectResidualsAfterDivergence(*s2, DivergenceBlock(n0, n2), "n2");
  ExpectReadable("ns", n0, 0);
  ExpectReadable("ns", n1, 0);
  ExpectReadable("ns", n2, 0);
  const StoreStats st = store_->Stats("ns");
  EXPECT_GT(st.cluster.centroids, 20u);
  EXPECT_GE(st.cluster.residual_nodes, 40u);  // n1's and n2's branches
  // Inspect shows the dependency and the trie distance to the centroid.
  const BlockReport& last = s1->blocks.back();
  auto in = store_->Inspect("ns", n1.model_id, last.node_id);
  ASSERT_TRUE(in.ok());
  EXPECT_EQ(in->node.reference_node_id, last.reference_node_id);
  EXPECT_GT(in->node.distance_to_reference_bits, 0);
  EXPECT_TRUE(
      KvStoreTestPeer::HasDependents(store_.get(), "ns", n1.model_id, last.reference_node_id));
}

TEST_F(ClusterStoreTest, LossyNearDuplicatesMeetTheTargetAndDeletingTheCentroidKeepsThem) {
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1"), n2 = Load("neardup/n2");
  const EncodeOptions enc{.encoding = Encoding::kResidual, .target_rel_rms = 0.1};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  auto s1 = Put("ns", n1, enc);
  auto s2 = Put("ns", n2, enc);
  ASSERT_TRUE(s1.ok() && s2.ok());
  ExpectResidualsAfterDivergence(*s1, DivergenceBlock(n0, n1), "n1");
  ExpectResidualsAfterDivergence(*s2, DivergenceBlock(n0, n2), "n2");
  ExpectReadable("ns", n1, 0.1);
  ExpectReadable("ns", n2, 0.1);

  // Delete n0's own branch (from its first block after the shared prefix): its blocks leave every
  // lookup; those n1 and n2 are coded against stay, retained, so they still read back within the
  // target (kv_store_retain_test.cc has the rest of retention).
  const size_t div = std::min(DivergenceBlock(n0, n1), DivergenceBlock(n0, n2));
  const size_t own = std::max(DivergenceBlock(n0, n1), DivergenceBlock(n0, n2));
  ASSERT_LT(div, own + 1);
  std::vector<uint32_t> n0_branch(n0.token_ids.begin(),
                                  n0.token_ids.begin() + (own + 1) * kBlockTokens);
  auto del = store_->Delete("ns", n0.model_id, n0_branch);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_EQ(del->nodes_deleted + del->nodes_retained, n0.num_tokens() / kBlockTokens - own);
  EXPECT_GT(del->centroids_retained, 20u);
  EXPECT_EQ(del->nodes_rewritten, 0u);
  EXPECT_EQ(store_->Lookup("ns", n0.model_id, n0.token_ids).node_ids.size(), own);
  ExpectReadable("ns", n1, 0.1);
  ExpectReadable("ns", n2, 0.1);
  EXPECT_TRUE(KvStoreTestPeer::HasDependents(store_.get(), "ns", n1.model_id,
                                             s1->blocks.back().reference_node_id));
}

TEST_F(ClusterStoreTest, LosslessDeleteOfTheCentroidKeepsMembersBitExact) {
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  ASSERT_TRUE(Put("ns", n1, enc).ok());
  const size_t div = DivergenceBlock(n0, n1);
  std::vector<uint32_t> n0_branch(n0.token_ids.begin(),
                                  n0.token_ids.begin() + (div + 1) * kBlockTokens);
  ASSERT_TRUE(store_->Delete("ns", n0.model_id, n0_branch).ok());
  ExpectReadable("ns", n1, 0);
  EXPECT_EQ(store_->Stats("ns").cluster.residual_nodes, 0u);
}

TEST_F(ClusterStoreTest, NamespacesNeverClusterAcrossEachOther) {
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(Put("a", n0, enc).ok());
  auto s = Put("b", n1, enc);
  ASSERT_TRUE(s.ok());
  for (const BlockReport& r : s->blocks) {
    EXPECT_EQ(r.outcome, BlockOutcome::kStored) << "block " << r.block_index;
  }
  EXPECT_EQ(store_->Stats("").cluster.residual_nodes, 0u);
}

// More in kv_store_shift_test.cc. With near_dup disabled nothing is detected or counted.
TEST_F(ClusterStoreTest, PositionShiftedNearDuplicateIsCodedAgainstTheCentroid) {
  const KvDump n0 = Load("neardup/n0"), n3 = Load("neardup/n3");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  auto s = Put("ns", n3, enc);
  ASSERT_TRUE(s.ok());
  const StoreStats st = store_->Stats("ns");
  EXPECT_GT(st.cluster.position_shifted_coded, 20u);
  EXPECT_EQ(st.cluster.residual_nodes, st.cluster.position_shifted_coded);
  ExpectReadable("ns", n3, 0);
}

TEST_F(ClusterStoreTest, DistanceGateOfZeroBitsClustersNothing) {
  store_.reset();
  StoreOptions o;
  o.data_dir = dir_.string();
  o.near_dup.max_distance_bits = 0;
  auto opened = KvStore::Open(o);
  ASSERT_TRUE(opened.ok());
  store_ = *std::move(opened);
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  ASSERT_TRUE(Put("ns", n1, enc).ok());
  const StoreStats st = store_->Stats("ns");
  EXPECT_EQ(st.cluster.residual_nodes, 0u);
  EXPECT_GT(st.cluster.gated_by_distance, 20u);
  EXPECT_GT(st.cluster.near_dup_groups, 20u);
}

TEST_F(ClusterStoreTest, ResidualsSurviveARestart) {
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kResidual, .target_rel_rms = 0.1};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  ASSERT_TRUE(Put("ns", n1, enc).ok());
  const uint64_t residuals = store_->Stats("ns").cluster.residual_nodes;
  ASSERT_GT(residuals, 20u);
  store_.reset();
  StoreOptions o;
  o.data_dir = dir_.string();
  auto opened = KvStore::Open(o);
  ASSERT_TRUE(opened.ok());
  store_ = *std::move(opened);
  EXPECT_EQ(store_->Stats("ns").cluster.residual_nodes, residuals);
  ExpectReadable("ns", n1, 0.1);
}

// A re-elected centroid can be newer than a member coded against it: recovery, which reads nodes
// by id, still finds it (here n0's blocks are re-coded against n1's, which came later).
TEST_F(ClusterStoreTest, AMemberOlderThanItsCentroidSurvivesARestart) {
  store_.reset();
  StoreOptions o;
  o.data_dir = dir_.string();
  o.near_dup.enabled = false;
  auto opened = KvStore::Open(o);
  ASSERT_TRUE(opened.ok());
  store_ = *std::move(opened);
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  auto s0 = Put("ns", n0, enc);
  auto s1 = Put("ns", n1, enc);
  ASSERT_TRUE(s0.ok() && s1.ok());
  const size_t div = DivergenceBlock(n0, n1);
  for (size_t b = div + 1; b < s0->blocks.size(); ++b) {
    ASSERT_LT(s0->blocks[b].node_id, s1->blocks[b].node_id);
    auto r = KvStoreTestPeer::RecodeAgainstCentroid(store_.get(), "ns", n0.model_id,
                                                    s0->blocks[b].node_id, s1->blocks[b].node_id);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_GT(*r, 0u);
  }
  const uint64_t residuals = store_->Stats("ns").cluster.residual_nodes;
  EXPECT_EQ(residuals, s0->blocks.size() - div - 1);
  store_.reset();
  opened = KvStore::Open(o);
  ASSERT_TRUE(opened.ok());
  store_ = *std::move(opened);
  EXPECT_EQ(store_->recovery().dropped_missing_parent, 0u);
  EXPECT_EQ(store_->Stats("ns").cluster.residual_nodes, residuals);
  ExpectReadable("ns", n0, 0);
  ExpectReadable("ns", n1, 0);
}

TEST_F(ClusterStoreTest, DiskEvictionNeverLeavesAMemberWithoutItsCentroid) {
  store_.reset();
  StoreOptions o;
  o.data_dir = dir_.string();
  o.disk_bytes = 450000;  // n0 + n1 fit (~320 KB lossless); s0..s3 then force evictions
  auto opened = KvStore::Open(o);
  ASSERT_TRUE(opened.ok());
  store_ = *std::move(opened);
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  ASSERT_TRUE(Put("ns", n1, enc).ok());
  ASSERT_GT(store_->Stats("ns").cluster.residual_nodes, 20u);
  for (int i = 0; i < 4; ++i) {
    auto s = Put("ns", Load("sessions/s" + std::to_string(i)), enc);
    ASSERT_TRUE(s.ok()) << s.status();
  }
  const StoreStats st = store_->Stats("ns");
  EXPECT_GT(st.evictions_disk, 0u);
  EXPECT_LE(st.disk_bytes, o.disk_bytes);
  EXPECT_GT(st.cluster.residual_nodes, 0u);  // some members survived, so did their centroids
  // Whatever is left of n0 and n1 decodes bit-exact: no member lost its centroid.
  ExpectReadable("ns", n1, 0, /*whole=*/false);
  ExpectReadable("ns", n0, 0, /*whole=*/false);
}

// n0..n3 stored with `enc`, then n0's own blocks from 8 on deleted (every centroid of the blocks
// the four share after their divergences); returns the namespace's stored bytes before and after.
struct ReelectRun {
  uint64_t before = 0, after = 0;
  DeleteSummary deleted;
  double growth() const { return static_cast<double>(after) / before - 1; }
};

class ReelectTest : public ClusterStoreTest {
 protected:
  static constexpr size_t kFirstDeleted = 8;
  // retain: --cluster_retain_deleted_centroids (lossy clusters keep their deleted centroid).
  void Run(const EncodeOptions& enc, bool retain = true) {
    if (!retain) {
      store_.reset();
      StoreOptions o;
      o.data_dir = dir_.string();
      o.near_dup.retain_lossy_centroids = false;
      auto s = KvStore::Open(o);
      ASSERT_TRUE(s.ok()) << s.status();
      store_ = *std::move(s);
    }
    for (const char* name : {"neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}) {
      dumps_.push_back(Load(name));
      auto s = Put("ns", dumps_.back(), enc);
      ASSERT_TRUE(s.ok()) << name << ": " << s.status();
    }
    const KvDump& n0 = dumps_[0];
    run_.before = store_->Stats("ns").bytes_stored;
    std::vector<uint32_t> prefix(n0.token_ids.begin(),
                                 n0.token_ids.begin() + (kFirstDeleted + 1) * kBlockTokens);
    auto del = store_->Delete("ns", n0.model_id, prefix);
    ASSERT_TRUE(del.ok()) << del.status();
    run_.deleted = *del;
    run_.after = store_->Stats("ns").bytes_stored;
    RecordProperty("bytes_before", std::to_string(run_.before));
    RecordProperty("bytes_after", std::to_string(run_.after));
    RecordProperty("growth_percent", std::to_string(100 * run_.growth()));
  }
  // What the Delete reports and the store counts; the members are then residuals again.
  void ExpectReelected() {
    EXPECT_EQ(run_.deleted.nodes_deleted, dumps_[0].num_tokens() / kBlockTokens - kFirstDeleted);
    EXPECT_GE(run_.deleted.centroids_reelected, 20u);
    const StoreStats st = store_->Stats("ns");
    EXPECT_EQ(st.centroids_reelected, run_.deleted.centroids_reelected);
    EXPECT_GE(st.cluster.residual_nodes, 2 * run_.deleted.centroids_reelected);
  }

  std::vector<KvDump> dumps_;
  ReelectRun run_;
};

TEST_F(ReelectTest, DeletingLosslessCentroidsReelectsKeepingMembersBitExactWithin10Percent) {
  Run({.encoding = Encoding::kLossless});
  ExpectReelected();
  for (size_t i = 1; i < dumps_.size(); ++i) ExpectReadable("ns", dumps_[i], 0);
  ExpectReadable("ns", dumps_[0], 0, /*whole=*/false);
  EXPECT_LE(run_.growth(), 0.10) << run_.before << " -> " << run_.after << " bytes";
}

TEST_F(ReelectTest, DeletingLossyCentroidsWithoutRetentionReelectsKeepingMembersWithinTarget) {
  Run({.encoding = Encoding::kResidual, .target_rel_rms = 0.1}, /*retain=*/false);
  ExpectReelected();
  for (size_t i = 1; i < dumps_.size(); ++i) ExpectReadable("ns", dumps_[i], 0.1);
  ExpectReadable("ns", dumps_[0], 0.1, /*whole=*/false);
  // Members keep their reconstructions bit-exact (lossless against the new centroid, the new
  // centroid lossless standalone): 78,850 -> 240,313 bytes (+205 %; +195 % without the n-gram
  // index, which makes n3's shifted blocks members too), against +690 % when every member went
  // standalone lossless (a lossy new centroid would change its reconstruction, which its members
  // and descendants predict from). The bound guards against going back towards +690 %; the
  // default (retention, below) meets the issue's +10 %.
  EXPECT_LE(run_.growth(), 2.3) << run_.before << " -> " << run_.after << " bytes";
}

// The default: every deleted centroid with a lossy member stays, retained, for its members.
// Nothing is re-encoded: the members read back bit-identical to before (so within their target),
// the deleted prefix is matched by no lookup, and the namespace's bytes do not grow (issue 20:
// <= +10 %).
TEST_F(ReelectTest, DeletingLossyCentroidsRetainsThemAndTheBytesDoNotGrow) {
  const EncodeOptions enc{.encoding = Encoding::kResidual, .target_rel_rms = 0.1};
  std::vector<std::vector<std::vector<uint8_t>>> before;  // per member, per block
  for (const char* name : {"neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}) {
    const KvDump d = Load(name);
    ASSERT_TRUE(Put("ns", d, enc).ok()) << name;
    before.push_back(ReadAll(d));
  }
  store_.reset();
  std::filesystem::remove_all(dir_);
  SetUp();
  Run(enc);
  EXPECT_EQ(run_.deleted.centroids_reelected, 0u);
  EXPECT_GE(run_.deleted.centroids_retained, 20u);
  EXPECT_EQ(run_.deleted.nodes_rewritten, 0u);
  EXPECT_EQ(run_.deleted.nodes_deleted + run_.deleted.nodes_retained,
            dumps_[0].num_tokens() / kBlockTokens - kFirstDeleted);
  const StoreStats st = store_->Stats("ns");
  EXPECT_EQ(st.retained_nodes, run_.deleted.nodes_retained);
  EXPECT_GT(st.retained_bytes, 0u);
  EXPECT_EQ(store_->Lookup("ns", dumps_[0].model_id, dumps_[0].token_ids).node_ids.size(),
            kFirstDeleted);
  for (size_t i = 1; i < dumps_.size(); ++i) {
    ExpectReadable("ns", dumps_[i], 0.1);
    EXPECT_TRUE(ReadAll(dumps_[i]) == before[i]) << "member " << i << " changed";
  }
  EXPECT_LE(run_.growth(), 0.10) << run_.before << " -> " << run_.after << " bytes";
}

TEST_F(ClusterStoreTest, EvictingACentroidReelectsAndMembersStillReadBack) {
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  auto s0 = Put("ns", n0, enc);
  auto s1 = Put("ns", n1, enc);
  ASSERT_TRUE(s0.ok() && s1.ok());
  const uint64_t centroid = s0->blocks.back().node_id;  // n0's leaf
  ASSERT_EQ(s1->blocks.back().reference_node_id, centroid);
  auto freed = KvStoreTestPeer::Evict(store_.get(), "ns", n0.model_id, {centroid});
  ASSERT_TRUE(freed.ok()) << freed.status();
  const StoreStats st = store_->Stats("ns");
  EXPECT_EQ(st.evictions_disk, 1u);  // a centroid no longer pins itself
  EXPECT_EQ(st.centroids_reelected, 1u);
  EXPECT_FALSE(KvStoreTestPeer::HasDependents(store_.get(), "ns", n0.model_id, centroid));
  ExpectReadable("ns", n1, 0);
  ExpectReadable("ns", n0, 0, /*whole=*/false);
  auto got = store_->Get("ns", n0.model_id, n0.token_ids, 0);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->blocks.size(), n0.num_tokens() / kBlockTokens - 1);
}

// One eviction of a centroid together with some of its members (the disk budget evicts many
// leaves at once): the new centroid is never one that goes in the same eviction, so the member
// that stays reads back bit-exact, whichever member the election would prefer.
TEST_F(ClusterStoreTest, EvictingACentroidWithMembersNeverElectsOneThatGoes) {
  const KvDump n[4] = {Load("neardup/n0"), Load("neardup/n1"), Load("neardup/n2"),
                       Load("neardup/n3")};
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  for (size_t stays = 1; stays < 4; ++stays) {
    SCOPED_TRACE(absl::StrCat("n", stays, " stays"));
    const std::string ns = absl::StrCat("ns", stays);
    uint64_t leaf[4];
    for (int i = 0; i < 4; ++i) {
      auto s = Put(ns, n[i], enc);
      ASSERT_TRUE(s.ok()) << s.status();
      leaf[i] = s->blocks.back().node_id;
      if (i > 0) ASSERT_EQ(s->blocks.back().reference_node_id, leaf[0]);
    }
    std::vector<uint64_t> victims;  // the members first, then their centroid
    for (size_t i = 1; i < 4; ++i) {
      if (i != stays) victims.push_back(leaf[i]);
    }
    victims.push_back(leaf[0]);
    auto freed = KvStoreTestPeer::Evict(store_.get(), ns, n[0].model_id, victims);
    ASSERT_TRUE(freed.ok()) << freed.status();
    EXPECT_EQ(store_->Stats(ns).evictions_disk, 3u);
    ExpectReadable(ns, n[stays], 0);
  }
}

// A Get that lists a member (cold: read from a RocksDB snapshot) after its re-election's new
// encoding is on disk but before it is published reads a payload coded against another centroid
// than its listing names: ABORTED (read it again, as a client does), never another error.
TEST_F(ClusterStoreTest, AReadBetweenAReencodingsWriteAndItsPublicationIsAborted) {
  store_.reset();
  std::filesystem::remove_all(dir_);
  StoreOptions o;
  o.data_dir = dir_.string();
  o.memory_bytes = 1;  // every read from disk
  auto opened = KvStore::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status();
  store_ = *std::move(opened);
  const KvDump n[4] = {Load("neardup/n0"), Load("neardup/n1"), Load("neardup/n2"),
                       Load("neardup/n3")};
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  uint64_t centroid = 0;
  for (int i = 0; i < 4; ++i) {
    auto s = Put("ns", n[i], enc);
    ASSERT_TRUE(s.ok()) << s.status();
    if (i == 0) centroid = s->blocks.back().node_id;
  }
  const ModelInfo m = Model(n[0]);
  int reads = 0, aborted = 0;
  KvStoreTestPeer::SetReplaceHook(store_.get(), [&] {
    for (int i = 1; i < 4; ++i) {
      auto got = store_->Get("ns", m.model_id, n[i].token_ids, 0);
      ASSERT_TRUE(got.ok()) << got.status();
      std::vector<uint8_t> have(m.geometry.num_bytes());
      DecodeChain chain(m.geometry, nullptr);
      for (const BlockRead& b : got->blocks) {
        absl::Status s =
            store_->ReadAndDecodeBlock("ns", m.model_id, b, &chain, absl::MakeSpan(have));
        ++reads;
        if (absl::IsAborted(s)) {
          ++aborted;
          break;  // the rest of the chain is read again
        }
        ASSERT_TRUE(s.ok()) << "n" << i << " node " << b.node_id << ": " << s;
      }
    }
  });
  auto freed = KvStoreTestPeer::Evict(store_.get(), "ns", m.model_id, {centroid});
  KvStoreTestPeer::SetReplaceHook(store_.get(), nullptr);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GT(reads, 0);
  EXPECT_GT(aborted, 0);  // the hook saw the window
  for (int i = 1; i < 4; ++i) ExpectReadable("ns", n[i], 0);
}

// A dump of `tokens` whose KV rows are s0's rows `rows` (real KV, tokens chosen for the trie).
KvDump Synthetic(const KvDump& s0, const std::vector<uint32_t>& tokens,
                 const std::vector<size_t>& rows) {
  KvDump d;
  d.model_id = s0.model_id;
  d.num_layers = s0.num_layers;
  d.num_kv_heads = s0.num_kv_heads;
  d.head_dim = s0.head_dim;
  d.dtype = s0.dtype;
  d.token_ids = tokens;
  d.surprisal_bits.assign(tokens.size(), 1.0f);
  const size_t row = s0.head_dim * 2, planes = s0.num_layers * s0.num_kv_heads;
  for (const std::vector<uint8_t>* x : {&s0.k, &s0.v}) {
    std::vector<uint8_t>& out = x == &s0.k ? d.k : d.v;
    for (size_t p = 0; p < planes; ++p) {
      for (size_t r : rows) {
        const uint8_t* src = x->data() + (p * s0.num_tokens() + r) * row;
        out.insert(out.end(), src, src + row);
      }
    }
  }
  return d;
}

// A position-shifted member whose own text repeats within half a block, and whose child continues
// it: re-elected after its centroid's Delete, it must not be coded against a window of itself and
// its own child (its decode would need itself: unbounded recursion).
TEST_F(ClusterStoreTest, AReelectedShiftedMemberIsNeverCodedAgainstItself) {
  const KvDump s0 = Load("sessions/s0");
  auto seq = [](uint32_t from) {
    std::vector<uint32_t> t(kBlockTokens);
    for (uint32_t i = 0; i < kBlockTokens; ++i) t[i] = from + i;
    return t;
  };
  auto rows = [](size_t from) {
    std::vector<size_t> r(kBlockTokens);
    for (size_t i = 0; i < kBlockTokens; ++i) r[i] = from + i;
    return r;
  };
  auto cat = [](std::vector<std::vector<uint32_t>> parts) {
    std::vector<uint32_t> out;
    for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  };
  auto catr = [](std::vector<std::vector<size_t>> parts) {
    std::vector<size_t> out;
    for (auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  };
  std::vector<uint32_t> periodic(kBlockTokens), cont = seq(500);
  for (uint32_t i = 0; i < kBlockTokens; ++i) periodic[i] = 1 + i % 4;
  for (uint32_t i = 0; i < 4; ++i) cont[i] = 1 + i;  // continues the period for 4 tokens
  // KV rows with the text's period too: x's and y's periodic blocks alike, w's a little apart.
  std::vector<size_t> prow(kBlockTokens), wrow(kBlockTokens), crow = rows(100);
  for (size_t i = 0; i < kBlockTokens; ++i) {
    prow[i] = 16 + i % 4;
    wrow[i] = i < 12 ? 16 + i % 4 : 40 + i % 4;
  }
  for (size_t i = 0; i < 4; ++i) crow[i] = 16 + i;
  const KvDump x = Synthetic(s0, cat({seq(100), periodic}), catr({rows(0), prow}));
  const KvDump w = Synthetic(s0, cat({seq(200), periodic}), catr({rows(32), wrow}));
  const KvDump y = Synthetic(s0, cat({seq(300), seq(400), periodic, cont}),
                             catr({rows(64), rows(80), prow, crow}));
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  auto px = Put("ns", x, enc);
  auto pw = Put("ns", w, enc);
  auto py = Put("ns", y, enc);
  ASSERT_TRUE(px.ok() && pw.ok() && py.ok());
  const uint64_t centroid = px->blocks[1].node_id;
  EXPECT_EQ(pw->blocks[1].reference_node_id, centroid);
  ASSERT_EQ(py->blocks[2].reference_node_id, centroid);  // a shifted member of x's block
  ASSERT_EQ(py->blocks[3].reference_node_id, 0u);        // its child: standalone
  ASSERT_TRUE(store_->Delete("ns", x.model_id, x.token_ids).ok());
  ExpectReadable("ns", w, 0);
  ExpectReadable("ns", y, 0);
}

// The background pass's hook: a member stored standalone (here: clusters off when it was Put) is
// re-encoded against a centroid and stays bit-exact, smaller; a re-election still works after.
TEST_F(ClusterStoreTest, RecodeAgainstCentroidMakesAStandaloneMemberAResidual) {
  store_.reset();
  StoreOptions o;
  o.data_dir = dir_.string();
  o.near_dup.enabled = false;
  auto opened = KvStore::Open(o);
  ASSERT_TRUE(opened.ok());
  store_ = *std::move(opened);
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  auto s0 = Put("ns", n0, enc);
  auto s1 = Put("ns", n1, enc);
  ASSERT_TRUE(s0.ok() && s1.ok());
  const uint64_t before = store_->Stats("ns").bytes_stored;
  const size_t div = DivergenceBlock(n0, n1);
  uint64_t saved = 0;
  for (size_t b = div + 1; b < s1->blocks.size(); ++b) {
    auto r = KvStoreTestPeer::RecodeAgainstCentroid(store_.get(), "ns", n0.model_id,
                                                    s1->blocks[b].node_id, s0->blocks[b].node_id);
    ASSERT_TRUE(r.ok()) << r.status();
    saved += *r;
  }
  const StoreStats st = store_->Stats("ns");
  EXPECT_GT(saved, before / 4);
  EXPECT_EQ(st.bytes_stored, before - saved);
  EXPECT_EQ(st.cluster.residual_nodes, s1->blocks.size() - div - 1);
  ExpectReadable("ns", n1, 0);
  // Not twice, and never against itself or another depth.
  const uint64_t member = s1->blocks.back().node_id, centroid = s0->blocks.back().node_id;
  EXPECT_EQ(
      KvStoreTestPeer::RecodeAgainstCentroid(store_.get(), "ns", n0.model_id, member, centroid)
          .status()
          .code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(KvStoreTestPeer::RecodeAgainstCentroid(store_.get(), "ns", n0.model_id, centroid,
                                                   s1->blocks[div + 1].node_id)
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  std::vector<uint32_t> n0_branch(n0.token_ids.begin(),
                                  n0.token_ids.begin() + (div + 1) * kBlockTokens);
  auto del = store_->Delete("ns", n0.model_id, n0_branch);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_GT(del->centroids_reelected, 20u);
  ExpectReadable("ns", n1, 0);
}

}  // namespace
}  // namespace kvtrie

namespace kvtrie {
namespace {

// A centroid whose payload rots on disk is dropped (its own bytes failed their check); its
// members can not be decoded any more: they are DATA_LOSS on every read (never ABORTED, never
// served against a missing reference) but kept, since only bytes that fail their own check are
// dropped by a read (issue 18). Recovery drops them (their centroid is gone).
TEST_F(ClusterStoreTest, MembersOfACorruptCentroidAreDataLossAndKept) {
  const KvDump n0 = Load("neardup/n0"), n1 = Load("neardup/n1");
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(Put("ns", n0, enc).ok());
  auto s1 = Put("ns", n1, enc);
  ASSERT_TRUE(s1.ok()) << s1.status();
  const BlockReport member = s1->blocks[26];
  ASSERT_EQ(member.outcome, BlockOutcome::kResidualOfCentroid);
  std::string centroid;
  {
    auto got = store_->Get("ns", n0.model_id, n0.token_ids, 0);
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->blocks[26].node_id, member.reference_node_id);
    auto payload = store_->ReadPayload("ns", n0.model_id, got->blocks[26]);
    ASSERT_TRUE(payload.ok());
    centroid = **payload;
  }
  store_.reset();  // flushes: the payloads are now in blob files
  ASSERT_EQ(FlipByteInBlobFiles(dir_, centroid), 1)
      << "the centroid's payload was not found in a blob file";
  StoreOptions o;
  o.data_dir = dir_.string();
  auto reopened = KvStore::Open(o);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  store_ = *std::move(reopened);

  const ModelInfo m = Model(n1);
  auto got = store_->Get("ns", m.model_id, n1.token_ids, 0);
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->blocks.size(), 32u);
  std::vector<uint8_t> out(m.geometry.num_bytes());
  DecodeChain chain(m.geometry, nullptr);
  absl::Status s;
  size_t b = 0;
  for (; b < got->blocks.size(); ++b) {
    s = store_->ReadAndDecodeBlock("ns", m.model_id, got->blocks[b], &chain, absl::MakeSpan(out));
    if (!s.ok()) break;
  }
  EXPECT_EQ(b, 26u);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  // The centroid and its subtree are gone; the member and its subtree are still stored, and
  // DATA_LOSS again on the next read; what is before it (and what is left of n0) reads back.
  EXPECT_EQ(store_->Lookup("ns", m.model_id, n0.token_ids).node_ids.size(), 26u);
  EXPECT_EQ(store_->Lookup("ns", m.model_id, n1.token_ids).node_ids.size(), 32u);
  ExpectReadable("ns", n0, 0, /*whole=*/false);
  auto again = store_->Get("ns", m.model_id, n1.token_ids, 0);
  ASSERT_TRUE(again.ok());
  DecodeChain chain2(m.geometry, nullptr);
  for (b = 0; b < again->blocks.size(); ++b) {
    s = store_->ReadAndDecodeBlock("ns", m.model_id, again->blocks[b], &chain2,
                                   absl::MakeSpan(out));
    if (!s.ok()) break;
  }
  EXPECT_EQ(b, 26u);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(store_->Lookup("ns", m.model_id, n1.token_ids).node_ids.size(), 32u);
}

}  // namespace
}  // namespace kvtrie
