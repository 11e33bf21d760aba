#include "trie/kv_store.h"

#include <rocksdb/db.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/kv_store_testing.h"
#include "trie/record_store.h"

namespace kvtrie {
namespace {

class KvStoreTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(testing::TempDir()) /
           ("kv_store_test_" + std::to_string(::getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    Reopen();
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Reopen(StoreOptions options = {}) {
    store_.reset();
    options.data_dir = dir_.string();
    auto s = KvStore::Open(options);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }

  static KvDump Load(const std::string& name) {
    auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
    EXPECT_TRUE(d.ok()) << d.status();
    return *d;
  }
  static ModelInfo Model(const KvDump& d) {
    return {d.model_id, {d.num_layers, d.num_kv_heads, 16, d.head_dim, d.dtype}};
  }

  // Puts every full block of `d`, each split into two layer-range messages.
  absl::StatusOr<PutSummary> Put(const KvDump& d, Encoding enc = Encoding::kLossless,
                                 size_t send_blocks = SIZE_MAX) {
    ModelInfo m = Model(d);
    auto session = store_->BeginPut("ns", m, d.token_ids, d.surprisal_bits, {.encoding = enc});
    if (!session.ok()) return session.status();
    std::vector<uint8_t> block(m.geometry.num_bytes());
    const size_t blocks = std::min(d.num_tokens() / 16, send_blocks);
    const size_t half = m.geometry.layer_range_bytes(0, 2);
    for (size_t b = 0; b < blocks; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      auto s = (*session)->AddLayers(b, 2, 0, absl::MakeSpan(block).subspan(half));
      if (!s.ok()) return s;
      s = (*session)->AddLayers(b, 0, 2, absl::MakeSpan(block).subspan(0, half));
      if (!s.ok()) return s;
    }
    return (*session)->Finish();
  }

  // Reads back the longest stored prefix of `d` and checks it is bit-identical.
  void ExpectBitExact(const KvDump& d, size_t want_blocks) {
    ModelInfo m = Model(d);
    auto got = store_->Get("ns", m.model_id, d.token_ids, 0);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->blocks.size(), want_blocks);
    std::vector<uint8_t> want(m.geometry.num_bytes()), have(m.geometry.num_bytes());
    DecodeChain chain(m.geometry, nullptr);
    for (size_t b = 0; b < want_blocks; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(want));
      ASSERT_TRUE(
          store_->ReadAndDecodeBlock("ns", m.model_id, got->blocks[b], &chain, absl::MakeSpan(have))
              .ok());
      ASSERT_EQ(have, want) << "block " << b;
    }
  }

  std::filesystem::path dir_;
  std::unique_ptr<KvStore> store_;
};

TEST_F(KvStoreTest, SharedPrefixIsStoredOnceAndEverySessionReadsBackBitExact) {
  std::vector<KvDump> sessions;
  for (int i = 0; i < 4; ++i) sessions.push_back(Load("sessions/s" + std::to_string(i)));
  for (auto& s : sessions) ASSERT_TRUE(Put(s).ok());
  // 369 shared tokens = 23 full shared blocks; each session has 32 blocks.
  const StoreStats st = store_->Stats("");
  EXPECT_EQ(st.nodes, 23u + 4 * 9);
  EXPECT_EQ(st.blocks_deduplicated, 3u * 23);
  for (auto& s : sessions) ExpectBitExact(s, 32);
}

TEST_F(KvStoreTest, PutOfAStoredPrefixStoresNothingNew) {
  KvDump d = Load("sessions/s0");
  ASSERT_TRUE(Put(d).ok());
  const uint64_t bytes = store_->Stats("").bytes_stored;
  auto again = Put(d);
  ASSERT_TRUE(again.ok());
  for (const BlockReport& r : again->blocks) EXPECT_EQ(r.outcome, BlockOutcome::kDeduplicated);
  EXPECT_EQ(store_->Stats("").bytes_stored, bytes);
  EXPECT_EQ(again->stored_tokens, 512u);
}

TEST_F(KvStoreTest, RestartServesEverythingAcknowledged) {
  KvDump a = Load("sessions/s1"), b = Load("GPL-3");
  ASSERT_TRUE(Put(a, Encoding::kLossless).ok());
  ASSERT_TRUE(Put(b, Encoding::kRaw).ok());
  Reopen();
  EXPECT_EQ(store_->recovery().nodes, 64u);
  ExpectBitExact(a, 32);
  ExpectBitExact(b, 32);
}

TEST_F(KvStoreTest, TruncatedPutStoresNothing) {
  KvDump d = Load("story_prompt");
  ModelInfo m = Model(d);
  auto session = store_->BeginPut("ns", m, d.token_ids, d.surprisal_bits, {});
  ASSERT_TRUE(session.ok());
  std::vector<uint8_t> block(m.geometry.num_bytes());
  GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), 0, absl::MakeSpan(block));
  ASSERT_TRUE((*session)->AddLayers(0, 0, 0, block).ok());
  ASSERT_TRUE(
      (*session)
          ->AddLayers(1, 0, 3, absl::MakeSpan(block).subspan(0, m.geometry.layer_range_bytes(0, 3)))
          .ok());
  auto r = (*session)->Finish();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kv: block 1 is missing layers [3, 5)"), std::string::npos)
      << r.status();
  EXPECT_EQ(store_->Stats("").nodes, 0u);
}

