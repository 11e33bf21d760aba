// End-to-end: operating kvtrie-server (issue 13) — TLS and mutual TLS with certificates made by
// openssl at test time, Prometheus /metrics scraped over a raw socket and checked by a strict
// text-format parser, the config file with flag overrides and JSON logs, `kvtrie call`, and the
// SIGTERM drain with all of it on.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "client/client.h"
#include "codec/kv_dump.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/prometheus_text.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::RunCommand;
using testing::ServerProcess;

KvDump Session(int i) {
  absl::StatusOr<KvDump> d =
      ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/sessions/s" + std::to_string(i));
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void Openssl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"/usr/bin/openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::string out, err;
  ASSERT_EQ(RunCommand(argv, &out, &err), 0) << err;
}

// A CA and a certificate it signs for `cn` (P-256 keys; subjectAltName localhost and 127.0.0.1).
void MakeCa(const std::string& dir, const std::string& name) {
  Openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
           "-keyout", dir + "/" + name + ".key", "-out", dir + "/" + name + ".pem", "-days", "2",
           "-subj", "/CN=" + name});
}
void MakeCert(const std::string& dir, const std::string& ca, const std::string& name) {
  const std::string p = dir + "/" + name;
  std::ofstream(p + ".ext") << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
  Openssl({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
           p + ".key", "-out", p + ".csr", "-subj", "/CN=" + name});
  Openssl({"x509", "-req", "-in", p + ".csr", "-CA", dir + "/" + ca + ".pem", "-CAkey",
           dir + "/" + ca + ".key", "-CAcreateserial", "-out", p + ".pem", "-days", "2", "-extfile",
           p + ".ext"});
}

