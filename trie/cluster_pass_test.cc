// The background cluster pass (trie/cluster_pass.h) on the real near-duplicate dumps
// (tests/data/neardup/n0..n3: the GPL-3 preamble with one word changed, then the same text).
#include "trie/cluster_pass.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "codec/block_codec.h"
#include "codec/decode_chain.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"
#include "trie/record_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::DumpModel;
using testing_store::ExpectBitExact;
using testing_store::FreshTestDir;
using testing_store::LoadTestDumps;

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
  // Puts every full block of `d` on the default path (the server encodes it with `enc`).
  void PutWith(const KvDump& d, const EncodeOptions& enc) {
    auto summary = testing_store::PutDump(store_.get(), "ns", d, enc);
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
  // The blocks of `d` as a Get reads them now (decoded in order on one chain), appended to *out.
  void ReadBack(const KvDump& d, std::vector<std::vector<uint8_t>>* out) {
    const ModelInfo m = DumpModel(d);
    auto got = store_->Get("ns", m.model_id, d.token_ids, 0);
    ASSERT_TRUE(got.ok()) << got.status();
    DecodeChain chain(m.geometry, nullptr);
    for (const BlockRead& b : got->blocks) {
      out->emplace_back(m.geometry.num_bytes());
      ASSERT_TRUE(
          store_->ReadAndDecodeBlock("ns", m.model_id, b, &chain, absl::MakeSpan(out->back()))
              .ok());
    }
  }

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
  EXPECT_LE(after, before * 0.70) << before << " -> " << after;
  EXPECT_GE(st.cluster_pass_rounds, 1u);
  for (const KvDump& d : dumps_) {
    EXPECT_EQ(ExpectBitExact(store_.get(), "ns", d), d.num_tokens() / 16);
  }
  // Settled: a round now visits nothing and encodes nothing.
  const ClusterPassRound idle = KvStoreTestPeer::RunClusterPass(store_.get());
  EXPECT_EQ(idle.groups, 0u);
  EXPECT_EQ(idle.encodings, 0u);
}

// Lossy client-encoded blocks (RESIDUAL fast at 0.1): a member is coded against the centroid only
// when its reconstruction, coded losslessly against the centroid's, is smaller than its lossy
// standalone encoding (here it mostly is: -32 %); every block keeps its reconstruction.
TEST_F(ClusterPassTest, EncodedLossyPutsShrinkAndKeepTheirReconstruction) {
  Open();
  const EncodeOptions eo{
      .encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = 0.1};
  for (const KvDump& d : dumps_) PutEncoded(d, eo);
  const uint64_t before = Bytes();
  std::vector<std::vector<uint8_t>> recon;  // n1's blocks as read before the pass
  const auto read = [&](std::vector<std::vector<uint8_t>>* out) { ReadBack(dumps_[1], out); };
  read(&recon);
  RunToCompletion();
  const uint64_t after = Bytes();
  RecordProperty("bytes_before", std::to_string(before));
  RecordProperty("bytes_after", std::to_string(after));
  EXPECT_LE(after, before * 0.75) << before << " -> " << after;  // measured 238,040 -> 161,406
  std::vector<std::vector<uint8_t>> again;
  read(&again);
  EXPECT_EQ(again, recon);
}

