// trie/memory_env.h
//
// An in-memory RocksDB Env for StoreOptions::env: a KvStore whose files (SSTs, WAL, MANIFEST)
// live in this process's memory instead of under data_dir (which is still created, empty). For
// fuzzers and tests that need the real store without disk I/O; everything is lost with the Env.
// The Env must outlive every store opened on it.
// Thread-safe (RocksDB's NewMemEnv).
#ifndef KVTRIE_TRIE_MEMORY_ENV_H_
#define KVTRIE_TRIE_MEMORY_ENV_H_

#include <memory>

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace kvtrie {

// A new in-memory Env over rocksdb::Env::Default() (its threads and clock).
std::shared_ptr<rocksdb::Env> NewMemoryEnv();

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_MEMORY_ENV_H_
