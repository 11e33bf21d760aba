// End-to-end tests of the Get and Lookup hot paths (issue 10) against a real kvtrie-server: a
// prefix whose blocks mix raw, compact-residual and fast-profile encodings reads back the same
// through the zero-copy, pipelined RECONSTRUCTED path (one and three codec threads) as through
// the client's own decode; token ids sent packed or as varints match the same blocks; bad packed
// ids are INVALID_ARGUMENT naming the field; a cold block read by one Get is read from RocksDB
// once and stays cold.
#include <grpcpp/grpcpp.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;

KvDump LoadSession(int i) {
  absl::StatusOr<KvDump> d =
      ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s" + std::to_string(i));
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

class GetPath : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(absl::StrCat("get_path_", GetParam()));
    absl::StatusOr<std::unique_ptr<ServerProcess>> s = ServerProcess::Start(
        dir_ + "/data",
        {absl::StrCat("--codec_threads=", GetParam()), "--max_get_message_bytes=4096"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    client_ = Client::Create({.target = server_->target(), .ns = "get"});
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
};

// Sessions 0-2 share a 369-token preamble: s0 stores it raw, s1 extends it with compact residual
// blocks (the first predicts from a raw parent), s2 with fast-profile ones.
TEST_P(GetPath, MixedEncodingsReadBackTheSameThroughEveryPath) {
  const KvDump s0 = LoadSession(0), s1 = LoadSession(1), s2 = LoadSession(2);
  ASSERT_TRUE(client_->Put(s0, {.encoding = v1::ENCODING_RAW}).ok());
  ASSERT_TRUE(client_->Put(s1, {.encoding = v1::ENCODING_RESIDUAL, .target_rel_rms = 0.1}).ok());
  ASSERT_TRUE(client_
                  ->Put(s2, {.encoding = v1::ENCODING_RESIDUAL,
                             .target_rel_rms = 0.1,
                             .profile = v1::EncodingSpec::PROFILE_FAST})
                  .ok());
  absl::StatusOr<KvDump> raw = client_->Get(s0.model_id, s0.token_ids);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(raw->k, s0.k);  // raw blocks straight from their payloads, bit-exact
  EXPECT_EQ(raw->v, s0.v);
  for (const KvDump* s : {&s1, &s2}) {
    absl::StatusOr<KvDump> dense = client_->Get(s->model_id, s->token_ids);
    absl::StatusOr<KvDump> here =
        client_->Get(s->model_id, s->token_ids, {.mode = v1::GET_MODE_RESIDUAL});
    ASSERT_TRUE(dense.ok()) << dense.status();
    ASSERT_TRUE(here.ok()) << here.status();
    ASSERT_EQ(dense->token_ids.size(), 512u);
    EXPECT_EQ(dense->k, here->k);
    EXPECT_EQ(dense->v, here->v);
    EXPECT_NE(dense->k, s->k);  // lossy past the preamble: a real decode ran
    // The shared preamble's 23 full blocks are s0's raw ones.
    const size_t row = 512 * s->head_dim * 2, shared = 368 * s->head_dim * 2;
    for (size_t r = 0; r < s->num_layers * s->num_kv_heads; ++r) {
      ASSERT_EQ(0, std::memcmp(dense->k.data() + r * row, s0.k.data() + r * row, shared)) << r;
    }
  }
}

TEST_P(GetPath, PackedTokenIdsMatchTheSameBlocksAndBadOnesNameTheField) {
  const KvDump s0 = LoadSession(0);
  ASSERT_TRUE(client_->Put(s0, {.encoding = v1::ENCODING_LOSSLESS}).ok());
  auto stub = v1::KVCache::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  v1::LookupRequest varints;
  varints.set_namespace_("get");
  varints.set_model_id(s0.model_id);
  varints.mutable_token_ids()->Add(s0.token_ids.begin(), s0.token_ids.end());
  v1::LookupRequest packed = varints;
  packed.clear_token_ids();
  packed.mutable_token_ids_packed()->assign(reinterpret_cast<const char*>(s0.token_ids.data()),
                                            s0.token_ids.size() * 4);
  v1::LookupResponse a, b;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Lookup(&ctx, varints, &a).ok());
  }
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Lookup(&ctx, packed, &b).ok());
  }
  EXPECT_EQ(a.matched_blocks(), 32u);
  EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
  // The client library sends packed ids; it matches the same.
  absl::StatusOr<v1::LookupResponse> c = client_->Lookup(s0.model_id, s0.token_ids);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->SerializeAsString(), a.SerializeAsString());

  v1::LookupRequest both = packed;
  both.add_token_ids(1);
  v1::LookupRequest ragged = packed;
  ragged.mutable_token_ids_packed()->push_back('x');
  for (const v1::LookupRequest* r : {&both, &ragged}) {
    grpc::ClientContext ctx;
    v1::LookupResponse resp;
    grpc::Status s = stub->Lookup(&ctx, *r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("token_ids_packed"), std::string::npos) << s.error_message();
  }
  // Get takes them too: a packed, unaligned-length request is refused, a packed one served.
  v1::GetRequest get;
  get.set_namespace_("get");
  get.set_model_id(s0.model_id);
  get.set_token_ids_packed(std::string(7, '\0'));
  {
    grpc::ClientContext ctx;
    auto reader = stub->Get(&ctx, get);
    v1::GetResponse msg;
    EXPECT_FALSE(reader->Read(&msg));
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("token_ids_packed"), std::string::npos) << s.error_message();
  }
  get.set_token_ids_packed(packed.token_ids_packed());
  {
    grpc::ClientContext ctx;
    auto reader = stub->Get(&ctx, get);
    v1::GetResponse msg;
    ASSERT_TRUE(reader->Read(&msg));
    EXPECT_EQ(msg.header().matched_blocks(), 32u);
    size_t blocks = 0;
    while (reader->Read(&msg)) blocks += msg.block().layer_begin() == 0;
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(blocks, 32u);
  }
}

