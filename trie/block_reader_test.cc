// The store's one read path (trie/block_reader.h), with real RocksDB and real KV (tests/data,
// stories260K): a cold block read by one Get is read from RocksDB once and stays cold (the tier
// rule "a block read once stays cold", trie/tier_manager.h), also when it decodes on the chain;
// blocks coded against a learned state decode alone on the pool and are bit-identical to the
// sequential chain; RESIDUAL readers yield the stored envelopes as they are.
#include "trie/block_reader.h"

#include <filesystem>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/decode_chain.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/thread_pool.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::DumpModel;

class BlockReaderTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("block_reader_test");
    testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3", "genesis_1-3", "story_prompt"},
                                 &dumps_);
    ASSERT_EQ(dumps_.size(), 3u);
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  // Learning (when `learn`) refits after every 512 tokens (one dump); no background thread.
  void Open(bool learn) {
    store_.reset();
    StoreOptions o;
    o.data_dir = dir_.string();
    o.background = false;
    o.predictors.learn = learn;
    o.predictors.refit_every_tokens = 512;
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  void Put(const std::string& ns, const KvDump& d, Encoding encoding, Profile profile) {
    const ModelInfo m = DumpModel(d);
    auto session =
        store_->BeginPut(ns, m, d.token_ids, d.surprisal_bits,
                         {.encoding = encoding, .profile = profile, .target_rel_rms = 0.05});
    ASSERT_TRUE(session.ok()) << session.status();
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (size_t b = 0; b < d.num_tokens() / 16; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      ASSERT_TRUE((*session)->AddLayers(b, 0, 0, block).ok());
    }
    auto summary = (*session)->Finish();
    ASSERT_TRUE(summary.ok()) << summary.status();
    KvStoreTestPeer::DrainLearning(store_.get());
  }
  // Every block of `d`'s stored prefix through one reader. *alone: blocks decoded off the chain.
  std::vector<std::string> ReadAll(const std::string& ns, const KvDump& d, BlockReader::Mode mode,
                                   ThreadPool* pool, size_t* alone = nullptr,
                                   GetResult* listing = nullptr) {
    std::vector<std::string> out;
    auto reader = store_->NewReader(ns, d.model_id, d.token_ids, 0, mode, pool);
    EXPECT_TRUE(reader.ok()) << reader.status();
    if (!reader.ok()) return out;
    for (;;) {
      BlockReader::Block b;
      bool end = false;
      absl::Status s = (*reader)->Next(&b, &end);
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok() || end) break;
      EXPECT_EQ(b.index, out.size());
      EXPECT_NE(b.owner, nullptr);
      out.emplace_back(b.bytes);
    }
    if (alone != nullptr) *alone = (*reader)->decoded_alone();
    if (listing != nullptr) *listing = (*reader)->listing();
    return out;
  }
  // The same blocks decoded one at a time on one chain (KvStore::ReadAndDecodeBlock).
  std::vector<std::string> ReadSequential(const std::string& ns, const KvDump& d) {
    const BlockGeometry g = DumpModel(d).geometry;
    std::vector<std::string> out;
    auto got = store_->Get(ns, d.model_id, d.token_ids, 0);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return out;
    DecodeChain chain(g, nullptr);
    std::vector<uint8_t> block(g.num_bytes());
    for (const BlockRead& b : got->blocks) {
      absl::Status s = store_->ReadAndDecodeBlock(ns, d.model_id, b, &chain, absl::MakeSpan(block));
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok()) break;
      out.emplace_back(block.begin(), block.end());
    }
    return out;
  }

  std::filesystem::path dir_;
  std::vector<KvDump> dumps_;
  std::unique_ptr<KvStore> store_;
};

