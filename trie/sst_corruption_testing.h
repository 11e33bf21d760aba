// trie/sst_corruption_testing.h — test-only: rots a byte of RocksDB's own files on disk.
//
// FlipByteInSstFiles flips one bit near the start (the first data block) of every live SST file
// of column family `cf` ("nodes", "payloads") of the closed store under `dir`, and returns the
// files and offsets changed so the caller can flip them back (FlipBack) — a repair, after which
// everything must read again.
#ifndef KVTRIE_TRIE_SST_CORRUPTION_TESTING_H_
#define KVTRIE_TRIE_SST_CORRUPTION_TESTING_H_

#include <rocksdb/db.h>
#include <rocksdb/metadata.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace kvtrie {

using FlippedBytes = std::vector<std::pair<std::string, std::streamoff>>;

inline void FlipByteAt(const std::string& file, std::streamoff at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(at);
  f.write(&c, 1);
}

inline FlippedBytes FlipByteInSstFiles(const std::filesystem::path& dir, const std::string& cf) {
  std::vector<std::string> files;
  {
    rocksdb::DB* db = nullptr;
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {"default", {}}, {"models", {}}, {"nodes", {}}, {"payloads", {}}};
    rocksdb::DBOptions o;
    if (!rocksdb::DB::OpenForReadOnly(o, dir.string(), cfs, &h, &db).ok()) return {};
    std::vector<rocksdb::LiveFileMetaData> meta;
    db->GetLiveFilesMetaData(&meta);
    for (const auto& m : meta) {
      if (m.column_family_name == cf) files.push_back(m.db_path + "/" + m.name);
    }
    for (auto* x : h) db->DestroyColumnFamilyHandle(x);
    delete db;
  }
  FlippedBytes flipped;
  for (const std::string& f : files) {
    FlipByteAt(f, 16);
    flipped.emplace_back(f, 16);
  }
  return flipped;
}

inline void FlipBack(const FlippedBytes& flipped) {
  for (const auto& [file, at] : flipped) FlipByteAt(file, at);
}

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_SST_CORRUPTION_TESTING_H_
