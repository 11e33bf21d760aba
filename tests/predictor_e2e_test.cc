// End-to-end tests of the learned predictor states (issue 11) through a real kvtrie-server run
// with --learn_predictors: real KV (tests/data) Put as RESIDUAL, the server learns and publishes a
// version, later blocks are coded against it; GetPredictor streams it (chunks with total size and
// CRC-32C), the C++ client fetches and caches it to decode a RESIDUAL Get itself, bit-identical to
// RECONSTRUCTED and within the target of the original (fast blocks coded against the state on four
// client codec threads too); errors name their fields; one namespace never fetches another's
// state; Inspect and Stats show the versions. When every block is encoded by its client (issue 19)
// the server still learns (it decodes them in the background), later client-encoded blocks name
// the version, and a Put larger than --learn_queue_bytes is sampled.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/block_codec.h"
#include "codec/block_geometry.h"
#include "codec/crc32c.h"
#include "codec/kv_dump.h"
#include "codec/predictor_state.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;
constexpr double kTarget = 0.05;

KvDump Load(const std::string& name) {
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

// Worst relative RMS error over (layer, K/V) planes of the whole sequence.
double WorstPlaneError(const KvDump& got, const KvDump& want) {
  double worst = 0;
  const size_t plane = static_cast<size_t>(want.num_kv_heads) * want.num_tokens() * want.head_dim;
  for (const bool values : {false, true}) {
    const std::vector<uint8_t>& a = values ? got.v : got.k;
    const std::vector<uint8_t>& b = values ? want.v : want.k;
    std::vector<float> x(a.size() / 2), y(b.size() / 2);
    if (x.size() != y.size()) return 1e9;
    ToFloat(DType::kFp16, a.data(), x.size(), x.data());
    ToFloat(DType::kFp16, b.data(), y.size(), y.data());
    for (size_t l = 0; l < want.num_layers; ++l) {
      double err = 0, energy = 0;
      for (size_t i = l * plane; i < (l + 1) * plane; ++i) {
        err += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
        energy += double(y[i]) * y[i];
      }
      if (energy > 0) worst = std::max(worst, std::sqrt(err / energy));
    }
  }
  return worst;
}

class PredictorEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    // A refit after every 512 tokens (one dump); GetPredictor chunks of 4 KiB, so a state spans
    // several.
    auto s = ServerProcess::Start(dir_ + "/data",
                                  {"--learn_predictors", "--predictor_cross_layer",
                                   "--predictor_refit_tokens=512", "--max_get_message_bytes=4096"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    gpl_ = Load("GPL-3");
    genesis_ = Load("genesis_1-3");
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<Client> NewClient(const std::string& ns) {
    return Client::Create({.target = server_->target(), .ns = ns});
  }
  // Puts `d` as RESIDUAL at kTarget and waits (up to 20 s) until `ns` published `fits` versions.
  void PutAndWaitForFits(Client* client, const KvDump& d, uint64_t fits) {
    absl::StatusOr<v1::PutResponse> r =
        client->Put(d, {.encoding = v1::ENCODING_RESIDUAL,
                        .target_rel_rms = kTarget,
                        .profile = v1::EncodingSpec::PROFILE_COMPACT});
    ASSERT_TRUE(r.ok()) << r.status();
    for (int i = 0; i < 400; ++i) {
      absl::StatusOr<v1::StatsResponse> s = client->Stats();
      ASSERT_TRUE(s.ok()) << s.status();
      if (s->predictor_fits() >= fits) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "the server published fewer than " << fits << " predictor versions";
  }
  // Waits (up to 20 s) until `client`'s namespace published `fits` versions; its Stats then.
  v1::StatsResponse WaitForFits(Client* client, uint64_t fits) {
    v1::StatsResponse last;
    for (int i = 0; i < 400; ++i) {
      absl::StatusOr<v1::StatsResponse> s = client->Stats();
      EXPECT_TRUE(s.ok()) << s.status();
      if (!s.ok()) return last;
      last = *s;
      if (s->predictor_fits() >= fits) return last;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "the server published fewer than " << fits << " predictor versions";
    return last;
  }
  // The predictor version each block of a RESIDUAL Get of `d` names.
  std::vector<uint32_t> NamedVersions(Client* client, const std::string& ns, const KvDump& d) {
    v1::GetRequest req;
    req.set_namespace_(ns);
    req.set_model_id(d.model_id);
    req.mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.end());
    req.set_mode(v1::GET_MODE_RESIDUAL);
    grpc::ClientContext ctx;
    auto reader = client->stub()->Get(&ctx, req);
    v1::GetResponse msg;
    std::vector<uint32_t> out;
    while (reader->Read(&msg)) {
      if (msg.has_block() && msg.block().layer_begin() == 0) {
        out.push_back(msg.block().predictor_version());
      }
    }
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  }
  // The raw GetPredictor stream.
  grpc::Status Fetch(Client* client, const std::string& ns, uint32_t version,
                     std::vector<v1::PredictorChunk>* chunks) {
    v1::GetPredictorRequest req;
    req.set_namespace_(ns);
    req.set_model_id(gpl_.model_id);
    req.set_version(version);
    grpc::ClientContext ctx;
    auto reader = client->stub()->GetPredictor(&ctx, req);
    v1::PredictorChunk c;
    while (reader->Read(&c)) chunks->push_back(c);
    return reader->Finish();
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump gpl_, genesis_;
};

TEST_F(PredictorEndToEnd, AResidualGetIsDecodedByTheClientWithTheFetchedState) {
  auto client = NewClient("a");
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(client.get(), gpl_, 1));
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(client.get(), genesis_, 2));  // coded against v1

  // Some blocks of Genesis name version 1 in a RESIDUAL Get.
  v1::GetRequest req;
  req.set_namespace_("a");
  req.set_model_id(genesis_.model_id);
  req.mutable_token_ids()->Add(genesis_.token_ids.begin(), genesis_.token_ids.end());
  req.set_mode(v1::GET_MODE_RESIDUAL);
  grpc::ClientContext ctx;
  auto reader = client->stub()->Get(&ctx, req);
  v1::GetResponse msg;
  int on_v1 = 0;
  while (reader->Read(&msg)) on_v1 += msg.has_block() && msg.block().predictor_version() == 1;
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_GT(on_v1, 0);

  absl::StatusOr<KvDump> residual =
      client->Get(genesis_.model_id, genesis_.token_ids, {.mode = v1::GET_MODE_RESIDUAL});
  ASSERT_TRUE(residual.ok()) << residual.status();
  absl::StatusOr<KvDump> reconstructed =
      client->Get(genesis_.model_id, genesis_.token_ids, {.mode = v1::GET_MODE_RECONSTRUCTED});
  ASSERT_TRUE(reconstructed.ok()) << reconstructed.status();
  EXPECT_EQ(residual->k, reconstructed->k);  // the client decodes what the server decodes
  EXPECT_EQ(residual->v, reconstructed->v);
  EXPECT_LE(WorstPlaneError(*residual, genesis_), kTarget * 1.001);

  // The stream: chunks in order, each with the total size and the CRC of the whole.
  std::vector<v1::PredictorChunk> chunks;
  ASSERT_TRUE(Fetch(client.get(), "a", 1, &chunks).ok());
  ASSERT_GT(chunks.size(), 1u);
  std::string bytes;
  for (const v1::PredictorChunk& c : chunks) {
    EXPECT_EQ(c.version(), 1u);
    EXPECT_EQ(c.offset(), bytes.size());
    EXPECT_EQ(c.total_bytes(), chunks[0].total_bytes());
    bytes += c.data();
  }
  EXPECT_EQ(bytes.size(), chunks[0].total_bytes());
  EXPECT_EQ(Crc32c(bytes), chunks[0].crc32c());
  absl::StatusOr<std::shared_ptr<const PredictorState>> state = PredictorState::Parse(bytes);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ((*state)->version(), 1u);
  EXPECT_EQ((*state)->tokens_learned(), 512u);
  absl::StatusOr<std::shared_ptr<const PredictorState>> cached = client->GetPredictor(
      genesis_.model_id, 1);  // fetched by the RESIDUAL Get above: the same object
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ((*cached)->Serialize(), bytes);

  // Inspect and Stats show the versions.
  absl::StatusOr<v1::InspectResponse> inspect = client->Inspect(genesis_.model_id, 0);
  ASSERT_TRUE(inspect.ok()) << inspect.status();
  ASSERT_EQ(inspect->predictors_size(), 2);
  EXPECT_EQ(inspect->predictors(0).version(), 1u);
  EXPECT_EQ(inspect->predictors(0).state_bytes(), bytes.size());
  EXPECT_GT(inspect->predictors(0).dependents(), 0u);
  EXPECT_TRUE(inspect->predictors(1).latest());
  EXPECT_FALSE(inspect->predictors(1).description().empty());
  absl::StatusOr<v1::StatsResponse> stats = client->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->predictor_versions(), 2u);
  EXPECT_EQ(stats->blocks_on_learned(),
            inspect->predictors(0).dependents() + inspect->predictors(1).dependents());
  EXPECT_GT(stats->predictor_state_bytes(), bytes.size());
  // What learning bought (estimated per block by the encoder; FAST blocks only): Stats is the
  // sum over the versions Inspect lists (each rounded down).
  EXPECT_NEAR(static_cast<double>(stats->predictor_bytes_saved()),
              static_cast<double>(inspect->predictors(0).bytes_saved() +
                                  inspect->predictors(1).bytes_saved()),
              2.0);
}

// Fast LOSSLESS (issue 22): the server codes it against the latest learned state, the client
// too (encode_on_client); both come back bit for bit, in both Get modes, smaller than without a
// state, and still after a newer state is published.
TEST_F(PredictorEndToEnd, FastLosslessIsCodedAgainstTheLatestStateAndComesBackBitExact) {
  auto client = NewClient("a");
  const PutOptions server_side{.encoding = v1::ENCODING_LOSSLESS,
                               .profile = v1::EncodingSpec::PROFILE_FAST,
                               .learned_lossless = true};
  // Namespace "b" has no state: the byte-plane mode.
  absl::StatusOr<v1::PutResponse> without = NewClient("b")->Put(genesis_, server_side);
  ASSERT_TRUE(without.ok()) << without.status();
  // Waits (up to 20 s) until `ns` keeps `versions` states.
  auto wait_for_states = [&](Client* c, int versions) {
    for (int i = 0; i < 400; ++i) {
      absl::StatusOr<v1::InspectResponse> root = c->Inspect(genesis_.model_id, 0);
      if (root.ok() && root->predictors_size() >= versions) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "fewer than " << versions << " states";
  };
  for (const bool on_client : {false, true}) {
    const std::string ns = on_client ? "c" : "a";
    // predictor_refresh 0: the client sees the state published after its first Put at once.
    auto c = Client::Create(
        {.target = server_->target(), .ns = ns, .predictor_refresh = absl::ZeroDuration()});
    ASSERT_TRUE(c->Put(gpl_, {.encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = kTarget}).ok());
    wait_for_states(c.get(), 1);
    PutOptions lossless = server_side;
    lossless.encode_on_client = on_client;
    absl::StatusOr<v1::PutResponse> with = c->Put(genesis_, lossless);
    ASSERT_TRUE(with.ok()) << with.status();
    uint64_t bytes_with = 0, bytes_without = 0;
    for (const v1::BlockResult& b : with->blocks()) bytes_with += b.bytes_stored();
    for (const v1::BlockResult& b : without->blocks()) bytes_without += b.bytes_stored();
    EXPECT_GT(bytes_without, 0u);
    EXPECT_LT(bytes_with, bytes_without) << "on_client " << on_client;
    // The blocks name the state in a RESIDUAL-mode Get (the stored bytes as they are).
    v1::GetRequest req;
    req.set_namespace_(ns);
    req.set_model_id(genesis_.model_id);
    req.mutable_token_ids()->Add(genesis_.token_ids.begin(), genesis_.token_ids.end());
    req.set_mode(v1::GET_MODE_RESIDUAL);
    grpc::ClientContext ctx;
    auto reader = c->stub()->Get(&ctx, req);
    v1::GetResponse msg;
    int named = 0;
    while (reader->Read(&msg)) {
      named += msg.has_block() && msg.block().predictor_version() != 0 &&
               msg.block().encoding() == v1::ENCODING_LOSSLESS;
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_GT(named, 0) << "on_client " << on_client;
    for (const v1::GetMode mode : {v1::GET_MODE_RESIDUAL, v1::GET_MODE_RECONSTRUCTED}) {
      absl::StatusOr<KvDump> got = c->Get(genesis_.model_id, genesis_.token_ids, {.mode = mode});
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->k, genesis_.k) << "on_client " << on_client << " mode " << mode;
      EXPECT_EQ(got->v, genesis_.v) << "on_client " << on_client << " mode " << mode;
    }
  }
  // Namespace "a" learns from Genesis too: a newer state; the blocks coded against the older one
  // still come back bit for bit.
  wait_for_states(client.get(), 2);
  absl::StatusOr<v1::InspectResponse> root = client->Inspect(genesis_.model_id, 0);
  ASSERT_TRUE(root.ok()) << root.status();
  ASSERT_GE(root->predictors_size(), 2);
  EXPECT_FALSE(root->predictors(0).latest());
  auto fresh = NewClient("a");  // no cached state
  absl::StatusOr<KvDump> got =
      fresh->Get(genesis_.model_id, genesis_.token_ids, {.mode = v1::GET_MODE_RESIDUAL});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->k, genesis_.k);
  EXPECT_EQ(got->v, genesis_.v);
}

TEST_F(PredictorEndToEnd, BadRequestsNameTheFieldAndNamespacesAreIsolated) {
  auto a = NewClient("a");
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(a.get(), gpl_, 1));
  std::vector<v1::PredictorChunk> chunks;
  grpc::Status zero = Fetch(a.get(), "a", 0, &chunks);
  EXPECT_EQ(zero.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(zero.error_message().find("version"), std::string::npos) << zero.error_message();
  grpc::Status missing = Fetch(a.get(), "a", 7, &chunks);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(missing.error_message().find("version"), std::string::npos) << missing.error_message();
  // Namespace b stores nothing: a's version 1 is not b's to fetch.
  auto b = NewClient("b");
  grpc::Status other = Fetch(b.get(), "b", 1, &chunks);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(other.error_message().find("model_id"), std::string::npos) << other.error_message();
  EXPECT_TRUE(chunks.empty());
  absl::StatusOr<std::shared_ptr<const PredictorState>> via_client =
      b->GetPredictor(gpl_.model_id, 1);
  EXPECT_TRUE(absl::IsNotFound(via_client.status())) << via_client.status();
  // b's own Put is never coded against a's state, and b learns its own.
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(b.get(), genesis_, 1));
  absl::StatusOr<v1::StatsResponse> sb = b->Stats();
  ASSERT_TRUE(sb.ok());
  EXPECT_EQ(sb->blocks_on_learned(), 0u);
  EXPECT_EQ(sb->predictor_tokens_learned(), 512u);
  std::vector<v1::PredictorChunk> a1, b1;
  ASSERT_TRUE(Fetch(a.get(), "a", 1, &a1).ok());
  ASSERT_TRUE(Fetch(b.get(), "b", 1, &b1).ok());
  std::string a_bytes, b_bytes;
  for (const v1::PredictorChunk& c : a1) a_bytes += c.data();
  for (const v1::PredictorChunk& c : b1) b_bytes += c.data();
  EXPECT_NE(a_bytes, b_bytes);  // each learned from its own namespace's blocks
}

