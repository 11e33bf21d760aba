// Faults under the store (trie/fault_injection_testing.h, the StoreOptions::env seam): a failed
// WAL append, a failed sync, a failed blob read, ENOSPC and a power loss that drops unsynced
// writes. Each is a named status; nothing acknowledged is lost; nothing wrong is served; a failed
// Delete or Pin changes nothing, in memory or (checked by reopening) on disk.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/fault_injection_testing.h"
#include "trie/kv_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

class FaultTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("kv_store_fault_test");
    ASSERT_NO_FATAL_FAILURE(
        testing_store::LoadTestDumps(std::vector<const char*>{"sessions/s0", "GPL-3"}, &dumps_));
    fs_ = std::make_shared<FaultFs>();
    env_ = FaultFs::NewEnv(fs_);
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open(bool sync = false) {
    store_.reset();
    StoreOptions o;
    o.data_dir = dir_.string();
    o.sync = sync;
    o.env = env_.get();
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  static ModelInfo Model(const KvDump& d) { return testing_store::DumpModel(d); }
  absl::StatusOr<PutSummary> Put(const std::string& ns, const KvDump& d) {
    return testing_store::PutDump(store_.get(), ns, d);
  }
  size_t Stored(const std::string& ns, const KvDump& d) {
    return testing_store::StoredBlocks(store_.get(), ns, d);
  }
  // Reads the longest stored prefix back; every block must be bit-exact. Returns the blocks.
  size_t ExpectBitExact(const std::string& ns, const KvDump& d) {
    return testing_store::ExpectBitExact(store_.get(), ns, d);
  }

  std::filesystem::path dir_;
  std::vector<KvDump> dumps_;
  std::shared_ptr<FaultFs> fs_;
  std::unique_ptr<rocksdb::Env> env_;
  std::unique_ptr<KvStore> store_;
};

TEST_F(FaultTest, FailedWalAppendFailsThePutAndTheStoreRefusesWritesUntilRestart) {
  Open();
  ASSERT_TRUE(Put("ns", dumps_[0]).ok());
  fs_->fail_wal_append = true;
  auto failed = Put("ns", dumps_[1]);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_NE(failed.status().message().find("store failed"), std::string::npos);
  EXPECT_GT(fs_->faults.load(), 0);
  EXPECT_EQ(Stored("ns", dumps_[1]), 0u);  // not published
  fs_->fail_wal_append = false;
  // Sticky: the next write is refused by name, health says why; reads go on.
  EXPECT_EQ(store_->health().code(), absl::StatusCode::kUnavailable);
  auto again = Put("other", dumps_[1]);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  EXPECT_NE(again.status().message().find("store failed"), std::string::npos);
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
  Open();  // a restart clears it; the acknowledged Put is there, the failed one is not
  EXPECT_TRUE(store_->health().ok());
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
  EXPECT_EQ(Stored("ns", dumps_[1]), 0u);
  EXPECT_TRUE(Put("ns", dumps_[1]).ok());
}

TEST_F(FaultTest, FailedSyncIsNotAcknowledgedAndLeavesAllOrNothing) {
  Open(/*sync=*/true);
  ASSERT_TRUE(Put("ns", dumps_[0]).ok());
  fs_->fail_wal_sync = true;
  auto failed = Put("ns", dumps_[1]);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_EQ(Stored("ns", dumps_[1]), 0u);
  fs_->fail_wal_sync = false;
  Open(/*sync=*/true);
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
  // The batch may have reached the WAL before the sync failed: then it is whole.
  const size_t got = ExpectBitExact("ns", dumps_[1]);
  EXPECT_TRUE(got == 0 || got == 32) << got;
}

TEST_F(FaultTest, NoSpaceIsResourceExhaustedThenUnavailable) {
  Open();
  ASSERT_TRUE(Put("ns", dumps_[0]).ok());
  fs_->no_space = true;
  auto failed = Put("ns", dumps_[1]);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  EXPECT_NE(failed.status().message().find("space"), std::string::npos) << failed.status();
  auto again = Put("other", dumps_[1]);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  fs_->no_space = false;
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
  Open();
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
  EXPECT_EQ(Stored("ns", dumps_[1]), 0u);
}

