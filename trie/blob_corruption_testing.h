// trie/blob_corruption_testing.h — test-only: rots a stored payload on disk.
//
// Flips one bit in the middle of `payload` wherever it appears in the RocksDB blob files or the
// value log segments under `dir` (payloads live there uncompressed: predictor states in BlobDB,
// block payloads in the value log, or in BlobDB in folders of an older kvtrie). The store must be
// closed. Returns how many blob files were changed (1 when the payload is stored once).
#ifndef KVTRIE_TRIE_BLOB_CORRUPTION_TESTING_H_
#define KVTRIE_TRIE_BLOB_CORRUPTION_TESTING_H_

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace kvtrie {

inline int FlipByteInBlobFiles(const std::filesystem::path& dir, const std::string& payload) {
  int flipped = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.path().extension() != ".blob" && e.path().extension() != ".seg") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t at = bytes.find(payload);
    if (at == std::string::npos) continue;
    const size_t victim = at + payload.size() / 2;
    f.seekp(static_cast<std::streamoff>(victim));
    const char c = static_cast<char>(bytes[victim] ^ 0x40);
    f.write(&c, 1);
    ++flipped;
  }
  return flipped;
}

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_BLOB_CORRUPTION_TESTING_H_