// Issue 19: the learned fast blocks of a RESIDUAL Get decode on the client's codec threads (they
// need the state, their tokens and the token before them, not their parent), bit-identical to
// the server's RECONSTRUCTED Get and to a client decoding on one thread.
TEST_F(PredictorEndToEnd, LearnedFastBlocksDecodeOnFourClientThreadsAsTheServerDecodes) {
  auto writer = NewClient("p");
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(writer.get(), gpl_, 1));
  ASSERT_TRUE(writer
                  ->Put(genesis_, {.encoding = v1::ENCODING_RESIDUAL,
                                   .target_rel_rms = kTarget,
                                   .profile = v1::EncodingSpec::PROFILE_FAST})
                  .ok());
  // Every block of Genesis is a fast one; most name version 1.
  v1::GetRequest req;
  req.set_namespace_("p");
  req.set_model_id(genesis_.model_id);
  req.mutable_token_ids()->Add(genesis_.token_ids.begin(), genesis_.token_ids.end());
  req.set_mode(v1::GET_MODE_RESIDUAL);
  grpc::ClientContext ctx;
  auto reader = writer->stub()->Get(&ctx, req);
  v1::GetResponse msg;
  int blocks = 0, learned = 0;
  while (reader->Read(&msg)) {
    if (!msg.has_block()) continue;
    ++blocks;
    absl::StatusOr<BlockHeader> h = ParseBlock(msg.block().encoded());
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->profile, Profile::kFast);
    learned += msg.block().predictor_version() == 1;
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(blocks, static_cast<int>(genesis_.num_tokens() / 16));
  EXPECT_GT(learned, blocks / 2);

  auto four = Client::Create({.target = server_->target(), .ns = "p", .codec_threads = 4});
  auto one = Client::Create({.target = server_->target(), .ns = "p", .codec_threads = 1});
  absl::StatusOr<KvDump> reconstructed =
      writer->Get(genesis_.model_id, genesis_.token_ids, {.mode = v1::GET_MODE_RECONSTRUCTED});
  ASSERT_TRUE(reconstructed.ok()) << reconstructed.status();
  for (Client* c : {four.get(), one.get()}) {
    absl::StatusOr<KvDump> residual =
        c->Get(genesis_.model_id, genesis_.token_ids, {.mode = v1::GET_MODE_RESIDUAL});
    ASSERT_TRUE(residual.ok()) << residual.status();
    EXPECT_EQ(residual->k, reconstructed->k);
    EXPECT_EQ(residual->v, reconstructed->v);
    EXPECT_LE(WorstPlaneError(*residual, genesis_), kTarget * 1.001);
  }
}

