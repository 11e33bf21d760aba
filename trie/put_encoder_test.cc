// PutEncoder and PutParentCache (trie/put_encoder.h): the put-parent cache's store-wide bound,
// and the encoder's rules for a Put's new blocks (every full block stored or sent; a repeated
// block coded against the stored one when smaller; the fast profile never tries a centroid).
// Real RocksDB, real KV (tests/data).
#include "trie/put_encoder.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::DumpModel;
using testing_store::FreshTestDir;

std::vector<uint8_t> Bytes(size_t n, uint8_t v) { return std::vector<uint8_t>(n, v); }

TEST(PutParentCacheTest, KeepsTheLastReconstructionsAndFindsThemById) {
  StoreOptions options;
  options.put_parent_cache_bytes = 1000;
  ShardContext context;
  context.options = &options;
  PutParentCache cache(&context);
  EXPECT_EQ(cache.Find(1), nullptr);
  cache.Keep(1, Bytes(100, 7));
  cache.Keep(2, Bytes(100, 9));
  auto one = cache.Find(1);
  ASSERT_NE(one, nullptr);
  EXPECT_EQ(*one, Bytes(100, 7));
  ASSERT_NE(cache.Find(2), nullptr);
  EXPECT_EQ(cache.Find(3), nullptr);
  EXPECT_EQ(context.put_parent_bytes.load(), 200u);
  cache.Keep(3, {});  // nothing to keep
  EXPECT_EQ(cache.size(), 2u);
}

TEST(PutParentCacheTest, TheOldestGoWhileTheStoresBoundWouldPass) {
  StoreOptions options;
  options.put_parent_cache_bytes = 250;
  ShardContext context;
  context.options = &options;
  PutParentCache cache(&context);
  cache.Keep(1, Bytes(100, 1));
  cache.Keep(2, Bytes(100, 2));
  cache.Keep(3, Bytes(100, 3));  // 300 > 250: node 1 goes
  EXPECT_EQ(cache.Find(1), nullptr);
  EXPECT_NE(cache.Find(2), nullptr);
  EXPECT_NE(cache.Find(3), nullptr);
  EXPECT_EQ(context.put_parent_bytes.load(), 200u);
  cache.Keep(4, Bytes(251, 4));  // alone larger than the bound: not kept, nothing evicted
  EXPECT_EQ(cache.Find(4), nullptr);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(context.put_parent_bytes.load(), 200u);
}

TEST(PutParentCacheTest, AShardFindingTheBoundFilledByOthersKeepsNothing) {
  StoreOptions options;
  options.put_parent_cache_bytes = 150;
  ShardContext context;  // shared by both shards' caches, as a store's shards share it
  context.options = &options;
  PutParentCache ns(&context), other(&context);
  ns.Keep(1, Bytes(100, 1));
  other.Keep(2, Bytes(100, 2));  // only ns's own bytes could make room: none are other's
  EXPECT_NE(ns.Find(1), nullptr);
  EXPECT_EQ(other.Find(2), nullptr);
  EXPECT_EQ(context.put_parent_bytes.load(), 100u);
  ns.Keep(3, Bytes(100, 3));  // ns makes room from its own
  EXPECT_EQ(ns.Find(1), nullptr);
  EXPECT_NE(ns.Find(3), nullptr);
  EXPECT_EQ(context.put_parent_bytes.load(), 100u);
}

class PutEncoderTest : public testing::Test {
 protected:
  void SetUp() override {
    std::vector<KvDump> dumps;
    testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3"}, &dumps);
    ASSERT_EQ(dumps.size(), 1u);
    gpl_ = dumps[0];
    dir_ = FreshTestDir("put_encoder_test");
    StoreOptions o;
    o.data_dir = dir_.string();
    o.background = false;
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  // Puts the blocks `kv_blocks` of GPL-3 (their KV) under `tokens` (one block of tokens each),
  // sending only those in `send` (all when empty).
  absl::StatusOr<PutSummary> Put(const std::vector<uint32_t>& tokens,
                                 const std::vector<uint32_t>& kv_blocks, EncodeOptions encode,
                                 std::vector<uint32_t> send = {}) {
    const ModelInfo m = DumpModel(gpl_);
    const std::vector<float> surprisal(tokens.size(), 1.0f);
    auto session = store_->BeginPut("ns", m, tokens, surprisal, encode);
    if (!session.ok()) return session.status();
    if (send.empty()) {
      for (uint32_t b = 0; b < kv_blocks.size(); ++b) send.push_back(b);
    }
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (uint32_t b : send) {
      GatherBlock(m.geometry, gpl_.num_tokens(), gpl_.k.data(), gpl_.v.data(), kv_blocks[b],
                  absl::MakeSpan(block));
      if (auto s = (*session)->AddLayers(b, 0, 0, block); !s.ok()) return s;
    }
    return (*session)->Finish();
  }
  // Tokens of GPL-3's blocks `blocks`, one block each; `first` replaces the very first token.
  std::vector<uint32_t> Tokens(const std::vector<uint32_t>& blocks, int64_t first = -1) {
    std::vector<uint32_t> out;
    for (uint32_t b : blocks) {
      out.insert(out.end(), gpl_.token_ids.begin() + b * 16, gpl_.token_ids.begin() + b * 16 + 16);
    }
    if (first >= 0) out[0] = static_cast<uint32_t>(first);
    return out;
  }

  std::filesystem::path dir_;
  KvDump gpl_;
  std::unique_ptr<KvStore> store_;
};

TEST_F(PutEncoderTest, AFullBlockNeitherStoredNorSentFailsNamingKv) {
  auto summary = Put(Tokens({0, 1, 2}), {0, 1, 2}, {.encoding = Encoding::kLossless}, {0, 2});
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().code(), absl::StatusCode::kInvalidArgument) << summary.status();
  EXPECT_NE(summary.status().message().find("kv: blocks [1, 2)"), std::string::npos)
      << summary.status();
  EXPECT_TRUE(store_->Lookup("ns", gpl_.model_id, Tokens({0})).node_ids.empty())
      << "all or nothing: block 0 was not committed";
}

TEST_F(PutEncoderTest, ARepeatedBlockIsCodedAgainstTheStoredOneWhenSmaller) {
  const EncodeOptions lossless{.encoding = Encoding::kLossless, .profile = Profile::kCompact};
  auto first = Put(Tokens({0, 1}), {0, 1}, lossless);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->blocks.size(), 2u);
  // Another first block (another token, other KV), then block 1 again at the same depth.
  auto second = Put(Tokens({5, 1}, 3), {5, 1}, lossless);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->blocks.size(), 2u);
  EXPECT_EQ(second->blocks[0].outcome, BlockOutcome::kStored);
  EXPECT_EQ(second->blocks[1].outcome, BlockOutcome::kResidualOfCentroid);
  EXPECT_EQ(second->blocks[1].reference_node_id, first->blocks[1].node_id);
  EXPECT_LT(second->blocks[1].bytes_stored, first->blocks[1].bytes_stored);
}

TEST_F(PutEncoderTest, TheFastProfileNeverTriesACentroid) {
  const EncodeOptions fast{.encoding = Encoding::kLossless, .profile = Profile::kFast};
  auto first = Put(Tokens({0, 1}), {0, 1}, fast);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = Put(Tokens({5, 1}, 3), {5, 1}, fast);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->blocks.size(), 2u);
  EXPECT_EQ(second->blocks[1].outcome, BlockOutcome::kStored);
  EXPECT_EQ(second->blocks[1].reference_node_id, 0u);
}

}  // namespace
}  // namespace kvtrie
