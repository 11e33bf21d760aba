// End-to-end tests of encoded Puts (issue 19) against a real kvtrie-server run with
// --learn_predictors: a block the client encodes itself (PutBlock.encoded) is stored as it came —
// the same bytes a dense Put of the block stores against the same state, read back identically
// (RESIDUAL and RECONSTRUCTED) — and every wrong field of an encoded block gets its named status,
// stores nothing, and leaves both namespaces reading back bit-identical.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/block_codec.h"
#include "codec/crc32c.h"
#include "codec/predictor_state.h"
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
constexpr double kTarget = 0.05;

// The first `tokens` tokens of `d` (sequence layout: [layers][heads][tokens][head_dim] per side).
KvDump FirstTokens(const KvDump& d, size_t tokens) {
  KvDump out = d;
  out.token_ids.resize(tokens);
  if (!out.surprisal_bits.empty()) out.surprisal_bits.resize(tokens);
  const size_t row = static_cast<size_t>(d.head_dim) * 2;  // fp16
  const size_t rows = static_cast<size_t>(d.num_layers) * d.num_kv_heads;
  out.k.assign(rows * tokens * row, 0);
  out.v.assign(out.k.size(), 0);
  for (size_t r = 0; r < rows; ++r) {
    const size_t from = r * d.num_tokens() * row, to = r * tokens * row;
    std::copy_n(d.k.begin() + from, tokens * row, out.k.begin() + to);
    std::copy_n(d.v.begin() + from, tokens * row, out.v.begin() + to);
  }
  return out;
}

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

v1::PutRequest EncodedMsg(uint32_t b, const EncodedBlock& e) {
  v1::PutRequest r;
  v1::PutBlock* pb = r.mutable_block();
  pb->set_block_index(b);
  pb->set_encoded(e.bytes);
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

// The CRC-32C trailer recomputed after an edit, so the check behind it is reached.
std::string FixCrc(std::string bytes) {
  const uint32_t crc = Crc32c(absl::string_view(bytes).substr(0, bytes.size() - 4));
  std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
  return bytes;
}

class EncodedPutEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto s = ServerProcess::Start(
        dir_ + "/data",
        {"--learn_predictors", "--predictor_refit_tokens=512", "--verify_encoded_puts=all"});
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
  // Puts `d` densely as RESIDUAL fast (the learner learns from dense Puts) and waits (up to 20 s)
  // until `fits` versions are published.
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
  // The stored encoded bytes of the first `blocks` blocks of `d` (a RESIDUAL Get).
  std::vector<std::string> StoredBytes(Client* client, const std::string& ns, const KvDump& d,
                                       uint32_t blocks) {
    v1::GetRequest req;
    req.set_namespace_(ns);
    req.set_model_id(d.model_id);
    req.mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.begin() + blocks * 16);
    req.set_mode(v1::GET_MODE_RESIDUAL);
    grpc::ClientContext ctx;
    auto reader = client->stub()->Get(&ctx, req);
    v1::GetResponse msg;
    std::vector<std::string> out;
    while (reader->Read(&msg)) {
      if (msg.has_block()) out.push_back(msg.block().encoded());
    }
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  KvDump gpl_, genesis_;
};

