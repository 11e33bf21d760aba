// PutSession's encoding on arrival (trie/put_session.h): on the codec pool and inline, the same
// stored bytes; an abandoned session stores nothing and gives its bytes back; blocks stored when
// the session began are encoded at Finish only if they went meanwhile; max_put_bytes counts an
// encoded block's dense size.
#include "trie/put_session.h"

#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/kv_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

class PutSessionTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing_store::FreshTestDir("put_session_test"); }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open(int codec_threads, uint64_t max_inflight = 1ull << 30,
            uint64_t max_put = 256ull << 20) {
    store_.reset();
    StoreOptions o;
    o.data_dir = (dir_ / std::to_string(++opened_)).string();
    o.codec_threads = codec_threads;
    o.max_inflight_put_bytes = max_inflight;
    o.max_put_bytes = max_put;
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  // Sends blocks [first, end) of `d` whole (AddBlock) or in two layer ranges (AddLayers).
  absl::Status Send(PutSession* session, const KvDump& d, size_t first, size_t end, bool whole) {
    const ModelInfo m = testing_store::DumpModel(d);
    std::vector<uint8_t> block(m.geometry.num_bytes());
    const size_t half = m.geometry.layer_range_bytes(0, 2);
    for (size_t b = first; b < end; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      if (whole) {
        if (auto s = session->AddBlock(b, std::string(block.begin(), block.end())); !s.ok())
          return s;
      } else {
        if (auto s = session->AddLayers(b, 2, 0, absl::MakeSpan(block).subspan(half)); !s.ok())
          return s;
        if (auto s = session->AddLayers(b, 0, 2, absl::MakeSpan(block).subspan(0, half)); !s.ok())
          return s;
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<PutSummary> Put(const KvDump& d, const EncodeOptions& e, bool whole) {
    auto session = store_->BeginPut("ns", testing_store::DumpModel(d), d.token_ids, {}, e);
    if (!session.ok()) return session.status();
    if (auto s = Send(session->get(), d, 0, d.num_tokens() / 16, whole); !s.ok()) return s;
    return (*session)->Finish();
  }

  std::filesystem::path dir_;
  int opened_ = 0;
  std::unique_ptr<KvStore> store_;
};

TEST_F(PutSessionTest, OnThePoolAndInlineStoreTheSameBytes) {
  std::vector<KvDump> dumps;
  testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3"}, &dumps);
  const KvDump& d = dumps[0];
  const EncodeOptions encodings[] = {
      {.encoding = Encoding::kRaw},
      {.encoding = Encoding::kLossless, .profile = Profile::kFast},
      {.encoding = Encoding::kResidual, .profile = Profile::kFast, .target_rel_rms = 0.05},
  };
  for (const EncodeOptions& e : encodings) {
    std::vector<std::vector<uint64_t>> sizes;
    for (int threads : {0, 2}) {
      for (bool whole : {true, false}) {
        Open(threads);
        absl::StatusOr<PutSummary> r = Put(d, e, whole);
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(r->blocks.size(), d.num_tokens() / 16);
        std::vector<uint64_t> s;
        for (const BlockReport& b : r->blocks) {
          EXPECT_EQ(b.outcome, BlockOutcome::kStored);
          s.push_back(b.bytes_stored);
          if (e.encoding == Encoding::kResidual) {
            EXPECT_LE(b.rel_rms_error_k, 0.05 * 1.001);
            EXPECT_GT(b.rel_rms_error_k, 0);
          }
        }
        sizes.push_back(s);
        if (e.encoding != Encoding::kResidual) {
          EXPECT_EQ(testing_store::ExpectBitExact(store_.get(), "ns", d), d.num_tokens() / 16);
        }
      }
    }
    for (const auto& s : sizes) EXPECT_EQ(s, sizes[0]) << EncodingName(e.encoding);
  }
}

TEST_F(PutSessionTest, AnAbandonedSessionStoresNothingAndGivesItsBytesBack) {
  std::vector<KvDump> dumps;
  testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3"}, &dumps);
  const KvDump& d = dumps[0];
  const size_t blocks = d.num_tokens() / 16;
  const uint64_t block_bytes = testing_store::DumpModel(d).geometry.num_bytes();
  Open(1, blocks * block_bytes);  // room for one Put at a time
  for (int round = 0; round < 3; ++round) {
    auto session = store_->BeginPut("ns", testing_store::DumpModel(d), d.token_ids, {},
                                    {.encoding = Encoding::kRaw});
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE(Send(session->get(), d, 0, blocks, round % 2 == 0).ok());
    // Destroyed with encodes queued or running, before its Finish.
  }
  EXPECT_EQ(testing_store::StoredBlocks(store_.get(), "ns", d), 0u);
  absl::StatusOr<PutSummary> r = Put(d, {.encoding = Encoding::kRaw}, true);
  ASSERT_TRUE(r.ok()) << r.status();  // every abandoned session gave its bytes back
  EXPECT_EQ(testing_store::ExpectBitExact(store_.get(), "ns", d), blocks);
}

TEST_F(PutSessionTest, BlocksStoredAtTheStartAreEncodedOnlyIfTheyWentMeanwhile) {
  std::vector<KvDump> dumps;
  testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3"}, &dumps);
  const KvDump& d = dumps[0];
  const size_t blocks = d.num_tokens() / 16;
  ASSERT_GE(blocks, 4u);
  Open(2);
  KvDump head = d;  // the first block: deleting it deletes the whole prefix
  head.token_ids.resize(16);
  ASSERT_TRUE(Put(d, {.encoding = Encoding::kRaw}, true).ok());
  // Stored at the start and still stored: deduplicated.
  {
    absl::StatusOr<PutSummary> again = Put(d, {.encoding = Encoding::kRaw}, true);
    ASSERT_TRUE(again.ok()) << again.status();
    for (const BlockReport& b : again->blocks) EXPECT_EQ(b.outcome, BlockOutcome::kDeduplicated);
  }
  // Stored at the start, deleted before the Finish: encoded then, from the buffered bytes.
  auto session = store_->BeginPut("ns", testing_store::DumpModel(d), d.token_ids, {},
                                  {.encoding = Encoding::kRaw});
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(Send(session->get(), d, 0, blocks, false).ok());
  ASSERT_TRUE(store_->Delete("ns", d.model_id, head.token_ids).ok());
  EXPECT_EQ(testing_store::StoredBlocks(store_.get(), "ns", d), 0u);
  absl::StatusOr<PutSummary> r = (*session)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  for (const BlockReport& b : r->blocks) EXPECT_EQ(b.outcome, BlockOutcome::kStored);
  EXPECT_EQ(testing_store::ExpectBitExact(store_.get(), "ns", d), blocks);
}

}  // namespace
}  // namespace kvtrie

namespace kvtrie {
namespace {

// Issue 34: max_put_bytes bounds a Put's dense KV. A client-encoded RAW block is its dense bytes
// plus an envelope; a RAW Put of exactly max_put_bytes sent encoded (as kvtrie::Client sends it
// by default) was refused ("buffers more than max_put_bytes") while the same Put sent dense
// passed. One dense block more is still refused, naming the limit.
TEST_F(PutSessionTest, AnEncodedRawPutOfExactlyMaxPutBytesFitsAndOneBlockMoreDoesNot) {
  std::vector<KvDump> dumps;
  testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3"}, &dumps);
  const KvDump& d = dumps[0];
  const ModelInfo m = testing_store::DumpModel(d);
  const size_t blocks = d.num_tokens() / 16;
  ASSERT_GE(blocks, 2u);
  Open(1, 1ull << 30, blocks * m.geometry.num_bytes());
  const EncodeOptions raw{.encoding = Encoding::kRaw};
  auto put_encoded = [&](size_t n) -> absl::Status {
    auto session = store_->BeginPut("ns", m, d.token_ids, {}, raw);
    if (!session.ok()) return session.status();
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (size_t b = 0; b < n; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      absl::StatusOr<EncodedBlock> e = EncodeBlock(m.geometry, block, raw, PredictionContext{});
      if (!e.ok()) return e.status();
      EXPECT_GT(e->bytes.size(), block.size());  // the envelope
      if (auto s = (*session)->AddEncodedBlock(static_cast<uint32_t>(b), std::move(e->bytes), {});
          !s.ok()) {
        return s;
      }
    }
    return (*session)->Finish().status();
  };
  ASSERT_TRUE(put_encoded(blocks).ok());
  EXPECT_EQ(testing_store::ExpectBitExact(store_.get(), "ns", d), blocks);
  // A limit one block smaller: the last block is refused, and the Put stores nothing.
  Open(1, 1ull << 30, (blocks - 1) * m.geometry.num_bytes());
  const absl::Status s = put_encoded(blocks);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("max_put_bytes"), std::string::npos) << s;
  EXPECT_EQ(testing_store::StoredBlocks(store_.get(), "ns", d), 0u);
}

}  // namespace
}  // namespace kvtrie
