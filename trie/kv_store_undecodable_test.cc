// Issue 30 rows 1 and 3 at the store: a client-encoded block that passes its checksum but does
// not decode (a mutant of a real fast LOSSLESS envelope with its CRC-32C recomputed, accepted by
// --verify_encoded_puts=structure) is DATA_LOSS naming the node and dropped with its subtree when
// read; a Put that would deduplicate onto it decodes it first and stores its own block instead
// (also after a restart); a client-reported rel RMS error above 4 is refused naming the field,
// and no stored error can make Stats read inf or nan.
#include <rocksdb/db.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "codec/testing_mutants.h"
#include "gtest/gtest.h"
#include "trie/block_reader.h"
#include "trie/kv_store.h"
#include "trie/record_store.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::DumpModel;
using testing_store::FreshTestDir;

constexpr uint32_t kBlocks = 5;  // the Put: the first 5 blocks of GPL-3
constexpr uint32_t kBad = 2;     // the mutant's block

class UndecodableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("undecodable");
    Reopen();
    auto d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/GPL-3");
    ASSERT_TRUE(d.ok()) << d.status();
    dump_ = *std::move(d);
    model_ = DumpModel(dump_);
    tokens_.assign(dump_.token_ids.begin(), dump_.token_ids.begin() + kBlocks * 16);
    surprisal_.assign(dump_.surprisal_bits.begin(), dump_.surprisal_bits.begin() + kBlocks * 16);
    for (uint32_t b = 0; b < kBlocks; ++b) {
      encoded_.push_back(EncodeFast(b));
      ASSERT_FALSE(encoded_.back().empty());
    }
    std::vector<std::string> mutants = UndecodableLosslessMutants(model_.geometry, encoded_[kBad]);
    ASSERT_EQ(mutants.size(), 1u) << "no undecodable mutant of block " << kBad;
    mutant_ = mutants[0];
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Reopen() {
    store_.reset();
    StoreOptions options;  // verify_encoded_puts = structure, the default
    options.data_dir = dir_.string();
    auto s = KvStore::Open(options);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  std::vector<uint8_t> Dense(uint32_t b) const {
    std::vector<uint8_t> block(model_.geometry.num_bytes());
    GatherBlock(model_.geometry, dump_.num_tokens(), dump_.k.data(), dump_.v.data(), b,
                absl::MakeSpan(block));
    return block;
  }
  std::string EncodeFast(uint32_t b) const {
    EncodeOptions o{.encoding = Encoding::kLossless};
    o.profile = Profile::kFast;
    absl::StatusOr<EncodedBlock> e = EncodeBlock(model_.geometry, Dense(b), o, {});
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? e->bytes : std::string();
  }
  // The first kBlocks blocks sent encoded (block kBad as `bad`, all reporting `error`).
  absl::StatusOr<PutSummary> PutEncoded(const std::string& bad,
                                        PutSession::ClientError error = {}) {
    EncodeOptions o{.encoding = Encoding::kLossless};
    o.profile = Profile::kFast;
    auto session = store_->BeginPut("ns", model_, tokens_, surprisal_, o);
    if (!session.ok()) return session.status();
    for (uint32_t b = 0; b < kBlocks; ++b) {
      if (auto s = (*session)->AddEncodedBlock(b, b == kBad ? bad : encoded_[b], error); !s.ok())
        return s;
    }
    return (*session)->Finish();
  }
  // The first kBlocks blocks sent dense (the store encodes them LOSSLESS).
  absl::StatusOr<PutSummary> PutDense() {
    auto session = store_->BeginPut("ns", model_, tokens_, surprisal_, {});
    if (!session.ok()) return session.status();
    for (uint32_t b = 0; b < kBlocks; ++b) {
      std::vector<uint8_t> block = Dense(b);
      if (auto s = (*session)->AddLayers(b, 0, 0, block); !s.ok()) return s;
    }
    return (*session)->Finish();
  }
  // A RECONSTRUCTED Get through the store's read path: the blocks read before the first error
  // (*error: it, or OK), each checked bit-exact.
  size_t ReadBack(absl::Status* error) {
    auto reader = store_->NewReader("ns", model_.model_id, tokens_, 0,
                                    BlockReader::Mode::kReconstructed, nullptr);
    if (!reader.ok()) {
      *error = reader.status();
      return 0;
    }
    size_t n = 0;
    for (;;) {
      BlockReader::Block block;
      bool end = false;
      *error = (*reader)->Next(&block, &end);
      if (!error->ok() || end) return n;
      const std::vector<uint8_t> want = Dense(static_cast<uint32_t>(block.index));
      EXPECT_TRUE(block.bytes ==
                  absl::string_view(reinterpret_cast<const char*>(want.data()), want.size()))
          << "block " << block.index;
      ++n;
    }
  }
  size_t Stored() { return store_->Lookup("ns", model_.model_id, tokens_).node_ids.size(); }

  std::filesystem::path dir_;
  std::unique_ptr<KvStore> store_;
  KvDump dump_;
  ModelInfo model_;
  std::vector<uint32_t> tokens_;
  std::vector<float> surprisal_;
  std::vector<std::string> encoded_;
  std::string mutant_;
};

