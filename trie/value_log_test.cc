// The value log (trie/value_log.h) and RecordStore's use of it (trie/record_store.h): payloads
// written once, torn tails detected by CRC, recovery from the records alone, GC by live ratio
// that respects snapshots, and the fault-injection seam (torn segment writes, ENOSPC, a failed
// segment delete, a crash in the middle of a GC).
#include "trie/value_log.h"

#include <rocksdb/db.h>
#include <rocksdb/env.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "trie/fault_injection_testing.h"
#include "trie/record_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

uint64_t FileSize(const std::filesystem::path& p) {
  std::error_code ec;
  const uintmax_t n = std::filesystem::file_size(p, ec);
  return ec ? 0 : n;
}

std::vector<std::filesystem::path> Segments(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir / "vlog", ec)) {
    if (e.path().extension() == ".seg") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ---------------------------------------------------------------------------------------------
// ValueLog alone

class ValueLogTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("value_log_test");
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    log_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open(uint64_t segment_bytes = 64ull << 20) {
    log_.reset();
    ValueLog::Options o;
    o.env = rocksdb::Env::Default();
    o.dir = (dir_ / "vlog").string();
    o.segment_bytes = segment_bytes;
    auto l = ValueLog::Open(o);
    ASSERT_TRUE(l.ok()) << l.status();
    log_ = *std::move(l);
  }
  std::vector<ValuePointer> Append(const std::vector<std::string>& keys,
                                   const std::vector<std::string>& payloads) {
    std::vector<ValueLog::Entry> e;
    for (size_t i = 0; i < keys.size(); ++i) e.push_back({keys[i], payloads[i]});
    std::vector<ValuePointer> out;
    EXPECT_TRUE(log_->Append(e, &out).ok());
    return out;
  }

  std::filesystem::path dir_;
  std::unique_ptr<ValueLog> log_;
};

TEST_F(ValueLogTest, PointerRoundTripsAndAnInlineEnvelopeIsNeverOne) {
  const ValuePointer p{7, 123456789012ull, 2u << 20, 0xdeadbeef};
  const std::string enc = EncodeValuePointer(p);
  EXPECT_EQ(enc.size(), kValuePointerBytes);
  ValuePointer q;
  ASSERT_TRUE(DecodeValuePointer(enc, &q));
  EXPECT_TRUE(q == p);
  std::string envelope = "KVB1" + std::string(24, 'x');  // 28 bytes, an envelope's magic
  EXPECT_FALSE(DecodeValuePointer(envelope, &q));
  EXPECT_FALSE(DecodeValuePointer(enc.substr(0, 27), &q));
}

TEST_F(ValueLogTest, AGroupIsAppendedInOrderAndReadsBackBitExact) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::vector<std::string> keys = {NodeKey(1, 1), NodeKey(1, 2), NodeKey(1, 3)};
  const std::vector<std::string> payloads = {RandomBytes(1000, 1), "", RandomBytes(70000, 3)};
  const std::vector<ValuePointer> p = Append(keys, payloads);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0].offset, 0u);
  EXPECT_EQ(p[1].offset, ValueLog::RecordBytes(1000));
  EXPECT_EQ(p[2].offset, ValueLog::RecordBytes(1000) + ValueLog::RecordBytes(0));
  for (size_t i = 0; i < 3; ++i) {
    auto got = log_->Read(keys[i], p[i]);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, payloads[i]);
  }
  // Another key's pointer is not this record.
  auto wrong = log_->Read(NodeKey(1, 9), p[0]);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kDataLoss) << wrong.status();
  // Written once: the file is the records, nothing more.
  ASSERT_NO_FATAL_FAILURE(Open());  // sealed at close
  const auto segs = Segments(dir_);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(FileSize(segs[0]),
            ValueLog::RecordBytes(1000) + ValueLog::RecordBytes(0) + ValueLog::RecordBytes(70000));
}

