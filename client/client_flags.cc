#include "client/client_flags.h"

#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM) that the server's certificate must chain to; turns TLS on");
ABSL_FLAG(std::string, tls_cert, "", "client certificate (PEM) for mutual TLS, with --tls_key");
ABSL_FLAG(std::string, tls_key, "", "private key (PEM) of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name expected in the server's certificate (default: the target's host)");
ABSL_FLAG(std::string, token, "",
          "bearer token for a server with --tokens_file (default: $KVTRIE_TOKEN)");
ABSL_FLAG(int, retry_attempts, 5,
          "attempts of a call, the first included (1 = never retry): a Put that ends ABORTED "
          "(its prefix kept changing under concurrent Puts; nothing stored) or UNAVAILABLE is "
          "sent again, whole; Lookup and Stats again after UNAVAILABLE");
ABSL_FLAG(int, retry_initial_backoff_ms, 100,
          "wait before the first retry (jittered: drawn from [d/2, d]); doubles each retry");
ABSL_FLAG(int, retry_max_backoff_ms, 2000, "longest wait between two attempts");
ABSL_FLAG(int, codec_threads, 0,
          "threads that decode a RESIDUAL get and encode a put with --encode_on_client, the "
          "caller's included (0 = the machine's cores, 1 = the calling thread only)");

namespace kvtrie {

absl::Status ApplyClientFlags(ClientOptions* options) {
  if (absl::Status s = LoadTlsFiles(absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
                                    absl::GetFlag(FLAGS_tls_key), options);
      !s.ok()) {
    return s;
  }
  options->retry.max_attempts = absl::GetFlag(FLAGS_retry_attempts);
  options->retry.initial_backoff =
      absl::Milliseconds(absl::GetFlag(FLAGS_retry_initial_backoff_ms));
  options->retry.max_backoff = absl::Milliseconds(absl::GetFlag(FLAGS_retry_max_backoff_ms));
  if (options->retry.max_attempts < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--retry_attempts: ", options->retry.max_attempts, " (must be >= 1; 1 = never retry)"));
  }
  if (absl::Status s = ValidateRetryPolicy(options->retry); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--retry_initial_backoff_ms, --retry_max_backoff_ms: need 0 <= initial <= max (",
        s.message(), ")"));
  }
  options->codec_threads = absl::GetFlag(FLAGS_codec_threads);
  if (options->codec_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--codec_threads: ", options->codec_threads,
                                                   " (must be >= 0; 0 = the machine's cores)"));
  }
  options->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options->token = absl::GetFlag(FLAGS_token);
  if (options->token.empty()) {
    if (const char* env = std::getenv("KVTRIE_TOKEN"); env != nullptr) options->token = env;
  }
  return absl::OkStatus();
}

}  // namespace kvtrie