TEST_F(UndecodableTest, AnUndecodableBlockIsDataLossNamingItAndIsDroppedWithItsSubtree) {
  ASSERT_TRUE(PutEncoded(mutant_).ok());  // structure only: accepted, as on main
  ASSERT_EQ(Stored(), kBlocks);
  const uint64_t bad_id = store_->Lookup("ns", model_.model_id, tokens_).node_ids[kBad];
  absl::Status error;
  EXPECT_EQ(ReadBack(&error), kBad);  // the blocks before it were served
  EXPECT_TRUE(absl::IsDataLoss(error)) << error;
  EXPECT_NE(error.message().find(absl::StrCat("node ", bad_id)), std::string::npos) << error;
  EXPECT_NE(error.message().find("does not decode"), std::string::npos) << error;
  EXPECT_NE(error.message().find("zstd"), std::string::npos) << error;
  // Dropped with its subtree: a Get of the longer prefix now returns the blocks before it.
  EXPECT_EQ(Stored(), kBad);
  EXPECT_EQ(store_->Stats("").evictions_data_loss, kBlocks - kBad);
  EXPECT_EQ(ReadBack(&error), kBad);
  EXPECT_TRUE(error.ok()) << error;
}

TEST_F(UndecodableTest, ACorrectDensePutReplacesAnUndecodableBlockItWouldDeduplicateOnto) {
  ASSERT_TRUE(PutEncoded(mutant_).ok());
  absl::StatusOr<PutSummary> dense = PutDense();
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_EQ(dense->blocks.size(), kBlocks);
  for (const BlockReport& r : dense->blocks) {  // the good blocks before it are deduplicated
    EXPECT_EQ(r.outcome == BlockOutcome::kDeduplicated, r.block_index < kBad)
        << "block " << r.block_index;
  }
  absl::Status error;
  EXPECT_EQ(ReadBack(&error), kBlocks);
  EXPECT_TRUE(error.ok()) << error;
  // A good client-encoded block, checked once, is deduplicated onto as before.
  absl::StatusOr<PutSummary> again = PutEncoded(encoded_[kBad]);
  ASSERT_TRUE(again.ok()) << again.status();
  for (const BlockReport& r : again->blocks) EXPECT_EQ(r.outcome, BlockOutcome::kDeduplicated);
}

TEST_F(UndecodableTest, ACorrectDensePutReplacesItAfterARestart) {
  ASSERT_TRUE(PutEncoded(mutant_).ok());
  Reopen();  // the "not decoded yet" mark is in memory: recovery sets it on client-encoded nodes
  ASSERT_EQ(Stored(), kBlocks);
  absl::StatusOr<PutSummary> dense = PutDense();
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_NE(dense->blocks[kBad].outcome, BlockOutcome::kDeduplicated);
  absl::Status error;
  EXPECT_EQ(ReadBack(&error), kBlocks);
  EXPECT_TRUE(error.ok()) << error;
  Reopen();
  EXPECT_EQ(ReadBack(&error), kBlocks);
  EXPECT_TRUE(error.ok()) << error;
}

TEST_F(UndecodableTest, AnUndecodableBlockStoredBeforeARestartIsDataLossAfterIt) {
  ASSERT_TRUE(PutEncoded(mutant_).ok());
  Reopen();
  absl::Status error;
  EXPECT_EQ(ReadBack(&error), kBad);
  EXPECT_TRUE(absl::IsDataLoss(error)) << error;
  Reopen();  // the drop was written
  EXPECT_EQ(Stored(), kBad);
  EXPECT_EQ(ReadBack(&error), kBad);
  EXPECT_TRUE(error.ok()) << error;
}