TEST_F(ValueLogTest, ATornTailReadsAsDataLossAndScanStopsBeforeIt) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::vector<std::string> keys = {NodeKey(1, 1), NodeKey(1, 2), NodeKey(1, 3)};
  const std::vector<std::string> payloads = {RandomBytes(5000, 1), RandomBytes(5000, 2),
                                             RandomBytes(5000, 3)};
  const std::vector<ValuePointer> p = Append(keys, payloads);
  log_.reset();
  const auto segs = Segments(dir_);
  ASSERT_EQ(segs.size(), 1u);
  // A crash in the middle of the third record.
  std::filesystem::resize_file(segs[0], p[2].offset + ValueLog::kHeaderBytes + 100);
  ASSERT_NO_FATAL_FAILURE(Open());
  std::vector<std::string> scanned;
  ASSERT_TRUE(log_->Scan(1, [&](absl::string_view key,
                                const ValuePointer& q) { scanned.emplace_back(key); })
                  .ok());
  EXPECT_EQ(scanned, std::vector<std::string>(keys.begin(), keys.begin() + 2));
  EXPECT_EQ(*log_->Read(keys[1], p[1]), payloads[1]);
  auto torn = log_->Read(keys[2], p[2]);
  EXPECT_EQ(torn.status().code(), absl::StatusCode::kDataLoss) << torn.status();
  EXPECT_NE(torn.status().message().find("value log segment 1"), std::string::npos);
  // Appends after a reopen never go after the torn tail.
  const std::vector<ValuePointer> next = Append({NodeKey(1, 4)}, {"abc"});
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].segment, 2u);
  EXPECT_EQ(next[0].offset, 0u);
}