TEST_F(PredictorEndToEnd, ClientEncodedPutsAloneGrowAStateThatLaterBlocksName) {
  // Every block is encoded by the worker (RESIDUAL fast): the server sees no dense block, decodes
  // them on its learning thread, and publishes a version. predictor_refresh 0: the client looks
  // the latest version up before every Put (by default it uses what it found for 10 s).
  auto client = Client::Create(
      {.target = server_->target(), .ns = "w", .predictor_refresh = absl::ZeroDuration()});
  const PutOptions encoded{.encoding = v1::ENCODING_RESIDUAL,
                           .target_rel_rms = kTarget,
                           .profile = v1::EncodingSpec::PROFILE_FAST,
                           .encode_on_client = true};
  ASSERT_TRUE(client->Put(gpl_, encoded).ok());
  v1::StatsResponse s = WaitForFits(client.get(), 1);
  EXPECT_EQ(s.predictor_encoded_observations(), 32u);
  EXPECT_EQ(s.predictor_encoded_dropped(), 0u);
  EXPECT_EQ(s.predictor_observations(), 32u);
  EXPECT_EQ(s.blocks_on_learned(), 0u);  // coded before any state existed
  EXPECT_EQ(s.predictor_tokens_learned(), 512u);

  // The next encoded Put is coded by the client against that version, and every block names it.
  ASSERT_TRUE(client->Put(genesis_, encoded).ok());
  const std::vector<uint32_t> named = NamedVersions(client.get(), "w", genesis_);
  ASSERT_EQ(named.size(), 32u);
  for (uint32_t v : named) EXPECT_EQ(v, 1u);
  s = WaitForFits(client.get(), 2);  // and the server learned from those too
  EXPECT_EQ(s.predictor_encoded_observations(), 64u);
  EXPECT_EQ(s.blocks_on_learned(), 32u);
  // Read back: RECONSTRUCTED (the server decodes) within the target of the original, and the
  // same as the client's own decode of the RESIDUAL blocks.
  absl::StatusOr<KvDump> reconstructed =
      client->Get(genesis_.model_id, genesis_.token_ids, {.mode = v1::GET_MODE_RECONSTRUCTED});
  ASSERT_TRUE(reconstructed.ok()) << reconstructed.status();
  EXPECT_LE(WorstPlaneError(*reconstructed, genesis_), kTarget * 1.001);
  absl::StatusOr<KvDump> residual =
      client->Get(genesis_.model_id, genesis_.token_ids, {.mode = v1::GET_MODE_RESIDUAL});
  ASSERT_TRUE(residual.ok()) << residual.status();
  EXPECT_EQ(residual->k, reconstructed->k);
  EXPECT_EQ(residual->v, reconstructed->v);
}

