// End-to-end tests: a real kvtrie-server process on a loopback port with a temporary data folder,
// driven through the C++ client library, the `kvtrie` CLI, raw gRPC stubs and a Node.js
// reflection client, on real KV caches of stories260K (tests/data).
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "client/client.h"
#include "codec/block_geometry.h"
#include "codec/kv_dump.h"
#include "codec/kv_layout.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;

constexpr int kSessions = 4;
constexpr uint32_t kSharedPrefixTokens = 369;  // sessions/*/manifest.json shared_prefix_tokens
constexpr uint64_t kBlockBytes = 5 * 2 * 4 * 16 * 8 * 2;  // one fp16 block of stories260K

std::string DataDir(const std::string& name) {
  return std::string(KVTRIE_TESTDATA_DIR) + "/" + name;
}

KvDump LoadDump(const std::string& name) {
  absl::StatusOr<KvDump> d = ReadKvDump(DataDir(name));
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

std::string SessionName(int i) { return "sessions/s" + std::to_string(i); }

class EndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (int i = 0; i < kSessions; ++i) sessions_.push_back(LoadDump(SessionName(i)));
  }

  void SetUp() override {
    test_dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    data_dir_ = test_dir_ + "/data";
    StartServer();
  }
  void TearDown() override {
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(test_dir_);  // keep the log of a failure
  }

  void StartServer() {
    absl::StatusOr<std::unique_ptr<ServerProcess>> s = ServerProcess::Start(data_dir_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }

  // A clean restart: SIGTERM, exit status 0, start again on the same data folder.
  void Restart() {
    ASSERT_EQ(server_->Stop(), 0) << server_->log();
    StartServer();
  }

  std::unique_ptr<Client> NewClient(const std::string& ns) {
    return Client::Create({.target = server_->target(), .ns = ns});
  }

  // Exactly the dump's full blocks, as Get returns them.
  static void ExpectSameKv(const KvDump& got, const KvDump& want, size_t tokens) {
    ASSERT_EQ(got.token_ids.size(), tokens);
    const size_t row = want.num_tokens() * want.head_dim * 2;
    const size_t got_row = tokens * want.head_dim * 2;
    for (size_t r = 0; r < want.num_layers * want.num_kv_heads; ++r) {
      ASSERT_EQ(0, memcmp(got.k.data() + r * got_row, want.k.data() + r * row, got_row)) << r;
      ASSERT_EQ(0, memcmp(got.v.data() + r * got_row, want.v.data() + r * row, got_row)) << r;
    }
  }

  void PutAllSessions(Client& client, v1::Encoding encoding) {
    for (const KvDump& s : sessions_) {
      absl::StatusOr<v1::PutResponse> r =
          client.Put(s, {.encoding = encoding, .layers_per_message = 2});
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->stored_tokens(), 512u);
      EXPECT_EQ(r->tail_tokens_ignored(), 0u);
    }
  }

  void ExpectEverySessionBitExact(Client& client, v1::GetMode mode) {
    for (const KvDump& s : sessions_) {
      absl::StatusOr<KvDump> got = client.Get(s.model_id, s.token_ids, {.mode = mode});
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSameKv(*got, s, 512);
    }
  }

  static std::vector<KvDump> sessions_;
  std::string test_dir_;
  std::string data_dir_;
  std::unique_ptr<ServerProcess> server_;
};

std::vector<KvDump> EndToEnd::sessions_;

TEST_F(EndToEnd, LookupReturnsEachSessionsFullBlockAlignedLength) {
  auto client = NewClient("");
  PutAllSessions(*client, v1::ENCODING_LOSSLESS);
  for (const KvDump& s : sessions_) {
    absl::StatusOr<v1::LookupResponse> r = client->Lookup(s.model_id, s.token_ids);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->matched_tokens(), 512u);
    EXPECT_EQ(r->matched_blocks(), 32u);
    EXPECT_EQ(r->node_ids_size(), 32);
  }
  // A sequence that only shares the preamble matches its full shared blocks and no more.
  std::vector<uint32_t> other(sessions_[0].token_ids.begin(),
                              sessions_[0].token_ids.begin() + kSharedPrefixTokens);
  other.resize(512, 3);
  EXPECT_EQ(client->Lookup(sessions_[0].model_id, other)->matched_tokens(),
            kSharedPrefixTokens / 16 * 16);
}

