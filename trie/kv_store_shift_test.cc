// Position-shifted near-duplicates in KvStore (trie/cluster_index.h, codec/reference_shift.h), on
// the real dumps: tests/data/neardup/n3 is n0 with "practical" (8 tokens) replaced by "useful"
// (4 tokens) at token 89, then the same text 4 tokens earlier. After n0, n3's blocks from 6 on are
// coded against n0's window at the offset (the end of one n0 block and the start of the next, keys
// turned by -4 positions); its last block repeats n0's last 12 tokens, where n0 ends: a tail
// window of n0's last block.
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::DumpModel;
using testing_store::ExpectBitExact;
using testing_store::ExpectWithin;
using testing_store::FreshTestDir;
using testing_store::PutDump;
using testing_store::StoredBlocks;

constexpr size_t kFirstShifted = 6;  // n3's first block wholly after the changed word

KvDump Load(const std::string& name) {
  auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

class ShiftStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("kvtrie_shift");
    Reopen();
    n0_ = Load("neardup/n0");
    n3_ = Load("neardup/n3");
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Reopen() {
    store_.reset();
    StoreOptions o;
    o.data_dir = dir_.string();
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  // n3's blocks from kFirstShifted on: stored against a centroid (and how many), and their bytes.
  static size_t ShiftedResiduals(const PutSummary& s, uint64_t* bytes) {
    size_t n = 0;
    *bytes = 0;
    for (const BlockReport& r : s.blocks) {
      if (r.block_index < kFirstShifted) continue;
      *bytes += r.bytes_stored;
      n += r.outcome == BlockOutcome::kResidualOfCentroid;
    }
    return n;
  }
  // The same blocks standalone: n3 alone in another namespace (namespaces never cluster).
  uint64_t StandaloneBytes(const EncodeOptions& enc) {
    auto s = PutDump(store_.get(), "alone", n3_, enc);
    EXPECT_TRUE(s.ok()) << s.status();
    uint64_t bytes = 0;
    if (s.ok()) ShiftedResiduals(*s, &bytes);
    return bytes;
  }

  std::filesystem::path dir_;
  std::unique_ptr<KvStore> store_;
  KvDump n0_, n3_;
};

TEST_F(ShiftStoreTest, LosslessShiftedBranchIsCodedAgainstTheCentroidBitExactAcrossARestart) {
  const EncodeOptions enc{.encoding = Encoding::kLossless};
  ASSERT_TRUE(PutDump(store_.get(), "ns", n0_, enc).ok());
  auto s3 = PutDump(store_.get(), "ns", n3_, enc);
  ASSERT_TRUE(s3.ok()) << s3.status();
  uint64_t bytes = 0;
  const size_t residuals = ShiftedResiduals(*s3, &bytes);
  EXPECT_EQ(residuals, 32 - kFirstShifted);  // the last one with a tail window
  StoreStats st = store_->Stats("ns");
  EXPECT_EQ(st.cluster.position_shifted_coded, residuals);
  EXPECT_EQ(st.cluster.position_shifted_skipped, 0u);
  EXPECT_EQ(st.cluster.residual_nodes, residuals);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", n3_), 32u);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", n0_), 32u);
  const uint64_t alone = StandaloneBytes(enc);
  // Measured 0.36 of standalone (layer 0 nearly free, low mantissa bits of the others).
  EXPECT_LT(bytes, alone / 2) << bytes << " vs " << alone;

  Reopen();  // the offset and the centroid's parent are in the payloads; the edges in the records
  st = store_->Stats("ns");
  EXPECT_EQ(st.cluster.residual_nodes, residuals);
  EXPECT_EQ(ExpectBitExact(store_.get(), "ns", n3_), 32u);
}

