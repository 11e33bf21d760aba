// End-to-end: kvtrie::PutStream (Client::OpenPut, a Put sent layer by layer), Client::Pin and
// ClientOptions::token, against a real kvtrie-server process, on the real sessions of
// tests/data (issue 14: what the Python client is built on).
#include <grpcpp/grpcpp.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/client.h"
#include "client/put_stream.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;

class PutStreamE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s0");
    ASSERT_TRUE(d.ok()) << d.status();
    dump_ = new KvDump(*std::move(d));
    absl::StatusOr<std::unique_ptr<ServerProcess>> s =
        ServerProcess::Start(testing::FreshDir("put_stream_e2e") + "/data");
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = s->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete dump_;
  }

  std::unique_ptr<Client> NewClient() {
    return Client::Create({.target = server_->target(),
                           .ns = ::testing::UnitTest::GetInstance()->current_test_info()->name()});
  }

  // Layers [begin, end) of the dump's K or V, all 512 tokens.
  static absl::Span<const uint8_t> Layers(const std::vector<uint8_t>& kv, uint32_t begin,
                                          uint32_t end) {
    const size_t layer = kv.size() / dump_->num_layers;
    return absl::MakeConstSpan(kv).subspan(begin * layer, (end - begin) * layer);
  }

  static KvDump* dump_;
  static ServerProcess* server_;
};
KvDump* PutStreamE2E::dump_ = nullptr;
ServerProcess* PutStreamE2E::server_ = nullptr;

TEST_F(PutStreamE2E, LayersInAnyOrderAreStoredTogetherAtTheCommit) {
  auto c = NewClient();
  absl::StatusOr<std::unique_ptr<PutStream>> s = c->OpenPut(*dump_);
  ASSERT_TRUE(s.ok()) << s.status();
  for (uint32_t l : {4u, 0u, 2u}) {
    ASSERT_TRUE(
        (*s)->WriteLayers(l, l + 1, 0, 512, Layers(dump_->k, l, l + 1), Layers(dump_->v, l, l + 1))
            .ok());
  }
  ASSERT_TRUE((*s)->WriteLayers(1, 2, 0, 512, Layers(dump_->k, 1, 2), Layers(dump_->v, 1, 2)).ok());
  ASSERT_TRUE((*s)->WriteLayers(3, 4, 0, 512, Layers(dump_->k, 3, 4), Layers(dump_->v, 3, 4)).ok());
  EXPECT_EQ(c->Lookup(dump_->model_id, dump_->token_ids)->matched_tokens(), 0u);  // not yet
  absl::StatusOr<v1::PutResponse> r = (*s)->Commit();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks_stored(), 32u);
  absl::StatusOr<KvDump> got = c->Get(dump_->model_id, dump_->token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->k, dump_->k);
  EXPECT_EQ(got->v, dump_->v);
  EXPECT_EQ((*s)->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(PutStreamE2E, AStreamDestroyedBeforeItsCommitStoresNothing) {
  auto c = NewClient();
  {
    absl::StatusOr<std::unique_ptr<PutStream>> s = c->OpenPut(*dump_);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(
        (*s)->WriteLayers(0, 5, 0, 512, Layers(dump_->k, 0, 5), Layers(dump_->v, 0, 5)).ok());
  }
  EXPECT_EQ(c->Lookup(dump_->model_id, dump_->token_ids)->matched_tokens(), 0u);
}

TEST_F(PutStreamE2E, ASpanFromFirstBlockSendsOnlyItsBlocks) {
  auto c = NewClient();
  KvDump head = *dump_;  // the first 10 blocks, stored first
  head.token_ids.resize(160);
  head.surprisal_bits.resize(160);
  head.k.clear();
  head.v.clear();
  const size_t row = 512 * 8 * 2, head_row = 160 * 8 * 2;
  std::vector<uint8_t> tail_k, tail_v;  // tokens [160, 512) of every (layer, head)
  for (size_t r = 0; r < 5 * 4; ++r) {
    head.k.insert(head.k.end(), dump_->k.begin() + r * row, dump_->k.begin() + r * row + head_row);
    head.v.insert(head.v.end(), dump_->v.begin() + r * row, dump_->v.begin() + r * row + head_row);
    tail_k.insert(tail_k.end(), dump_->k.begin() + r * row + head_row,
                  dump_->k.begin() + (r + 1) * row);
    tail_v.insert(tail_v.end(), dump_->v.begin() + r * row + head_row,
                  dump_->v.begin() + (r + 1) * row);
  }
  ASSERT_TRUE(c->Put(head).ok());
  absl::StatusOr<std::unique_ptr<PutStream>> s = c->OpenPut(*dump_, {.first_block = 10});
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE((*s)->WriteLayers(0, 5, 160, 352, tail_k, tail_v).ok());
  absl::StatusOr<v1::PutResponse> r = (*s)->Commit();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->blocks_stored(), 22u);
  EXPECT_EQ(r->blocks_deduplicated(), 10u);
  EXPECT_EQ(c->Get(dump_->model_id, dump_->token_ids)->k, dump_->k);
}