TEST_F(EncodedPutEndToEnd, AnEncodedPutStoresWhatADensePutStoresAndReadsBackTheSame) {
  auto a = NewClient("a");
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(a.get(), gpl_, 1));
  absl::StatusOr<std::shared_ptr<const PredictorState>> v1 = a->GetPredictor(gpl_.model_id, 1);
  ASSERT_TRUE(v1.ok()) << v1.status();
  // The server learns from encoded Puts too: 24 blocks (384 tokens) per Put stay under the
  // 512-token refit, so no case's encoded Put publishes a state its dense Put would code against.
  auto b = NewClient("b");  // no state until both its RESIDUAL Puts below were learned from
  constexpr uint32_t kBlocks = 24;
  const std::vector<uint32_t> first(genesis_.token_ids.begin(), genesis_.token_ids.begin() + 16);
  struct Case {
    Client* client;
    std::string ns;
    Encoding encoding;
    const PredictorState* state;
  } cases[] = {{a.get(), "a", Encoding::kResidual, v1->get()},
               {b.get(), "b", Encoding::kResidual, nullptr},
               {b.get(), "b", Encoding::kLossless, nullptr},
               {b.get(), "b", Encoding::kRaw, nullptr}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.ns + " " + std::string(EncodingName(c.encoding)));
    const v1::PutHeader header =
        FastHeader(genesis_, c.ns, kBlocks * 16, static_cast<v1::Encoding>(c.encoding));
    std::vector<v1::PutRequest> msgs = {Msg(header)};
    std::vector<std::string> sent;
    std::vector<double> errors_k;
    for (uint32_t i = 0; i < kBlocks; ++i) {
      const EncodedBlock e = EncodeOf(genesis_, i, Fast(c.encoding), c.state);
      if (c.state != nullptr && i > 0) {
        EXPECT_EQ(e.predictor_version, 1u) << i;
      }
      sent.push_back(e.bytes);
      errors_k.push_back(e.rel_rms_error_k);
      msgs.push_back(EncodedMsg(i, e));
    }
    msgs.push_back(Commit());
    v1::PutResponse resp;
    grpc::Status put = testing::RawPut(c.client->stub(), msgs, &resp);
    ASSERT_TRUE(put.ok()) << put.error_message();
    EXPECT_EQ(resp.blocks_stored(), kBlocks);
    EXPECT_EQ(StoredBytes(c.client, c.ns, genesis_, kBlocks), sent);  // as they came
    const std::vector<uint32_t> tokens(genesis_.token_ids.begin(),
                                       genesis_.token_ids.begin() + kBlocks * 16);
    absl::StatusOr<KvDump> encoded_rec = c.client->Get(genesis_.model_id, tokens);
    absl::StatusOr<KvDump> encoded_res =
        c.client->Get(genesis_.model_id, tokens, {.mode = v1::GET_MODE_RESIDUAL});
    ASSERT_TRUE(encoded_rec.ok() && encoded_res.ok());
    // Inspect and Stats show the client's error, marked as reported by it.
    absl::StatusOr<v1::LookupResponse> look = c.client->Lookup(genesis_.model_id, tokens);
    ASSERT_TRUE(look.ok() && look->node_ids_size() == static_cast<int>(kBlocks));
    absl::StatusOr<v1::InspectResponse> node =
        c.client->Inspect(genesis_.model_id, look->node_ids(5));
    ASSERT_TRUE(node.ok()) << node.status();
    EXPECT_TRUE(node->node().error_client_reported());
    EXPECT_FLOAT_EQ(node->node().rel_rms_error_k(), errors_k[5]);
    absl::StatusOr<v1::StatsResponse> stats = c.client->Stats();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->client_reported_error_nodes(), kBlocks);
    ASSERT_TRUE(c.client->Delete(genesis_.model_id, first).ok());

    // The same blocks dense, encoded by the server against the same state.
    std::vector<v1::PutRequest> dense = {Msg(header)};
    for (uint32_t i = 0; i < kBlocks; ++i) dense.push_back(Msg(testing::BlockOf(genesis_, i)));
    dense.push_back(Commit());
    put = testing::RawPut(c.client->stub(), dense);
    ASSERT_TRUE(put.ok()) << put.error_message();
    // (Fast LOSSLESS codes against the learned state only when asked: learned_lossless.)
    EXPECT_EQ(StoredBytes(c.client, c.ns, genesis_, kBlocks), sent);
    absl::StatusOr<KvDump> dense_rec = c.client->Get(genesis_.model_id, tokens);
    absl::StatusOr<KvDump> dense_res =
        c.client->Get(genesis_.model_id, tokens, {.mode = v1::GET_MODE_RESIDUAL});
    ASSERT_TRUE(dense_rec.ok() && dense_res.ok());
    EXPECT_TRUE(dense_rec->k == encoded_rec->k && dense_rec->v == encoded_rec->v);
    EXPECT_TRUE(dense_res->k == encoded_res->k && dense_res->v == encoded_res->v);
    EXPECT_TRUE(dense_res->k == dense_rec->k && dense_res->v == dense_rec->v);
    if (c.encoding == Encoding::kLossless) {
      const KvDump original = FirstTokens(genesis_, kBlocks * 16);
      EXPECT_TRUE(dense_rec->k == original.k && dense_rec->v == original.v);  // bit-exact
    }
    look = c.client->Lookup(genesis_.model_id, tokens);
    ASSERT_TRUE(look.ok() && look->node_ids_size() == static_cast<int>(kBlocks));
    node = c.client->Inspect(genesis_.model_id, look->node_ids(5));
    ASSERT_TRUE(node.ok()) << node.status();
    EXPECT_FALSE(node->node().error_client_reported());  // measured by the server
    EXPECT_FLOAT_EQ(node->node().rel_rms_error_k(), errors_k[5]);
    ASSERT_TRUE(c.client->Delete(genesis_.model_id, first).ok());
  }
}