TEST_F(ShiftStoreTest, LossyShiftedBranchMeetsTheTargetAndOutlivesItsCentroids) {
  const EncodeOptions enc{.encoding = Encoding::kResidual, .target_rel_rms = 0.1};
  ASSERT_TRUE(PutDump(store_.get(), "ns", n0_, enc).ok());
  auto s3 = PutDump(store_.get(), "ns", n3_, enc);
  ASSERT_TRUE(s3.ok()) << s3.status();
  uint64_t bytes = 0;
  EXPECT_EQ(ShiftedResiduals(*s3, &bytes), 32 - kFirstShifted);
  for (const BlockReport& r : s3->blocks) {
    EXPECT_LE(r.rel_rms_error_k, 0.1 * 1.0001) << "block " << r.block_index;
    EXPECT_LE(r.rel_rms_error_v, 0.1 * 1.0001) << "block " << r.block_index;
  }
  ExpectWithin(store_.get(), "ns", n3_, 0.1);
  const uint64_t alone = StandaloneBytes(enc);
  // Measured ~0.06 of standalone.
  EXPECT_LT(bytes, alone / 8) << bytes << " vs " << alone;
  Reopen();
  ExpectWithin(store_.get(), "ns", n3_, 0.1);

  // Delete n0's branch after the shared prefix (the centroids and their parents): they stay,
  // retained, for n3's lossy blocks (at their offset they need a centroid's parent too), which
  // still read back within the target, also after a restart; n3's Delete then takes them.
  const size_t div = 89 / 16;
  std::vector<uint32_t> branch(n0_.token_ids.begin(), n0_.token_ids.begin() + (div + 1) * 16);
  const uint64_t residuals = store_->Stats("ns").cluster.residual_nodes;
  auto del = store_->Delete("ns", n0_.model_id, branch);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_GT(del->centroids_retained, 20u);
  EXPECT_EQ(store_->Stats("ns").cluster.residual_nodes, residuals);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n0_), div);
  ExpectWithin(store_.get(), "ns", n3_, 0.1);
  Reopen();
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n0_), div);
  ExpectWithin(store_.get(), "ns", n3_, 0.1);
  EXPECT_GT(store_->Stats("ns").retained_nodes, 20u);
  std::vector<uint32_t> n3_branch(n3_.token_ids.begin(), n3_.token_ids.begin() + (div + 1) * 16);
  ASSERT_TRUE(store_->Delete("ns", n3_.model_id, n3_branch).ok());
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 0u);
  EXPECT_EQ(store_->Stats("ns").nodes, div);
}

// A RESIDUAL-style read of the encoded blocks with a chain that fetches what it lacks (as the
// client does): the fetcher is asked for the centroid and the centroid's parent, and the decoded
// blocks equal the store's own reconstruction.
TEST_F(ShiftStoreTest, ChainFetchesTheCentroidAndItsParent) {
  const EncodeOptions enc{.encoding = Encoding::kResidual, .target_rel_rms = 0.1};
  ASSERT_TRUE(PutDump(store_.get(), "ns", n0_, enc).ok());
  ASSERT_TRUE(PutDump(store_.get(), "ns", n3_, enc).ok());
  const ModelInfo m = DumpModel(n3_);
  auto got = store_->Get("ns", m.model_id, n3_.token_ids, 0);
  ASSERT_TRUE(got.ok());
  std::vector<uint64_t> fetched;
  // What the service does for GetRequest.node_id: the node's path, decoded, its last block.
  DecodeChain client(m.geometry, [&](uint64_t id, absl::Span<uint8_t> out) -> absl::Status {
    fetched.push_back(id);
    auto path = store_->PathTokens("ns", m.model_id, id);
    if (!path.ok()) return path.status();
    auto blocks = store_->Get("ns", m.model_id, *path, 0);
    if (!blocks.ok()) return blocks.status();
    DecodeChain chain(m.geometry, nullptr);
    for (const BlockRead& r : blocks->blocks) {
      if (auto s = store_->ReadAndDecodeBlock("ns", m.model_id, r, &chain, out); !s.ok()) return s;
    }
    return absl::OkStatus();
  });
  DecodeChain server(m.geometry, nullptr);
  std::vector<uint8_t> a(m.geometry.num_bytes()), b(m.geometry.num_bytes());
  size_t shifted = 0, tails = 0;
  for (const BlockRead& r : got->blocks) {
    auto payload = store_->ReadPayload("ns", m.model_id, r);
    ASSERT_TRUE(payload.ok());
    auto h = ParseBlock(**payload);
    ASSERT_TRUE(h.ok());
    if (h->reference_shift.enabled) {
      ++shifted;
      EXPECT_EQ(h->reference_shift.rotation, -4);
      EXPECT_EQ(h->reference_shift.token_shift, 12u);
      tails += h->reference_shift.tail;
    }
    ASSERT_TRUE(client.Next(**payload, r.reference_node_id, absl::MakeSpan(a)).ok());
    ASSERT_TRUE(store_->ReadAndDecodeBlock("ns", m.model_id, r, &server, absl::MakeSpan(b)).ok());
    ASSERT_EQ(a, b);
  }
  EXPECT_EQ(shifted, 32 - kFirstShifted);
  EXPECT_EQ(tails, 1u);
  // n0's blocks 6..31, each fetched once: a window shares a node with the next, and the tail
  // window of the last block is n0's block 31 alone.
  EXPECT_EQ(fetched.size(), shifted);
}

}  // namespace
}  // namespace kvtrie
