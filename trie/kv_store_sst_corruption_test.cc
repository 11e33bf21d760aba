// A corrupt SST of RocksDB's own index (not a payload's bytes) never drops data that a restart
// after a repair could read: reads refuse with DATA_LOSS naming RocksDB, recovery refuses to
// start, and nothing is deleted (issue 9: one corrupt payload-index SST used to drop 91 nodes).
#include <filesystem>
#include <string>
#include <vector>

#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/sst_corruption_testing.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

class SstCorruptionTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("kv_store_sst_test");
    ASSERT_NO_FATAL_FAILURE(
        testing_store::LoadTestDumps(std::vector<const char*>{"sessions/s0", "GPL-3"}, &dumps_));
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  absl::Status Open() {
    store_.reset();
    auto s = KvStore::Open({.data_dir = dir_.string()});
    if (!s.ok()) return s.status();
    store_ = *std::move(s);
    return absl::OkStatus();
  }
  void PutAll() {
    ASSERT_TRUE(testing_store::PutDump(store_.get(), "a", dumps_[0]).ok());
    ASSERT_TRUE(testing_store::PutDump(store_.get(), "b", dumps_[1]).ok());
  }
  // Reads every block of `d` in `ns`; returns how many read back bit-exact (stops at the first
  // error, returned in `error`).
  size_t ReadBack(const std::string& ns, const KvDump& d, absl::Status* error) {
    return testing_store::ReadBackBitExact(store_.get(), ns, d, error);
  }

  std::filesystem::path dir_;
  std::vector<KvDump> dumps_;
  std::unique_ptr<KvStore> store_;
};

TEST_F(SstCorruptionTest, CorruptPayloadIndexRefusesReadsAndDropsNothing) {
  ASSERT_TRUE(Open().ok());
  PutAll();
  store_.reset();  // flushed: the payload index is in an SST
  const FlippedBytes flipped = FlipByteInSstFiles(dir_, "payloads");
  ASSERT_FALSE(flipped.empty()) << "no SST of the payloads column family";
  ASSERT_TRUE(Open().ok());  // recovery reads node records only
  absl::Status error;
  for (int attempt = 0; attempt < 2; ++attempt) {  // refused every time, never dropped
    EXPECT_LT(ReadBack("a", dumps_[0], &error), 32u);
    EXPECT_EQ(error.code(), absl::StatusCode::kDataLoss) << error;
    EXPECT_NE(error.message().find("RocksDB"), std::string::npos) << error;
    EXPECT_NE(error.message().find("nothing was dropped"), std::string::npos) << error;
  }
  EXPECT_EQ(store_->Lookup("a", dumps_[0].model_id, dumps_[0].token_ids).node_ids.size(), 32u);
  EXPECT_EQ(store_->Stats("").evictions_data_loss, 0u);
  EXPECT_EQ(store_->Stats("").nodes, 64u);
  store_.reset();
  FlipBack(flipped);  // repaired: everything reads again
  ASSERT_TRUE(Open().ok());
  EXPECT_EQ(ReadBack("a", dumps_[0], &error), 32u) << error;
  EXPECT_EQ(ReadBack("b", dumps_[1], &error), 32u) << error;
}

TEST_F(SstCorruptionTest, CorruptNodeIndexRefusesToStartAndDropsNothing) {
  ASSERT_TRUE(Open().ok());
  PutAll();
  store_.reset();
  const FlippedBytes flipped = FlipByteInSstFiles(dir_, "nodes");
  ASSERT_FALSE(flipped.empty()) << "no SST of the nodes column family";
  absl::Status s = Open();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("nothing was dropped"), std::string::npos) << s;
  FlipBack(flipped);
  ASSERT_TRUE(Open().ok());
  EXPECT_EQ(store_->recovery().nodes, 64u);
  absl::Status error;
  EXPECT_EQ(ReadBack("a", dumps_[0], &error), 32u) << error;
  EXPECT_EQ(ReadBack("b", dumps_[1], &error), 32u) << error;
}

}  // namespace
}  // namespace kvtrie