TEST_F(EndToEnd, PackedLookupFromTheCallersMemoryAgreesWithVarintIds) {
  // kvtrie::Client sends the ids of a Lookup as token_ids_packed straight from the caller's
  // memory (its own wire bytes); the varint path is the reference. Prefixes end inside the
  // trie's compressed edges (the sessions share 369 tokens, then branch), on a block boundary,
  // inside a block, or are empty; one diverges inside an edge.
  auto packed = NewClient("ns-a");
  ClientOptions varint_options{.target = server_->target(), .ns = "ns-a"};
  varint_options.packed_token_ids = false;
  auto varint = Client::Create(varint_options);
  PutAllSessions(*packed, v1::ENCODING_RAW);
  std::vector<uint32_t> diverging = sessions_[1].token_ids;
  diverging[200] ^= 1;
  for (const KvDump& s : {sessions_[0], sessions_[1]}) {
    for (size_t n : {0u, 7u, 16u, 100u, 368u, 369u, 400u, 512u}) {
      const absl::Span<const uint32_t> prefix(s.token_ids.data(), n);
      absl::StatusOr<v1::LookupResponse> a = packed->Lookup(s.model_id, prefix);
      absl::StatusOr<v1::LookupResponse> b = varint->Lookup(s.model_id, prefix);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_EQ(a->matched_tokens(), n / 16 * 16) << n;
      EXPECT_EQ(a->block_tokens(), 16u);
      EXPECT_EQ(std::vector<uint64_t>(a->node_ids().begin(), a->node_ids().end()),
                std::vector<uint64_t>(b->node_ids().begin(), b->node_ids().end()))
          << n;
    }
  }
  absl::StatusOr<v1::LookupResponse> d = packed->Lookup(sessions_[1].model_id, diverging);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->matched_tokens(), 192u);
  // Another namespace sees nothing; an unknown model is a miss, not an error.
  EXPECT_EQ(
      NewClient("ns-b")->Lookup(sessions_[0].model_id, sessions_[0].token_ids)->node_ids_size(), 0);
  absl::StatusOr<v1::LookupResponse> unknown = packed->Lookup("no-such-model", diverging);
  ASSERT_TRUE(unknown.ok()) << unknown.status();
  EXPECT_EQ(unknown->block_tokens(), 0u);
}

TEST_F(EndToEnd, StatsShowTheSharedPrefixStoredOnce) {
  auto client = NewClient("");
  PutAllSessions(*client, v1::ENCODING_LOSSLESS);
  absl::StatusOr<v1::StatsResponse> st = client->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  constexpr uint64_t kShared = kSharedPrefixTokens / 16;  // 23 full blocks are common
  constexpr uint64_t kUnique = 32 - kShared;
  EXPECT_EQ(st->nodes(), kShared + kSessions * kUnique);
  EXPECT_EQ(st->blocks_stored(), kShared + kSessions * kUnique);
  EXPECT_EQ(st->blocks_deduplicated(), (kSessions - 1) * kShared);
  EXPECT_EQ(st->bytes_logical(), (kShared + kSessions * kUnique) * kBlockBytes);
  EXPECT_LT(st->bytes_stored(), st->bytes_logical());
  // The store holds fewer bytes than one copy per session would need even uncompressed... and
  // the shared blocks' bytes appear once: storing s0 alone costs more than a third of all four.
  auto alone = NewClient("alone");
  ASSERT_TRUE(alone->Put(sessions_[0], {.encoding = v1::ENCODING_LOSSLESS}).ok());
  const uint64_t one = alone->Stats()->bytes_stored();
  EXPECT_LT(st->bytes_stored(), 2 * one);
  EXPECT_EQ(client->Stats("alone")->nodes(), 32u);
}

TEST_F(EndToEnd, GetIsBitIdenticalWithBothEncodingsAndAfterARestart) {
  auto raw = NewClient("raw");
  auto lossless = NewClient("lossless");
  PutAllSessions(*raw, v1::ENCODING_RAW);
  PutAllSessions(*lossless, v1::ENCODING_LOSSLESS);
  for (Client* c : {raw.get(), lossless.get()}) {
    ExpectEverySessionBitExact(*c, v1::GET_MODE_RECONSTRUCTED);
    ExpectEverySessionBitExact(*c, v1::GET_MODE_RESIDUAL);
  }
  const v1::StatsResponse before = *raw->Stats("");
  raw.reset();
  lossless.reset();
  Restart();
  raw = NewClient("raw");
  lossless = NewClient("lossless");
  for (Client* c : {raw.get(), lossless.get()}) {
    ExpectEverySessionBitExact(*c, v1::GET_MODE_RECONSTRUCTED);
  }
  const v1::StatsResponse after = *raw->Stats("");
  EXPECT_EQ(after.nodes(), before.nodes());
  EXPECT_EQ(after.bytes_stored(), before.bytes_stored());
}