TEST_F(KvStoreTest, MissingBlocksAreRejectedNamingKv) {
  KvDump d = Load("story_prompt");  // 284 tokens = 17 full blocks + 12 tail tokens
  auto r = Put(d, Encoding::kLossless, /*send_blocks=*/10);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kv: blocks [10, 17)"), std::string::npos) << r.status();
  auto ok = Put(d);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->tail_tokens_ignored, 12u);
  EXPECT_EQ(ok->stored_tokens, 272u);
}

TEST_F(KvStoreTest, AModelKeepsItsGeometry) {
  KvDump d = Load("sessions/s0");
  ASSERT_TRUE(Put(d).ok());
  ModelInfo m = Model(d);
  m.geometry.head_dim = 16;
  auto s = store_->BeginPut("ns", m, d.token_ids, {}, {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("model.head_dim"), std::string::npos) << s.status();
  // Another namespace is another world: the same model_id may have another geometry there.
  EXPECT_TRUE(store_->BeginPut("other", m, d.token_ids, {}, {}).ok());
}

TEST_F(KvStoreTest, NamespacesShareNothing) {
  KvDump d = Load("sessions/s0");
  ASSERT_TRUE(Put(d).ok());
  EXPECT_EQ(store_->Lookup("other", d.model_id, d.token_ids).node_ids.size(), 0u);
  EXPECT_EQ(store_->Stats("other").nodes, 0u);
  EXPECT_EQ(store_->Stats("ns").nodes, 32u);
}

TEST_F(KvStoreTest, CorruptPayloadIsDataLossAndDroppedAtRecovery) {
  KvDump a = Load("sessions/s0"), b = Load("GPL-3");
  ASSERT_TRUE(Put(a).ok());
  ASSERT_TRUE(Put(b).ok());
  const uint64_t victim = store_->Lookup("ns", a.model_id, a.token_ids).node_ids[30];
  store_.reset();
  {  // Flip a byte of one stored payload behind the store's back.
    rocksdb::DB* db;
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {"default", {}},  {"models", {}},          {"nodes", {}},
        {"payloads", {}}, {"predictor_index", {}}, {"predictors", {}}};
    ASSERT_TRUE(rocksdb::DB::Open({}, dir_.string(), cfs, &h, &db).ok());
    const std::string key = NodeKey(/*shard_id=*/1, victim);  // the first model of the store
    std::string v;
    ASSERT_TRUE(db->Get({}, h[3], key, &v).ok());
    v[v.size() / 2] ^= 0x10;
    ASSERT_TRUE(db->Put({}, h[3], key, v).ok());
    for (auto* x : h) db->DestroyColumnFamilyHandle(x);
    delete db;
  }
  Reopen({.verify_payloads_on_open = true});  // by default payloads are checked when read
  EXPECT_EQ(store_->recovery().dropped_bad_payload, 1u);
  EXPECT_EQ(store_->recovery().dropped_missing_parent, 1u);  // its child, block 31
  ExpectBitExact(a, 30);
  ExpectBitExact(b, 32);
}

TEST_F(KvStoreTest, DeleteRemovesASubtreeAndKeepsSiblings) {
  KvDump s0 = Load("sessions/s0"), s1 = Load("sessions/s1");
  ASSERT_TRUE(Put(s0).ok());
  ASSERT_TRUE(Put(s1).ok());
  auto del = store_->Delete("ns", s0.model_id, absl::MakeSpan(s0.token_ids).subspan(0, 30 * 16));
  ASSERT_TRUE(del.ok()) << del.status();
  EXPECT_EQ(del->nodes_deleted, 3u);  // blocks 29, 30, 31 of s0 (block 29 is past the shared 23)
  ExpectBitExact(s1, 32);
  ExpectBitExact(s0, 29);
  EXPECT_EQ(store_->Delete("ns", s0.model_id, absl::MakeSpan(s0.token_ids).subspan(0, 32 * 16))
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  Reopen();
  ExpectBitExact(s0, 29);
}

TEST_F(KvStoreTest, ConcurrentPutsOfOnePrefixStoreItOnce) {
  KvDump d = Load("genesis_1-3");
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] { ok += Put(d).ok(); });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 4);
  EXPECT_EQ(store_->Stats("").nodes, 32u);
  ExpectBitExact(d, 32);
}

}  // namespace
}  // namespace kvtrie