TEST_F(ValueLogTest, ARottenPayloadByteIsDataLoss) {
  ASSERT_NO_FATAL_FAILURE(Open());
  const std::string key = NodeKey(2, 1);
  const std::string payload = RandomBytes(4096, 5);
  const std::vector<ValuePointer> p = Append({key}, {payload});
  log_.reset();
  {
    std::fstream f(Segments(dir_)[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(ValueLog::kHeaderBytes + 2000));
    const char c = static_cast<char>(payload[2000] ^ 0x10);
    f.write(&c, 1);
  }
  ASSERT_NO_FATAL_FAILURE(Open());
  auto got = log_->Read(key, p[0]);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_NE(got.status().message().find("checksum"), std::string::npos) << got.status();
}

TEST_F(ValueLogTest, SegmentsRollAtTheirSizeAndObsoleteOnesAreDeletedAfterTheirReaders) {
  ASSERT_NO_FATAL_FAILURE(Open(/*segment_bytes=*/10000));
  std::vector<ValuePointer> all;
  for (int i = 0; i < 6; ++i) {
    auto p = Append({NodeKey(1, i)}, {RandomBytes(6000, i)});
    all.push_back(p[0]);
  }
  // 6000-byte payloads, a segment is full after two: 3 segments.
  EXPECT_EQ(all[0].segment, 1u);
  EXPECT_EQ(all[1].segment, 1u);
  EXPECT_EQ(all[2].segment, 2u);
  EXPECT_EQ(all[5].segment, 3u);
  log_->MarkObsolete(1, /*seq=*/50);
  log_->MarkObsolete(3, /*seq=*/10);  // the active segment is never obsolete
  ASSERT_TRUE(log_->DeleteObsolete(/*oldest_reader_seq=*/49).ok());
  EXPECT_EQ(log_->segments_deleted(), 0u);
  ASSERT_TRUE(log_->DeleteObsolete(50).ok());
  EXPECT_EQ(log_->segments_deleted(), 1u);
  auto gone = log_->Read(NodeKey(1, 0), all[0]);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  EXPECT_TRUE(log_->Read(NodeKey(1, 5), all[5]).ok());
  EXPECT_EQ(Segments(dir_).size(), 2u);
}

// ---------------------------------------------------------------------------------------------
// RecordStore over the value log

class RecordStoreVlogTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_store::FreshTestDir("value_log_store_test");
    fs_ = std::make_shared<FaultFs>();
    env_ = FaultFs::NewEnv(fs_);
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open(bool sync = false, uint64_t segment_bytes = 64 << 10) {
    store_.reset();
    RecordStore::Options o;
    o.data_dir = dir_.string();
    o.sync = sync;
    o.env = env_.get();
    o.segment_bytes = segment_bytes;
    auto s = RecordStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  static NodeMeta Meta() {
    NodeMeta m;
    m.ns = "ns";
    m.model_id = "m";
    m.token_ids = {1, 2, 3};
    return m;
  }
  absl::Status Put(uint64_t id, const std::string& payload) {
    RecordBatch b(store_.get());
    b.PutNode(1, id, Meta(), &payload);
    return store_->Write(b);
  }
  absl::Status Delete(uint64_t id) {
    RecordBatch b(store_.get());
    b.DeleteNode(1, id);
    return store_->Write(b);
  }
  // Puts ids [from, to) with 20000-byte payloads: four records per 64 KiB segment (a segment is
  // sealed once it reaches its size), so ids 0-3 are in segment 1, 4-7 in segment 2, ...
  void PutRange(uint64_t from, uint64_t to) {
    for (uint64_t id = from; id < to; ++id) {
      payloads_[id] = RandomBytes(20000, static_cast<uint32_t>(id));
      ASSERT_TRUE(Put(id, payloads_[id]).ok());
    }
  }
  void ExpectReads(uint64_t id) {
    auto got = store_->ReadPayload(1, id, nullptr);
    ASSERT_TRUE(got.ok()) << id << ": " << got.status();
    EXPECT_EQ(*got, payloads_[id]) << id;
  }

  std::filesystem::path dir_;
  std::shared_ptr<FaultFs> fs_;
  std::unique_ptr<rocksdb::Env> env_;
  std::unique_ptr<RecordStore> store_;
  std::map<uint64_t, std::string> payloads_;
};

TEST_F(RecordStoreVlogTest, APayloadIsWrittenOnceAndRocksDbHoldsOnlyItsPointer) {
  ASSERT_NO_FATAL_FAILURE(Open(false, 64 << 20));
  const std::string payload = RandomBytes(4 << 20, 1);
  payloads_[1] = payload;
  ASSERT_TRUE(Put(1, payload).ok());
  ExpectReads(1);
  const RecordStore::ValueLogStats st = store_->value_log_stats();
  EXPECT_EQ(st.bytes_appended, payload.size());
  EXPECT_EQ(st.live_bytes, ValueLog::RecordBytes(payload.size()));
  // The rest of what RocksDB accounts (the WAL with the batch) is far below the payload.
  EXPECT_LT(store_->DiskUsage() - st.bytes, 64u << 10);
  ASSERT_NO_FATAL_FAILURE(Open(false, 64 << 20));  // flushed to SST: still a pointer
  ExpectReads(1);
  EXPECT_EQ(store_->value_log_stats().live_bytes, ValueLog::RecordBytes(payload.size()));
  EXPECT_LT(store_->DiskUsage() - store_->value_log_stats().bytes, 64u << 10);
}

TEST_F(RecordStoreVlogTest, GcRewritesSegmentsAtMostHalfLiveAndLiveBytesReadAsBefore) {
  ASSERT_NO_FATAL_FAILURE(Open());
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 12));  // 3 segments (the 3rd active)
  // Segment 1 (ids 0-3) keeps one of four; segment 2 (4-7) three of four.
  for (uint64_t id : {0, 1, 2, 4}) {
    ASSERT_TRUE(Delete(id).ok());
    payloads_.erase(id);
  }
  const uint64_t before = store_->value_log_stats().bytes;
  ASSERT_TRUE(store_->CollectValueLog(RecordStore::kValueLogGcRatio).ok());
  const RecordStore::ValueLogStats st = store_->value_log_stats();
  EXPECT_EQ(st.segments_deleted, 1u);  // segment 1 only: segment 2 is 3/4 live
  EXPECT_LT(st.bytes, before);
  EXPECT_FALSE(std::filesystem::exists(dir_ / "vlog" / "000001.seg"));
  EXPECT_TRUE(std::filesystem::exists(dir_ / "vlog" / "000002.seg"));
  for (const auto& [id, p] : payloads_) ExpectReads(id);
  // Recovery rebuilds the same accounting from the records.
  const uint64_t live = st.live_bytes;
  ASSERT_NO_FATAL_FAILURE(Open());
  EXPECT_EQ(store_->value_log_stats().live_bytes, live);
  for (const auto& [id, p] : payloads_) ExpectReads(id);
}