TEST_F(FaultTest, FailedBlobReadIsUnavailableAndDropsNothing) {
  Open();
  ASSERT_TRUE(Put("ns", dumps_[0]).ok());
  Open();  // closed with a flush: the payloads are in blob files, and every payload is cold
  fs_->fail_blob_read = true;
  {
    auto got = store_->Get("ns", dumps_[0].model_id, dumps_[0].token_ids, 0);
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->blocks.size(), 32u);
    auto payload = store_->ReadPayload("ns", dumps_[0].model_id, got->blocks[5]);
    EXPECT_EQ(payload.status().code(), absl::StatusCode::kUnavailable) << payload.status();
  }
  fs_->fail_blob_read = false;
  EXPECT_EQ(store_->Stats("").evictions_data_loss, 0u);
  EXPECT_TRUE(store_->health().ok());  // a read error does not fail the store
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
}

TEST_F(FaultTest, FailedDeleteAndPinChangeNothingInMemoryOrOnDisk) {
  Open();
  ASSERT_TRUE(Put("ns", dumps_[0]).ok());
  const KvDump& d = dumps_[0];
  fs_->fail_wal_append = true;
  auto del = store_->Delete("ns", d.model_id, absl::MakeSpan(d.token_ids).subspan(0, 20 * 16));
  EXPECT_EQ(del.status().code(), absl::StatusCode::kUnavailable) << del.status();
  auto pin = store_->Pin("ns", d.model_id, d.token_ids, 0, false);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kUnavailable) << pin.status();
  fs_->fail_wal_append = false;
  EXPECT_EQ(Stored("ns", d), 32u);  // memory: nothing deleted, nothing pinned
  EXPECT_EQ(store_->Stats("ns").pinned_nodes, 0u);
  EXPECT_EQ(ExpectBitExact("ns", d), 32u);
  Open();  // disk agrees
  EXPECT_EQ(Stored("ns", d), 32u);
  EXPECT_EQ(store_->Stats("ns").pinned_nodes, 0u);
  EXPECT_EQ(ExpectBitExact("ns", d), 32u);
}

TEST_F(FaultTest, PowerLossWithSyncLosesNoAcknowledgedPut) {
  Open(/*sync=*/true);
  ASSERT_TRUE(Put("a", dumps_[0]).ok());
  ASSERT_TRUE(Put("b", dumps_[1]).ok());
  auto pin = store_->Pin("a", dumps_[0].model_id, dumps_[0].token_ids, 0, false);
  ASSERT_TRUE(pin.ok()) << pin.status();
  fs_->Crash();  // nothing more reaches the disk: no flush at close
  store_.reset();
  fs_->DropUnsyncedWal();
  Open(/*sync=*/true);
  EXPECT_EQ(ExpectBitExact("a", dumps_[0]), 32u);
  EXPECT_EQ(ExpectBitExact("b", dumps_[1]), 32u);
  EXPECT_EQ(store_->Stats("a").pinned_nodes, 1u);
}

TEST_F(FaultTest, PowerLossWithoutSyncServesNothingWrong) {
  Open();
  ASSERT_TRUE(Put("a", dumps_[0]).ok());
  Open();                                 // flushed: durable
  ASSERT_TRUE(Put("b", dumps_[1]).ok());  // only in the (unsynced) WAL
  fs_->Crash();
  store_.reset();
  fs_->DropUnsyncedWal();
  Open();
  EXPECT_EQ(ExpectBitExact("a", dumps_[0]), 32u);
  const size_t b = ExpectBitExact("b", dumps_[1]);  // lost or whole, never half or wrong
  EXPECT_TRUE(b == 0 || b == 32) << b;
  EXPECT_TRUE(Put("b", dumps_[1]).ok());
}

}  // namespace
}  // namespace kvtrie
