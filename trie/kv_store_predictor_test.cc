// Learned predictor states in the store (issue 11; trie/predictor_registry.h), with real RocksDB
// and real KV (tests/data, stories260K): the store learns from committed Puts in the background,
// publishes immutable versions, codes new kResidual blocks against the latest, keeps a version
// while blocks depend on it (across restarts), frees it with its last dependent, never shares one
// across namespaces, and a corrupt persisted state is DATA_LOSS for its dependents only.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "codec/block_geometry.h"
#include "codec/decode_chain.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "gtest/gtest.h"
#include "trie/blob_corruption_testing.h"
#include "trie/kv_store.h"
#include "trie/kv_store_testing.h"
#include "trie/predictor_registry.h"
#include "trie/store_testing.h"

namespace kvtrie {
namespace {

using testing_store::DumpModel;
using testing_store::FreshTestDir;

constexpr double kTarget = 0.05;  // rel RMS error of each (layer, K/V) plane

class PredictorStoreTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDir("predictor_store_test");
    std::vector<KvDump> dumps;
    testing_store::LoadTestDumps(std::vector<const char*>{"GPL-3", "genesis_1-3", "story_prompt"},
                                 &dumps);
    ASSERT_EQ(dumps.size(), 3u);
    gpl_ = dumps[0];
    genesis_ = dumps[1];
    story_ = dumps[2];
    Reopen();
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  // Learning on, a refit after every 512 tokens (one dump), no background tier thread.
  void Reopen(uint64_t queue_bytes = 64ull << 20, bool cross_layer = true) {
    store_.reset();
    StoreOptions o;
    o.data_dir = dir_.string();
    o.background = false;
    o.predictors.learn = true;
    o.predictors.cross_layer = cross_layer;  // on: linear weights and KLT bases are stored too
    o.predictors.refit_every_tokens = 512;
    o.predictors.queue_bytes = queue_bytes;
    o.predictors.resident_versions = 0;  // only the latest in memory: older ones are read back
    auto s = KvStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  // Puts every full block of `d` as kResidual at kTarget, and waits until it was learned from.
  void Put(const std::string& ns, const KvDump& d, Profile profile = Profile::kCompact) {
    const ModelInfo m = DumpModel(d);
    auto session = store_->BeginPut(
        ns, m, d.token_ids, d.surprisal_bits,
        {.encoding = Encoding::kResidual, .profile = profile, .target_rel_rms = kTarget});
    ASSERT_TRUE(session.ok()) << session.status();
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (size_t b = 0; b < d.num_tokens() / 16; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      ASSERT_TRUE((*session)->AddLayers(b, 0, 0, block).ok());
    }
    auto summary = (*session)->Finish();
    ASSERT_TRUE(summary.ok()) << summary.status();
    KvStoreTestPeer::DrainLearning(store_.get());
  }
  // Puts every full block of `d` encoded here, as a worker does (PutSession::AddEncodedBlock), in
  // `encoding` of the fast profile at kTarget, against `learned` (null: none); waits until it
  // was learned from. Returns the versions the blocks name.
  std::vector<uint32_t> PutEncoded(const std::string& ns, const KvDump& d, Encoding encoding,
                                   const PredictorState* learned = nullptr) {
    const ModelInfo m = DumpModel(d);
    const EncodeOptions eo{
        .encoding = encoding, .profile = Profile::kFast, .target_rel_rms = kTarget};
    auto session = store_->BeginPut(ns, m, d.token_ids, d.surprisal_bits, eo);
    EXPECT_TRUE(session.ok()) << session.status();
    std::vector<uint32_t> versions;
    if (!session.ok()) return versions;
    const uint32_t bt = m.geometry.block_tokens;
    std::vector<uint8_t> block(m.geometry.num_bytes());
    for (size_t b = 0; b < d.num_tokens() / bt; ++b) {
      GatherBlock(m.geometry, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      const size_t off = b * bt;
      const std::vector<int32_t> tokens(d.token_ids.begin() + off, d.token_ids.begin() + off + bt);
      PredictionContext ctx;
      ctx.learned = learned;
      ctx.tokens = tokens;
      ctx.first_position = static_cast<uint32_t>(off);
      ctx.previous_token = off == 0 ? -1 : static_cast<int32_t>(d.token_ids[off - 1]);
      absl::StatusOr<EncodedBlock> e = EncodeBlock(m.geometry, block, eo, ctx);
      EXPECT_TRUE(e.ok()) << e.status();
      if (!e.ok()) return versions;
      versions.push_back(e->predictor_version);
      absl::Status s =
          (*session)->AddEncodedBlock(static_cast<uint32_t>(b), std::move(e->bytes),
                                      {e->rel_rms_error_k, e->rel_rms_error_v, e->max_abs_error});
      EXPECT_TRUE(s.ok()) << s;
    }
    auto summary = (*session)->Finish();
    EXPECT_TRUE(summary.ok()) << summary.status();
    KvStoreTestPeer::DrainLearning(store_.get());
    return versions;
  }
  // Every stored block of `d` in `ns`, decoded by the store, in order. *error: the first error.
  std::vector<std::vector<uint8_t>> Read(const std::string& ns, const KvDump& d,
                                         absl::Status* error = nullptr) {
    const ModelInfo m = DumpModel(d);
    std::vector<std::vector<uint8_t>> out;
    auto got = store_->Get(ns, m.model_id, d.token_ids, 0);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return out;
    DecodeChain chain(m.geometry, nullptr);
    for (const BlockRead& b : got->blocks) {
      std::vector<uint8_t> block(m.geometry.num_bytes());
      absl::Status s = store_->ReadAndDecodeBlock(ns, m.model_id, b, &chain, absl::MakeSpan(block));
      if (!s.ok()) {
        if (error != nullptr) *error = s;
        return out;
      }
      out.push_back(std::move(block));
    }
    if (error != nullptr) *error = absl::OkStatus();
    return out;
  }
  // The worst relative RMS error of any (layer, K/V) plane of `blocks` against `d`.
  static double WorstPlaneError(const KvDump& d, const std::vector<std::vector<uint8_t>>& blocks) {
    const BlockGeometry g = DumpModel(d).geometry;
    const size_t plane = static_cast<size_t>(g.num_kv_heads) * g.block_tokens * g.head_dim;
    std::vector<uint8_t> want(g.num_bytes());
    std::vector<float> x(plane), y(plane);
    double worst = 0;
    for (size_t b = 0; b < blocks.size(); ++b) {
      GatherBlock(g, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(want));
      for (size_t p = 0; p < 2 * g.num_layers; ++p) {
        ToFloat(g.dtype, blocks[b].data() + p * plane * 2, plane, x.data());
        ToFloat(g.dtype, want.data() + p * plane * 2, plane, y.data());
        double err = 0, energy = 0;
        for (size_t i = 0; i < plane; ++i) {
          err += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
          energy += double(y[i]) * y[i];
        }
        if (energy > 0) worst = std::max(worst, std::sqrt(err / energy));
      }
    }
    return worst;
  }
  std::vector<PredictorVersionView> Versions(const std::string& ns) {
    auto v = store_->PredictorVersions(ns, gpl_.model_id);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::vector<PredictorVersionView>{};
  }
  // The first two versions published: GPL-3 then Genesis learned from; Genesis is coded against
  // version 1 and version 2 is the latest.
  void LearnTwoVersions() {
    Put("ns", gpl_);
    std::vector<PredictorVersionView> v = Versions("ns");
    ASSERT_EQ(v.size(), 1u);
    EXPECT_EQ(v[0].version, 1u);
    EXPECT_TRUE(v[0].latest);
    EXPECT_EQ(v[0].dependents, 0u);  // GPL-3 was coded before it existed
    EXPECT_EQ(v[0].tokens_learned, 512u);
    EXPECT_GT(v[0].state_bytes, 0u);
    Put("ns", genesis_);
    v = Versions("ns");
    ASSERT_EQ(v.size(), 2u);
    EXPECT_EQ(v[0].version, 1u);
    EXPECT_GT(v[0].dependents, 0u) << "no Genesis block was coded against version 1";
    EXPECT_FALSE(v[0].latest);
    EXPECT_EQ(v[1].version, 2u);
    EXPECT_TRUE(v[1].latest);
    EXPECT_EQ(v[1].tokens_learned, 1024u);
    EXPECT_EQ(v[0].memory_bytes, 0u);  // resident_versions = 0: read back when needed
    EXPECT_GT(v[1].memory_bytes, 0u);  // the latest stays in memory
  }

  std::filesystem::path dir_;
  std::unique_ptr<KvStore> store_;
  KvDump gpl_, genesis_, story_;
};

TEST_F(PredictorStoreTest, VersionNDecodesBitIdenticallyAfterNPlusOneAndARestart) {
  ASSERT_NO_FATAL_FAILURE(LearnTwoVersions());
  const std::vector<std::vector<uint8_t>> genesis = Read("ns", genesis_);
  ASSERT_EQ(genesis.size(), 32u);
  EXPECT_LE(WorstPlaneError(genesis_, genesis), kTarget * 1.001);
  Put("ns", story_);  // coded against version 2
  const std::vector<PredictorVersionView> v = Versions("ns");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_GT(v[1].dependents, 0u);
  const std::vector<std::vector<uint8_t>> story = Read("ns", story_);
  ASSERT_EQ(story.size(), 17u);
  EXPECT_LE(WorstPlaneError(story_, story), kTarget * 1.001);
  EXPECT_EQ(Read("ns", genesis_), genesis);  // version 1 still decodes them, bit-identical
  const StoreStats stats = store_->Stats("ns");
  EXPECT_EQ(stats.predictor_versions, 2u);
  EXPECT_EQ(stats.predictor_fits, 2u);
  EXPECT_EQ(stats.blocks_on_learned, v[0].dependents + v[1].dependents);
  EXPECT_EQ(stats.predictor_state_bytes, v[0].state_bytes + v[1].state_bytes);

  Reopen();
  EXPECT_EQ(store_->recovery().predictor_versions, 2u);
  EXPECT_EQ(store_->recovery().predictor_versions_unreadable, 0u);
  const std::vector<PredictorVersionView> after = Versions("ns");
  ASSERT_EQ(after.size(), 2u);
  EXPECT_EQ(after[0].dependents, v[0].dependents);  // rebuilt from the node records
  EXPECT_EQ(after[1].dependents, v[1].dependents);
  EXPECT_TRUE(after[1].latest);
  EXPECT_EQ(Read("ns", genesis_), genesis);
  EXPECT_EQ(Read("ns", story_), story);
}

// The same with the FAST profile, whose blocks also use the states' cross-layer linear weights
// (Predictor::kTokenMeanLinear): a version with weights still decodes its blocks bit-identically
// after the next one is published and after a restart, and Stats / Inspect count what it saved.
TEST_F(PredictorStoreTest, LinearWeightsVersionDecodesAfterTheNextAndARestart) {
  Put("ns", gpl_, Profile::kFast);
  Put("ns", genesis_, Profile::kFast);  // coded against version 1
  std::vector<PredictorVersionView> v = Versions("ns");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_NE(v[0].description.find("linear"), std::string::npos) << v[0].description;
  EXPECT_GT(v[0].dependents, 0u);
  EXPECT_GT(v[0].bytes_saved, 0u);
  const std::vector<std::vector<uint8_t>> genesis = Read("ns", genesis_);
  ASSERT_EQ(genesis.size(), 32u);
  EXPECT_LE(WorstPlaneError(genesis_, genesis), kTarget * 1.001);
  Put("ns", story_, Profile::kFast);  // coded against version 2
  v = Versions("ns");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_GT(v[1].dependents, 0u);
  const std::vector<std::vector<uint8_t>> story = Read("ns", story_);
  EXPECT_LE(WorstPlaneError(story_, story), kTarget * 1.001);
  EXPECT_EQ(Read("ns", genesis_), genesis);  // version 1 still decodes them, bit-identical
  const StoreStats stats = store_->Stats("ns");
  EXPECT_NEAR(static_cast<double>(stats.predictor_bytes_saved),
              static_cast<double>(v[0].bytes_saved + v[1].bytes_saved), 2.0);
  Reopen();
  EXPECT_EQ(Read("ns", genesis_), genesis);
  EXPECT_EQ(Read("ns", story_), story);
}

// The nice value of this process's thread named `name` (/proc/self/task/*/stat field 19), or -100.
int NiceOfThread(const std::string& name) {
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string got;
    std::getline(comm, got);
    if (got != name) continue;
    std::ifstream stat_file(task.path() / "stat");
    std::stringstream all;
    all << stat_file.rdbuf();
    const std::string stat = all.str();
    std::istringstream fields(stat.substr(stat.rfind(')') + 2));  // from field 3 (the state)
    std::string field;
    for (int i = 3; i <= 19 && fields >> field; ++i) {
      if (i == 19) return std::stoi(field);
    }
  }
  return -100;
}

TEST_F(PredictorStoreTest, CrossLayerPartsOnlyWhenAskedAndTheLearnerYieldsTheCpu) {
  Reopen(64ull << 20, /*cross_layer=*/false);
  Put("ns", gpl_, Profile::kFast);
  const std::vector<PredictorVersionView> v = Versions("ns");
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].description.find("linear"), std::string::npos) << v[0].description;
  EXPECT_EQ(NiceOfThread("kvtrie-learn"), kLearnerNice);
}