TEST_F(EncodedPutEndToEnd, AClientThatEncodesStoresWhatTheServerWouldEncode) {
  auto a = Client::Create({.target = server_->target(), .ns = "a", .codec_threads = 2});
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(a.get(), gpl_, 1));
  // The server learns from encoded Puts too: 24 blocks (384 tokens) stay under the 512-token
  // refit, so the dense Put below codes against the same version 1 as the client did.
  constexpr uint32_t kBlocks = 24;
  const KvDump genesis = FirstTokens(genesis_, kBlocks * 16);
  PutOptions o{.encoding = v1::ENCODING_RESIDUAL,
               .target_rel_rms = kTarget,
               .profile = v1::EncodingSpec::PROFILE_FAST,
               .encode_on_client = true};
  absl::StatusOr<v1::PutResponse> put = a->Put(genesis, o);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->blocks_stored(), kBlocks);
  const std::vector<std::string> encoded = StoredBytes(a.get(), "a", genesis, kBlocks);
  absl::StatusOr<v1::StatsResponse> stats = a->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->client_reported_error_nodes(), kBlocks);
  EXPECT_GT(stats->blocks_on_learned(), 0u);  // coded against version 1
  absl::StatusOr<KvDump> got = a->Get(genesis.model_id, genesis.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<uint32_t> first(genesis_.token_ids.begin(), genesis_.token_ids.begin() + 16);
  ASSERT_TRUE(a->Delete(genesis_.model_id, first).ok());
  o.encode_on_client = false;
  ASSERT_TRUE(a->Put(genesis, o).ok());
  EXPECT_EQ(StoredBytes(a.get(), "a", genesis, kBlocks), encoded);
  absl::StatusOr<KvDump> dense = a->Get(genesis.model_id, genesis.token_ids);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_TRUE(dense->k == got->k && dense->v == got->v);
  // What the client cannot encode (the compact profile) is sent dense: the server encodes it.
  ASSERT_TRUE(a->Delete(genesis_.model_id, first).ok());
  o.encode_on_client = true;
  o.profile = v1::EncodingSpec::PROFILE_COMPACT;
  absl::StatusOr<v1::PutResponse> compact = a->Put(genesis, o);
  ASSERT_TRUE(compact.ok()) << compact.status();
  stats = a->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->client_reported_error_nodes(), 0u);
  const std::vector<std::string> compact_bytes = StoredBytes(a.get(), "a", genesis, kBlocks);
  ASSERT_EQ(compact_bytes.size(), kBlocks);
  absl::StatusOr<BlockHeader> h = ParseBlock(compact_bytes[1]);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->profile, Profile::kCompact);
}

