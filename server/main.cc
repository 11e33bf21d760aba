// kvtrie-server: the kvtrie.v1.KVCache gRPC service over an embedded RocksDB.
//
//   kvtrie-server --listen=127.0.0.1:50051 --data_dir=./kvtrie-data
//
// Serves grpc.health.v1.Health (status SERVING for "" and "kvtrie.v1.KVCache") and server
// reflection (v1alpha, what gRPC 1.51 ships), so grpcurl can list, describe and call it.
// If the store fails (a write to disk failed; it then refuses writes), health turns NOT_SERVING.
// SIGTERM or SIGINT: health turns NOT_SERVING, calls already sent are read for 200 ms more,
// then new calls are refused; running calls get --shutdown_grace_seconds (from the signal), less
// a reserve for the teardown, to finish and are then cancelled (streams whose clients stalled
// too), the store is flushed and closed, and the process exits 0 within the grace.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.pb.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/guarded_service.h"
#include "server/kvcache_service.h"
#include "server/metrics.h"
#include "server/ops_flags.h"
#include "server/parse_failure_interceptor.h"
#include "server/service_flags.h"
#include "server/store_flags.h"
#include "server/tls.h"
#include "trie/kv_store.h"
#include "trie/record_store.h"

namespace kvtrie {
namespace {

constexpr char kServiceName[] = "kvtrie.v1.KVCache";

// Flags of kvtrie-server itself (for --help and the effective configuration).
bool IsServerFlagFile(absl::string_view file) {
  return absl::StrContains(file, "server/store_flags.cc") ||
         absl::StrContains(file, "server/service_flags.cc") ||
         absl::StrContains(file, "server/ops_flags.cc");
}

void WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  std::rename(tmp.c_str(), path.c_str());  // appears whole or not at all
}

// A plaintext port with only the health service, for probes that cannot speak TLS
// (--health_listen); null when none is asked for.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const OpsFlags& ops) {
  if (ops.health_listen.empty()) return nullptr;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(ops.health_listen, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("--health_listen: cannot listen on ", ops.health_listen));
  }
  server->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  server->GetHealthCheckService()->SetServingStatus(true);
  spdlog::info("health on {} (bound port {}, plaintext)", ops.health_listen, port);
  if (!ops.health_port_file.empty()) WritePortFile(ops.health_port_file, port);
  return server;
}

// Prometheus /metrics of `store` (--metrics_listen); null when none is asked for.
absl::StatusOr<std::unique_ptr<Metrics>> StartMetrics(const OpsFlags& ops, KvStore* store,
                                                      const Authenticator& auth) {
  if (ops.metrics_listen.empty()) return nullptr;
  auto metrics = std::make_unique<Metrics>(store, ops.metrics_max_namespaces);
  metrics->SetShardName(ops.shard_name);
  if (auth.table() != nullptr) metrics->NameNamespaces(auth.table()->namespaces());
  absl::StatusOr<int> port = metrics->Listen(ops.metrics_listen);
  if (!port.ok()) return port.status();
  spdlog::info("metrics on http://{}/metrics (bound port {})", ops.metrics_listen, *port);
  if (!ops.metrics_port_file.empty()) WritePortFile(ops.metrics_port_file, *port);
  return metrics;
}

