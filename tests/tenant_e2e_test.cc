// End-to-end: tenants, bearer tokens and quotas (issue 13) against a real kvtrie-server started
// with --tokens_file, on real KV caches of stories260K (tests/data/sessions).
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "tests/prometheus_text.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;

constexpr char kTokenA[] = "token-of-tenant-a";
constexpr char kTokenB[] = "token-of-tenant-b";
constexpr char kTokenAdmin[] = "token-of-the-admin";
constexpr char kTokenQuota[] = "token-of-tenant-q";
constexpr char kTokenBytes[] = "token-of-tenant-s";
constexpr char kTokenStreams[] = "token-of-tenant-p";
constexpr char kTokenEmptyNs[] = "token-of-tenant-e";

constexpr char kTokensJson[] = R"({"tenants": [
  {"name": "a", "tokens": ["token-of-tenant-a"], "namespaces": ["a"]},
  {"name": "b", "tokens": ["token-of-tenant-b"], "namespaces": ["b", "b-extra"]},
  {"name": "ops", "tokens": ["token-of-the-admin"], "admin": true},
  {"name": "q", "tokens": ["token-of-tenant-q"], "namespaces": ["q"], "quota": {"nodes": 36}},
  {"name": "s", "tokens": ["token-of-tenant-s"], "namespaces": ["s"],
   "quota": {"stored_bytes": "1KiB"}},
  {"name": "p", "tokens": ["token-of-tenant-p"], "namespaces": ["p"], "quota": {"put_streams": 1}},
  {"name": "e", "tokens": ["token-of-tenant-e"], "namespaces": [""]}
]})";

KvDump Session(int i) {
  absl::StatusOr<KvDump> d =
      ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s" + std::to_string(i));
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

class Tenants : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    tokens_file_ = dir_ + "/tokens.json";
    std::ofstream(tokens_file_) << kTokensJson;
    auto s = ServerProcess::Start(dir_ + "/data",
                                  {"--tokens_file=" + tokens_file_, "--metrics_listen=127.0.0.1:0",
                                   "--metrics_port_file=" + dir_ + "/metrics.port"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    std::ifstream(dir_ + "/metrics.port") >> metrics_port_;
  }
  void TearDown() override {
    if (server_) {
      EXPECT_EQ(server_->Stop(), 0) << server_->log();
    }
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<Client> As(const std::string& token, const std::string& ns = "") {
    ClientOptions o;
    o.target = server_->target();
    o.ns = ns;
    o.token = token;
    return Client::Create(o);
  }
  // The server's metric `series` (-1 if absent).
  double Metric(const std::string& series) {
    absl::StatusOr<PromText> m = ParsePromText(ScrapeMetrics(metrics_port_));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() && m->Has(series) ? m->samples.at(series) : -1;
  }

  std::string dir_, tokens_file_;
  int metrics_port_ = 0;
  std::unique_ptr<ServerProcess> server_;
};

void ExpectCode(const absl::Status& s, absl::StatusCode code, const std::string& says) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(std::string(s.message()).find(says), std::string::npos) << s << " should say " << says;
}

TEST_F(Tenants, MissingOrWrongTokenIsUnauthenticatedOnEveryMethod) {
  const KvDump s0 = Session(0);
  for (const std::string token : {"", "not-a-known-token"}) {
    std::unique_ptr<Client> c = As(token);
    ExpectCode(c->Stats().status(), absl::StatusCode::kUnauthenticated, "authorization");
    ExpectCode(c->Lookup(s0.model_id, s0.token_ids).status(), absl::StatusCode::kUnauthenticated,
               "authorization");
    ExpectCode(c->Put(s0).status(), absl::StatusCode::kUnauthenticated, "authorization");
    ExpectCode(c->Get(s0.model_id, s0.token_ids).status(), absl::StatusCode::kUnauthenticated,
               "authorization");
    ExpectCode(c->Inspect(s0.model_id, 0).status(), absl::StatusCode::kUnauthenticated,
               "authorization");
    ExpectCode(c->Delete(s0.model_id, s0.token_ids).status(), absl::StatusCode::kUnauthenticated,
               "authorization");
  }
  // Nothing was stored by the refused Put.
  absl::StatusOr<v1::StatsResponse> all = As(kTokenAdmin)->Stats();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->nodes(), 0u);
}