// The tiers' rule "a block read once stays cold" over the wire (issue 19): after a restart every
// block is cold; one Get RECONSTRUCTED of compact-residual blocks (decoded on the chain, each from
// its parent) reads each payload from RocksDB once and promotes none; a second Get promotes them.
TEST_P(GetPath, AColdBlockReadByOneGetIsReadOnceAndStaysCold) {
  const KvDump s1 = LoadSession(1);
  ASSERT_TRUE(client_
                  ->Put(s1, {.encoding = v1::ENCODING_RESIDUAL,
                             .target_rel_rms = 0.1,
                             .profile = v1::EncodingSpec::PROFILE_COMPACT})
                  .ok());
  client_.reset();
  server_.reset();  // stops it
  absl::StatusOr<std::unique_ptr<ServerProcess>> s = ServerProcess::Start(
      dir_ + "/data",
      {absl::StrCat("--codec_threads=", GetParam()), "--max_get_message_bytes=4096"});
  ASSERT_TRUE(s.ok()) << s.status();
  server_ = *std::move(s);
  client_ = Client::Create({.target = server_->target(), .ns = "get"});
  absl::StatusOr<v1::StatsResponse> before = client_->Stats();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->cold_reads(), 0u);
  ASSERT_EQ(before->hot_nodes(), 0u);
  absl::StatusOr<KvDump> dense = client_->Get(s1.model_id, s1.token_ids);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_EQ(dense->token_ids.size(), 512u);
  EXPECT_NE(dense->k, s1.k);  // lossy: decoded, not raw
  absl::StatusOr<v1::StatsResponse> after = client_->Stats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->cold_reads(), 32u);  // once per block, not once framed and once decoded
  EXPECT_EQ(after->promotions(), 0u);
  EXPECT_EQ(after->hot_nodes(), 0u);
  absl::StatusOr<KvDump> again = client_->Get(s1.model_id, s1.token_ids);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->k, dense->k);
  EXPECT_EQ(again->v, dense->v);
  after = client_->Stats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->cold_reads(), 64u);
  EXPECT_EQ(after->promotions(), 32u);  // read again while cold: brought back
}

INSTANTIATE_TEST_SUITE_P(CodecThreads, GetPath, ::testing::Values(1, 3));

}  // namespace
}  // namespace kvtrie