TEST_F(PredictorStoreTest, AVersionIsKeptWhileBlocksDependOnItAndFreedWithTheLast) {
  ASSERT_NO_FATAL_FAILURE(LearnTwoVersions());
  auto v1 = store_->GetPredictor("ns", gpl_.model_id, 1);
  ASSERT_TRUE(v1.ok()) << v1.status();
  // Deleting GPL-3 (no block of it depends on a version) frees nothing.
  ASSERT_TRUE(
      store_->Delete("ns", gpl_.model_id, absl::MakeConstSpan(gpl_.token_ids).first(16)).ok());
  EXPECT_EQ(Versions("ns").size(), 2u);
  // Genesis holds every dependent of version 1: deleting it frees version 1 (not the latest).
  auto deleted =
      store_->Delete("ns", genesis_.model_id, absl::MakeConstSpan(genesis_.token_ids).first(16));
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  std::vector<PredictorVersionView> v = Versions("ns");
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].version, 2u);
  EXPECT_TRUE(v[0].latest);
  EXPECT_EQ(store_->Stats("ns").predictor_versions_freed, 1u);
  auto gone = store_->GetPredictor("ns", gpl_.model_id, 1);
  EXPECT_TRUE(absl::IsNotFound(gone.status())) << gone.status();
  EXPECT_NE(gone.status().message().find("version"), std::string::npos) << gone.status();
  Reopen();  // freed on disk too
  v = Versions("ns");
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].version, 2u);
  EXPECT_EQ(store_->recovery().predictor_versions, 1u);
}

