#include "trie/memory_env.h"

#include "rocksdb/env.h"

namespace kvtrie {

std::shared_ptr<rocksdb::Env> NewMemoryEnv() {
  return std::shared_ptr<rocksdb::Env>(rocksdb::NewMemEnv(rocksdb::Env::Default()));
}

}  // namespace kvtrie