TEST_F(UndecodableTest, AClientReportedRelRmsErrorAboveFourNegativeOrNotFiniteIsRefused) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const struct {
    PutSession::ClientError error;
    const char* field;
  } bad[] = {{{1e308, 0, 0}, "rel_rms_error_k"}, {{0, 4.5, 0}, "rel_rms_error_v"},
             {{-0.1, 0, 0}, "rel_rms_error_k"},  {{0, nan, 0}, "rel_rms_error_v"},
             {{inf, 0, 0}, "rel_rms_error_k"},   {{0, 0, inf}, "max_abs_error"}};
  for (const auto& c : bad) {
    absl::StatusOr<PutSummary> r = PutEncoded(encoded_[kBad], c.error);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << c.field << ": " << r.status();
    EXPECT_TRUE(absl::StartsWith(r.status().message(), c.field)) << r.status();
  }
  EXPECT_EQ(Stored(), 0u);
  ASSERT_TRUE(PutEncoded(encoded_[kBad], {4.0, 4.0, 1e300}).ok());  // the bound itself is fine
  const StoreStats s = store_->Stats("");
  EXPECT_EQ(s.max_rel_rms_error, 4.0);
  EXPECT_TRUE(std::isfinite(s.sum_rel_rms_error_k)) << s.sum_rel_rms_error_k;
}

// A node record that holds an absurd error (written before the bound, or by hand): Stats, the
// namespace's and the server's, stay finite and within [0, 4].
TEST_F(UndecodableTest, AnAbsurdStoredErrorCannotMakeStatsReadInfOrNan) {
  ASSERT_TRUE(PutEncoded(encoded_[kBad], {0.5, 0.5, 0}).ok());
  const uint64_t id = store_->Lookup("ns", model_.model_id, tokens_).node_ids[kBad];
  store_.reset();
  {  // rel_rms_error_k / _v (fields 9 and 10, fixed64 doubles) of the record: 0.5 -> 1e308 / nan
    rocksdb::DB* db;
    std::vector<rocksdb::ColumnFamilyHandle*> h;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {"default", {}},  {"models", {}},          {"nodes", {}},
        {"payloads", {}}, {"predictor_index", {}}, {"predictors", {}}};
    ASSERT_TRUE(rocksdb::DB::Open({}, dir_.string(), cfs, &h, &db).ok());
    const std::string key = NodeKey(/*shard_id=*/1, id);
    std::string v;
    ASSERT_TRUE(db->Get({}, h[2], key, &v).ok());
    const double half = 0.5, huge = 1e308, nan = std::numeric_limits<double>::quiet_NaN();
    const struct {
      char tag;
      double to;
    } fields[] = {{0x49, huge}, {0x51, nan}};
    for (const auto& f : fields) {
      std::string from(1, f.tag), to(1, f.tag);
      from.append(reinterpret_cast<const char*>(&half), 8);
      to.append(reinterpret_cast<const char*>(&f.to), 8);
      const size_t at = v.find(from);
      ASSERT_NE(at, std::string::npos) << "field tag " << int{f.tag};
      v.replace(at, from.size(), to);
    }
    ASSERT_TRUE(db->Put({}, h[2], key, v).ok());
    for (auto* x : h) db->DestroyColumnFamilyHandle(x);
    delete db;
  }
  Reopen();
  ASSERT_EQ(Stored(), kBlocks);
  for (const std::string ns : {"", "ns"}) {
    const StoreStats s = store_->Stats(ns);
    EXPECT_EQ(s.lossy_nodes, kBlocks);
    EXPECT_TRUE(std::isfinite(s.sum_rel_rms_error_k)) << s.sum_rel_rms_error_k;
    EXPECT_TRUE(std::isfinite(s.sum_rel_rms_error_v)) << s.sum_rel_rms_error_v;
    EXPECT_LE(s.sum_rel_rms_error_k, 4.0 + 4 * 0.5 + 1e-6);
    EXPECT_EQ(s.max_rel_rms_error, 4.0);
  }
}

}  // namespace
}  // namespace kvtrie
