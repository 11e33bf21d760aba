// Tiered store: memory bound, cold reads, disk eviction order, pins and TTL, on-disk corruption.
// Real KV blocks from tests/data (stories260K, 10 KiB dense per block).
#include <rocksdb/db.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/blob_corruption_testing.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"
#include "trie/record_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

const char* const kDumps[] = {"sessions/s0", "sessions/s1", "sessions/s2",  "sessions/s3",
                              "GPL-3",       "genesis_1-3", "story_prompt", "neardup/n0",
                              "neardup/n1",  "neardup/n2",  "neardup/n3"};

uint64_t RssBytes() {
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

class TierTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("kv_store_tier_test");
    ASSERT_NO_FATAL_FAILURE(testing_store::LoadTestDumps(kDumps, &dumps_));
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open(StoreOptions options) {
    store_.reset();
    options.data_dir = dir_.string();
    if (!options.now_seconds) options.now_seconds = [this] { return now_.load(); };
    auto s = KvStore::Open(options);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  static ModelInfo Model(const KvDump& d) { return testing_store::DumpModel(d); }
  absl::StatusOr<PutSummary> Put(const std::string& ns, const KvDump& d,
                                 Encoding enc = Encoding::kLossless) {
    return testing_store::PutDump(store_.get(), ns, d, enc);
  }
  // Blocks of `d` stored in `ns` (longest prefix).
  size_t Stored(const std::string& ns, const KvDump& d) {
    return testing_store::StoredBlocks(store_.get(), ns, d);
  }
  // Reads the longest stored prefix and checks every block bit-exact; returns the block count.
  size_t ExpectBitExact(const std::string& ns, const KvDump& d) {
    return testing_store::ExpectBitExact(store_.get(), ns, d);
  }

  std::filesystem::path dir_;
  std::vector<KvDump> dumps_;
  std::unique_ptr<KvStore> store_;
  std::atomic<uint64_t> now_{1'000'000};
};

TEST_F(TierTest, HotBytesNeverExceedTheBudgetAndColdGetsAreBitExact) {
  constexpr uint64_t kBudget = 4 << 20;
  Open({.memory_bytes = kBudget, .memtable_bytes = 4 << 20});
  const uint64_t rss_before = RssBytes();
  uint64_t put_bytes = 0;
  int puts = 0;
  // Ten times the budget of real blocks; each namespace is its own trie, so nothing dedups.
  while (put_bytes < 10 * kBudget) {
    const KvDump& d = dumps_[puts % std::size(kDumps)];
    auto r = Put("bound" + std::to_string(puts), d, Encoding::kRaw);
    ASSERT_TRUE(r.ok()) << r.status();
    for (const BlockReport& b : r->blocks) put_bytes += b.bytes_stored;
    ++puts;
    const StoreStats st = store_->Stats("");
    ASSERT_LE(st.hot_bytes, kBudget) << "after put " << puts;  // slack: none, it is accounted
  }
  const StoreStats st = store_->Stats("");
  EXPECT_EQ(st.disk_bytes, put_bytes);
  EXPECT_GT(st.cold_nodes, st.hot_nodes);
  EXPECT_GT(st.demotions, 0u);
  // RSS: the hot budget + two 4 MiB payload memtables + 8 MiB block cache + 16 MiB for node
  // metadata and the allocator; well under the 40 MiB put.
  const uint64_t rss_growth = RssBytes() > rss_before ? RssBytes() - rss_before : 0;
  EXPECT_LT(rss_growth, kBudget + 8 * (1 << 20) + 8 * (1 << 20) + 16 * (1 << 20))
      << "put " << put_bytes << " bytes";
  // The first Puts are long cold: read back bit-exact from RocksDB.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ExpectBitExact("bound" + std::to_string(i), dumps_[i]), 32u);
  }
  EXPECT_GE(store_->Stats("").cold_reads, 96u);
  EXPECT_LE(store_->Stats("").hot_bytes, kBudget);
}