TEST_F(EndToEnd, HealthIsServingAndReflectionWorksFromNode) {
  auto channel = grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  for (const char* service : {"", "kvtrie.v1.KVCache"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  auto client = NewClient("");
  ASSERT_TRUE(client->Put(sessions_[0], {}).ok());

  const std::string dir = std::string(KVTRIE_SOURCE_DIR) + "/tests/reflection";
  ASSERT_TRUE(std::filesystem::exists(dir + "/node_modules/grpc-js-reflection-client"))
      << "run `npm ci --prefix tests/reflection` first (the README's test command does)";
  std::string out, err;
  const int rc = testing::RunCommand(
      {"/usr/bin/env", "node", dir + "/reflect.js", server_->target()}, &out, &err);
  ASSERT_EQ(rc, 0) << err;
  nlohmann::json j = nlohmann::json::parse(out);
  std::vector<std::string> services = j["services"];
  EXPECT_NE(std::find(services.begin(), services.end(), "kvtrie.v1.KVCache"), services.end());
  EXPECT_NE(std::find(services.begin(), services.end(), "grpc.health.v1.Health"), services.end());
  EXPECT_EQ(j["stats"]["nodes"], "32");  // proto3 JSON prints uint64 as strings
  EXPECT_EQ(j["health"], "SERVING");
  EXPECT_NE(std::find(j["kvcache_methods"].begin(), j["kvcache_methods"].end(), "Put"),
            j["kvcache_methods"].end());
}

// Relative RMS error ||x - x'|| / ||x|| of the first `tokens` tokens of K (is_v false) or V.
double RelRms(const KvDump& got, const KvDump& want, size_t tokens, bool is_v) {
  const std::vector<uint8_t>& a = is_v ? got.v : got.k;
  const std::vector<uint8_t>& b = is_v ? want.v : want.k;
  const size_t d = want.head_dim;
  double err = 0, ref = 0;
  for (size_t r = 0; r < want.num_layers * want.num_kv_heads; ++r) {
    for (size_t i = 0; i < tokens * d; ++i) {
      uint16_t x, y;
      memcpy(&x, a.data() + 2 * (r * tokens * d + i), 2);
      memcpy(&y, b.data() + 2 * (r * want.num_tokens() * d + i), 2);
      const double fx = HalfToFloat(x), fy = HalfToFloat(y);
      err += (fx - fy) * (fx - fy);
      ref += fy * fy;
    }
  }
  return std::sqrt(err / ref);
}

TEST_F(EndToEnd, ResidualEncodingMeetsItsErrorTargetThroughTheServer) {
  constexpr double kTarget = 0.05;
  auto client = NewClient("lossy");
  for (const KvDump& s : sessions_) {
    absl::StatusOr<v1::PutResponse> r =
        client->Put(s, {.encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = kTarget});
    ASSERT_TRUE(r.ok()) << r.status();
    for (const v1::BlockResult& b : r->blocks()) {
      if (b.disposition() != v1::BLOCK_STORED) continue;
      EXPECT_EQ(b.encoding(), v1::ENCODING_RESIDUAL);
      EXPECT_LE(b.rel_rms_error_k(), kTarget * 1.0001);
      EXPECT_LE(b.rel_rms_error_v(), kTarget * 1.0001);
      EXPECT_LT(b.bits_per_component(), 8.0);
    }
  }
  for (const KvDump& s : sessions_) {
    absl::StatusOr<KvDump> dense = client->Get(s.model_id, s.token_ids);
    absl::StatusOr<KvDump> decoded_here =
        client->Get(s.model_id, s.token_ids, {.mode = v1::GET_MODE_RESIDUAL});
    ASSERT_TRUE(dense.ok()) << dense.status();
    ASSERT_TRUE(decoded_here.ok()) << decoded_here.status();
    EXPECT_EQ(dense->k, decoded_here->k);  // the client's decoder is the server's
    EXPECT_EQ(dense->v, decoded_here->v);
    EXPECT_LE(RelRms(*dense, s, 512, false), kTarget);
    EXPECT_LE(RelRms(*dense, s, 512, true), kTarget);
    EXPECT_GT(RelRms(*dense, s, 512, false), 0);  // lossy for real
  }
  v1::StatsResponse st = *client->Stats();
  EXPECT_EQ(st.lossy_nodes(), st.nodes());
  EXPECT_LE(st.max_rel_rms_error(), kTarget * 1.0001);
  EXPECT_GT(st.compression_ratio(), 3.0);
  // A bad target names its field.
  absl::StatusOr<v1::PutResponse> bad =
      client->Put(sessions_[0], {.encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = 1.5});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("encoding.target_rel_rms"), std::string::npos);
}

TEST_F(EndToEnd, FastProfileBlocksMeetTheTargetAndDecodeAnywhere) {
  constexpr double kTarget = 0.1;
  auto client = NewClient("fast");
  const KvDump& s = sessions_[1];
  absl::StatusOr<v1::PutResponse> r = client->Put(s, {.encoding = v1::ENCODING_RESIDUAL,
                                                      .target_rel_rms = kTarget,
                                                      .profile = v1::EncodingSpec::PROFILE_FAST});
  ASSERT_TRUE(r.ok()) << r.status();
  for (const v1::BlockResult& b : r->blocks()) {
    EXPECT_LE(b.rel_rms_error_k(), kTarget * 1.0001);
    EXPECT_LE(b.rel_rms_error_v(), kTarget * 1.0001);
  }
  absl::StatusOr<KvDump> dense = client->Get(s.model_id, s.token_ids);
  absl::StatusOr<KvDump> decoded_here =
      client->Get(s.model_id, s.token_ids, {.mode = v1::GET_MODE_RESIDUAL});
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_TRUE(decoded_here.ok()) << decoded_here.status();
  EXPECT_EQ(dense->k, decoded_here->k);
  EXPECT_EQ(dense->v, decoded_here->v);
  EXPECT_LE(RelRms(*dense, s, 512, false), kTarget);
  EXPECT_GT(RelRms(*dense, s, 512, false), 0);
  // Lossless fast is bit-exact.
  auto exact = NewClient("fast-lossless");
  ASSERT_TRUE(
      exact->Put(s, {.encoding = v1::ENCODING_LOSSLESS, .profile = v1::EncodingSpec::PROFILE_FAST})
          .ok());
  absl::StatusOr<KvDump> back = exact->Get(s.model_id, s.token_ids);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->k, s.k);
  EXPECT_EQ(back->v, s.v);
  // FAST has no bits budget: the error names the field.
  absl::StatusOr<v1::PutResponse> bad = exact->Put(s, {.encoding = v1::ENCODING_RESIDUAL,
                                                       .target_rel_rms = 1.5,
                                                       .profile = v1::EncodingSpec::PROFILE_FAST});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- Bad input ----

class BadInput : public EndToEnd {
 protected:
  void SetUp() override {
    EndToEnd::SetUp();
    client_ = NewClient("");
    ASSERT_TRUE(client_->Put(sessions_[0], {}).ok());
    before_ = *client_->Stats();
  }
  // Nothing stored changed and s0 still reads back bit-exact.
  void ExpectUnchanged() {
    v1::StatsResponse now = *client_->Stats();
    EXPECT_EQ(now.nodes(), before_.nodes());
    EXPECT_EQ(now.bytes_stored(), before_.bytes_stored());
    absl::StatusOr<KvDump> got = client_->Get(sessions_[0].model_id, sessions_[0].token_ids);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameKv(*got, sessions_[0], 512);
  }
  // Sends `header` and then `blocks` on a raw Put stream; returns the status.
  grpc::Status RawPut(const v1::PutHeader& header, const std::vector<v1::PutBlock>& blocks,
                      bool commit = true) {
    v1::PutResponse resp;
    grpc::ClientContext ctx;
    auto writer = client_->stub()->Put(&ctx, &resp);
    v1::PutRequest req;
    *req.mutable_header() = header;
    writer->Write(req);
    for (const v1::PutBlock& b : blocks) {
      req.Clear();
      *req.mutable_block() = b;
      if (!writer->Write(req)) break;
    }
    if (commit) {
      req.Clear();
      req.mutable_commit();
      writer->Write(req);
    }
    writer->WritesDone();
    return writer->Finish();
  }
  static v1::PutHeader Header(const KvDump& d, size_t tokens) {
    v1::PutHeader h;
    h.mutable_model()->set_model_id(d.model_id);
    h.mutable_model()->set_num_layers(d.num_layers);
    h.mutable_model()->set_num_kv_heads(d.num_kv_heads);
    h.mutable_model()->set_head_dim(d.head_dim);
    h.mutable_model()->set_dtype(v1::DTYPE_FP16);
    h.mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.begin() + tokens);
    return h;
  }
  static std::vector<v1::PutBlock> Blocks(const KvDump& d, size_t first, size_t count) {
    BlockGeometry g{d.num_layers, d.num_kv_heads, 16, d.head_dim, d.dtype};
    std::vector<v1::PutBlock> out;
    std::vector<uint8_t> block(g.num_bytes());
    for (size_t b = first; b < first + count; ++b) {
      GatherBlock(g, d.num_tokens(), d.k.data(), d.v.data(), b, absl::MakeSpan(block));
      v1::PutBlock pb;
      pb.set_block_index(static_cast<uint32_t>(b));
      pb.set_kv(block.data(), block.size());
      out.push_back(pb);
    }
    return out;
  }
  static void ExpectInvalid(const grpc::Status& s, const std::string& field) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(field), std::string::npos)
        << "message should name " << field << ": " << s.error_message();
  }

  std::unique_ptr<Client> client_;
  v1::StatsResponse before_;
};

