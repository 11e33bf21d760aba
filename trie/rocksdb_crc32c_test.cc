// librocksdb's CRC-32C calls reach kvtrie's hardware CRC (trie/rocksdb_crc32c.h), and what
// RocksDB writes with it reads back verified.
#include "trie/rocksdb_crc32c.h"

#include <cstddef>
#include <filesystem>
#include <memory>
#include <vector>

#include "codec/crc32c.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/store_testing.h"

namespace rocksdb::crc32c {
uint32_t Extend(uint32_t init_crc, const char* data, size_t n);  // librocksdb's util/crc32c.h
}  // namespace rocksdb::crc32c

namespace kvtrie {
namespace {

TEST(RocksDbCrc32cTest, TheSymbolResolvesToKvtriesAndComputesTheStandardCrc) {
  ASSERT_TRUE(RocksDbCrc32cIsKvtries())
      << "rocksdb::crc32c::Extend resolves to librocksdb's own (software) loop";
  EXPECT_EQ(rocksdb::crc32c::Extend(0, "123456789", 9), 0xE3069283u);  // the check value
  // Extending in two pieces is the CRC of the whole, as RocksDB's callers rely on.
  const uint32_t head = rocksdb::crc32c::Extend(0, "1234", 4);
  EXPECT_EQ(rocksdb::crc32c::Extend(head, "56789", 5), 0xE3069283u);
  EXPECT_EQ(rocksdb::crc32c::Extend(0, "", 0), 0u);
}

TEST(RocksDbCrc32cTest, RocksDbWritesAndVerifiesThroughIt) {
  const std::filesystem::path dir = testing_store::FreshTestDir("rocksdb_crc32c_test");
  std::vector<KvDump> dumps;
  ASSERT_NO_FATAL_FAILURE(testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3"}, &dumps));
  StoreOptions o;
  o.data_dir = dir.string();
  {
    auto store = KvStore::Open(o);
    ASSERT_TRUE(store.ok()) << store.status();
    const uint64_t before = RocksDbCrc32cCalls();
    auto put = testing_store::PutDump(store->get(), "ns", dumps[0], Encoding::kRaw);
    ASSERT_TRUE(put.ok()) << put.status();
    // The WAL record of the commit's batch is checksummed by librocksdb, through kvtrie's.
    EXPECT_GT(RocksDbCrc32cCalls(), before);
  }
  // Reopened (memtables were flushed to SST and blob files at close, each record checksummed
  // on write and verified on read): every block back bit-exact.
  auto store = KvStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_GT(testing_store::ExpectBitExact(store->get(), "ns", dumps[0]), 0u);
  store->reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtrie
