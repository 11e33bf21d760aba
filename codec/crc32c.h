// codec/crc32c.h
//
// CRC-32C (Castagnoli, polynomial 0x1EDC6F41, reflected), the checksum of iSCSI, ext4, LevelDB
// and RocksDB. Uses the SSE4.2 `crc32` instruction when the CPU has it (three interleaved streams
// over 8 KiB lanes, then 256-byte lanes, combined by GF(2) shift tables), a slicing table
// otherwise. Also RocksDB's CRC-32C in kvtrie's executables (trie/rocksdb_crc32c.h). Check value:
// Crc32c("123456789") == 0xE3069283.
#ifndef KVTRIE_CODEC_CRC32C_H_
#define KVTRIE_CODEC_CRC32C_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace kvtrie {

// Extends `crc` (the CRC of earlier bytes, 0 for none) with `n` bytes at `data`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(absl::string_view bytes) {
  return Crc32cExtend(0, bytes.data(), bytes.size());
}

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_CRC32C_H_