TEST_F(PredictorEndToEnd, APutLargerThanTheLearnQueueIsSampled) {
  // --learn_queue_bytes with room for 8 of a Put's 32 blocks: 8 are learned from, the rest
  // counted as dropped, and the Put itself stores all 32.
  const uint64_t block = 2ull * gpl_.num_layers * gpl_.num_kv_heads * 16 * gpl_.head_dim * 2;
  auto small =
      ServerProcess::Start(dir_ + "/small", {"--learn_predictors", "--predictor_refit_tokens=128",
                                             "--learn_queue_bytes=" + std::to_string(8 * block)});
  ASSERT_TRUE(small.ok()) << small.status();
  auto client = Client::Create({.target = (*small)->target(), .ns = "q"});
  ASSERT_TRUE(client
                  ->Put(gpl_, {.encoding = v1::ENCODING_RESIDUAL,
                               .target_rel_rms = kTarget,
                               .profile = v1::EncodingSpec::PROFILE_FAST,
                               .encode_on_client = true})
                  .ok());
  const v1::StatsResponse s = WaitForFits(client.get(), 1);  // 8 blocks = 128 tokens: one fit
  EXPECT_EQ(s.predictor_observations(), 8u);
  EXPECT_EQ(s.predictor_observations_dropped(), 24u);
  EXPECT_EQ(s.predictor_encoded_observations(), 8u);
  EXPECT_EQ(s.predictor_encoded_dropped(), 24u);
  absl::StatusOr<v1::LookupResponse> l = client->Lookup(gpl_.model_id, gpl_.token_ids);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->matched_tokens(), 512u);
}

}  // namespace
}  // namespace kvtrie
