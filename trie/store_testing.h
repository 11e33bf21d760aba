// trie/store_testing.h — test-only helpers shared by the KvStore tests: put a real KV dump
// (codec/kv_dump.h, tests/data) into a store block by block, and read it back checked against
// the dump. Blocks are 16 tokens; the dump's geometry is the model's.
#ifndef KVTRIE_TRIE_STORE_TESTING_H_
#define KVTRIE_TRIE_STORE_TESTING_H_

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/decode_chain.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/testing_blocks.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"

namespace kvtrie::testing_store {

// An empty folder under the test temp dir, unique to this process, `prefix` and the running test.
inline std::filesystem::path FreshTestDir(const std::string& prefix) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      (prefix + "_" + std::to_string(::getpid()) + "_" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  return dir;
}

// Reads the dumps `names` of tests/data (KVTRIE_TESTDATA_DIR) into *out. Fails the test (and
// returns early from a void caller's ASSERT context) if one is unreadable.
template <typename Names>
inline void LoadTestDumps(const Names& names, std::vector<KvDump>* out) {
  for (const char* name : names) {
    auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
    ASSERT_TRUE(d.ok()) << d.status();
    out->push_back(*std::move(d));
  }
}

// The model spec of a dump, with 16-token blocks.
inline ModelInfo DumpModel(const KvDump& d) {
  return {d.model_id, {d.num_layers, d.num_kv_heads, 16, d.head_dim, d.dtype}};
}

// Puts every full block of `d` into namespace `ns` (one message per block, the store encodes it
// with `enc`) and commits.
inline absl::StatusOr<PutSummary> PutDump(KvStore* store, const std::string& ns, const KvDump& d,
                                          const EncodeOptions& enc) {
  const ModelInfo m = DumpModel(d);
  auto session = store->BeginPut(ns, m, d.token_ids, d.surprisal_bits, enc);
  if (!session.ok()) return session.status();
  std::vector<uint8_t> block(m.geometry.num_bytes());
  for (size_t b = 0; b < d.num_tokens() / 16; ++b) {
    GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
    if (auto s = (*session)->AddLayers(b, 0, 0, block); !s.ok()) return s;
  }
  return (*session)->Finish();
}

inline absl::StatusOr<PutSummary> PutDump(KvStore* store, const std::string& ns, const KvDump& d,
                                          Encoding encoding = Encoding::kLossless) {
  return PutDump(store, ns, d, EncodeOptions{.encoding = encoding});
}

// Blocks of `d` stored in `ns` (the longest stored prefix).
inline size_t StoredBlocks(KvStore* store, const std::string& ns, const KvDump& d) {
  return store->Lookup(ns, d.model_id, d.token_ids).node_ids.size();
}

// Reads the longest stored prefix of `d` in `ns` and expects every block bit-exact. Returns the
// number of blocks read before the first error (*error: that error, or OK) — all of them when
// every read succeeded.
inline size_t ReadBackBitExact(KvStore* store, const std::string& ns, const KvDump& d,
                               absl::Status* error) {
  const ModelInfo m = DumpModel(d);
  auto got = store->Get(ns, m.model_id, d.token_ids, 0);
  if (!got.ok()) {
    *error = got.status();
    return 0;
  }
  std::vector<uint8_t> want(m.geometry.num_bytes()), have(m.geometry.num_bytes());
  DecodeChain chain(m.geometry, nullptr);
  *error = absl::OkStatus();
  for (size_t b = 0; b < got->blocks.size(); ++b) {
    GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(want));
    *error =
        store->ReadAndDecodeBlock(ns, m.model_id, got->blocks[b], &chain, absl::MakeSpan(have));
    if (!error->ok()) return b;
    EXPECT_EQ(have, want) << ns << " block " << b;
  }
  return got->blocks.size();
}

// Reads every block of `d` back from `ns` through a fresh decode chain and expects its K and V
// relative RMS error against the dump (codec/testing_blocks.h RelRms) within `target`.
inline void ExpectWithin(KvStore* store, const std::string& ns, const KvDump& d, double target) {
  const ModelInfo m = DumpModel(d);
  auto got = store->Get(ns, m.model_id, d.token_ids, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->blocks.size(), d.num_tokens() / 16);
  std::vector<uint8_t> want(m.geometry.num_bytes()), have(m.geometry.num_bytes());
  DecodeChain chain(m.geometry, nullptr);
  for (size_t b = 0; b < got->blocks.size(); ++b) {
    GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(want));
    ASSERT_TRUE(
        store->ReadAndDecodeBlock(ns, m.model_id, got->blocks[b], &chain, absl::MakeSpan(have))
            .ok())
        << "block " << b;
    EXPECT_LE(kvtrie::RelRms(m.geometry, want, have, 0), target * 1.0001) << "K, block " << b;
    EXPECT_LE(kvtrie::RelRms(m.geometry, want, have, 1), target * 1.0001) << "V, block " << b;
  }
}

// Every block of the longest stored prefix of `d` in `ns`, decoded in order through one chain
// (each read must succeed): to compare what a store serves before and after a change.
inline std::vector<std::vector<uint8_t>> ReadAllBlocks(KvStore* store, const std::string& ns,
                                                       const KvDump& d) {
  std::vector<std::vector<uint8_t>> out;
  auto got = store->Get(ns, d.model_id, d.token_ids, 0);
  EXPECT_TRUE(got.ok()) << got.status();
  if (!got.ok()) return out;
  const BlockGeometry& g = got->model.geometry;
  DecodeChain chain(g, nullptr);
  for (const BlockRead& b : got->blocks) {
    out.emplace_back(g.num_bytes());
    absl::Status s =
        store->ReadAndDecodeBlock(ns, d.model_id, b, &chain, absl::MakeSpan(out.back()));
    EXPECT_TRUE(s.ok()) << ns << " block " << out.size() - 1 << ": " << s;
  }
  return out;
}

// As ReadBackBitExact, and every read must succeed.
inline size_t ExpectBitExact(KvStore* store, const std::string& ns, const KvDump& d) {
  absl::Status error;
  const size_t n = ReadBackBitExact(store, ns, d, &error);
  EXPECT_TRUE(error.ok()) << error;
  return n;
}

}  // namespace kvtrie::testing_store

#endif  // KVTRIE_TRIE_STORE_TESTING_H_