TEST_F(TierTest, RecoveryReadsNoPayloadAndASecondColdReadPromotes) {
  Open({});
  ASSERT_TRUE(Put("ns", dumps_[0]).ok());
  ASSERT_TRUE(Put("ns", dumps_[4]).ok());
  Open({});
  EXPECT_EQ(store_->recovery().nodes, 64u);
  EXPECT_EQ(store_->Stats("").hot_nodes, 0u);
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
  EXPECT_EQ(store_->Stats("").promotions, 0u);  // read once: stays cold (scan-resistant)
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 32u);
  const StoreStats st = store_->Stats("");
  EXPECT_EQ(st.promotions, 32u);
  EXPECT_EQ(st.hot_nodes, 32u);
  EXPECT_EQ(ExpectBitExact("ns", dumps_[4]), 32u);
}

TEST_F(TierTest, DiskBudgetEvictsOneOffLeavesAndKeepsSharedPrefixes) {
  // Four sessions sharing a 23-block preamble, each read back twice: hot and shared.
  Open({.disk_bytes = 2 << 20});
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(Put("ns", dumps_[i]).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(ExpectBitExact("ns", dumps_[i]), 32u);
  // One-off prefixes, ~4x the remaining budget (a scan: each stored once, never read).
  for (int round = 0; round < 4; ++round) {
    for (size_t i = 4; i < std::size(kDumps); ++i) {
      auto r = Put("scan" + std::to_string(round), dumps_[i]);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_LE(store_->Stats("").disk_bytes, 2u << 20);
    }
  }
  const StoreStats st = store_->Stats("");
  EXPECT_GT(st.evictions_disk, 100u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(Stored("ns", dumps_[i]), 32u) << "session " << i;
  // Evicting frees about what is needed, not more: less than a few blocks' room is left. (Usually
  // under one block's, 12 KiB; twice, once under ASan, 52-54 KiB were left, cause not found yet:
  // the bound is 64 KiB so that a store evicting a whole prefix too many still fails.)
  EXPECT_GT(st.disk_bytes + 64 * 1024, 2u << 20);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(ExpectBitExact("ns", dumps_[i]), 32u);
  // Eviction takes leaves: what remains of a one-off prefix is a prefix of it, and reads back.
  for (size_t i = 4; i < std::size(kDumps); ++i) ExpectBitExact("scan3", dumps_[i]);
}

TEST_F(TierTest, PinHoldsAPrefixUntilItsTtlAndPinsThatFillTheDiskRejectPuts) {
  Open({.disk_bytes = 1 << 20});
  const KvDump& pinned = dumps_[4];
  ASSERT_TRUE(Put("ns", pinned).ok());
  auto id = store_->Pin("ns", pinned.model_id, pinned.token_ids, /*ttl_seconds=*/60, false);
  ASSERT_TRUE(id.ok()) << id.status();
  for (size_t i = 5; i < std::size(kDumps); ++i) ASSERT_TRUE(Put("ns", dumps_[i]).ok());
  for (size_t i = 0; i < 4; ++i) ASSERT_TRUE(Put("ns", dumps_[i]).ok());
  EXPECT_EQ(Stored("ns", pinned), 32u);  // never read, yet pinned: kept
  EXPECT_EQ(store_->Stats("").pinned_nodes, 1u);
  now_ += 61;  // the TTL passes; the next Puts may take it
  for (size_t i = 5; i < std::size(kDumps); ++i) ASSERT_TRUE(Put("ns2", dumps_[i]).ok());
  EXPECT_LT(Stored("ns", pinned), 32u);
  EXPECT_EQ(store_->Stats("").pins_expired, 1u);
  EXPECT_EQ(store_->Stats("").pinned_nodes, 0u);

  // Pins survive a restart; when pinned prefixes fill the budget, a Put is RESOURCE_EXHAUSTED
  // and stores nothing.
  ASSERT_TRUE(Put("p", dumps_[4]).ok());
  ASSERT_TRUE(store_->Pin("p", dumps_[4].model_id, dumps_[4].token_ids, 0, false).ok());
  Open({.disk_bytes = 1 << 20});
  EXPECT_EQ(store_->Stats("p").pinned_nodes, 1u);
  absl::Status full;
  std::string ns;
  const KvDump* d = nullptr;
  for (int i = 0; i < 20; ++i) {
    ns = "p" + std::to_string(i);
    d = &dumps_[5 + i % 6];
    auto r = Put(ns, *d);
    if (!r.ok()) {
      full = r.status();
      break;
    }
    auto pin = store_->Pin(ns, d->model_id, d->token_ids, 0, false);
    ASSERT_TRUE(pin.ok()) << pin.status();
  }
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("disk_bytes"), std::string::npos);
  EXPECT_EQ(Stored(ns, *d), 0u);
  EXPECT_EQ(store_->Stats("").puts_rejected_disk_full, 1u);
  // Unpinned, the first pinned prefix makes room again.
  ASSERT_TRUE(store_->Pin("p", dumps_[4].model_id, dumps_[4].token_ids, 0, true).ok());
  EXPECT_TRUE(Put(ns, *d).ok());
  EXPECT_EQ(Stored("p0", dumps_[5]), 32u);
  EXPECT_LE(store_->Stats("").disk_bytes, 1u << 20);
}

uint64_t FolderBytes(const std::filesystem::path& dir) {  // what `du --apparent-size` counts
  uint64_t total = 0;
  std::error_code ec;  // RocksDB deletes files while we list them
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    const uint64_t size = e.file_size(ec);
    if (!ec && e.is_regular_file(ec)) total += size;
  }
  return total;
}

