// End-to-end tests of issue 30 rows 2 and 4 against a real kvtrie-server: a block names the
// learned state it was coded against by fingerprint (another namespace's version 1 is refused),
// and a forged LOSSLESS fast block — payload changed, CRC-32C recomputed — is refused when the
// server decodes it (--verify_encoded_puts=sample draws it) and never read back as bit-exact.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/block_codec.h"
#include "codec/predictor_state.h"
#include "codec/testing_mutate.h"
#include "gtest/gtest.h"
#include "tests/hostile_testing.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::Commit;
using testing::GeometryOf;
using testing::HeaderOf;
using testing::Msg;
using testing::ServerProcess;
constexpr double kTarget = 0.1;
constexpr uint32_t kBlocks = 8;

EncodeOptions Fast(Encoding e) {
  EncodeOptions o;
  o.encoding = e;
  o.profile = Profile::kFast;
  o.target_rel_rms = kTarget;
  return o;
}

// Block `b` of `d` encoded as a worker would: against `state` (null: none) with its tokens.
EncodedBlock EncodeOf(const KvDump& d, uint32_t b, const EncodeOptions& o,
                      const PredictorState* state) {
  const BlockGeometry g = GeometryOf(d);
  std::vector<uint8_t> block(g.num_bytes());
  GatherBlock(g, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
  const std::vector<int32_t> tokens(d.token_ids.begin() + b * 16,
                                    d.token_ids.begin() + b * 16 + 16);
  PredictionContext ctx;
  ctx.learned = state;
  ctx.tokens = tokens;
  ctx.first_position = b * 16;
  ctx.previous_token = b == 0 ? -1 : static_cast<int32_t>(d.token_ids[b * 16 - 1]);
  absl::StatusOr<EncodedBlock> e = EncodeBlock(g, block, o, ctx);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : EncodedBlock{};
}

v1::PutRequest EncodedMsg(uint32_t b, const std::string& bytes, const EncodedBlock& e) {
  v1::PutRequest r;
  v1::PutBlock* pb = r.mutable_block();
  pb->set_block_index(b);
  pb->set_encoded(bytes);
  pb->set_rel_rms_error_k(e.rel_rms_error_k);
  pb->set_rel_rms_error_v(e.rel_rms_error_v);
  pb->set_max_abs_error(e.max_abs_error);
  return r;
}

v1::PutHeader FastHeader(const KvDump& d, const std::string& ns, long tokens, v1::Encoding e) {
  v1::PutHeader h = HeaderOf(d, ns, tokens, e);
  h.mutable_encoding()->set_profile(v1::EncodingSpec::PROFILE_FAST);
  h.mutable_encoding()->set_target_rel_rms(kTarget);
  return h;
}

// A forgery of a LOSSLESS fast block that decodes without any structural error: one bit of a
// low byte plane (stored as is, after the zstd frame of the high bytes) flipped, CRC fixed up.
std::string ForgeLossless(const std::string& encoded, size_t k) {
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  EXPECT_TRUE(h.ok());
  if (!h.ok()) return "";
  uint32_t frame = 0;
  std::memcpy(&frame, h->payload.data(), 4);
  return testing::MutateFixCrc(encoded, 4 + frame + 17 + 131 * k, 0x04);
}

class ContentChecksumEndToEnd : public ::testing::Test {
 protected:
  void StartServer(std::vector<std::string> flags) {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto s = ServerProcess::Start(dir_ + "/data", std::move(flags));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    gpl_ = testing::LoadTestDump("GPL-3");
    genesis_ = testing::LoadTestDump("genesis_1-3");
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<Client> NewClient(const std::string& ns) {
    return Client::Create({.target = server_->target(), .ns = ns});
  }
  // Puts `d` densely as RESIDUAL fast and waits (up to 20 s) until `fits` versions are published.
  void PutAndWaitForFits(Client* client, const KvDump& d, uint64_t fits) {
    absl::StatusOr<v1::PutResponse> r = client->Put(d, {.encoding = v1::ENCODING_RESIDUAL,
                                                        .target_rel_rms = kTarget,
                                                        .profile = v1::EncodingSpec::PROFILE_FAST,
                                                        .encode_on_client = false});
    ASSERT_TRUE(r.ok()) << r.status();
    for (int i = 0; i < 400; ++i) {
      absl::StatusOr<v1::StatsResponse> s = client->Stats();
      ASSERT_TRUE(s.ok()) << s.status();
      if (s->predictor_fits() >= fits) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "the server published fewer than " << fits << " predictor versions";
  }
  // The first `blocks` blocks of `d` encoded as `o` against `state`, block `forged` (if any
  // < blocks) forged by ForgeLossless; then the Put of them to `ns`.
  grpc::Status PutEncoded(Client* client, const std::string& ns, const KvDump& d,
                          const EncodeOptions& o, const PredictorState* state,
                          const std::vector<uint32_t>& forged, size_t k = 0) {
    std::vector<v1::PutRequest> msgs = {
        Msg(FastHeader(d, ns, kBlocks * 16, static_cast<v1::Encoding>(o.encoding)))};
    for (uint32_t i = 0; i < kBlocks; ++i) {
      const EncodedBlock e = EncodeOf(d, i, o, state);
      const bool forge = std::find(forged.begin(), forged.end(), i) != forged.end();
      msgs.push_back(EncodedMsg(i, forge ? ForgeLossless(e.bytes, k + i) : e.bytes, e));
    }
    msgs.push_back(Commit());
    return testing::RawPut(client->stub(), msgs);
  }
  uint32_t Matched(Client* client, const KvDump& d) {
    absl::StatusOr<v1::LookupResponse> look = client->Lookup(d.model_id, d.token_ids);
    EXPECT_TRUE(look.ok()) << look.status();
    return look.ok() ? look->matched_blocks() : 0;
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump gpl_, genesis_;
};

// Issue 30 row 2: RESIDUAL fast blocks coded against namespace a's version 1, sent to namespace
// b whose version 1 is another state, were stored and served at a worst-plane rel RMS of 0.6.
TEST_F(ContentChecksumEndToEnd, BlocksCodedAgainstAnotherNamespacesVersionOneAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--learn_predictors", "--predictor_refit_tokens=512"}));
  auto a = NewClient("a");
  auto b = NewClient("b");
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(a.get(), gpl_, 1));      // a: version 1 of GPL-3
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(b.get(), genesis_, 1));  // b: version 1 of genesis
  absl::StatusOr<std::shared_ptr<const PredictorState>> a1 = a->GetPredictor(gpl_.model_id, 1);
  absl::StatusOr<std::shared_ptr<const PredictorState>> b1 = b->GetPredictor(gpl_.model_id, 1);
  ASSERT_TRUE(a1.ok() && b1.ok());
  ASSERT_NE((*a1)->fingerprint(), (*b1)->fingerprint());
  // GetPredictor answers the fingerprint (PredictorChunk.fingerprint, first chunk).
  {
    v1::GetPredictorRequest req;
    req.set_namespace_("a");
    req.set_model_id(gpl_.model_id);
    req.set_version(1);
    grpc::ClientContext ctx;
    auto reader = a->stub()->GetPredictor(&ctx, req);
    v1::PredictorChunk chunk;
    ASSERT_TRUE(reader->Read(&chunk));
    EXPECT_EQ(chunk.fingerprint(), (*a1)->fingerprint());
    while (reader->Read(&chunk)) {
    }
    EXPECT_TRUE(reader->Finish().ok());
  }
  // GPL-3 blocks coded against a's version 1 (as a worker of a would), sent to b.
  const grpc::Status s =
      PutEncoded(b.get(), "b", gpl_, Fast(Encoding::kResidual), a1->get(), /*forged=*/{});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("predictor_fingerprint: block "), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("version 1 here is another state"), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("namespace 'b', model '" + gpl_.model_id + "'"),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(Matched(b.get(), gpl_), 0u) << "stored something";
  // The same blocks are what a's version 1 codes: a takes them.
  const grpc::Status ok =
      PutEncoded(a.get(), "a", genesis_, Fast(Encoding::kResidual), a1->get(), {});
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  // A block written without a fingerprint (a client from before) still goes by its version.
  EncodeOptions old = Fast(Encoding::kResidual);
  old.content_checksum = false;
  const grpc::Status legacy = PutEncoded(a.get(), "a", gpl_, old, a1->get(), {});
  EXPECT_TRUE(legacy.ok()) << legacy.error_message();
}

// Issue 30 row 4: payload mutants of LOSSLESS fast blocks decoded without error to other values.
TEST_F(ContentChecksumEndToEnd, AForgedLosslessBlockIsNeverReadBackAsBitExact) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--verify_encoded_puts=structure"}));
  auto a = NewClient("a");
  // Without decoding, the forgery passes every structural check and is stored.
  const grpc::Status put =
      PutEncoded(a.get(), "a", genesis_, Fast(Encoding::kLossless), nullptr, /*forged=*/{3});
  ASSERT_TRUE(put.ok()) << put.error_message();
  const std::vector<uint32_t> tokens(genesis_.token_ids.begin(),
                                     genesis_.token_ids.begin() + kBlocks * 16);
  for (v1::GetMode mode : {v1::GET_MODE_RECONSTRUCTED, v1::GET_MODE_RESIDUAL}) {
    SCOPED_TRACE(v1::GetMode_Name(mode));
    // The server's decoder (RECONSTRUCTED) checks the content checksum: DATA_LOSS, the node
    // dropped, and the client's one re-send gets the blocks before it. The RESIDUAL Get after
    // that finds the same prefix; a client decoder that met the block would answer DATA_LOSS.
    absl::StatusOr<KvDump> got = a->Get(genesis_.model_id, tokens, {.mode = mode});
    if (got.ok()) {
      EXPECT_EQ(got->num_tokens(), 3u * 16) << "served the forged block or lost the ones before";
    } else {
      EXPECT_TRUE(absl::IsDataLoss(got.status())) << got.status();
      EXPECT_NE(got.status().message().find("content checksum mismatch"), std::string::npos)
          << got.status();
    }
  }
}

TEST_F(ContentChecksumEndToEnd, SampleVerificationRefusesAPutOfForgedLosslessBlocks) {
  ASSERT_NO_FATAL_FAILURE(StartServer({"--verify_encoded_puts=sample"}));
  auto a = NewClient("a");
  // Every block forged: whichever one in 8 the server draws, it is refused (several Puts: the
  // draw is per Put).
  for (size_t k = 0; k < 4; ++k) {
    const grpc::Status s = PutEncoded(a.get(), "a", genesis_, Fast(Encoding::kLossless), nullptr,
                                      {0, 1, 2, 3, 4, 5, 6, 7}, k);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("encoded: does not decode: encoded block: content checksum "
                                     "mismatch"),
              std::string::npos)
        << s.error_message();
    EXPECT_EQ(Matched(a.get(), genesis_), 0u) << "stored something";
  }
  const grpc::Status ok =
      PutEncoded(a.get(), "a", genesis_, Fast(Encoding::kLossless), nullptr, {});
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(Matched(a.get(), genesis_), kBlocks);
}

}  // namespace
}  // namespace kvtrie