TEST_F(Tenants, TenantCannotSeeHitCountOrTimeAnothersPrefixes) {
  const KvDump s0 = Session(0);
  std::unique_ptr<Client> b = As(kTokenB);  // namespace "" = b's default, "b"
  absl::StatusOr<v1::PutResponse> put = b->Put(s0);
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_EQ(put->blocks_stored(), 32u);
  const uint64_t b_node = put->blocks(31).node_id();

  std::unique_ptr<Client> a = As(kTokenA);
  std::unique_ptr<Client> a_naming_b = As(kTokenA, "b");
  // Lookup and Get: no hit in a's own namespace; naming b's is refused.
  absl::StatusOr<v1::LookupResponse> look = a->Lookup(s0.model_id, s0.token_ids);
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->matched_tokens(), 0u);
  ExpectCode(a_naming_b->Lookup(s0.model_id, s0.token_ids).status(),
             absl::StatusCode::kPermissionDenied, "namespace");
  absl::StatusOr<KvDump> got = a->Get(s0.model_id, s0.token_ids);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->token_ids.empty());
  ExpectCode(a_naming_b->Get(s0.model_id, s0.token_ids).status(),
             absl::StatusCode::kPermissionDenied, "namespace");
  {  // a Get by b's node id from a's namespace finds nothing
    v1::GetRequest req;
    req.set_model_id(s0.model_id);
    req.set_node_id(b_node);
    auto ctx = a->NewContext();
    auto reader = a->stub()->Get(ctx.get(), req);
    v1::GetResponse msg;
    int blocks = 0;
    while (reader->Read(&msg)) blocks += msg.has_block();
    grpc::Status st = reader->Finish();
    EXPECT_EQ(blocks, 0);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  }
  // Stats: a's own namespace, with a's own counters only.
  absl::StatusOr<v1::StatsResponse> st = a->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->nodes(), 0u);
  EXPECT_EQ(st->bytes_stored(), 0u);
  EXPECT_EQ(st->puts(), 0u);  // b's Put is not counted
  EXPECT_EQ(st->blocks_stored(), 0u);
  EXPECT_EQ(st->lookups(), 1u);  // only a's own Lookup
  EXPECT_EQ(st->lookup_hits(), 0u);
  EXPECT_EQ(st->gets(), 1u);  // the Get naming b and the one by b's node id failed
  ExpectCode(a->Stats("b").status(), absl::StatusCode::kPermissionDenied, "namespace");
  // Inspect: a's namespace has no such model, and b's node is not a's.
  ExpectCode(a->Inspect(s0.model_id, 0).status(), absl::StatusCode::kNotFound, "");
  ExpectCode(a->Inspect(s0.model_id, b_node).status(), absl::StatusCode::kNotFound, "");
  ExpectCode(a_naming_b->Inspect(s0.model_id, b_node).status(), absl::StatusCode::kPermissionDenied,
             "namespace");
  // Delete and Pin cannot reach b's prefix.
  ExpectCode(a->Delete(s0.model_id, s0.token_ids).status(), absl::StatusCode::kNotFound, "");
  ExpectCode(a_naming_b->Delete(s0.model_id, s0.token_ids).status(),
             absl::StatusCode::kPermissionDenied, "namespace");
  for (Client* c : {a.get(), a_naming_b.get()}) {
    v1::PinRequest req;
    req.set_namespace_(c == a.get() ? "" : "b");
    req.set_model_id(s0.model_id);
    req.mutable_token_ids()->Add(s0.token_ids.begin(), s0.token_ids.end());
    v1::PinResponse resp;
    auto ctx = c->NewContext();
    grpc::Status pin = c->stub()->Pin(ctx.get(), req, &resp);
    EXPECT_EQ(pin.error_code(),
              c == a.get() ? grpc::StatusCode::NOT_FOUND : grpc::StatusCode::PERMISSION_DENIED)
        << pin.error_message();
  }

  // GetPredictor: a learned state of b's is not a's to fetch (named or not).
  for (Client* c : {a.get(), a_naming_b.get()}) {
    v1::GetPredictorRequest req;
    req.set_namespace_(c == a.get() ? "" : "b");
    req.set_model_id(s0.model_id);
    req.set_version(1);
    auto ctx = c->NewContext();
    auto reader = c->stub()->GetPredictor(ctx.get(), req);
    v1::PredictorChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    grpc::Status got = reader->Finish();
    EXPECT_EQ(got.error_code(),
              c == a.get() ? grpc::StatusCode::NOT_FOUND : grpc::StatusCode::PERMISSION_DENIED)
        << got.error_message();
  }

  // b still has everything; b sees its own counters, not a's.
  absl::StatusOr<KvDump> b_got = b->Get(s0.model_id, s0.token_ids);
  ASSERT_TRUE(b_got.ok()) << b_got.status();
  EXPECT_EQ(b_got->token_ids.size(), 512u);
  absl::StatusOr<v1::StatsResponse> bs = b->Stats();
  ASSERT_TRUE(bs.ok()) << bs.status();
  EXPECT_EQ(bs->nodes(), 32u);
  EXPECT_EQ(bs->lookups(), 0u);
  EXPECT_EQ(bs->puts(), 1u);
  EXPECT_EQ(bs->blocks_stored(), 32u);
  // b may use its second namespace, which is empty.
  absl::StatusOr<v1::StatsResponse> bx = As(kTokenB, "b-extra")->Stats();
  ASSERT_TRUE(bx.ok()) << bx.status();
  EXPECT_EQ(bx->nodes(), 0u);
  // The admin sees any namespace and the whole server.
  absl::StatusOr<v1::StatsResponse> admin_b = As(kTokenAdmin)->Stats("b");
  ASSERT_TRUE(admin_b.ok()) << admin_b.status();
  EXPECT_EQ(admin_b->nodes(), 32u);
  absl::StatusOr<v1::StatsResponse> admin_all = As(kTokenAdmin)->Stats();
  ASSERT_TRUE(admin_all.ok()) << admin_all.status();
  EXPECT_EQ(admin_all->nodes(), 32u);
  EXPECT_GE(admin_all->lookups(), 1u);
}