// The disk budget bounds the whole data folder (WAL, memtables' logs, SST and blob files), not
// just payload bytes: a long run of small Puts at a 4 MiB budget stays within the bound stated in
// trie/record_store.h (the folder was 1.29 GB, 39 WAL files, before the WAL was bound).
TEST_F(TierTest, DiskBudgetBoundsTheWholeDataFolder) {
  constexpr uint64_t kBudget = 4 << 20;
  Open({.memory_bytes = 1 << 20, .disk_bytes = kBudget});
  uint64_t peak = 0;
  const KvDump& d = dumps_[4];
  const ModelInfo m = Model(d);
  std::vector<uint8_t> block(m.geometry.num_bytes());
  for (int i = 0; i < 2000; ++i) {  // 2000 one-block Puts of 10 KiB: ~20 MiB written
    const size_t b = static_cast<size_t>(i) % (d.num_tokens() / 16);
    std::vector<uint32_t> tokens(d.token_ids.begin() + b * 16, d.token_ids.begin() + b * 16 + 16);
    auto session =
        store_->BeginPut("n" + std::to_string(i), m, tokens, {}, {.encoding = Encoding::kRaw});
    ASSERT_TRUE(session.ok());
    GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
    ASSERT_TRUE((*session)->AddLayers(0, 0, 0, block).ok());
    auto put = (*session)->Finish();
    ASSERT_TRUE(put.ok()) << put.status();
    if (i % 100 == 99) peak = std::max(peak, FolderBytes(dir_));
  }
  std::printf("peak data folder %llu bytes at a %llu-byte budget\n",
              static_cast<unsigned long long>(peak), static_cast<unsigned long long>(kBudget));
  EXPECT_LE(store_->Stats("").disk_bytes, kBudget);
  EXPECT_LE(peak, RecordStore::FolderBound(kBudget)) << "peak folder size " << peak;
  EXPECT_GT(store_->Stats("").evictions_disk, 1200u);  // the run was ~5x the budget
}

// Flips a byte of one payload inside RocksDB's blob file (a real on-disk corruption).
TEST_F(TierTest, CorruptBlobOnDiskIsDataLossAndOnlyThatSubtreeIsDropped) {
  Open({});
  ASSERT_TRUE(Put("ns", dumps_[0], Encoding::kRaw).ok());
  ASSERT_TRUE(Put("ns", dumps_[4], Encoding::kRaw).ok());
  const uint64_t nodes = store_->Stats("").nodes;
  std::string victim;  // block 26: past the prefix s0 may share with GPL-3
  {
    auto got = store_->Get("ns", dumps_[0].model_id, dumps_[0].token_ids, 0);
    ASSERT_TRUE(got.ok());
    victim = *got->blocks[26].encoded;
  }
  store_.reset();  // flushes: the payloads are now in blob files
  ASSERT_EQ(FlipByteInBlobFiles(dir_, victim), 1) << "the payload was not found in a blob file";
  Open({});
  EXPECT_EQ(store_->recovery().dropped_bad_payload, 0u);  // payloads are checked when read
  {  // (a Get's snapshot must not outlive the store)
    auto got = store_->Get("ns", dumps_[0].model_id, dumps_[0].token_ids, 0);
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->blocks.size(), 32u);
    auto bad = store_->ReadPayload("ns", dumps_[0].model_id, got->blocks[26]);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
  }
  EXPECT_EQ(Stored("ns", dumps_[0]), 26u);  // block 26 and its 5 descendants are dropped
  EXPECT_EQ(store_->Stats("").evictions_data_loss, 6u);
  EXPECT_EQ(ExpectBitExact("ns", dumps_[0]), 26u);
  EXPECT_EQ(ExpectBitExact("ns", dumps_[4]), 32u);
  Open({});  // and the drop is persistent
  EXPECT_EQ(Stored("ns", dumps_[0]), 26u);
  EXPECT_EQ(store_->recovery().nodes, nodes - 6);
}