class Ops : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override {
    if (server_) {
      EXPECT_EQ(server_->Stop(), 0) << server_->log();  // SIGTERM drains, exit 0
    }
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  void Start(const std::vector<std::string>& flags) {
    auto s = ServerProcess::Start(dir_ + "/data", flags);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  ClientOptions Tls(const std::string& ca, const std::string& cert = "") {
    ClientOptions o = Plain(absl::Seconds(10));
    absl::Status s =
        LoadTlsFiles(dir_ + "/" + ca + ".pem", cert.empty() ? "" : dir_ + "/" + cert + ".pem",
                     cert.empty() ? "" : dir_ + "/" + cert + ".key", &o);
    EXPECT_TRUE(s.ok()) << s;
    return o;
  }

  ClientOptions Plain(absl::Duration timeout, const std::string& ns = "") {
    ClientOptions o;
    o.target = server_->target();
    o.ns = ns;
    o.timeout = timeout;
    return o;
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
};

TEST_F(Ops, TlsClientConnectsAndPlaintextIsRefused) {
  MakeCa(dir_, "ca");
  MakeCert(dir_, "ca", "server");
  const std::string health_port_file = dir_ + "/health.port";
  Start({"--tls_cert=" + dir_ + "/server.pem", "--tls_key=" + dir_ + "/server.key",
         "--health_listen=127.0.0.1:0", "--health_port_file=" + health_port_file});
  absl::StatusOr<v1::StatsResponse> st = Client::Create(Tls("ca"))->Stats();
  EXPECT_TRUE(st.ok()) << st.status() << "\n" << server_->log();
  absl::StatusOr<v1::StatsResponse> plain = Client::Create(Plain(absl::Seconds(5)))->Stats();
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kUnavailable) << plain.status();
  // A client that trusts another CA refuses the server.
  MakeCa(dir_, "other");
  EXPECT_EQ(Client::Create(Tls("other"))->Stats().status().code(), absl::StatusCode::kUnavailable);
  // The CLI takes the same flags.
  std::string out, err;
  EXPECT_EQ(RunCommand({testing::BinaryPath("client/kvtrie"), "--target=" + server_->target(),
                        "--tls_ca=" + dir_ + "/ca.pem", "stats"},
                       &out, &err),
            0)
      << err;
  EXPECT_NE(out.find("\"nodes\": 0"), std::string::npos) << out;
  EXPECT_NE(server_->log().find("(bound port"), std::string::npos);
  EXPECT_NE(server_->log().find(", TLS)"), std::string::npos) << server_->log();
  // The plaintext health port (for Kubernetes probes) serves health and nothing else.
  int health_port = 0;
  std::ifstream(health_port_file) >> health_port;
  ASSERT_GT(health_port, 0) << server_->log();
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(health_port),
                                     grpc::InsecureChannelCredentials());
  for (const char* service : {"", "kvtrie.v1.KVCache"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status hs = grpc::health::v1::Health::NewStub(channel)->Check(&ctx, req, &resp);
    ASSERT_TRUE(hs.ok()) << hs.error_message();
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  grpc::ClientContext ctx;
  v1::StatsResponse resp;
  EXPECT_EQ(v1::KVCache::NewStub(channel)->Stats(&ctx, v1::StatsRequest(), &resp).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(Ops, MutualTlsRefusesAClientWithoutAValidCertificate) {
  MakeCa(dir_, "ca");
  MakeCert(dir_, "ca", "server");
  MakeCert(dir_, "ca", "client");
  MakeCa(dir_, "rogue");
  MakeCert(dir_, "rogue", "intruder");
  Start({"--tls_cert=" + dir_ + "/server.pem", "--tls_key=" + dir_ + "/server.key",
         "--tls_client_ca=" + dir_ + "/ca.pem", "--tls_require_client_cert"});
  EXPECT_TRUE(Client::Create(Tls("ca", "client"))->Stats().ok()) << server_->log();
  EXPECT_EQ(Client::Create(Tls("ca"))->Stats().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Client::Create(Tls("ca", "intruder"))->Stats().status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(Client::Create(Plain(absl::Seconds(5)))->Stats().status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(Ops, ServerCertificateReplacedOnDiskIsServedWithoutRestart) {
  MakeCa(dir_, "ca");
  MakeCert(dir_, "ca", "server");
  MakeCa(dir_, "ca2");
  MakeCert(dir_, "ca2", "server2");
  Start({"--tls_cert=" + dir_ + "/server.pem", "--tls_key=" + dir_ + "/server.key",
         "--tls_refresh_seconds=1"});
  ASSERT_TRUE(Client::Create(Tls("ca"))->Stats().ok());
  // Rotate: the new key first, then the certificate (the watcher wants a matching pair).
  std::filesystem::copy_file(dir_ + "/server2.key", dir_ + "/server.key.new");
  std::filesystem::copy_file(dir_ + "/server2.pem", dir_ + "/server.pem.new");
  std::filesystem::rename(dir_ + "/server.key.new", dir_ + "/server.key");
  std::filesystem::rename(dir_ + "/server.pem.new", dir_ + "/server.pem");
  absl::Status s;
  for (int i = 0; i < 100; ++i) {  // within a few refresh periods
    s = Client::Create(Tls("ca2"))->Stats().status();
    if (s.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(s.ok()) << s << "\n" << server_->log();
  EXPECT_EQ(server_->Stop(), 0) << server_->log();
  server_.reset();
}

TEST_F(Ops, MetricsScrapedAfterTrafficParseStrictlyAndMoved) {
  const std::string port_file = dir_ + "/metrics.port";
  Start({"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + port_file,
         "--metrics_max_namespaces=2"});
  int port = 0;
  std::ifstream(port_file) >> port;
  ASSERT_GT(port, 0) << server_->log();
  absl::StatusOr<PromText> before = ParsePromText(ScrapeMetrics(port));
  ASSERT_TRUE(before.ok()) << before.status();

  const KvDump s0 = Session(0), s1 = Session(1);
  std::unique_ptr<Client> m = Client::Create({.target = server_->target(), .ns = "m"});
  ASSERT_TRUE(m->Put(s0).ok());
  ASSERT_TRUE(m->Put(s1).ok());                            // 23 blocks deduplicated
  ASSERT_TRUE(m->Lookup(s1.model_id, s1.token_ids).ok());  // 512 asked, 512 matched
  ASSERT_TRUE(m->Get(s0.model_id, s0.token_ids).ok());
  EXPECT_FALSE(m->Inspect(s0.model_id, 999999).ok());  // NOT_FOUND
  // Namespaces past the cap (2) are "other".
  ASSERT_TRUE(Client::Create({.target = server_->target(), .ns = "n"})->Stats().ok());
  ASSERT_TRUE(Client::Create({.target = server_->target(), .ns = "z"})->Stats().ok());
  absl::StatusOr<v1::StatsResponse> stats = m->Stats();
  ASSERT_TRUE(stats.ok());

  absl::StatusOr<PromText> after = ParsePromText(ScrapeMetrics(port));
  ASSERT_TRUE(after.ok()) << after.status();
  auto v = [&](const std::string& series) { return after->Value(series); };
  EXPECT_EQ(v(R"(kvtrie_rpc_requests_total{code="OK",method="Put",namespace="m"})"), 2);
  EXPECT_EQ(v(R"(kvtrie_rpc_requests_total{code="NOT_FOUND",method="Inspect",namespace="m"})"), 1);
  EXPECT_EQ(v(R"(kvtrie_rpc_requests_total{code="OK",method="Stats",namespace="n"})"), 1);
  EXPECT_EQ(v(R"(kvtrie_rpc_requests_total{code="OK",method="Stats",namespace="other"})"), 1);
  EXPECT_FALSE(after->Has(R"(kvtrie_rpc_requests_total{code="OK",method="Stats",namespace="z"})"));
  EXPECT_EQ(v(R"(kvtrie_rpc_duration_seconds_count{method="Put",namespace="m"})"), 2);
  EXPECT_EQ(v(R"(kvtrie_rpc_duration_seconds_bucket{le="+Inf",method="Put",namespace="m"})"), 2);
  EXPECT_GT(v(R"(kvtrie_rpc_duration_seconds_sum{method="Put",namespace="m"})"), 0);
  EXPECT_EQ(v(R"(kvtrie_tokens_asked_total{namespace="m"})"), 1024);  // Lookup + Get
  EXPECT_EQ(v(R"(kvtrie_tokens_matched_total{namespace="m"})"), 1024);
  EXPECT_EQ(v(R"(kvtrie_hit_ratio{namespace="m"})"), 1.0);
  EXPECT_EQ(v(R"(kvtrie_put_blocks_total{disposition="deduplicated",namespace="m"})"), 23);
  EXPECT_EQ(v(R"(kvtrie_put_blocks_total{disposition="stored",namespace="m"})"), 41);
  EXPECT_EQ(v(R"(kvtrie_put_streams_in_flight{namespace="m"})"), 0);
  EXPECT_EQ(v(R"(kvtrie_nodes{namespace="m"})"), 41);
  EXPECT_EQ(v(R"(kvtrie_bytes_stored{namespace="m"})"), static_cast<double>(stats->bytes_stored()));
  EXPECT_EQ(v(R"(kvtrie_bytes_logical{namespace="m"})"),
            static_cast<double>(stats->bytes_logical()));
  EXPECT_EQ(v(R"(kvtrie_tier_bytes{namespace="m",tier="hot"})") +
                v(R"(kvtrie_tier_bytes{namespace="m",tier="cold"})"),
            static_cast<double>(stats->bytes_stored()));
  EXPECT_EQ(v(R"(kvtrie_tier_budget_bytes{tier="hot"})"), 1 << 30);
  EXPECT_TRUE(after->Has(R"(kvtrie_evictions_total{reason="disk"})"));
  EXPECT_TRUE(after->Has(R"(kvtrie_centroids{namespace="m"})"));
  EXPECT_TRUE(after->Has("kvtrie_centroids_reelected_total"));
  EXPECT_EQ(v(R"(kvtrie_retained_nodes{namespace="m"})"), 0);
  EXPECT_EQ(v(R"(kvtrie_retained_bytes{namespace="m"})"), 0);
  EXPECT_EQ(v(R"(kvtrie_lossy_nodes{namespace="m"})"), static_cast<double>(stats->lossy_nodes()));
  // Of them, re-coded LOSSLESS by the cluster pass (a recoding keeps lossy_nodes as it is).
  EXPECT_TRUE(after->Has(R"(kvtrie_lossy_recoded_nodes{namespace="m"})"));
  EXPECT_LE(v(R"(kvtrie_lossy_recoded_nodes{namespace="m"})"),
            v(R"(kvtrie_lossy_nodes{namespace="m"})"));
  EXPECT_EQ(after->type.at("kvtrie_rpc_duration_seconds"), "histogram");
  EXPECT_EQ(after->type.at("kvtrie_rpc_requests_total"), "counter");
  // Every metric the example Grafana dashboard plots is one the server exports.
  std::ifstream dash_in(std::string(KVTRIE_SOURCE_DIR) + "/deploy/grafana-dashboard.json");
  nlohmann::json dash = nlohmann::json::parse(dash_in, nullptr, false);
  ASSERT_FALSE(dash.is_discarded());
  const std::string metrics_doc = Slurp(std::string(KVTRIE_SOURCE_DIR) + "/server/metrics.h");
  std::set<std::string> families;
  for (const auto& [series, value] : after->samples)
    families.insert(series.substr(0, series.find('{')));
  int exprs = 0;
  for (const auto& panel : dash["panels"]) {
    for (const auto& target : panel["targets"]) {
      const std::string expr = target["expr"];
      ++exprs;
      for (size_t at = expr.find("kvtrie_"); at != std::string::npos;
           at = expr.find("kvtrie_", at)) {
        size_t end = at;
        while (end < expr.size() &&
               (std::isalnum(static_cast<unsigned char>(expr[end])) || expr[end] == '_'))
          ++end;
        const std::string name = expr.substr(at, end - at);
        // Exported now, or (a family with no sample yet, e.g. quota refusals) documented.
        EXPECT_TRUE(families.count(name) || metrics_doc.find(name + " ") != std::string::npos ||
                    metrics_doc.find(name + "{") != std::string::npos)
            << "dashboard plots " << name << " in " << expr;
        at = end;
      }
    }
  }
  EXPECT_GE(exprs, 9);
  // Counters never go down between scrapes.
  for (const auto& [series, value] : before->samples) {
    const std::string family = series.substr(0, series.find('{'));
    if (absl::EndsWith(family, "_total") && after->Has(series)) {
      EXPECT_GE(after->Value(series), value) << series;
    }
  }
}

TEST_F(Ops, ConfigFileAppliesFlagsOverrideItAndLogsAreJson) {
  const std::string conf = dir_ + "/kvtrie.conf";
  std::ofstream(conf) << "# test config\nmemory_bytes = 3MiB\ndisk_bytes = 2GB\n"
                         "default_encoding = residual\nlog_format = json\n";
  Start({"--config=" + conf, "--memory_bytes=5MiB"});
  absl::StatusOr<v1::StatsResponse> st = Client::Create({.target = server_->target()})->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->memory_budget_bytes(), 5u << 20);   // the flag wins
  EXPECT_EQ(st->disk_budget_bytes(), 2000000000u);  // from the file, decimal GB
  absl::StatusOr<v1::PutResponse> put =
      Client::Create({.target = server_->target()})->Put(Session(0));
  ASSERT_TRUE(put.ok());
  EXPECT_EQ(put->blocks(0).encoding(), v1::ENCODING_RESIDUAL);  // default_encoding from the file
  ASSERT_EQ(server_->Stop(), 0);
  const std::string log = server_->log();
  server_.reset();
  int lines = 0;
  bool effective = false;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "not a JSON line: " << line;
    ASSERT_TRUE(j.contains("msg") && j.contains("level") && j.contains("time")) << line;
    ++lines;
    const std::string msg = j["msg"];
    if (msg.rfind("effective configuration:", 0) == 0) {
      effective = true;
      EXPECT_NE(msg.find("memory_bytes=5MiB"), std::string::npos) << msg;
      EXPECT_NE(msg.find("disk_bytes=2GB"), std::string::npos) << msg;
      EXPECT_NE(msg.find("default_encoding=residual"), std::string::npos) << msg;
      EXPECT_NE(msg.find("tls_cert="), std::string::npos) << msg;
    }
  }
  EXPECT_GE(lines, 3);
  EXPECT_TRUE(effective) << log;
}

TEST_F(Ops, BadConfigAndBadByteSizesExitWithTheirName) {
  const std::string conf = dir_ + "/bad.conf";
  std::ofstream(conf) << "listen = 127.0.0.1:0\nmemroy_bytes = 1GiB\n";
  std::string out, err;
  const std::string server = testing::BinaryPath("server/kvtrie-server");
  EXPECT_EQ(RunCommand({server, "--config=" + conf}, &out, &err), 2);
  EXPECT_NE(err.find("unknown setting 'memroy_bytes'"), std::string::npos) << err;
  EXPECT_NE(RunCommand({server, "--memory_bytes=8XB", "--data_dir=" + dir_ + "/d"}, &out, &err), 0);
  EXPECT_NE(err.find("memory_bytes"), std::string::npos) << err;
  EXPECT_NE(err.find("'8XB'"), std::string::npos) << err;
  ASSERT_EQ(RunCommand({server, "--help"}, &out, &err), 1);  // absl's --help exits 1
  const std::string help = out + err;
  for (const char* want :
       {"--memory_bytes", "KiB/MiB/GiB/TiB = 1024^n", "kB/MB/GB/TB = 1000^n", "--config",
        "--log_format", "--tls_cert", "--tls_client_ca", "--tls_require_client_cert",
        "--tokens_file", "--metrics_listen", "--metrics_max_namespaces"}) {
    EXPECT_NE(help.find(want), std::string::npos) << want;
  }
  for (const char* bin : {"client/kvtrie", "client/worker/kvtrie-worker"}) {
    RunCommand({testing::BinaryPath(bin), "--help"}, &out, &err);
    for (const char* want : {"--tls_ca", "--tls_cert", "--tls_key", "--token"}) {
      EXPECT_NE((out + err).find(want), std::string::npos) << bin << " " << want;
    }
  }
}

TEST_F(Ops, CallVerbRunsAnyMethodFromJson) {
  Start({});
  const std::string kvtrie = testing::BinaryPath("client/kvtrie");
  const std::string target = "--target=" + server_->target();
  // One fp16 block of a tiny model: 1 layer, 1 head, head_dim 8, 16 tokens = 512 bytes.
  std::string kv(512, '\0');
  for (size_t i = 0; i < kv.size(); i += 2) kv[i + 1] = static_cast<char>(0x3c + (i / 2) % 3);
  v1::PutRequest dummy;  // base64 of kv through protobuf's own JSON printer
  dummy.mutable_block()->set_kv(kv);
  std::string block_json;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(dummy, &block_json).ok());
  std::string tokens = "[";
  for (int i = 0; i < 16; ++i) tokens += (i ? "," : "") + std::to_string(100 + i);
  tokens += "]";
  const std::string put =
      R"([{"header": {"namespace": "cli", "model": {"model_id": "tiny", "num_layers": 1,
          "num_kv_heads": 1, "head_dim": 8, "dtype": "DTYPE_FP16"}, "token_ids": )" +
      tokens + R"(, "encoding": {"encoding": "ENCODING_LOSSLESS"}}}, )" + block_json +
      R"(, {"commit": {}}])";
  std::ofstream(dir_ + "/put.json") << put;
  std::string out, err;
  ASSERT_EQ(RunCommand({kvtrie, target, "call", "Put", "@" + dir_ + "/put.json"}, &out, &err), 0)
      << err;
  nlohmann::json r = nlohmann::json::parse(out);
  EXPECT_EQ(r["stored_tokens"], 16);
  EXPECT_EQ(r["blocks_stored"], 1);
  ASSERT_EQ(RunCommand({kvtrie, target, "call", "kvtrie.v1.KVCache/Lookup",
                        R"({"namespace": "cli", "model_id": "tiny", "token_ids": )" + tokens + "}"},
                       &out, &err),
            0)
      << err;
  EXPECT_EQ(nlohmann::json::parse(out)["matched_tokens"], 16);
  // Get streams two messages: the header, then the block, whose kv is the bytes put.
  ASSERT_EQ(RunCommand({kvtrie, target, "call", "Get",
                        R"({"namespace": "cli", "model_id": "tiny", "tokenIds": )" + tokens + "}"},
                       &out, &err),
            0)
      << err;
  const size_t split = out.find("}\n{");
  ASSERT_NE(split, std::string::npos) << out;
  nlohmann::json block = nlohmann::json::parse(out.substr(split + 2));
  v1::PutRequest got;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  nlohmann::json{{"block", {{"kv", block["block"]["kv"]}}}}.dump(), &got)
                  .ok());
  EXPECT_EQ(got.block().kv(), kv);
  ASSERT_EQ(RunCommand({kvtrie, target, "call", "Stats", R"({"namespace": "cli"})"}, &out, &err),
            0);
  EXPECT_EQ(nlohmann::json::parse(out)["nodes"], "1");  // protobuf JSON: uint64 as a string
  // Errors: an unknown method, JSON naming an unknown field, a server-side error.
  EXPECT_EQ(RunCommand({kvtrie, target, "call", "Frobnicate", "{}"}, &out, &err), 1);
  EXPECT_NE(err.find("METHOD"), std::string::npos) << err;
  EXPECT_EQ(RunCommand({kvtrie, target, "call", "Stats", R"({"namespac": "x"})"}, &out, &err), 1);
  EXPECT_NE(err.find("namespac"), std::string::npos) << err;
  EXPECT_EQ(RunCommand({kvtrie, target, "call", "Lookup", "{}"}, &out, &err), 1);
  EXPECT_NE(err.find("INVALID_ARGUMENT: model_id"), std::string::npos) << err;
}

TEST_F(Ops, SigtermDrainsAPutInFlightThenExitsZero) {
  const std::string health_port_file = dir_ + "/health.port";
  const std::string tokens = dir_ + "/tokens.json";
  std::ofstream(tokens) << R"({"tenants": [{"name": "t", "tokens": ["drain-token-1"],
                                              "namespaces": ["t"]}]})";
  Start({"--tokens_file=" + tokens, "--metrics_listen=127.0.0.1:0", "--health_listen=127.0.0.1:0",
         "--health_port_file=" + health_port_file});
  int health_port = 0;
  std::ifstream(health_port_file) >> health_port;
  auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(health_port), grpc::InsecureChannelCredentials()));
  auto serving = [&] {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    return health->Check(&ctx, req, &resp).ok() &&
           resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  };
  ASSERT_TRUE(serving());
  // A Put of two blocks of a tiny model (1 layer, 1 head, head_dim 8, fp16; plumbing only).
  ClientOptions o = Plain(absl::Seconds(20));
  o.token = "drain-token-1";
  std::unique_ptr<Client> client = Client::Create(o);
  auto ctx = client->NewContext();
  v1::PutResponse resp;
  auto writer = client->stub()->Put(ctx.get(), &resp);
  v1::PutRequest req;
  v1::PutHeader* h = req.mutable_header();
  h->mutable_model()->set_model_id("tiny");
  h->mutable_model()->set_num_layers(1);
  h->mutable_model()->set_num_kv_heads(1);
  h->mutable_model()->set_head_dim(8);
  h->mutable_model()->set_dtype(v1::DTYPE_FP16);
  for (uint32_t t = 0; t < 32; ++t) h->add_token_ids(7 + t);
  ASSERT_TRUE(writer->Write(req));
  auto block = [](uint32_t i) {
    v1::PutRequest b;
    b.mutable_block()->set_block_index(i);
    b.mutable_block()->set_layer_begin(0);
    b.mutable_block()->set_layer_end(1);
    std::string kv(512, '\0');
    for (size_t j = 0; j < kv.size(); j += 2) kv[j + 1] = static_cast<char>(0x30 + (i + j) % 9);
    b.mutable_block()->set_kv(kv);
    return b;
  };
  ASSERT_TRUE(writer->Write(block(0)));
  ASSERT_EQ(kill(server_->pid(), SIGTERM), 0);
  for (int i = 0; i < 100 && serving(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_FALSE(serving());  // health turned NOT_SERVING at once
  // The Put in flight may finish within the grace period.
  ASSERT_TRUE(writer->Write(block(1)));
  v1::PutRequest commit;
  commit.mutable_commit();
  ASSERT_TRUE(writer->Write(commit));
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message() << "\n" << server_->log();
  EXPECT_EQ(resp.blocks_stored(), 2u);
  EXPECT_EQ(server_->Stop(), 0) << server_->log();
  // What it acknowledged is there after a restart.
  Start({"--tokens_file=" + tokens});
  o.target = server_->target();
  std::vector<uint32_t> ids;
  for (uint32_t t = 0; t < 32; ++t) ids.push_back(7 + t);
  absl::StatusOr<v1::LookupResponse> look = Client::Create(o)->Lookup("tiny", ids);
  ASSERT_TRUE(look.ok()) << look.status();
  EXPECT_EQ(look->matched_tokens(), 32u);
}

}  // namespace
}  // namespace kvtrie