// Issue 33: a lossy block the pass re-coded LOSSLESS against its centroid stays lossy (its
// reconstruction is not what its Put sent), also after a restart: Stats count it, Inspect says
// so, and a Delete of its centroid's prefix keeps the centroid (retained) instead of re-coding
// the members, so the namespace does not grow (it grew 1.76x when the LOSSLESS coding made them
// count as bit-exact), nor does an eviction take it; every member still reads back as before.
TEST_F(ClusterPassTest, ALossyBlockRecodedLosslessStaysLossyAndKeepsItsCentroidOnDelete) {
  Open();
  const EncodeOptions eo{
      .encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = 0.1};
  for (const KvDump& d : dumps_) PutEncoded(d, eo);
  RunToCompletion();
  const std::string model = dumps_[0].model_id;
  const auto check_kinds = [&] {
    const StoreStats st = store_->Stats("ns");
    EXPECT_GT(st.cluster.residual_nodes, 40u);
    EXPECT_EQ(st.lossy_nodes, st.nodes);  // every block was sent lossy
    EXPECT_EQ(st.lossy_recoded_nodes, st.cluster.residual_nodes);
    size_t members = 0;
    for (uint64_t id : store_->Lookup("ns", model, dumps_[1].token_ids).node_ids) {
      auto in = store_->Inspect("ns", model, id);
      ASSERT_TRUE(in.ok()) << in.status();
      EXPECT_TRUE(in->node.lossy) << id;
      EXPECT_NEAR(in->node.target_rel_rms, 0.1, 1e-6) << id;  // what the Put asked
      if (in->node.reference_node_id == 0) continue;
      ++members;
      EXPECT_EQ(in->node.encoding, Encoding::kLossless) << id;
      EXPECT_GT(std::max(in->node.rel_rms_error_k, in->node.rel_rms_error_v), 0.0) << id;
    }
    EXPECT_GT(members, 10u);
  };
  check_kinds();
  Open();  // restart: the kind is in the node record
  check_kinds();
  std::vector<std::vector<uint8_t>> before;  // n1 as read now
  const auto read = [&](std::vector<std::vector<uint8_t>>* out) { ReadBack(dumps_[1], out); };
  read(&before);
  // Eviction: n0's leaf is the centroid of lossy members (coded LOSSLESS now): not evicted (its
  // members would be re-coded larger than it frees).
  const uint64_t n0_leaf = store_->Lookup("ns", model, dumps_[0].token_ids).node_ids.back();
  ASSERT_TRUE(KvStoreTestPeer::HasDependents(store_.get(), "ns", model, n0_leaf));
  const uint64_t before_evict = Bytes();
  auto freed = KvStoreTestPeer::Evict(store_.get(), "ns", model, {n0_leaf});
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 0u);
  EXPECT_EQ(Bytes(), before_evict);
  EXPECT_EQ(store_->Stats("ns").evictions_disk, 0u);
  // n0's own branch holds the centroids (the most probable variant).
  size_t shared = 0;
  for (size_t j = 1; j < dumps_.size(); ++j) {
    size_t i = 0;
    while (i < dumps_[0].num_tokens() && dumps_[0].token_ids[i] == dumps_[j].token_ids[i]) ++i;
    shared = std::max(shared, i / 16);
  }
  const uint64_t bytes = Bytes();
  std::vector<uint32_t> branch(dumps_[0].token_ids.begin(),
                               dumps_[0].token_ids.begin() + (shared + 1) * 16);
  auto del = store_->Delete("ns", model, branch);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_GT(del->centroids_retained, 10u);
  EXPECT_EQ(del->centroids_reelected, 0u);
  EXPECT_EQ(del->bytes_rewritten, 0u);
  EXPECT_LE(Bytes(), bytes);
  std::vector<std::vector<uint8_t>> after;
  read(&after);
  EXPECT_EQ(after, before);
}

// Records written before NodeRecord.lossy (by a server whose pass re-coded lossy blocks LOSSLESS
// and kept their errors) read as lossy: a record with lossy = false is what such a server wrote
// (proto3 writes no false bool), and the Delete of the centroids then retains them too.
TEST_F(ClusterPassTest, RecordsWrittenBeforeTheLossyFieldReadAsLossy) {
  Open();
  const EncodeOptions eo{
      .encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = 0.1};
  for (const KvDump& d : dumps_) PutEncoded(d, eo);
  RunToCompletion();
  const StoreStats want = store_->Stats("ns");
  ASSERT_GT(want.lossy_recoded_nodes, 40u);
  store_.reset();
  {
    RecordStore::Options o;
    o.data_dir = dir_.string();
    auto records = RecordStore::Open(o);
    ASSERT_TRUE(records.ok()) << records.status();
    RecordBatch batch(records->get());
    size_t rewritten = 0;
    ASSERT_TRUE((*records)
                    ->ForEachNode(false,
                                  [&](uint64_t shard, uint64_t id, absl::StatusOr<NodeMeta> m,
                                      const std::string*) {
                                    ASSERT_TRUE(m.ok()) << m.status();
                                    if (!m->lossy) return;
                                    m->lossy = false;
                                    batch.PutNode(shard, id, *m, nullptr);  // the record only
                                    ++rewritten;
                                  })
                    .ok());
    EXPECT_EQ(rewritten, want.nodes);
    ASSERT_TRUE((*records)->Write(batch).ok());
  }
  Open();
  const StoreStats got = store_->Stats("ns");
  EXPECT_EQ(got.lossy_nodes, want.lossy_nodes);
  EXPECT_EQ(got.lossy_recoded_nodes, want.lossy_recoded_nodes);
  EXPECT_EQ(got.bytes_stored, want.bytes_stored);
  std::vector<uint32_t> branch(dumps_[0].token_ids.begin(), dumps_[0].token_ids.begin() + 9 * 16);
  auto del = store_->Delete("ns", dumps_[0].model_id, branch);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_GT(del->centroids_retained, 10u);
  EXPECT_EQ(del->centroids_reelected, 0u);
  EXPECT_LE(Bytes(), want.bytes_stored);
}