// Gets racing Puts of the same prefixes under a tiny memory budget see whole blocks or nothing.
TEST_F(TierTest, GetsConcurrentWithPutsSeeWholeBlocksOrNothing) {
  Open({.memory_bytes = 64 << 10});
  std::atomic<bool> done{false};
  std::thread writer([&] {
    for (int i = 0; i < 6; ++i) {
      for (int d = 0; d < 4; ++d) EXPECT_TRUE(Put("r" + std::to_string(i), dumps_[d]).ok());
    }
    done = true;
  });
  int reads = 0;
  while (!done || reads < 3) {
    for (int i = 0; i < 6; ++i) ExpectBitExact("r" + std::to_string(i), dumps_[reads % 4]);
    ++reads;
  }
  writer.join();
  EXPECT_LE(store_->Stats("").hot_bytes, 64u << 10);
}

// PinRequest.extend_only (a lease, e.g. the vLLM connector's between its lookup and its load):
// never shortens a pin — one until unpinned, or a longer one, stays — and extends a shorter one.
// A plain pin with a shorter TTL does shorten it (the control).
TEST_F(TierTest, AnExtendOnlyPinNeverShortensAPinAndExtendsAShorterOne) {
  Open({.disk_bytes = 1 << 20});
  const KvDump& a = dumps_[4];
  ASSERT_TRUE(Put("ns", a).ok());
  int round = 0;
  // Puts that need the whole disk budget, in a fresh namespace. The budget bounds the data
  // folder as RocksDB's files measure it, which depends on when its background flushes and
  // compactions ran: under load a Put may find the folder full (RESOURCE_EXHAUSTED) after it
  // evicted what it could. The pressure is what this test needs, not each Put's success: any
  // other error fails, and each round stores something.
  auto pressure = [&] {
    const std::string ns = "fill" + std::to_string(++round);
    int stored = 0;
    for (size_t i = 5; i < std::size(kDumps); ++i) {
      absl::StatusOr<PutSummary> put = Put(ns, dumps_[i]);
      ASSERT_TRUE(put.ok() || absl::IsResourceExhausted(put.status())) << put.status();
      stored += put.ok();
    }
    EXPECT_GT(stored, 0) << "round " << round << " stored nothing";
  };
  auto pin = [&](uint64_t ttl, bool extend_only) {
    auto id = store_->Pin("ns", a.model_id, a.token_ids, ttl, false, extend_only);
    ASSERT_TRUE(id.ok()) << id.status();
  };
  pin(0, false);  // until unpinned
  pin(30, true);
  now_ += 31;
  pressure();
  EXPECT_EQ(Stored("ns", a), 32u);  // the lease did not turn it into a 30 s pin
  pin(100, false);
  pin(10, true);
  now_ += 50;
  pressure();
  EXPECT_EQ(Stored("ns", a), 32u);  // still the 100 s pin
  pin(200, true);                   // extends it to now + 200
  now_ += 60;
  pressure();
  EXPECT_EQ(Stored("ns", a), 32u);
  pin(10, false);  // a plain pin shortens it
  now_ += 11;
  pressure();
  EXPECT_LT(Stored("ns", a), 32u);
}

}  // namespace
}  // namespace kvtrie