// Compact-profile residual blocks decode on the chain (each predicts from its parent): the
// reader reads each payload once and decodes from those bytes, so a Get of a cold prefix counts
// one cold read per block and promotes none; a second Get promotes them all.
TEST_F(BlockReaderTest, ColdChainBlocksAreReadOnceAndStayCold) {
  const KvDump& d = dumps_[0];
  ASSERT_NO_FATAL_FAILURE(Open(false));
  ASSERT_NO_FATAL_FAILURE(Put("ns", d, Encoding::kResidual, Profile::kCompact));
  ASSERT_NO_FATAL_FAILURE(Open(false));  // recovery reads no payload: every block is cold
  StoreStats st = store_->Stats("ns");
  ASSERT_EQ(st.hot_nodes, 0u);
  ASSERT_EQ(st.cold_reads, 0u);
  ThreadPool pool(3);
  size_t alone = 0;
  GetResult listing;
  const std::vector<std::string> got =
      ReadAll("ns", d, BlockReader::Mode::kReconstructed, &pool, &alone, &listing);
  const size_t n = d.num_tokens() / 16;
  ASSERT_EQ(got.size(), n);
  for (const BlockRead& b : listing.blocks) {
    ASSERT_EQ(b.encoding, Encoding::kResidual);
    ASSERT_EQ(b.reference_node_id, 0u);  // no centroid read besides the blocks themselves
  }
  EXPECT_EQ(alone, 0u);  // compact: every block on the chain
  st = store_->Stats("ns");
  EXPECT_EQ(st.cold_reads, n);  // once per block (twice before: framed, then decoded)
  EXPECT_EQ(st.promotions, 0u);
  EXPECT_EQ(st.hot_nodes, 0u);
  // Bit-identical to the store's sequential decode (a second read of each: now promoted).
  EXPECT_EQ(got, ReadSequential("ns", d));
  st = store_->Stats("ns");
  EXPECT_EQ(st.cold_reads, 2 * n);
  EXPECT_EQ(st.promotions, n);
  EXPECT_EQ(st.hot_nodes, n);
}

// A RESIDUAL reader yields every stored envelope as it is, each read once.
TEST_F(BlockReaderTest, StoredModeYieldsTheEnvelopesReadOnce) {
  const KvDump& d = dumps_[1];
  ASSERT_NO_FATAL_FAILURE(Open(false));
  ASSERT_NO_FATAL_FAILURE(Put("ns", d, Encoding::kResidual, Profile::kFast));
  ASSERT_NO_FATAL_FAILURE(Open(false));
  GetResult listing;
  const std::vector<std::string> got =
      ReadAll("ns", d, BlockReader::Mode::kStored, nullptr, nullptr, &listing);
  const size_t n = d.num_tokens() / 16;
  ASSERT_EQ(got.size(), n);
  EXPECT_EQ(store_->Stats("ns").cold_reads, n);
  EXPECT_EQ(store_->Stats("ns").promotions, 0u);
  const BlockGeometry g = DumpModel(d).geometry;
  std::vector<uint8_t> dense(g.num_bytes());
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<BlockHeader> h = ParseBlock(got[i]);  // a whole envelope, CRC included
    ASSERT_TRUE(h.ok()) << "block " << i << ": " << h.status();
    EXPECT_EQ(h->profile, Profile::kFast);
    EXPECT_TRUE(DecodeBlock(got[i], absl::MakeSpan(dense)).ok()) << "block " << i;
  }
}

// Fast blocks coded against a learned state need the state, their tokens, first position and
// previous token, not their parent: the reader decodes them alone on the pool, bit-identical to
// the sequential chain, with one thread or three.
TEST_F(BlockReaderTest, LearnedFastBlocksDecodeAloneBitIdenticalToTheChain) {
  ASSERT_NO_FATAL_FAILURE(Open(true));
  ASSERT_NO_FATAL_FAILURE(Put("ns", dumps_[0], Encoding::kResidual, Profile::kFast));
  const KvDump& d = dumps_[1];  // coded against the state learned from the first
  ASSERT_NO_FATAL_FAILURE(Put("ns", d, Encoding::kResidual, Profile::kFast));
  const size_t n = d.num_tokens() / 16;
  const std::vector<std::string> want = ReadSequential("ns", d);
  ASSERT_EQ(want.size(), n);
  for (int threads : {1, 3}) {
    ThreadPool pool(threads);
    size_t alone = 0;
    GetResult listing;
    const std::vector<std::string> got =
        ReadAll("ns", d, BlockReader::Mode::kReconstructed, &pool, &alone, &listing);
    size_t learned = 0;
    for (const BlockRead& b : listing.blocks) learned += b.predictor_version != 0;
    EXPECT_GT(learned, n / 2) << "most blocks are coded against the learned state";
    EXPECT_EQ(alone, n) << "every fast block decodes alone, learned or not";
    EXPECT_EQ(got, want) << threads << " threads";
  }
}

// An unknown model is a miss: a reader with no blocks.
TEST_F(BlockReaderTest, UnknownModelIsAnEmptyReader) {
  ASSERT_NO_FATAL_FAILURE(Open(false));
  EXPECT_TRUE(ReadAll("ns", dumps_[0], BlockReader::Mode::kReconstructed, nullptr).empty());
}

}  // namespace
}  // namespace kvtrie