TEST_F(RecordStoreVlogTest, CompactRemovesEveryDeletedByteButWhatASnapshotStillSees) {
  ASSERT_NO_FATAL_FAILURE(Open());
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 6));
  std::shared_ptr<const ReadSnapshot> snap = store_->Snapshot();
  const std::string victim = payloads_[1];
  ASSERT_TRUE(Delete(1).ok());
  payloads_.erase(1);
  ASSERT_TRUE(store_->Compact().ok());
  // The snapshot (a Get that started before the Delete) still reads the deleted payload.
  auto old = store_->ReadPayload(1, 1, snap.get());
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(*old, victim);
  auto now = store_->ReadPayload(1, 1, nullptr);
  EXPECT_EQ(now.status().code(), absl::StatusCode::kNotFound) << now.status();
  // Live payloads were moved, and read the same with or without the old snapshot.
  for (const auto& [id, p] : payloads_) ExpectReads(id);
  auto moved = store_->ReadPayload(1, 3, snap.get());
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, payloads_[3]);
  const uint64_t held = store_->value_log_stats().bytes;
  snap.reset();  // its segments go now
  EXPECT_LT(store_->value_log_stats().bytes, held);
  const std::string needle = victim.substr(victim.size() / 2, 64);
  for (const auto& seg : Segments(dir_)) {
    std::ifstream in(seg, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(bytes.find(needle), std::string::npos) << seg;
  }
  // Live bytes are exactly the records left.
  uint64_t expect = 0;
  for (const auto& [id, p] : payloads_) expect += ValueLog::RecordBytes(p.size());
  EXPECT_EQ(store_->value_log_stats().live_bytes, expect);
  EXPECT_EQ(store_->value_log_stats().bytes, expect);
}

TEST_F(RecordStoreVlogTest, AFailedSegmentDeleteKeepsItCountedAndIsRetried) {
  ASSERT_NO_FATAL_FAILURE(Open());
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 8));
  for (uint64_t id : {0, 1, 2}) {
    ASSERT_TRUE(Delete(id).ok());
    payloads_.erase(id);
  }
  fs_->fail_segment_delete = true;
  absl::Status s = store_->CollectValueLog(RecordStore::kValueLogGcRatio);
  EXPECT_FALSE(s.ok());
  EXPECT_GT(fs_->faults.load(), 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ / "vlog" / "000001.seg"));
  EXPECT_GE(store_->DiskUsage(), FileSize(dir_ / "vlog" / "000001.seg"));
  EXPECT_TRUE(store_->health().ok());  // GC's delete failing does not fail the store
  for (const auto& [id, p] : payloads_) ExpectReads(id);
  fs_->fail_segment_delete = false;
  ASSERT_TRUE(store_->CollectValueLog(RecordStore::kValueLogGcRatio).ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ / "vlog" / "000001.seg"));
  for (const auto& [id, p] : payloads_) ExpectReads(id);
}

TEST_F(RecordStoreVlogTest, ACrashInTheMiddleOfAGcLosesNothingAndItsOrphansGoAtOpen) {
  ASSERT_NO_FATAL_FAILURE(Open());
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 9));
  for (uint64_t id : {0, 1, 4, 5}) {  // segments 1 and 2 half live
    ASSERT_TRUE(Delete(id).ok());
    payloads_.erase(id);
  }
  ASSERT_NO_FATAL_FAILURE(Open());  // flushed: durable without sync
  // Crash 1: after the copies, before the swap.
  store_->gc_after_copy_for_testing = [this] {
    fs_->Crash();
    return absl::UnavailableError("crashed for the test");
  };
  EXPECT_FALSE(store_->CollectValueLog(RecordStore::kValueLogGcRatio).ok());
  store_.reset();
  fs_->DropUnsyncedWal();
  ASSERT_NO_FATAL_FAILURE(Open());
  for (const auto& [id, p] : payloads_) ExpectReads(id);
  uint64_t expect = 0;
  for (const auto& [id, p] : payloads_) expect += ValueLog::RecordBytes(p.size());
  EXPECT_EQ(store_->value_log_stats().live_bytes, expect);
  // Crash 2: after the swap, before the old segments' delete (the delete fails, then the process
  // dies): the next open deletes them.
  fs_->fail_segment_delete = true;
  EXPECT_FALSE(store_->CollectValueLog(RecordStore::kValueLogGcRatio).ok());
  EXPECT_TRUE(std::filesystem::exists(dir_ / "vlog" / "000001.seg"));
  fs_->fail_segment_delete = false;
  store_.reset();
  ASSERT_NO_FATAL_FAILURE(Open());
  EXPECT_FALSE(std::filesystem::exists(dir_ / "vlog" / "000001.seg"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "vlog" / "000002.seg"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "vlog" / "000004.seg"));  // crash 1's copies
  for (const auto& [id, p] : payloads_) ExpectReads(id);
  EXPECT_EQ(store_->value_log_stats().live_bytes, expect);
  EXPECT_EQ(store_->value_log_stats().bytes, expect);
}