namespace kvtrie {
namespace {

TEST_F(KvStoreTest, UnfinishedPutsTogetherStayUnderTheirByteBudget) {
  KvDump d = Load("GPL-3");
  ModelInfo m = Model(d);
  StoreOptions options;
  options.max_inflight_put_bytes = 3 * m.geometry.num_bytes();
  Reopen(options);
  std::vector<uint8_t> block(m.geometry.num_bytes());
  GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), 0, absl::MakeSpan(block));
  auto a = store_->BeginPut("ns", m, d.token_ids, {}, {});
  auto b = store_->BeginPut("ns", m, d.token_ids, {}, {});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->AddLayers(0, 0, 0, block).ok());
  ASSERT_TRUE((*a)->AddLayers(1, 0, 0, block).ok());
  ASSERT_TRUE((*b)->AddLayers(0, 0, 0, block).ok());
  absl::Status s = (*b)->AddLayers(1, 0, 0, block);  // the fourth block over a budget of three
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("max_inflight_put_bytes"), std::string::npos) << s;
  a->reset();  // a finished (here: abandoned) Put gives its bytes back
  b->reset();
  auto c = store_->BeginPut("ns", m, d.token_ids, {}, {});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->AddLayers(0, 0, 0, block).ok());
  EXPECT_TRUE((*c)->AddLayers(1, 0, 0, block).ok());
}

// Issue 12 item 3: node ids and counters of one namespace tell nothing about another.
TEST_F(KvStoreTest, NodeIdsAreNumberedPerNamespace) {
  KvDump d = Load("sessions/s0");
  ASSERT_TRUE(Put(d).ok());
  const std::vector<uint64_t> ns_ids = store_->Lookup("ns", d.model_id, d.token_ids).node_ids;
  ModelInfo m = Model(d);
  auto session = store_->BeginPut("b", m, d.token_ids, d.surprisal_bits, {});
  ASSERT_TRUE(session.ok());
  std::vector<uint8_t> block(m.geometry.num_bytes());
  for (size_t b = 0; b < d.num_tokens() / 16; ++b) {
    GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
    ASSERT_TRUE((*session)->AddLayers(b, 0, 0, block).ok());
  }
  auto put = (*session)->Finish();
  ASSERT_TRUE(put.ok()) << put.status();
  // The same ids as a store that never saw "ns": 1, 2, ... (not 33, 34, ...).
  EXPECT_EQ(store_->Lookup("b", d.model_id, d.token_ids).node_ids, ns_ids);
  EXPECT_EQ(put->blocks.front().node_id, 1u);
}

TEST_F(KvStoreTest, StatsOfANamespaceCountOnlyItsOwnCalls) {
  KvDump d = Load("sessions/s0");
  ASSERT_TRUE(Put(d).ok());
  ASSERT_TRUE(Put(d).ok());  // deduplicated
  for (int i = 0; i < 5; ++i) store_->Lookup("ns", d.model_id, d.token_ids);
  ASSERT_TRUE(store_->Get("ns", d.model_id, d.token_ids, 0).ok());
  auto session = store_->BeginPut(
      "b", Model(d), std::vector<uint32_t>(d.token_ids.begin(), d.token_ids.begin() + 16), {}, {});
  ASSERT_TRUE(session.ok());
  std::vector<uint8_t> block(Model(d).geometry.num_bytes());
  GatherBlock(Model(d).geometry, d.num_tokens(), d.k.data(), d.v.data(), 0, absl::MakeSpan(block));
  ASSERT_TRUE((*session)->AddLayers(0, 0, 0, block).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  store_->Lookup("b", d.model_id, d.token_ids);
  const StoreStats b = store_->Stats("b");
  EXPECT_EQ(b.puts, 1u);
  EXPECT_EQ(b.blocks_stored, 1u);
  EXPECT_EQ(b.blocks_deduplicated, 0u);
  EXPECT_EQ(b.lookups, 1u);
  EXPECT_EQ(b.lookup_hits, 1u);
  EXPECT_EQ(b.gets, 0u);
  EXPECT_EQ(b.nodes, 1u);
  const StoreStats a = store_->Stats("ns");
  EXPECT_EQ(a.puts, 2u);
  EXPECT_EQ(a.blocks_deduplicated, 32u);
  EXPECT_EQ(a.gets, 1u);
  EXPECT_EQ(store_->Stats("").puts, 3u);  // the server sees all
}

}  // namespace
}  // namespace kvtrie