// RAW blocks stay RAW: the pass clusters only lossless and residual blocks.
TEST_F(ClusterPassTest, RawBlocksAreLeftAsTheyAre) {
  Open();
  const EncodeOptions eo{.encoding = Encoding::kRaw};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[1], eo);
  const uint64_t before = Bytes();
  EXPECT_EQ(RunToCompletion(), 0u);
  EXPECT_EQ(Bytes(), before);
  EXPECT_EQ(store_->Stats("ns").cluster_pass_recoded, 0u);
}

// Issue 33, any offset on the default path: n3 repeats n0 4 tokens earlier after its changed
// word, so its blocks from 6 on share no (depth, tokens) group with n0's. Client-encoded, they
// arrive standalone; the pass looks at each once and codes its exact reconstruction against
// n0's window at the offset (keys turned by RoPE), as the compact Put path does at Put time
// (trie/kv_store_shift_test.cc: 36 % of standalone), also after a restart before the pass. The
// older text is never coded against the newer one, everything stays bit-exact, and a settled
// namespace costs a round nothing (the marks are cleared).
TEST_F(ClusterPassTest, EncodedShiftedRepeatIsCodedAgainstWhatItRepeatsAtAnyOffset) {
  Open();
  const EncodeOptions eo{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[3], eo);
  const ModelInfo m = DumpModel(dumps_[3]);
  // n3's blocks from 6 on: their bytes and how many are residuals.
  const auto shifted = [&](uint64_t* bytes) {
    const std::vector<uint64_t> ids =
        store_->Lookup("ns", m.model_id, dumps_[3].token_ids).node_ids;
    EXPECT_EQ(ids.size(), 32u);
    size_t residuals = 0;
    *bytes = 0;
    for (size_t b = 6; b < ids.size(); ++b) {
      auto in = store_->Inspect("ns", m.model_id, ids[b]);
      EXPECT_TRUE(in.ok()) << in.status();
      if (!in.ok()) continue;
      *bytes += in->node.bytes_stored;
      residuals += in->node.reference_node_id != 0;
    }
    return residuals;
  };
  uint64_t before = 0, after = 0;
  ASSERT_EQ(shifted(&before), 0u);  // stored as their client sent them
  Open();  // a restart before the pass: the blocks to look at are marked in their records
  EXPECT_GT(RunToCompletion(), 0u);
  const size_t residuals = shifted(&after);
  RecordProperty("shifted_bytes_before", std::to_string(before));
  RecordProperty("shifted_bytes_after", std::to_string(after));
  EXPECT_GE(residuals, 24u);
  EXPECT_LT(after, before / 2) << before << " -> " << after;
  EXPECT_GE(store_->Stats("ns").cluster.position_shifted_coded, residuals);
  for (uint64_t id : store_->Lookup("ns", m.model_id, dumps_[0].token_ids).node_ids) {
    auto in = store_->Inspect("ns", m.model_id, id);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(in->node.reference_node_id, 0u) << "n0's node " << id;  // the older text
  }
  for (int i : {0, 3}) {
    EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[i]), dumps_[i].num_tokens() / 16);
  }
  const ClusterPassRound idle = KvStoreTestPeer::RunClusterPass(store_.get());
  EXPECT_EQ(idle.encodings, 0u);
  Open();  // durable
  EXPECT_EQ(shifted(&before), residuals);
  EXPECT_EQ(before, after);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[3]), dumps_[3].num_tokens() / 16);
}