TEST_F(Tenants, NodeQuotaIsEnforcedAndNamed) {
  std::unique_ptr<Client> q = As(kTokenQuota);
  absl::StatusOr<v1::PutResponse> first = q->Put(Session(0));  // 32 nodes of 36
  ASSERT_TRUE(first.ok()) << first.status();
  // s1 shares 23 blocks with s0 and would add 9 more: 41 > 36.
  ExpectCode(q->Put(Session(1)).status(), absl::StatusCode::kResourceExhausted, "quota nodes");
  // The same prefix again adds nothing and is allowed.
  absl::StatusOr<v1::PutResponse> again = q->Put(Session(0));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->blocks_deduplicated(), 32u);
  absl::StatusOr<v1::StatsResponse> st = q->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->nodes(), 32u);
}

TEST_F(Tenants, StoredBytesQuotaRefusesOnceReached) {
  std::unique_ptr<Client> s = As(kTokenBytes);
  ASSERT_TRUE(s->Put(Session(0)).ok());  // 0 bytes stored before: admitted
  absl::Status second = s->Put(Session(1)).status();
  ExpectCode(second, absl::StatusCode::kResourceExhausted, "quota stored_bytes");
  EXPECT_NE(std::string(second.message()).find("its quota is 1024"), std::string::npos) << second;
}

TEST_F(Tenants, PutStreamQuotaCountsStreamsInFlight) {
  const KvDump s0 = Session(0);
  std::unique_ptr<Client> p = As(kTokenStreams);
  // Open one Put stream (header only) and keep it open.
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kTokenStreams);
  v1::PutResponse open_resp;
  auto writer = p->stub()->Put(&ctx, &open_resp);
  v1::PutRequest header;
  header.mutable_header()->mutable_model()->set_model_id(s0.model_id);
  header.mutable_header()->mutable_model()->set_num_layers(s0.num_layers);
  header.mutable_header()->mutable_model()->set_num_kv_heads(s0.num_kv_heads);
  header.mutable_header()->mutable_model()->set_head_dim(s0.head_dim);
  header.mutable_header()->mutable_model()->set_dtype(v1::DTYPE_FP16);
  header.mutable_header()->mutable_token_ids()->Add(s0.token_ids.begin(), s0.token_ids.end());
  ASSERT_TRUE(writer->Write(header));
  // The server admits the stream when it reads the header: wait for it in the metrics.
  const std::string in_flight = R"(kvtrie_put_streams_in_flight{namespace="p"})";
  for (int i = 0; i < 250 && Metric(in_flight) != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(Metric(in_flight), 1);
  absl::Status second = p->Put(s0).status();
  ExpectCode(second, absl::StatusCode::kResourceExhausted, "quota put_streams");
  EXPECT_EQ(Metric(R"(kvtrie_quota_rejections_total{namespace="p",quota="put_streams"})"), 1);
  ctx.TryCancel();
  writer->Finish();
  // Once the first stream is gone, a Put is admitted again.
  absl::Status later;
  for (int i = 0; i < 100; ++i) {
    later = p->Put(s0).status();
    if (later.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(later.ok()) << later;
  EXPECT_EQ(Metric(in_flight), 0);
}

TEST_F(Tenants, TenantWhoseNamespaceIsEmptySeesOnlyItsOwnStats) {
  // Issue 18 #7: "" is a namespace like any other for a tenant; only an admin's Stats{} is the
  // whole server.
  absl::StatusOr<v1::PutResponse> put_a = As(kTokenA)->Put(Session(0));
  ASSERT_TRUE(put_a.ok()) << put_a.status();
  ASSERT_GT(put_a->blocks_stored(), 0u);
  std::unique_ptr<Client> e = As(kTokenEmptyNs);
  absl::StatusOr<v1::StatsResponse> mine = e->Stats();
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->nodes(), 0u) << "tenant e sees tenant a's nodes";
  EXPECT_EQ(mine->bytes_stored(), 0u);
  EXPECT_EQ(mine->namespaces(), 0u);
  EXPECT_EQ(mine->models(), 0u);
  absl::StatusOr<v1::PutResponse> put_e = e->Put(Session(1));
  ASSERT_TRUE(put_e.ok()) << put_e.status();
  mine = e->Stats();
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->nodes(), put_e->blocks_stored());
  EXPECT_EQ(mine->namespaces(), 1u);
  // The admin's Stats{} is still the whole server.
  absl::StatusOr<v1::StatsResponse> all = As(kTokenAdmin)->Stats();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->nodes(), put_a->blocks_stored() + put_e->blocks_stored());
  EXPECT_EQ(all->namespaces(), 2u);
}

TEST_F(Tenants, SighupReloadsTheTokensFileAndKeepsTheOldOneIfBad) {
  const std::string kNewToken = "a-token-added-later";
  ExpectCode(As(kNewToken)->Stats().status(), absl::StatusCode::kUnauthenticated, "authorization");
  {
    std::ofstream out(tokens_file_ + ".tmp");
    out << R"({"tenants": [{"name": "c", "tokens": [")" << kNewToken
        << R"("], "namespaces": ["c"]}]})";
  }
  std::filesystem::rename(tokens_file_ + ".tmp", tokens_file_);
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  absl::Status s;
  for (int i = 0; i < 250; ++i) {
    s = As(kNewToken)->Stats().status();
    if (s.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(s.ok()) << s << "\n" << server_->log();
  ExpectCode(As(kTokenA)->Stats().status(), absl::StatusCode::kUnauthenticated, "authorization");
  // A broken file is refused and the table in use stays.
  std::ofstream(tokens_file_) << "{broken";
  ASSERT_EQ(kill(server_->pid(), SIGHUP), 0);
  for (int i = 0; i < 250 && server_->log().find("not reloaded") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(server_->log().find("not reloaded"), std::string::npos) << server_->log();
  EXPECT_TRUE(As(kNewToken)->Stats().ok());
}

}  // namespace
}  // namespace kvtrie
