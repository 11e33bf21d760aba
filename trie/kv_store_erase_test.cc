// Erasing Deletes (KvStore::Delete with erase; issue 30 row 8): on the real near-duplicate dumps
// of tests/data (n0..n3 share a prefix and differ by a word; n0's blocks 8-31 are the centroids
// of lossy members in n1..n3), a Delete of n0's branch with erase retains nothing, re-codes the
// members (they read back exactly as before), says what that cost, and leaves no byte sequence of
// the deleted payloads in any file of the data folder. Without erase the centroids stay retained.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::ExpectWithin;
using testing_store::PutDump;
using testing_store::StoredBlocks;

using Blocks = std::vector<std::vector<uint8_t>>;

constexpr double kTarget = 0.1;
constexpr size_t kFirstDeleted = 8;  // n0's blocks from here on are the others' centroids

// The contents of every regular file under `dir`.
std::vector<std::string> FolderFiles(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

// How many of `chunks` occur in some file under `dir`.
size_t ChunksFound(const std::filesystem::path& dir, const std::vector<std::string>& chunks) {
  const std::vector<std::string> files = FolderFiles(dir);
  size_t found = 0;
  for (const std::string& c : chunks) {
    for (const std::string& f : files) {
      if (f.find(c) != std::string::npos) {
        ++found;
        break;
      }
    }
  }
  return found;
}

// A distinctive 48-byte piece of `payload` (from its middle, at least 24 distinct byte values:
// never a run a member's encoding could share by chance), or empty if none.
std::string DistinctiveChunk(const std::string& payload) {
  constexpr size_t kLen = 48;
  for (size_t at = payload.size() / 2; at + kLen <= payload.size(); at += 7) {
    const std::string c = payload.substr(at, kLen);
    if (std::set<char>(c.begin(), c.end()).size() >= 24) return c;
  }
  return "";
}

class EraseTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("kv_store_erase_test");
    ASSERT_NO_FATAL_FAILURE(testing_store::LoadTestDumps(
        std::vector<const char*>{"neardup/n0", "neardup/n1", "neardup/n2", "neardup/n3"}, &n_));
    StoreOptions o;
    o.data_dir = dir_.string();
    o.background = false;
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
    for (const KvDump& d : n_) ASSERT_TRUE(PutDump(store_.get(), "ns", d, kLossy).ok());
    for (size_t i = 1; i < n_.size(); ++i) before_.push_back(ReadAll(n_[i]));
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::vector<uint32_t> N0Branch() const {
    return {n_[0].token_ids.begin(), n_[0].token_ids.begin() + (kFirstDeleted + 1) * 16};
  }
  Blocks ReadAll(const KvDump& d) { return testing_store::ReadAllBlocks(store_.get(), "ns", d); }
  // A distinctive piece of the stored payload of each of n0's blocks that the Delete removes.
  std::vector<std::string> DeletedChunks() {
    std::vector<std::string> chunks;
    auto got = store_->Get("ns", n_[0].model_id, n_[0].token_ids, 0);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return chunks;
    for (size_t b = kFirstDeleted; b < got->blocks.size(); ++b) {
      auto payload = store_->ReadPayload("ns", n_[0].model_id, got->blocks[b]);
      EXPECT_TRUE(payload.ok()) << payload.status();
      if (!payload.ok()) continue;
      if (std::string c = DistinctiveChunk(**payload); !c.empty()) chunks.push_back(c);
    }
    return chunks;  // the Get (and its snapshot) ends here
  }

  static constexpr EncodeOptions kLossy{.encoding = Encoding::kResidual, .target_rel_rms = kTarget};
  std::filesystem::path dir_;
  std::vector<KvDump> n_;
  std::vector<Blocks> before_;  // n1..n3 as read before the Delete
  std::unique_ptr<KvStore> store_;
};

TEST_F(EraseTest, AnErasingDeleteRetainsNothingAndItsMembersReadAsBefore) {
  const uint64_t bytes_before = store_->Stats("ns").bytes_stored;
  auto del = store_->Delete("ns", n_[0].model_id, N0Branch(), /*erase=*/true);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_EQ(del->centroids_retained, 0u);
  EXPECT_EQ(del->nodes_retained, 0u);
  EXPECT_GT(del->centroids_reelected, 20u);
  EXPECT_GT(del->erase_bytes_rewritten, 0u);
  EXPECT_LE(del->erase_bytes_rewritten, del->bytes_rewritten);
  EXPECT_TRUE(del->compacted);
  const StoreStats st = store_->Stats("ns");
  EXPECT_EQ(st.retained_nodes, 0u);
  EXPECT_EQ(st.retained_bytes, 0u);
  EXPECT_EQ(st.bytes_stored, bytes_before - del->bytes_freed + del->bytes_rewritten);
  EXPECT_EQ(StoredBlocks(store_.get(), "ns", n_[0]), kFirstDeleted);
  for (size_t i = 1; i < n_.size(); ++i) {
    EXPECT_TRUE(ReadAll(n_[i]) == before_[i - 1]) << "n" << i << " changed";
    ExpectWithin(store_.get(), "ns", n_[i], kTarget);
  }
}

TEST_F(EraseTest, NoByteOfTheDeletedPayloadsIsLeftInTheDataFolder) {
  const std::vector<std::string> chunks = DeletedChunks();
  ASSERT_GE(chunks.size(), 20u);
  // The control: the folder holds them now (WAL or blob files).
  EXPECT_GE(ChunksFound(dir_, chunks), chunks.size() * 3 / 4);
  auto del = store_->Delete("ns", n_[0].model_id, N0Branch(), /*erase=*/true);
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_EQ(ChunksFound(dir_, chunks), 0u);
  for (size_t i = 1; i < n_.size(); ++i) {
    EXPECT_TRUE(ReadAll(n_[i]) == before_[i - 1]) << "n" << i << " changed";
  }
}

TEST_F(EraseTest, WithoutEraseTheLossyCentroidsStayRetainedAndOnDisk) {
  const std::vector<std::string> chunks = DeletedChunks();
  ASSERT_GE(chunks.size(), 20u);
  auto del = store_->Delete("ns", n_[0].model_id, N0Branch());
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_GT(del->centroids_retained, 20u);
  EXPECT_EQ(del->erase_bytes_rewritten, 0u);
  EXPECT_FALSE(del->compacted);
  EXPECT_GT(store_->Stats("ns").retained_nodes, 0u);
  EXPECT_GE(ChunksFound(dir_, chunks), chunks.size() * 3 / 4);
}

TEST_F(EraseTest, TheDeleteErasesFlagMakesEveryDeleteErase) {
  store_.reset();
  StoreOptions o;
  o.data_dir = dir_.string();
  o.background = false;
  o.delete_erases = true;
  auto s = KvStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status();
  store_ = *std::move(s);
  auto del = store_->Delete("ns", n_[0].model_id, N0Branch());
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_EQ(del->centroids_retained, 0u);
  EXPECT_TRUE(del->compacted);
  EXPECT_EQ(store_->Stats("ns").retained_nodes, 0u);
}

}  // namespace
}  // namespace kvtrie
