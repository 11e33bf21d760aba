#include "server/ops_flags.h"

#include <cstdlib>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "HOST:PORT to serve gRPC on; port 0 picks a free port (see --port_file)");
ABSL_FLAG(std::string, port_file, "",
          "if set, write the bound port to this file once serving (for tests and scripts)");
ABSL_FLAG(int, max_threads, 512,
          "most threads gRPC's synchronous server may run calls on (only server reflection is "
          "served so; the KVCache calls use the callback API and --handler_threads); calls past "
          "it are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, shutdown_grace_seconds, 10,
          "on SIGTERM, how long until the process exits: running calls may take this long, less "
          "a reserve for the teardown (a third of it, at most 1 s), before they are cancelled");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(std::string, config, "",
          "config file: one 'name = value' line per flag (same names); flags on the command "
          "line override it");
ABSL_FLAG(std::string, log_format, "text", "text, or json (one JSON object per log line)");
ABSL_FLAG(std::string, tls_cert, "",
          "server certificate chain (PEM); with --tls_key serves TLS only (no plaintext)");
ABSL_FLAG(std::string, tls_key, "", "private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "CA bundle (PEM) that client certificates are verified against (mutual TLS)");
ABSL_FLAG(bool, tls_require_client_cert, false,
          "mutual TLS: refuse clients without a certificate signed by --tls_client_ca");
ABSL_FLAG(uint32_t, tls_refresh_seconds, 60,
          "how often the TLS files are checked; replaced ones are used for new connections");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT of a second, plaintext gRPC port serving only grpc.health.v1.Health (for "
          "Kubernetes gRPC probes, which cannot speak TLS); empty = none");
ABSL_FLAG(std::string, health_port_file, "",
          "if set, write the bound health port to this file (for tests and scripts)");
ABSL_FLAG(std::string, tokens_file, "",
          "tenants (JSON: bearer tokens, their namespaces, admin, quotas; re-read on SIGHUP); "
          "set: every call needs 'authorization: Bearer TOKEN' and the namespace comes from it");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT for Prometheus /metrics over HTTP (e.g. 0.0.0.0:9090); empty = off");
ABSL_FLAG(std::string, metrics_port_file, "",
          "if set, write the bound metrics port to this file (for tests and scripts)");
ABSL_FLAG(uint32_t, metrics_max_namespaces, 32,
          "most namespaces with their own metrics label; the rest are namespace=\"other\"");

ABSL_FLAG(std::string, shard_name, "",
          "this server's shard name (e.g. kvtrie-0), added as shard=\"NAME\" to every /metrics "
          "sample; default: $POD_NAME (a StatefulSet pod's stable name), else none");

namespace kvtrie {

OpsFlags ReadOpsFlags() {
  OpsFlags f;
  f.listen = absl::GetFlag(FLAGS_listen);
  f.port_file = absl::GetFlag(FLAGS_port_file);
  f.max_threads = absl::GetFlag(FLAGS_max_threads);
  f.shutdown_grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  f.log_level = absl::GetFlag(FLAGS_log_level);
  f.log_format = absl::GetFlag(FLAGS_log_format);
  f.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  f.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  f.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  f.tls.require_client_cert = absl::GetFlag(FLAGS_tls_require_client_cert);
  f.tls.refresh_seconds = absl::GetFlag(FLAGS_tls_refresh_seconds);
  f.health_listen = absl::GetFlag(FLAGS_health_listen);
  f.health_port_file = absl::GetFlag(FLAGS_health_port_file);
  f.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  f.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  f.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  f.metrics_max_namespaces = absl::GetFlag(FLAGS_metrics_max_namespaces);
  f.shard_name = absl::GetFlag(FLAGS_shard_name);
  if (f.shard_name.empty()) {
    if (const char* pod = std::getenv("POD_NAME"); pod != nullptr) f.shard_name = pod;
  }
  return f;
}

}  // namespace kvtrie
