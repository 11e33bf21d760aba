// trie/rocksdb_crc32c.h
//
// RocksDB's CRC-32C, computed by kvtrie's hardware one (codec/crc32c.h).
//
// Debian 12's librocksdb 7.8 is built PORTABLE: its `rocksdb::crc32c::Extend` dispatches to a
// table-driven loop (no SSE4.2), which a profile of Put RAW found to be ~40 % of the server's
// CPU (bench/speed_put.md: the WAL record CRC and the blob record CRC at flush, each over every
// payload byte). rocksdb_crc32c.cc defines `rocksdb::crc32c::Extend(uint32_t, const char*,
// size_t)` in the executable; librocksdb calls that function through its PLT (it is exported
// with a JUMP_SLOT relocation), so the dynamic linker binds librocksdb's calls to the
// executable's definition (ELF symbol interposition: the executable comes first in the lookup
// scope). Same function, same values (standard CRC-32C, `crc` the CRC of the earlier bytes):
// files stay readable by a stock RocksDB and vice versa; no format change.
//
// If the interposition stops working (a RocksDB built with -Bsymbolic, LTO inlining the calls,
// a renamed symbol), RocksDB silently uses its own loop again: RecordStore::Open logs which one
// is in use, and RocksDbCrc32cTest fails.
#ifndef KVTRIE_TRIE_ROCKSDB_CRC32C_H_
#define KVTRIE_TRIE_ROCKSDB_CRC32C_H_

#include <cstdint>

namespace kvtrie {

// True when the symbol `rocksdb::crc32c::Extend` resolves to kvtrie's definition (so
// librocksdb's calls reach it).
bool RocksDbCrc32cIsKvtries();

// How many times librocksdb (or anyone) called `rocksdb::crc32c::Extend` in this process.
uint64_t RocksDbCrc32cCalls();

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_ROCKSDB_CRC32C_H_