TEST_F(RecordStoreVlogTest, ATornSegmentWriteFailsThePutAndRecoveryDropsOnlyIt) {
  ASSERT_NO_FATAL_FAILURE(Open(/*sync=*/true));
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 2));
  fs_->tear_segment_append = true;
  const std::string torn = RandomBytes(20000, 99);
  absl::Status s = Put(7, torn);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("store failed"), std::string::npos) << s;
  fs_->tear_segment_append = false;
  EXPECT_EQ(store_->ReadPayload(1, 7, nullptr).status().code(), absl::StatusCode::kNotFound);
  fs_->Crash();
  store_.reset();
  fs_->DropUnsyncedWal();
  ASSERT_NO_FATAL_FAILURE(Open(/*sync=*/true));
  for (const auto& [id, p] : payloads_) ExpectReads(id);
  EXPECT_EQ(store_->ReadPayload(1, 7, nullptr).status().code(), absl::StatusCode::kNotFound);
  payloads_[7] = torn;
  ASSERT_TRUE(Put(7, torn).ok());
  ExpectReads(7);
}

TEST_F(RecordStoreVlogTest, NoSpaceOnAppendIsResourceExhaustedAndNothingIsPublished) {
  ASSERT_NO_FATAL_FAILURE(Open());
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 2));
  fs_->no_space = true;
  absl::Status s = Put(5, RandomBytes(1000, 5));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("value log"), std::string::npos) << s;
  fs_->no_space = false;
  EXPECT_EQ(store_->health().code(), absl::StatusCode::kUnavailable);
  ASSERT_NO_FATAL_FAILURE(Open());
  for (const auto& [id, p] : payloads_) ExpectReads(id);
  EXPECT_EQ(store_->ReadPayload(1, 5, nullptr).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RecordStoreVlogTest, PowerLossWithSyncKeepsEveryAcknowledgedPayload) {
  ASSERT_NO_FATAL_FAILURE(Open(/*sync=*/true));
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 5));
  fs_->Crash();
  store_.reset();
  fs_->DropUnsyncedWal();  // segments too: only fdatasync'd bytes remain
  ASSERT_NO_FATAL_FAILURE(Open(/*sync=*/true));
  for (const auto& [id, p] : payloads_) ExpectReads(id);
}

TEST_F(RecordStoreVlogTest, PayloadsOfAnOlderFolderStoredInlineStayReadable) {
  ASSERT_NO_FATAL_FAILURE(Open());
  ASSERT_NO_FATAL_FAILURE(PutRange(0, 1));
  store_.reset();
  // Write an inline value (an older kvtrie's layout) straight into the payloads column family.
  const std::string inline_payload = "KVB1" + RandomBytes(3000, 42);
  {
    rocksdb::DBOptions dbo;
    std::vector<std::string> names;
    ASSERT_TRUE(rocksdb::DB::ListColumnFamilies(dbo, dir_.string(), &names).ok());
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    for (const auto& n : names) cfs.emplace_back(n, rocksdb::ColumnFamilyOptions());
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* db = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(dbo, dir_.string(), cfs, &handles, &db).ok());
    rocksdb::ColumnFamilyHandle* payloads = nullptr;
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == "payloads") payloads = handles[i];
    }
    ASSERT_NE(payloads, nullptr);
    ASSERT_TRUE(db->Put(rocksdb::WriteOptions(), payloads, NodeKey(1, 50), inline_payload).ok());
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h);
    delete db;
  }
  ASSERT_NO_FATAL_FAILURE(Open());
  auto got = store_->ReadPayload(1, 50, nullptr);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, inline_payload);
  ExpectReads(0);
}

}  // namespace
}  // namespace kvtrie