TEST_F(PutStreamE2E, BadArgumentsNameTheArgumentAndLeaveTheStreamUsable) {
  auto c = NewClient();
  absl::StatusOr<std::unique_ptr<PutStream>> s = c->OpenPut(*dump_);
  ASSERT_TRUE(s.ok());
  absl::Status e = (*s)->WriteLayers(5, 6, 0, 512, Layers(dump_->k, 0, 1), Layers(dump_->v, 0, 1));
  EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(e.message(), "layer_begin: ")) << e;
  e = (*s)->WriteLayers(0, 1, 3, 500, Layers(dump_->k, 0, 1), Layers(dump_->v, 0, 1));
  EXPECT_TRUE(absl::StartsWith(e.message(), "token_offset: ")) << e;
  e = (*s)->WriteLayers(0, 2, 0, 512, Layers(dump_->k, 0, 1), Layers(dump_->v, 0, 1));
  EXPECT_TRUE(absl::StartsWith(e.message(), "k: ")) << e;
  e = (*s)->WriteLayers(0, 1, 16, 512, Layers(dump_->k, 0, 1), Layers(dump_->v, 0, 1));
  EXPECT_TRUE(absl::StartsWith(e.message(), "k: tokens [16, 528)")) << e;
  ASSERT_TRUE((*s)->WriteLayers(0, 5, 0, 512, Layers(dump_->k, 0, 5), Layers(dump_->v, 0, 5)).ok());
  EXPECT_TRUE((*s)->Commit().ok());
  KvDump bad = *dump_;
  bad.surprisal_bits.resize(3);
  EXPECT_TRUE(absl::StartsWith(c->OpenPut(bad).status().message(), "surprisal_bits: "));
}

TEST_F(PutStreamE2E, AMissingLayerFailsAtTheCommitWithTheServersMessage) {
  auto c = NewClient();
  absl::StatusOr<std::unique_ptr<PutStream>> s = c->OpenPut(*dump_);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE((*s)->WriteLayers(0, 4, 0, 512, Layers(dump_->k, 0, 4), Layers(dump_->v, 0, 4)).ok());
  absl::StatusOr<v1::PutResponse> r = (*s)->Commit();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(r.status().message(), "kv: block 0 is missing layers [4, 5)"))
      << r.status();
  EXPECT_EQ(c->Lookup(dump_->model_id, dump_->token_ids)->matched_tokens(), 0u);
}

TEST_F(PutStreamE2E, PinAndUnpinAStoredPrefix) {
  auto c = NewClient();
  ASSERT_TRUE(c->Put(*dump_).ok());
  absl::StatusOr<v1::LookupResponse> l = c->Lookup(dump_->model_id, dump_->token_ids);
  absl::Span<const uint32_t> prefix = absl::MakeConstSpan(dump_->token_ids).subspan(0, 64);
  absl::StatusOr<v1::PinResponse> p = c->Pin(dump_->model_id, prefix, 60);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->node_id(), l->node_ids(3));
  EXPECT_EQ(c->Stats()->pinned_nodes(), 1u);
  EXPECT_EQ(c->Pin(dump_->model_id, prefix, 0, /*unpin=*/true)->node_id(), l->node_ids(3));
  EXPECT_EQ(c->Stats()->pinned_nodes(), 0u);
  std::vector<uint32_t> other(prefix.begin(), prefix.end());
  other[0] = 7;
  EXPECT_EQ(c->Pin(dump_->model_id, other).status().code(), absl::StatusCode::kNotFound);
}

// The server has no authentication yet: an in-process gRPC service records what the client sends.
class RecordingService final : public v1::KVCache::Service {
 public:
  grpc::Status Lookup(grpc::ServerContext* ctx, const v1::LookupRequest*,
                      v1::LookupResponse*) override {
    auto it = ctx->client_metadata().find("authorization");
    if (it != ctx->client_metadata().end())
      authorization = std::string(it->second.data(), it->second.size());
    return grpc::Status::OK;
  }
  std::string authorization;  // written by the one call, read after it
};

TEST(ClientOptionsE2E, ABearerTokenTravelsAsAuthorizationMetadata) {
  RecordingService service;
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_GT(port, 0);
  auto c =
      Client::Create({.target = "127.0.0.1:" + std::to_string(port), .ns = "", .token = "s3cret"});
  ASSERT_TRUE(c->Lookup("m", std::vector<uint32_t>{1, 2}).ok());
  EXPECT_EQ(service.authorization, "Bearer s3cret");
  server->Shutdown();
}

}  // namespace
}  // namespace kvtrie