TEST_F(PredictorStoreTest, ANamespaceNeverUsesOrSeesAnothersState) {
  Put("a", gpl_);
  ASSERT_EQ(Versions("a").size(), 1u);
  Put("b", genesis_);  // b has no state yet: nothing is coded against a's
  EXPECT_EQ(store_->Stats("b").blocks_on_learned, 0u);
  std::vector<PredictorVersionView> b = Versions("b");
  ASSERT_EQ(b.size(), 1u);  // b's own, learned from b's blocks only
  EXPECT_EQ(b[0].tokens_learned, 512u);
  auto a1 = store_->GetPredictor("a", gpl_.model_id, 1);
  auto b1 = store_->GetPredictor("b", gpl_.model_id, 1);
  ASSERT_TRUE(a1.ok() && b1.ok());
  EXPECT_NE(*a1, *b1);
  auto c1 = store_->GetPredictor("c", gpl_.model_id, 1);
  EXPECT_TRUE(absl::IsNotFound(c1.status())) << c1.status();
  EXPECT_NE(c1.status().message().find("model_id"), std::string::npos) << c1.status();
  auto zero = store_->GetPredictor("a", gpl_.model_id, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(zero.status())) << zero.status();
  EXPECT_EQ(store_->Stats("a").blocks_on_learned, 0u);
}

