// End-to-end tests of the encoded path as the normal one (issue 19), against a real kvtrie-server
// run with --learn_predictors: a kvtrie::Client with default options encodes its Puts itself
// (PutOptions::encode_on_client, the fast profile an unset profile means), learns the server's
// default encoding from its first Put, sends dense what it cannot code (the compact profile) or
// what it is told to (thin clients); and a Put coded against a learned state the server has freed
// since is encoded again against the latest without the caller seeing an error (the server's
// refusal names it by a machine-readable reason, STALE_PREDICTOR_VERSION, not only by its text).
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/status_reason.h"
#include "codec/block_codec.h"
#include "gtest/gtest.h"
#include "tests/hostile_testing.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;
constexpr double kTarget = 0.05;

class ClientEncodeEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto s = ServerProcess::Start(dir_ + "/data",
                                  {"--learn_predictors", "--predictor_refit_tokens=512"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    gpl_ = testing::LoadTestDump("GPL-3");
    genesis_ = testing::LoadTestDump("genesis_1-3");
    story_ = testing::LoadTestDump("story_prompt");
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  // Waits (up to 20 s) until `client`'s namespace has published `fits` predictor versions.
  void WaitForFits(Client* client, uint64_t fits) {
    for (int i = 0; i < 400; ++i) {
      absl::StatusOr<v1::StatsResponse> s = client->Stats();
      ASSERT_TRUE(s.ok()) << s.status();
      if (s->predictor_fits() >= fits) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "the server published fewer than " << fits << " predictor versions";
  }
  // The versions of the model's learned states the server keeps (Inspect of the root).
  std::vector<uint32_t> KeptVersions(Client* client, const std::string& model_id) {
    absl::StatusOr<v1::InspectResponse> root = client->Inspect(model_id, 0);
    EXPECT_TRUE(root.ok()) << root.status();
    std::vector<uint32_t> out;
    for (int i = 0; root.ok() && i < root->predictors_size(); ++i) {
      out.push_back(root->predictors(i).version());
    }
    return out;
  }
  // The stored blocks of the first `blocks` blocks of `d` as a RESIDUAL Get returns them.
  std::vector<v1::GetBlock> StoredBlocks(Client* client, const std::string& ns, const KvDump& d,
                                         uint32_t blocks) {
    v1::GetRequest req;
    req.set_namespace_(ns);
    req.set_model_id(d.model_id);
    req.mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.begin() + blocks * 16);
    req.set_mode(v1::GET_MODE_RESIDUAL);
    grpc::ClientContext ctx;
    auto reader = client->stub()->Get(&ctx, req);
    v1::GetResponse msg;
    std::vector<v1::GetBlock> out;
    while (reader->Read(&msg)) {
      if (msg.has_block()) out.push_back(msg.block());
    }
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  }
  uint64_t ClientReported(Client* client) {
    absl::StatusOr<v1::StatsResponse> s = client->Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->client_reported_error_nodes() : 0;
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump gpl_, genesis_, story_;
};

TEST_F(ClientEncodeEndToEnd, AStaleVersionIsEncodedAgainWithoutTheCallerSeeingIt) {
  // `dense` feeds the learner (it learns from dense Puts); `worker` encodes, with defaults except
  // that the latest version it found is never looked up again unless the server refuses it.
  auto dense = Client::Create({.target = server_->target(), .ns = "s"});
  auto worker = Client::Create(
      {.target = server_->target(), .ns = "s", .predictor_refresh = absl::InfiniteDuration()});
  const PutOptions thin{
      .encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = kTarget, .encode_on_client = false};
  const PutOptions residual{.encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = kTarget};
  ASSERT_TRUE(dense->Put(gpl_, thin).ok());
  ASSERT_NO_FATAL_FAILURE(WaitForFits(dense.get(), 1));

  // The worker encodes story_prompt against version 1 and caches it as the latest.
  absl::StatusOr<v1::PutResponse> first = worker->Put(story_, residual);
  ASSERT_TRUE(first.ok()) << first.status();
  const uint32_t story_blocks = static_cast<uint32_t>(story_.num_tokens() / 16);
  ASSERT_EQ(first->blocks_stored(), story_blocks);
  EXPECT_EQ(ClientReported(worker.get()), story_blocks);  // encoded by the client
  std::vector<v1::GetBlock> stored = StoredBlocks(worker.get(), "s", story_, story_blocks);
  ASSERT_EQ(stored.size(), story_blocks);
  for (uint32_t b = 1; b < story_blocks; ++b) EXPECT_EQ(stored[b].predictor_version(), 1u) << b;
  // A refit (genesis, dense: its blocks are coded against version 1) publishes version 2; once
  // story_prompt and genesis are deleted nothing names version 1 and the server frees it.
  ASSERT_TRUE(dense->Put(genesis_, thin).ok());
  ASSERT_NO_FATAL_FAILURE(WaitForFits(dense.get(), 2));
  const std::vector<uint32_t> story_first(story_.token_ids.begin(), story_.token_ids.begin() + 16);
  const std::vector<uint32_t> genesis_first(genesis_.token_ids.begin(),
                                            genesis_.token_ids.begin() + 16);
  ASSERT_TRUE(worker->Delete(story_.model_id, story_first).ok());
  ASSERT_TRUE(dense->Delete(genesis_.model_id, genesis_first).ok());
  std::vector<uint32_t> kept;
  for (int i = 0; i < 400; ++i) {
    kept = KeptVersions(dense.get(), gpl_.model_id);
    if (!kept.empty() && kept.front() != 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(kept.empty());
  ASSERT_NE(kept.front(), 1u) << "version 1 was not freed";
  const uint32_t latest = kept.back();  // oldest first
  ASSERT_GE(latest, 2u);

  // What the worker would send first is refused: a raw encoded Put against its cached version 1.
  {
    absl::StatusOr<std::shared_ptr<const PredictorState>> v1 =
        worker->GetPredictor(story_.model_id, 1);  // still cached by the worker
    ASSERT_TRUE(v1.ok()) << v1.status();
    const BlockGeometry g = testing::GeometryOf(story_);
    std::vector<uint8_t> block(g.num_bytes());
    GatherBlock(g, story_.num_tokens(), story_.k.data(), story_.v.data(), 1, absl::MakeSpan(block));
    const std::vector<int32_t> tokens(story_.token_ids.begin() + 16, story_.token_ids.begin() + 32);
    PredictionContext ctx;
    ctx.learned = v1->get();
    ctx.tokens = tokens;
    ctx.first_position = 16;
    ctx.previous_token = static_cast<int32_t>(story_.token_ids[15]);
    EncodeOptions o;
    o.encoding = Encoding::kResidual;
    o.profile = Profile::kFast;
    o.target_rel_rms = kTarget;
    absl::StatusOr<EncodedBlock> e = EncodeBlock(g, block, o, ctx);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_EQ(e->predictor_version, 1u);
    v1::PutHeader h = testing::HeaderOf(story_, "s", 32, v1::ENCODING_RESIDUAL);
    h.mutable_encoding()->set_profile(v1::EncodingSpec::PROFILE_FAST);
    h.mutable_encoding()->set_target_rel_rms(kTarget);
    v1::PutRequest b1;
    b1.mutable_block()->set_block_index(1);
    b1.mutable_block()->set_encoded(e->bytes);
    v1::PutRequest b0 = b1;
    b0.mutable_block()->set_block_index(0);
    const grpc::Status s =
        testing::RawPut(worker->stub(), {testing::Msg(h), b0, b1, testing::Commit()});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_NE(s.error_message().find("predictor_version"), std::string::npos) << s.error_message();
    // Machine-readable (issue 31): a google.rpc.ErrorInfo detail with the reason, which clients
    // match on instead of the text (client/status_reason.h), kept on the client's absl::Status.
    EXPECT_EQ(StatusReason(s), kStalePredictorVersion);
    const absl::Status as_absl = FromGrpcStatus(s);
    EXPECT_TRUE(IsStalePredictorVersion(as_absl)) << as_absl;
    EXPECT_EQ(as_absl.message(), s.error_message());

    // Another refusal of an encoded block (its CRC broken) carries no reason.
    v1::PutRequest broken = b0;
    std::string& bytes = *broken.mutable_block()->mutable_encoded();
    bytes.back() = static_cast<char>(bytes.back() ^ 0x5a);
    const grpc::Status bad =
        testing::RawPut(worker->stub(), {testing::Msg(h), broken, b1, testing::Commit()});
    EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad.error_message();
    EXPECT_EQ(StatusReason(bad), "");
    EXPECT_FALSE(IsStalePredictorVersion(FromGrpcStatus(bad)));
  }

  // The worker's Put: refused as above, then encoded against the latest version and stored; the
  // caller sees only the success.
  absl::StatusOr<v1::PutResponse> again = worker->Put(story_, residual);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->blocks_stored(), story_blocks);
  EXPECT_EQ(ClientReported(worker.get()), story_blocks);  // encoded by the client again
  stored = StoredBlocks(worker.get(), "s", story_, story_blocks);
  ASSERT_EQ(stored.size(), story_blocks);
  for (uint32_t b = 1; b < story_blocks; ++b) {
    EXPECT_EQ(stored[b].predictor_version(), latest) << b;
  }
  absl::StatusOr<KvDump> got = worker->Get(story_.model_id, story_.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->num_tokens(), story_blocks * 16);
}

TEST_F(ClientEncodeEndToEnd, DefaultPutsAreEncodedByTheClientAndDensePutsStoreTheSame) {
  auto c = Client::Create({.target = server_->target(), .ns = "d"});
  const std::vector<uint32_t> first(gpl_.token_ids.begin(), gpl_.token_ids.begin() + 16);
  const uint32_t blocks = static_cast<uint32_t>(gpl_.num_tokens() / 16);
  // The first Put of the server's default encoding goes dense: the client learns it (lossless).
  ASSERT_TRUE(c->Put(genesis_).ok());
  EXPECT_EQ(ClientReported(c.get()), 0u);
  // Then the client encodes: lossless of the fast profile, as the server would have.
  absl::StatusOr<v1::PutResponse> r = c->Put(gpl_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks_stored(), blocks);
  EXPECT_EQ(ClientReported(c.get()), blocks);
  std::vector<v1::GetBlock> encoded = StoredBlocks(c.get(), "d", gpl_, blocks);
  ASSERT_EQ(encoded.size(), blocks);
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded[3].encoded());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->encoding, Encoding::kLossless);
  EXPECT_EQ(h->profile, Profile::kFast);
  absl::StatusOr<KvDump> got = c->Get(gpl_.model_id, gpl_.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->k == gpl_.k && got->v == gpl_.v);  // lossless: bit-exact

  // A thin client's dense Put of the same KV: the server encodes the same bytes.
  ASSERT_TRUE(c->Delete(gpl_.model_id, first).ok());
  ASSERT_TRUE(c->Put(gpl_, {.encode_on_client = false}).ok());
  EXPECT_EQ(ClientReported(c.get()), 0u);
  std::vector<v1::GetBlock> dense = StoredBlocks(c.get(), "d", gpl_, blocks);
  ASSERT_EQ(dense.size(), blocks);
  for (uint32_t b = 0; b < blocks; ++b) EXPECT_EQ(dense[b].encoded(), encoded[b].encoded()) << b;

  // RESIDUAL with a target: encoded by the client (fast profile), within the target.
  ASSERT_TRUE(c->Delete(gpl_.model_id, first).ok());
  r = c->Put(gpl_, {.encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = kTarget});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ClientReported(c.get()), blocks);
  for (const v1::BlockResult& b : r->blocks()) {
    EXPECT_LE(b.rel_rms_error_k(), kTarget * 1.0001) << b.block_index();
    EXPECT_LE(b.rel_rms_error_v(), kTarget * 1.0001) << b.block_index();
  }

  // The compact profile, for callers who ask: sent dense, encoded by the server.
  ASSERT_TRUE(c->Delete(gpl_.model_id, first).ok());
  r = c->Put(gpl_, {.encoding = v1::ENCODING_RESIDUAL,
                    .target_rel_rms = kTarget,
                    .profile = v1::EncodingSpec::PROFILE_COMPACT});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ClientReported(c.get()), 0u);
  std::vector<v1::GetBlock> compact = StoredBlocks(c.get(), "d", gpl_, blocks);
  ASSERT_EQ(compact.size(), blocks);
  h = ParseBlock(compact[3].encoded());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->profile, Profile::kCompact);
}

}  // namespace
}  // namespace kvtrie
