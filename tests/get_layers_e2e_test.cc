// End-to-end tests of a Get of a layer range (GetRequest.layer_begin / layer_end, issue 23: a
// worker loads layer group by layer group) against a real kvtrie-server: the range equals the
// same layers of a whole Get, only its layers travel (split into several messages), and bad
// ranges are INVALID_ARGUMENT naming the field.
#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;

class GetLayers : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir("get_layers");
    // Small messages: a range of a 5-layer block is split by layer.
    absl::StatusOr<std::unique_ptr<ServerProcess>> s =
        ServerProcess::Start(dir_ + "/data", {"--max_get_message_bytes=600"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    client_ = Client::Create({.target = server_->target(), .ns = "layers"});
    absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s0");
    ASSERT_TRUE(d.ok()) << d.status();
    s0_ = *std::move(d);
    ASSERT_EQ(s0_.num_layers, 5u);
    ASSERT_TRUE(client_->Put(s0_, {.encoding = v1::ENCODING_LOSSLESS}).ok());
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }

  // Layers [begin, end) of a [layers][heads][tokens][head_dim] sequence-layout buffer.
  static std::vector<uint8_t> Slice(const KvDump& d, const std::vector<uint8_t>& x, uint32_t begin,
                                    uint32_t end) {
    const size_t per_layer = x.size() / d.num_layers;
    return std::vector<uint8_t>(x.begin() + begin * per_layer, x.begin() + end * per_layer);
  }

  v1::GetRequest Raw(uint32_t begin, uint32_t end, v1::GetMode mode) const {
    v1::GetRequest r;
    r.set_namespace_("layers");
    r.set_model_id(s0_.model_id);
    r.mutable_token_ids()->Add(s0_.token_ids.begin(), s0_.token_ids.end());
    r.set_mode(mode);
    r.set_layer_begin(begin);
    r.set_layer_end(end);
    return r;
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
  KvDump s0_;
};

TEST_F(GetLayers, ARangeEqualsThoseLayersOfTheWholeGet) {
  absl::StatusOr<KvDump> full = client_->Get(s0_.model_id, s0_.token_ids);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_EQ(full->token_ids.size(), 512u);
  EXPECT_EQ(full->k, s0_.k);  // lossless
  struct Range {
    uint32_t begin, end, expect_end;
  };
  for (Range r : {Range{0, 1, 1}, Range{1, 3, 3}, Range{4, 5, 5}, Range{2, 0, 5}, Range{0, 5, 5}}) {
    SCOPED_TRACE(absl::StrCat("layers [", r.begin, ", ", r.end, ")"));
    absl::StatusOr<KvDump> part =
        client_->Get(s0_.model_id, s0_.token_ids, {.layer_begin = r.begin, .layer_end = r.end});
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(part->num_layers, r.expect_end - r.begin);
    EXPECT_EQ(part->token_ids, full->token_ids);
    EXPECT_EQ(part->k, Slice(s0_, full->k, r.begin, r.expect_end));
    EXPECT_EQ(part->v, Slice(s0_, full->v, r.begin, r.expect_end));
  }
  // A prefix of the prompt and max_blocks still apply.
  absl::StatusOr<KvDump> two = client_->Get(s0_.model_id, s0_.token_ids,
                                            {.max_blocks = 2, .layer_begin = 3, .layer_end = 4});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->token_ids.size(), 32u);
  EXPECT_EQ(two->num_layers, 1u);
}

TEST_F(GetLayers, OnlyTheRangesLayersAreSent) {
  auto stub = v1::KVCache::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto reader = stub->Get(&ctx, Raw(1, 3, v1::GET_MODE_RECONSTRUCTED));
  v1::GetResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  ASSERT_TRUE(msg.has_header());
  const uint32_t blocks = msg.header().matched_blocks();
  ASSERT_EQ(blocks, 32u);
  size_t messages = 0, bytes = 0;
  while (reader->Read(&msg)) {
    ++messages;
    EXPECT_GE(msg.block().layer_begin(), 1u);
    EXPECT_LE(msg.block().layer_end(), 3u);
    bytes += msg.block().kv().size();
  }
  ASSERT_TRUE(reader->Finish().ok());
  const size_t layer_bytes = 2 * 4 * 16 * 8 * 2;  // K and V, 4 heads, 16 tokens, 8 dims, fp16
  EXPECT_EQ(bytes, blocks * 2 * layer_bytes);
  EXPECT_EQ(messages, blocks * 2);  // 600-byte messages: one layer (1,024 bytes) each
}

TEST_F(GetLayers, BadRangesAreInvalidArgumentNamingTheField) {
  auto stub = v1::KVCache::NewStub(
      grpc::CreateChannel(server_->target(), grpc::InsecureChannelCredentials()));
  struct Case {
    uint32_t begin, end;
    v1::GetMode mode;
    const char* field;
  };
  for (Case c : {Case{0, 6, v1::GET_MODE_RECONSTRUCTED, "layer_end"},
                 Case{3, 3, v1::GET_MODE_RECONSTRUCTED, "layer_begin"},
                 Case{4, 2, v1::GET_MODE_RECONSTRUCTED, "layer_begin"},
                 Case{5, 0, v1::GET_MODE_RECONSTRUCTED, "layer_begin"},
                 Case{0, 2, v1::GET_MODE_RESIDUAL, "layer_begin"}}) {
    SCOPED_TRACE(absl::StrCat("layers [", c.begin, ", ", c.end, ") mode ", c.mode));
    grpc::ClientContext ctx;
    auto reader = stub->Get(&ctx, Raw(c.begin, c.end, c.mode));
    v1::GetResponse msg;
    while (reader->Read(&msg)) {
    }
    grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StartsWith(s.error_message(), c.field)) << s.error_message();
  }
  // The client says so too, before sending a RESIDUAL range.
  absl::StatusOr<KvDump> r =
      client_->Get(s0_.model_id, s0_.token_ids,
                   {.mode = v1::GET_MODE_RESIDUAL, .layer_begin = 0, .layer_end = 2});
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  absl::StatusOr<KvDump> past =
      client_->Get(s0_.model_id, s0_.token_ids, {.layer_begin = 1, .layer_end = 9});
  EXPECT_TRUE(absl::IsInvalidArgument(past.status())) << past.status();
  EXPECT_TRUE(absl::StartsWith(past.status().message(), "layer_end")) << past.status();
}

TEST_F(GetLayers, TheCliGetsARangeWithLayers) {
  const std::string cli = testing::BinaryPath("client/kvtrie");
  const std::string out_dir = dir_ + "/out";
  std::string out, err;
  ASSERT_EQ(testing::RunCommand(
                {cli, "--target=" + server_->target(), "--namespace=layers", "--layers=1:3", "get",
                 std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s0", out_dir},
                &out, &err),
            0)
      << err;
  absl::StatusOr<KvDump> got = ReadKvDump(out_dir);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->num_layers, 2u);
  EXPECT_EQ(got->k, Slice(s0_, s0_.k, 1, 3));  // lossless
  EXPECT_EQ(got->v, Slice(s0_, s0_.v, 1, 3));
  EXPECT_NE(
      testing::RunCommand({cli, "--target=" + server_->target(), "--namespace=layers", "--layers=3",
                           "get", std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s0", out_dir},
                          &out, &err),
      0);
  EXPECT_NE(err.find("--layers"), std::string::npos) << err;
}

}  // namespace
}  // namespace kvtrie