int Run() {
  const OpsFlags ops = ReadOpsFlags();
  // Logs go to stderr (stdout stays free), as text or JSON lines.
  if (absl::Status s = SetUpLogging(ops.log_format, ops.log_level); !s.ok()) {
    std::fprintf(stderr, "kvtrie-server: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  spdlog::info("effective configuration: {}", EffectiveConfig(IsServerFlagFile));
  // Link the health protocol's descriptors so reflection can describe grpc.health.v1.Health
  // (gRPC 1.51's built-in health service does not register them).
  grpc::health::v1::HealthCheckRequest::descriptor();

  // Handle SIGTERM/SIGINT on one thread: block them before gRPC starts its threads.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);  // reloads the tokens file
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // The configuration, as data: each options struct from its flags, validated there.
  absl::StatusOr<StoreOptions> store_options = StoreOptionsFromFlags();
  if (!store_options.ok()) {
    spdlog::critical("{}", std::string(store_options.status().message()));
    return 2;
  }
  absl::StatusOr<ServingOptions> serving = ServingOptionsFromFlags(*store_options);
  if (!serving.ok()) {
    spdlog::critical("{}", std::string(serving.status().message()));
    return 2;
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<KvStore>> store = KvStore::Open(*store_options);
  if (!store.ok()) {
    spdlog::critical("cannot open the store: {}", std::string(store.status().message()));
    return 1;
  }
  const RecoveryStats& rec = (*store)->recovery();
  spdlog::info(
      "store {}: {} models, {} nodes recovered in {} ms ({} dropped: {} missing parent, "
      "{} bad payload)",
      store_options->data_dir, rec.models, rec.nodes,
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                            start)
          .count(),
      rec.dropped_missing_parent + rec.dropped_bad_payload, rec.dropped_missing_parent,
      rec.dropped_bad_payload);

  KvCacheService service(store->get(), serving->service);

  // Operating: tenants and quotas, metrics, TLS (server/guarded_service.h is what is served).
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::Create(ops.tokens_file);
  if (!auth.ok()) {
    spdlog::critical("{}", std::string(auth.status().message()));
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Metrics>> metrics_or = StartMetrics(ops, store->get(), **auth);
  if (!metrics_or.ok()) {
    spdlog::critical("{}", std::string(metrics_or.status().message()));
    return 1;
  }
  std::unique_ptr<Metrics> metrics = *std::move(metrics_or);
  GuardedService guarded(&service, auth->get(), store->get(), metrics.get(), serving->guarded);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(ops.tls);
  if (!credentials.ok()) {
    spdlog::critical("{}", std::string(credentials.status().message()));
    return 2;
  }
  if ((*auth)->enabled()) {
    spdlog::info("auth on: {} tenants from {}", (*auth)->table()->num_tenants(), ops.tokens_file);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // One server per port: without this gRPC sets SO_REUSEPORT and a second server on the same
  // port would serve (and split the calls) beside the first.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Bounded threads: past --max_threads gRPC's sync server (reflection) answers new calls
  // RESOURCE_EXHAUSTED. The KVCache calls are callback reactors (server/guarded_service.h).
  grpc::ResourceQuota quota("kvtrie-server");
  quota.SetMaxThreads(ops.max_threads);
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(serving->grpc_receive_cap);  // kvtrie checks a smaller limit
  int port = 0;
  builder.AddListeningPort(ops.listen, *credentials, &port);
  builder.RegisterService(&guarded);
  // A request that does not parse (invalid UTF-8 in a string field) gets INVALID_ARGUMENT saying
  // so, not gRPC's INTERNAL with an empty message.
  builder.experimental().SetInterceptorCreators(MakeParseFailureInterceptors());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    spdlog::critical(
        "cannot listen on {}: the address is in use (another kvtrie-server?) or not available",
        ops.listen);
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(kServiceName, true);
  server->GetHealthCheckService()->SetServingStatus(true);
  absl::StatusOr<std::unique_ptr<grpc::Server>> health = StartHealthServer(ops);
  if (!health.ok()) {
    spdlog::critical("{}", std::string(health.status().message()));
    return 1;
  }
  std::unique_ptr<grpc::Server> health_server = *std::move(health);
  spdlog::info("kvtrie-server serving {} on {} (bound port {}, {})", kServiceName, ops.listen, port,
               ops.tls.cert_file.empty()     ? "plaintext"
               : ops.tls.require_client_cert ? "mutual TLS"
                                             : "TLS");
  if (!ops.port_file.empty()) WritePortFile(ops.port_file, port);

  // A failed store write makes the store refuse writes until restart (trie/record_store.h):
  // health turns NOT_SERVING so the orchestrator restarts or drains this instance.
  absl::Notification stopping;
  std::thread health_watch([&] {
    while (!stopping.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      if (absl::Status h = (*store)->health(); !h.ok()) {
        spdlog::critical("{}; health is NOT_SERVING", std::string(h.message()));
        server->GetHealthCheckService()->SetServingStatus(kServiceName, false);
        server->GetHealthCheckService()->SetServingStatus(false);
        return;
      }
    }
  });
  std::thread waiter([&] {
    int sig = 0;
    while (sigwait(&signals, &sig) == 0 && sig == SIGHUP) {
      if (absl::Status s = (*auth)->Reload(); !s.ok()) {
        spdlog::error("SIGHUP: tokens file not reloaded (the old one stays): {}",
                      std::string(s.message()));
      } else if ((*auth)->enabled()) {
        spdlog::info("SIGHUP: reloaded {} tenants from {}", (*auth)->table()->num_tenants(),
                     ops.tokens_file);
      }
    }
    spdlog::info("signal {}: draining (grace {} s)", sig, ops.shutdown_grace_seconds);
    const auto signalled = std::chrono::system_clock::now();
    const auto deadline = signalled + std::chrono::seconds(ops.shutdown_grace_seconds);
    server->GetHealthCheckService()->Shutdown();  // NOT_SERVING for every service
    if (health_server) health_server->GetHealthCheckService()->Shutdown();
    // Calls a client sent just before the signal may not be read off their connection yet;
    // gRPC's Shutdown refuses what it has not matched, so give them a moment (within the grace).
    std::this_thread::sleep_until(
        std::min(deadline, std::chrono::system_clock::now() + std::chrono::milliseconds(200)));
    // Streams whose clients stalled never finish by themselves: gRPC's Shutdown waits for them
    // (and for their connections) until its deadline, then cancels every call and closes the
    // connections, and only then can the teardown start. So its deadline is the grace less a
    // reserve for the teardown (a third of it, at most 1 s): the process exits within the grace.
    const auto reserve = std::min<std::chrono::system_clock::duration>(std::chrono::seconds(1),
                                                                       (deadline - signalled) / 3);
    server->Shutdown(deadline - reserve);
  });
  server->Wait();
  guarded.StopHandlers();  // the last steps of finished calls, before the store closes
  waiter.join();
  stopping.Notify();
  health_watch.join();
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now());
  metrics.reset();  // stops /metrics, which reads the store
  store->reset();   // flushes and closes RocksDB
  spdlog::info("kvtrie-server stopped");
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "stores the KV caches of LLM inference workers (gRPC kvtrie.v1.KVCache).\n"
      "  kvtrie-server --listen=127.0.0.1:50051 --data_dir=./kvtrie-data");
  absl::FlagsUsageConfig usage;
  // --help lists this file's flags (absl's default expects the file to be named after the binary).
  usage.contains_help_flags = kvtrie::IsServerFlagFile;
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  // --config=FILE: its settings go before the command line's flags, which override them.
  absl::StatusOr<std::vector<std::string>> args = kvtrie::ExpandConfigFile(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "kvtrie-server: %s\n", std::string(args.status().message()).c_str());
    return 2;
  }
  std::vector<char*> expanded;
  for (std::string& a : *args) expanded.push_back(a.data());
  absl::ParseCommandLine(static_cast<int>(expanded.size()), expanded.data());
  return kvtrie::Run();
}
