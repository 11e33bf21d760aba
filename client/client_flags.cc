#include "client/client_flags.h"

#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM) that the server's certificate must chain to; turns TLS on");
ABSL_FLAG(std::string, tls_cert, "", "client certificate (PEM) for mutual TLS, with --tls_key");
ABSL_FLAG(std::string, tls_key, "", "private key (PEM) of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name expected in the server's certificate (default: the target's host)");
ABSL_FLAG(std::string, token, "",
          "bearer token for a server with --tokens_file (default: $KVTRIE_TOKEN)");

namespace kvtrie {

absl::Status ApplyClientFlags(ClientOptions* options) {
  if (absl::Status s = LoadTlsFiles(absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
                                    absl::GetFlag(FLAGS_tls_key), options);
      !s.ok()) {
    return s;
  }
  options->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options->token = absl::GetFlag(FLAGS_token);
  if (options->token.empty()) {
    if (const char* env = std::getenv("KVTRIE_TOKEN"); env != nullptr) options->token = env;
  }
  return absl::OkStatus();
}

}  // namespace kvtrie