TEST_F(EncodedPutEndToEnd, EveryWrongFieldGetsItsStatusStoresNothingAndChangesNothing) {
  auto a = NewClient("a");
  auto b = NewClient("b");
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(a.get(), gpl_, 1));      // a: version 1
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(b.get(), gpl_, 1));      // b: version 1
  ASSERT_NO_FATAL_FAILURE(PutAndWaitForFits(b.get(), genesis_, 2));  // b: version 2
  absl::StatusOr<std::shared_ptr<const PredictorState>> a1 = a->GetPredictor(gpl_.model_id, 1);
  absl::StatusOr<std::shared_ptr<const PredictorState>> b2 = b->GetPredictor(gpl_.model_id, 2);
  ASSERT_TRUE(a1.ok() && b2.ok());
  testing::StoredSnapshot snap_a(a.get(), {&gpl_});
  testing::StoredSnapshot snap_b(b.get(), {&gpl_, &genesis_});

  // Genesis blocks 0-1 into namespace a: block 0 good, block 1 broken by each case.
  const EncodedBlock good0 = EncodeOf(genesis_, 0, Fast(Encoding::kResidual), a1->get());
  const EncodedBlock good1 = EncodeOf(genesis_, 1, Fast(Encoding::kResidual), a1->get());
  ASSERT_EQ(good1.predictor_version, 1u);
  const absl::StatusOr<BlockHeader> h1 = ParseBlock(good1.bytes);
  ASSERT_TRUE(h1.ok());
  // After the predictor version (flags bit 1) and the envelope's checks (bits 2 and 3).
  const size_t params_len_at = h1->params.data() - good1.bytes.data() - 4;
  const auto edited = [&](const std::function<void(std::string*)>& edit) {
    std::string bytes = good1.bytes;
    edit(&bytes);
    return FixCrc(bytes);
  };
  const auto rewrapped = [&](const std::string& payload, uint64_t reference = 0) {
    return internal::WriteEnvelope(h1->encoding, h1->geometry, reference, h1->params, payload,
                                   h1->profile, h1->predictor_version);
  };
  std::string payload(h1->payload);
  const int lanes = static_cast<uint8_t>(h1->params[2]);
  std::string cut_lane = payload, huge_segment = payload;
  const uint32_t cut = 4 * (lanes / 2) + 2, huge = 0xFFFFFFF0u;
  std::memcpy(cut_lane.data(), &cut, 4);
  std::memcpy(huge_segment.data(), &huge, 4);
  EncodeOptions compact = Fast(Encoding::kResidual);
  compact.profile = Profile::kCompact;
  EncodeOptions int8 = Fast(Encoding::kInt8);
  int8.profile = Profile::kCompact;
  // A stateless block (every plane coded) whose rANS words are changed: its structure is sound,
  // only decoding it (--verify_encoded_puts=all, as this server runs) finds it wrong.
  const std::string stateless = EncodeOf(genesis_, 1, Fast(Encoding::kResidual), nullptr).bytes;
  std::string bad_word;
  {
    const absl::StatusOr<BlockHeader> h = ParseBlock(stateless);
    EXPECT_TRUE(h.ok());
    const size_t per_segment =
        static_cast<uint8_t>(h->params[4]) | (static_cast<uint8_t>(h->params[5]) << 8);
    const size_t segments = (2 * h->geometry.num_layers + per_segment - 1) / per_segment;
    std::string p(h->payload);
    p[4 * segments + 4 * static_cast<uint8_t>(h->params[2]) + 20] ^= 0x55;
    bad_word = internal::WriteEnvelope(h->encoding, h->geometry, 0, h->params, p, h->profile, 0);
  }

  struct Case {
    std::string name;
    std::string bytes;
    grpc::StatusCode code;
    std::string message;  // contained in the status message
    uint32_t layer_end = 0;
    double rel_rms_error_k = 0;
  };
  const std::vector<Case> cases = {
      {"crc",
       [&] {
         std::string s = good1.bytes;
         s[s.size() / 2] ^= 1;
         return s;
       }(),
       grpc::StatusCode::INVALID_ARGUMENT, "kv: block 1 encoded: CRC-32C mismatch"},
      {"magic", edited([](std::string* s) { (*s)[0] = 'X'; }), grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: bad magic"},
      {"version", edited([](std::string* s) { (*s)[4] = 2; }), grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: unsupported format_version 2"},
      {"geometry", edited([](std::string* s) { (*s)[14] = 16; }),
       grpc::StatusCode::INVALID_ARGUMENT, "kv: block 1 encoded: head_dim: the block has 16"},
      {"dtype", edited([](std::string* s) { (*s)[6] = 2; }), grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: dtype: the block is bf16, the model fp16"},
      {"encoding", EncodeOf(genesis_, 1, int8, nullptr).bytes, grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: encoding: int8 is not accepted"},
      {"compact profile", EncodeOf(genesis_, 1, compact, nullptr).bytes,
       grpc::StatusCode::INVALID_ARGUMENT, "of the compact profile is not accepted"},
      {"reference node id", rewrapped(payload, 42), grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: reference_node_id: 42, must be 0"},
      {"truncated lane", rewrapped(cut_lane), grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: segment 0 lane " + std::to_string(lanes / 2) + " runs past"},
      {"segment length overflows", rewrapped(huge_segment), grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: segment 0 (4294967280 bytes) runs past the payload"},
      {"params length overflows",
       edited([&](std::string* s) { std::memcpy(s->data() + params_len_at, &huge, 4); }),
       grpc::StatusCode::INVALID_ARGUMENT, "kv: block 1 encoded: params_len past the end"},
      {"unknown predictor version", edited([](std::string* s) { (*s)[24] = 9; }),
       grpc::StatusCode::FAILED_PRECONDITION,
       "predictor_version: block 1 encoded: version 9 is not kept by this namespace and model; "
       "the latest is 1"},
      {"another namespace's version",
       EncodeOf(genesis_, 1, Fast(Encoding::kResidual), b2->get()).bytes,
       grpc::StatusCode::FAILED_PRECONDITION, "version 2 is not kept"},
      {"a layer range", good1.bytes, grpc::StatusCode::INVALID_ARGUMENT, "layer_begin: block 1", 2},
      {"a word of the rANS stream", bad_word, grpc::StatusCode::INVALID_ARGUMENT,
       "kv: block 1 encoded: does not decode: "},
      {"a NaN error", good1.bytes, grpc::StatusCode::INVALID_ARGUMENT, "rel_rms_error_k: block 1",
       0, std::numeric_limits<double>::quiet_NaN()},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::PutRequest bad = EncodedMsg(1, good1);
    bad.mutable_block()->set_encoded(c.bytes);
    bad.mutable_block()->set_layer_end(c.layer_end);
    bad.mutable_block()->set_rel_rms_error_k(c.rel_rms_error_k);
    const grpc::Status s =
        testing::RawPut(a->stub(), {Msg(FastHeader(genesis_, "a", 32, v1::ENCODING_RESIDUAL)),
                                    EncodedMsg(0, good0), bad, Commit()});
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_NE(s.error_message().find(c.message), std::string::npos) << s.error_message();
    absl::StatusOr<v1::LookupResponse> look = a->Lookup(genesis_.model_id, genesis_.token_ids);
    ASSERT_TRUE(look.ok());
    EXPECT_EQ(look->matched_blocks(), 0u) << "stored something";
    snap_a.Expect(c.name);
    snap_b.Expect(c.name);
  }
  // The good blocks alone are stored.
  const grpc::Status ok =
      testing::RawPut(a->stub(), {Msg(FastHeader(genesis_, "a", 32, v1::ENCODING_RESIDUAL)),
                                  EncodedMsg(0, good0), EncodedMsg(1, good1), Commit()});
  EXPECT_TRUE(ok.ok()) << ok.error_message();
}

}  // namespace
}  // namespace kvtrie