TEST_F(PredictorStoreTest, ACorruptStateIsDataLossForItsDependentsOnly) {
  ASSERT_NO_FATAL_FAILURE(LearnTwoVersions());
  Put("ns", story_);  // coded against version 2
  const std::vector<std::vector<uint8_t>> gpl = Read("ns", gpl_);
  const std::vector<std::vector<uint8_t>> story = Read("ns", story_);
  auto v1 = store_->GetPredictor("ns", gpl_.model_id, 1);
  ASSERT_TRUE(v1.ok()) << v1.status();
  store_.reset();  // flushed: the states are in blob files
  ASSERT_EQ(FlipByteInBlobFiles(dir_, *v1), 1);
  Reopen();
  EXPECT_EQ(store_->recovery().predictor_versions, 2u);
  EXPECT_EQ(store_->recovery().predictor_versions_unreadable, 1u);
  const std::vector<PredictorVersionView> v = Versions("ns");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_FALSE(v[0].error.empty());
  EXPECT_TRUE(v[1].error.empty());
  auto fetch = store_->GetPredictor("ns", gpl_.model_id, 1);
  EXPECT_TRUE(absl::IsDataLoss(fetch.status())) << fetch.status();
  EXPECT_TRUE(store_->GetPredictor("ns", gpl_.model_id, 2).ok());
  // Everything not coded against version 1 still serves, bit-identical.
  EXPECT_EQ(Read("ns", gpl_), gpl);
  EXPECT_EQ(Read("ns", story_), story);
  absl::Status error;
  const size_t readable = Read("ns", genesis_, &error).size();
  EXPECT_TRUE(absl::IsDataLoss(error)) << error;
  EXPECT_LT(readable, 32u);
  // Its dependents fail but are kept (only bytes that fail their own check are dropped).
  EXPECT_EQ(store_->Lookup("ns", genesis_.model_id, genesis_.token_ids).node_ids.size(), 32u);
  EXPECT_EQ(Read("ns", genesis_, &error).size(), readable);
  EXPECT_TRUE(absl::IsDataLoss(error)) << error;
  EXPECT_EQ(Read("ns", story_), story);
}

