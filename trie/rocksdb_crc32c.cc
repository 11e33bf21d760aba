#include "trie/rocksdb_crc32c.h"

#include <dlfcn.h>

#include <atomic>
#include <cstddef>

#include "codec/crc32c.h"

namespace kvtrie {
namespace {
std::atomic<uint64_t> calls{0};
}  // namespace
}  // namespace kvtrie

// The interposed definition (see the header). Its signature must match RocksDB's
// util/crc32c.h exactly: `uint32_t Extend(uint32_t init_crc, const char* data, size_t n)`,
// mangled _ZN7rocksdb6crc32c6ExtendEjPKcm.
namespace rocksdb {
namespace crc32c {
__attribute__((visibility("default"))) uint32_t Extend(uint32_t init_crc, const char* data,
                                                       size_t n);
uint32_t Extend(uint32_t init_crc, const char* data, size_t n) {
  kvtrie::calls.fetch_add(1, std::memory_order_relaxed);
  return kvtrie::Crc32cExtend(init_crc, data, n);
}
}  // namespace crc32c
}  // namespace rocksdb

namespace kvtrie {

bool RocksDbCrc32cIsKvtries() {
  void* resolved = dlsym(RTLD_DEFAULT, "_ZN7rocksdb6crc32c6ExtendEjPKcm");
  return resolved == reinterpret_cast<void*>(&rocksdb::crc32c::Extend);
}

uint64_t RocksDbCrc32cCalls() { return calls.load(std::memory_order_relaxed); }

}  // namespace kvtrie