// The same for lossy client-encoded blocks (RESIDUAL fast at 0.1): a block's reconstruction,
// coded losslessly against a window of another lossy reconstruction, is kept only when smaller,
// so the namespace never grows and every block reads back exactly as before the pass.
TEST_F(ClusterPassTest, EncodedLossyShiftedRepeatNeverGrowsAndKeepsItsReconstruction) {
  Open();
  const EncodeOptions eo{
      .encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = 0.1};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[3], eo);
  const auto read = [&](std::vector<std::vector<uint8_t>>* out) { ReadBack(dumps_[3], out); };
  std::vector<std::vector<uint8_t>> recon, again;
  read(&recon);
  const uint64_t before = Bytes();
  RunToCompletion();
  const uint64_t after = Bytes();
  RecordProperty("bytes_before", std::to_string(before));
  RecordProperty("bytes_after", std::to_string(after));
  EXPECT_LE(after, before);
  read(&again);
  EXPECT_EQ(again, recon);
}

// A Get listed before the pass re-encoded a cold block reads the block's old bytes in its
// snapshot (standalone, while the node is now a residual of n0's window). Those bytes must not
// become the node's hot copy: every later Get would list them against the new centroid and fail
// ABORTED until they left memory (found by tests/cluster_pass_crash_test.cc).
TEST_F(ClusterPassTest, AColdReadListedBeforeARecodeIsNeverPromoted) {
  Open();
  const EncodeOptions eo{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[3], eo);
  Open();  // recovered cold; a block read twice while cold is promoted to memory
  const ModelInfo m = DumpModel(dumps_[3]);
  auto listed = store_->Get("ns", m.model_id, dumps_[3].token_ids, 0);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->blocks.size(), 32u);
  ASSERT_EQ(listed->blocks[20].encoded, nullptr);  // cold: read in the Get's snapshot
  EXPECT_GT(RunToCompletion(), 0u);                // n3's shifted blocks become residuals
  // The old bytes, read by the old listing: each block's second cold read (the pass read it once).
  for (const BlockRead& b : listed->blocks) {
    ASSERT_TRUE(store_->ReadPayload("ns", m.model_id, b).ok());
  }
  auto again = store_->Get("ns", m.model_id, dumps_[3].token_ids, 0);
  ASSERT_TRUE(again.ok());
  ASSERT_NE(again->blocks[20].reference_node_id, 0u);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[3]), 32u);
}

// A round spends at most its budget; the groups it could not finish are visited by the next.
TEST_F(ClusterPassTest, RoundsAreBoundedAndResume) {
  Open(0, 4);
  const EncodeOptions eo{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  PutEncoded(dumps_[0], eo);
  PutEncoded(dumps_[1], eo);
  const ClusterPassRound first = KvStoreTestPeer::RunClusterPass(store_.get());
  EXPECT_GT(first.encodings, 0u);
  EXPECT_LE(first.encodings, 4u);
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
  EXPECT_GE(st.cluster_pass_rounds, 1u);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", dumps_[1]), dumps_[1].num_tokens() / 16);
}

// Every arrival order of n0..n3, Put on the default (server-encoded) path and then settled by
// the pass: measured against the best order's bytes, and whether the most probable variant
// (lowest path surprisal) of each near-duplicate group is its centroid. Issue 20's target is
// 0.5 % for every order: met by every lossless order.
class ArrivalOrderTest : public ClusterPassTest {
 protected:
  struct Run {
    uint64_t put_bytes = 0;   // after the Puts
    uint64_t pass_bytes = 0;  // after the pass
    size_t groups = 0;        // aligned near-duplicate groups checked
    size_t wrong_centroid = 0;
  };
  Run PutInOrder(const std::vector<int>& order, const EncodeOptions& enc) {
    Run r;
    store_.reset();
    std::filesystem::remove_all(dir_);
    Open();
    for (int i : order) {
      PutWith(dumps_[i], enc);
    }
    r.put_bytes = Bytes();
    RunToCompletion();
    r.pass_bytes = Bytes();
    // Each block index: the dumps' nodes with the same tokens there, by node.
    const std::string model = dumps_[0].model_id;
    std::vector<std::vector<uint64_t>> path(dumps_.size());
    for (size_t i = 0; i < dumps_.size(); ++i) {
      path[i] = store_->Lookup("ns", model, dumps_[i].token_ids).node_ids;
    }
    for (size_t b = 0;; ++b) {
      std::vector<NodeView> group;
      for (size_t i = 0; i < dumps_.size(); ++i) {
        if (b >= path[i].size()) continue;
        auto in = store_->Inspect("ns", model, path[i][b]);
        EXPECT_TRUE(in.ok()) << in.status();
        if (!in.ok()) continue;
        const bool seen = std::any_of(group.begin(), group.end(), [&](const NodeView& v) {
          return v.node_id == in->node.node_id;
        });
        if (!seen && (group.empty() || in->node.token_ids == group.front().token_ids)) {
          group.push_back(in->node);
        }
      }
      if (group.empty()) break;
      if (group.size() < 2) continue;
      ++r.groups;
      const NodeView& best =
          *std::min_element(group.begin(), group.end(), [](const NodeView& a, const NodeView& b) {
            return a.path_surprisal_bits < b.path_surprisal_bits;
          });
      bool ok = best.reference_node_id == 0;
      for (const NodeView& v : group) {
        if (v.node_id != best.node_id && v.reference_node_id != best.node_id &&
            v.reference_node_id != 0) {
          ok = false;  // a residual of another member
        }
      }
      if (!ok) ++r.wrong_centroid;
    }
    return r;
  }
  // Every order's bytes after the Puts and after the pass (recorded), and the best and worst.
  std::vector<std::pair<std::string, Run>> EveryOrder(const EncodeOptions& enc) {
    std::vector<int> order = {0, 1, 2, 3};
    std::vector<std::pair<std::string, Run>> runs;
    do {
      std::string name;
      for (int i : order) name += "n" + std::to_string(i);
      runs.emplace_back(name, PutInOrder(order, enc));
    } while (std::next_permutation(order.begin(), order.end()));
    for (const auto& [name, r] : runs) {
      RecordProperty(name, std::to_string(r.put_bytes) + " -> " + std::to_string(r.pass_bytes));
    }
    return runs;
  }
  void ExpectEveryOrderNearTheBest(const EncodeOptions& enc, double tolerance) {
    std::vector<int> order = {0, 1, 2, 3};
    std::vector<std::pair<std::string, Run>> runs;
    do {
      std::string name;
      for (int i : order) name += "n" + std::to_string(i);
      runs.emplace_back(name, PutInOrder(order, enc));
      if (HasFatalFailure()) return;
    } while (std::next_permutation(order.begin(), order.end()));
    uint64_t best = UINT64_MAX, worst = 0, best_put = UINT64_MAX, worst_put = 0;
    for (const auto& [name, r] : runs) {
      best = std::min(best, r.pass_bytes);
      worst = std::max(worst, r.pass_bytes);
      best_put = std::min(best_put, r.put_bytes);
      worst_put = std::max(worst_put, r.put_bytes);
      RecordProperty(name, std::to_string(r.put_bytes) + " -> " + std::to_string(r.pass_bytes));
    }
    RecordProperty("put_best_worst", std::to_string(best_put) + " " + std::to_string(worst_put));
    RecordProperty("pass_best_worst", std::to_string(best) + " " + std::to_string(worst));
    for (const auto& [name, r] : runs) {
      EXPECT_LE(r.pass_bytes, r.put_bytes) << name;  // the pass never grows a namespace
      EXPECT_GT(r.groups, 20u) << name;
      // Every order ends within `tolerance` of the best order's bytes (measured: each one
      // exactly at the best's, 498,014), the most probable variant every group's centroid. With
      // the rarest (n2) first, the members move to it and the blocks n3 codes at an offset
      // follow and are looked at again once every group is settled (RecheckLocked: their best
      // window may span a group settled later, which made the result depend on the hash order
      // of the groups, +0.9 % at worst); with the position-shifted
      // variant (n3) first, each group of the aligned variants swaps with the n3 block it was
      // coded against at the offset (ConvergeGroup), which then codes against their path.
      EXPECT_LE(r.pass_bytes, best * (1 + tolerance))
          << name << ": " << r.put_bytes << " -> " << r.pass_bytes << " (best " << best << ")";
      EXPECT_EQ(r.wrong_centroid, 0u) << name << " of " << r.groups << " groups";
    }
  }
};

TEST_F(ArrivalOrderTest, LosslessArrivalOrdersEndNearTheBestWithTheMostProbableCentroid) {
  ExpectEveryOrderNearTheBest({.encoding = Encoding::kLossless}, 0.005);
}

// Lossy (residual at 0.1): a cluster moves only when its group's bytes fall, so the pass never
// grows a namespace. Measured: no lossy move pays (a member's lossy reconstruction coded
// losslessly against another is larger than its lossy residual): every order keeps its Put
// bytes, 78,718 (n1 first) to 81,179 (n3 first), +3.1 %.
TEST_F(ArrivalOrderTest, LossyArrivalOrdersNeverGrow) {
  const EncodeOptions enc{.encoding = Encoding::kResidual, .target_rel_rms = 0.1};
  uint64_t best = UINT64_MAX, worst = 0;
  for (const auto& [name, r] : EveryOrder(enc)) {
    EXPECT_LE(r.pass_bytes, r.put_bytes) << name;
    best = std::min(best, r.pass_bytes);
    worst = std::max(worst, r.pass_bytes);
  }
  RecordProperty("pass_best_worst", std::to_string(best) + " " + std::to_string(worst));
}

// The blocks a swap left for a later look (ClusterPolicy's recheck) are in their node records: a
// restart between the round that left them and the one that looks at them finds them again, and
// the namespace ends where an uninterrupted pass ends (n3 first: each aligned group swaps with
// the n3 block it was coded against at an offset, which then codes against their path).
TEST_F(ArrivalOrderTest, BlocksLeftForARecheckAreFoundAgainAfterARestart) {
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  const std::vector<int> order = {3, 0, 1, 2};
  const uint64_t uninterrupted = PutInOrder(order, enc).pass_bytes;
  store_.reset();
  std::filesystem::remove_all(dir_);
  Open(0, 16);  // small rounds: one ends with rechecks pending
  for (int i : order) PutWith(dumps_[i], enc);
  const std::string model = dumps_[0].model_id;
  std::vector<uint64_t> pending;
  for (int i = 0; i < 1000 && pending.empty(); ++i) {
    const ClusterPassRound r = KvStoreTestPeer::RunClusterPass(store_.get());
    pending = KvStoreTestPeer::PendingRechecks(store_.get(), "ns", model);
    if (r.encodings == 0) break;
  }
  ASSERT_FALSE(pending.empty()) << "no round ended with a recheck pending";
  Open(0, 16);  // restart
  EXPECT_EQ(KvStoreTestPeer::PendingRechecks(store_.get(), "ns", model), pending);
  RunToCompletion();
  EXPECT_TRUE(KvStoreTestPeer::PendingRechecks(store_.get(), "ns", model).empty());
  RecordProperty("bytes", std::to_string(Bytes()) + " vs " + std::to_string(uninterrupted));
  EXPECT_LE(Bytes(), uninterrupted * 1.005) << "uninterrupted: " << uninterrupted;
  for (const KvDump& d : dumps_) {
    EXPECT_EQ(ExpectBitExact(store_.get(), "ns", d), d.num_tokens() / 16);
  }
  Open(0, 16);  // and nothing is left marked
  EXPECT_TRUE(KvStoreTestPeer::PendingRechecks(store_.get(), "ns", model).empty());
}

}  // namespace
}  // namespace kvtrie