TEST_F(PredictorStoreTest, AFullLearningQueueDropsBlocksAndCountsThem) {
  Reopen(/*queue_bytes=*/1);  // no block fits
  Put("ns", gpl_);
  const StoreStats s = store_->Stats("ns");
  EXPECT_EQ(s.predictor_observations_dropped, 32u);
  EXPECT_EQ(s.predictor_observations, 0u);
  EXPECT_EQ(s.predictor_fits, 0u);
  EXPECT_TRUE(Versions("ns").empty());
  EXPECT_EQ(Read("ns", gpl_).size(), 32u);  // the Put itself is unaffected
}

TEST_F(PredictorStoreTest, LearnsFromClientEncodedPutsAndLaterBlocksNameTheVersion) {
  // Every block encoded by its client, RESIDUAL fast with no state yet: the store decodes them on
  // the learning thread, and one dump (512 tokens) is a refit.
  const std::vector<uint32_t> first = PutEncoded("ns", gpl_, Encoding::kResidual);
  ASSERT_EQ(first.size(), 32u);
  EXPECT_EQ(first[0], 0u);
  StoreStats s = store_->Stats("ns");
  EXPECT_EQ(s.predictor_encoded_observations, 32u);
  EXPECT_EQ(s.predictor_encoded_dropped, 0u);
  EXPECT_EQ(s.predictor_observations, 32u);
  EXPECT_EQ(s.predictor_observations_dropped, 0u);
  std::vector<PredictorVersionView> v = Versions("ns");
  ASSERT_EQ(v.size(), 1u);
  EXPECT_TRUE(v[0].latest);
  EXPECT_EQ(v[0].tokens_learned, 512u);

  // A worker fetches it and encodes the next Put against it; the store learns from those too,
  // decoding each against the version it names.
  absl::StatusOr<std::string> bytes = store_->GetPredictor("ns", gpl_.model_id, 1);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = PredictorState::Parse(*bytes);
  ASSERT_TRUE(state.ok()) << state.status();
  const std::vector<uint32_t> second =
      PutEncoded("ns", genesis_, Encoding::kResidual, state->get());
  ASSERT_EQ(second.size(), 32u);
  for (uint32_t version : second) EXPECT_EQ(version, 1u);
  s = store_->Stats("ns");
  EXPECT_EQ(s.predictor_encoded_observations, 64u);
  EXPECT_EQ(s.blocks_on_learned, 32u);
  v = Versions("ns");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].dependents, 32u);
  EXPECT_EQ(v[1].tokens_learned, 1024u);
  // What the store serves is what the worker encoded, within the target.
  const std::vector<std::vector<uint8_t>> genesis = Read("ns", genesis_);
  ASSERT_EQ(genesis.size(), 32u);
  EXPECT_LE(WorstPlaneError(genesis_, genesis), kTarget * 1.05);
}

TEST_F(PredictorStoreTest, LearnsFromLosslessFastEncodedPuts) {
  PutEncoded("ns", gpl_, Encoding::kLossless);
  const StoreStats s = store_->Stats("ns");
  EXPECT_EQ(s.predictor_encoded_observations, 32u);
  EXPECT_EQ(s.predictor_fits, 1u);
  ASSERT_EQ(Versions("ns").size(), 1u);
  EXPECT_EQ(Versions("ns")[0].tokens_learned, 512u);
  EXPECT_EQ(Read("ns", gpl_).size(), 32u);
}

TEST_F(PredictorStoreTest, APutLargerThanTheQueueIsSampledNotCutOff) {
  // Room for 8 of the Put's 32 blocks: 8 are learned from, 24 counted as dropped (before, the
  // first 8 were taken); which 8 is SpreadSample's (trie/predictor_registry_test.cc).
  const uint64_t block = DumpModel(gpl_).geometry.num_bytes();
  Reopen(/*queue_bytes=*/8 * block);
  PutEncoded("ns", gpl_, Encoding::kResidual);
  const StoreStats s = store_->Stats("ns");
  EXPECT_EQ(s.predictor_observations, 8u);
  EXPECT_EQ(s.predictor_observations_dropped, 24u);
  EXPECT_EQ(s.predictor_encoded_observations, 8u);
  EXPECT_EQ(s.predictor_encoded_dropped, 24u);
  EXPECT_EQ(Read("ns", gpl_).size(), 32u);  // the Put itself is unaffected
}

}  // namespace
}  // namespace kvtrie