TEST_F(BadInput, WrongHeadDimIsRejectedNamingHeadDim) {
  const KvDump& s1 = sessions_[1];
  // The model is stored with head_dim 8: a spec saying 16 contradicts it.
  v1::PutHeader h = Header(s1, 512);
  h.mutable_model()->set_head_dim(16);
  ExpectInvalid(RawPut(h, Blocks(s1, 0, 32)), "model.head_dim");
  // A new model whose spec says head_dim 16 but whose tensors are head_dim 8.
  h.mutable_model()->set_model_id("fresh-model");
  ExpectInvalid(RawPut(h, Blocks(s1, 0, 32)), "head_dim");
  EXPECT_EQ(client_->Stats()->models(), 1u);  // the failed Put left no model behind
  ExpectUnchanged();
  // ...so the right spec is still accepted for that model id.
  KvDump fresh = s1;
  fresh.model_id = "fresh-model";
  ASSERT_TRUE(client_->Put(fresh, {}).ok());
}

TEST_F(BadInput, TokenCountNotMatchingTheTensorsIsRejected) {
  const KvDump& s2 = sessions_[2];
  // token_ids claim 512 tokens (32 blocks) but KV arrives for 20 blocks.
  ExpectInvalid(RawPut(Header(s2, 512), Blocks(s2, 0, 20)), "kv: blocks [23, 32)");
  // token_ids claim 100 tokens (6 full blocks) but KV arrives for 32 blocks.
  ExpectInvalid(RawPut(Header(s2, 100), Blocks(s2, 0, 32)), "block_index");
  // The client library refuses tensors that do not match the token count before sending.
  KvDump short_tokens = s2;
  short_tokens.token_ids.resize(500);
  short_tokens.surprisal_bits.resize(500);
  absl::StatusOr<v1::PutResponse> r = client_->Put(short_tokens, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kv:"), std::string::npos) << r.status();
  ExpectUnchanged();
}

TEST_F(BadInput, UnknownDtypeIsRejectedNamingDtype) {
  v1::PutHeader h = Header(sessions_[3], 512);
  h.mutable_model()->set_dtype(static_cast<v1::DType>(7));
  ExpectInvalid(RawPut(h, Blocks(sessions_[3], 0, 32)), "model.dtype");
  h.mutable_model()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectInvalid(RawPut(h, Blocks(sessions_[3], 0, 32)), "model.dtype");
  ExpectUnchanged();
}

TEST_F(BadInput, TruncatedStreamIsRejectedAndStoresNothing) {
  const KvDump& s3 = sessions_[3];
  std::vector<v1::PutBlock> blocks = Blocks(s3, 0, 32);
  // Block 31 carries only its first two layers, then the stream ends.
  blocks.back().set_layer_end(2);
  blocks.back().mutable_kv()->resize(blocks.back().kv().size() * 2 / 5);
  ExpectInvalid(RawPut(Header(s3, 512), blocks), "kv: block 31 is missing layers [2, 5)");
  // Every block whole, but the stream ends without its PutCommit (a cut or cancelled stream).
  ExpectInvalid(RawPut(Header(s3, 512), Blocks(s3, 0, 32), /*commit=*/false), "commit:");
  // A stream with no header at all.
  {
    v1::PutResponse resp;
    grpc::ClientContext ctx;
    auto writer = client_->stub()->Put(&ctx, &resp);
    writer->WritesDone();
    ExpectInvalid(writer->Finish(), "header");
  }
  // A block whose bytes are cut short.
  blocks = Blocks(s3, 0, 32);
  blocks[5].mutable_kv()->resize(100);
  ExpectInvalid(RawPut(Header(s3, 512), blocks), "kv: block 5");
  EXPECT_EQ(client_->Lookup(s3.model_id, s3.token_ids)->matched_tokens(), 368u);  // shared only
  ExpectUnchanged();
}

TEST_F(BadInput, UnknownPrefixesAndNodesAreNotFoundOrMisses) {
  absl::StatusOr<KvDump> miss = client_->Get("no-such-model", sessions_[0].token_ids);
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_TRUE(miss->token_ids.empty());
  EXPECT_EQ(client_->Inspect(sessions_[0].model_id, 999999).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Delete("no-such-model", sessions_[0].token_ids).status().code(),
            absl::StatusCode::kNotFound);
  ExpectUnchanged();
}

// ---- The CLI ----

TEST_F(EndToEnd, CliPutsGetsAndReportsStatsAsJson) {
  const std::string cli = testing::BinaryPath("client/kvtrie");
  const std::string target = "--target=" + server_->target();
  std::string out, err;
  for (int i = 0; i < kSessions; ++i) {
    ASSERT_EQ(testing::RunCommand({cli, target, "put", DataDir(SessionName(i))}, &out, &err), 0)
        << err;
  }
  ASSERT_EQ(testing::RunCommand({cli, target, "stats"}, &out, &err), 0) << err;
  nlohmann::json stats = nlohmann::json::parse(out);
  for (const char* key :
       {"nodes", "blocks_stored", "blocks_deduplicated", "bytes_logical", "bytes_stored"}) {
    ASSERT_TRUE(stats.contains(key)) << key << " missing from " << out;
  }
  EXPECT_EQ(stats["nodes"], 59);
  EXPECT_EQ(stats["blocks_deduplicated"], 69);

  ASSERT_EQ(testing::RunCommand({cli, target, "lookup", DataDir("sessions/s1")}, &out, &err), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["matched_tokens"], 512);

  const std::string got = testing::FreshDir("cli_get");
  for (const char* mode : {"--mode=reconstructed", "--mode=residual"}) {
    ASSERT_EQ(
        testing::RunCommand({cli, target, mode, "get", DataDir("sessions/s2"), got}, &out, &err), 0)
        << err;
    auto s2 = ReadKvDump(got);
    ASSERT_TRUE(s2.ok()) << s2.status();
    ExpectSameKv(*s2, sessions_[2], 512);
  }

  std::filesystem::remove_all(got);
  ASSERT_EQ(testing::RunCommand({cli, target, "--model_id=stories260K", "inspect"}, &out, &err), 0)
      << err;
  nlohmann::json root = nlohmann::json::parse(out);
  EXPECT_EQ(root["node"]["depth"], 0);
  EXPECT_EQ(root["children"].size(), 1u);  // the shared preamble's first block

  // Errors: one line, non-zero exit.
  EXPECT_EQ(testing::RunCommand({cli, target, "put", "/no/such/dir"}, &out, &err), 1);
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_NE(err.find("NOT_FOUND"), std::string::npos) << err;
  EXPECT_EQ(testing::RunCommand({cli, "--target=127.0.0.1:1", "--timeout_seconds=2", "stats"}, &out,
                                &err),
            1);
  EXPECT_NE(err.find("UNAVAILABLE"), std::string::npos) << err;
}

}  // namespace
}  // namespace kvtrie
