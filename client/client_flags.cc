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
          "threads that decode a RESIDUAL get and encode a put (--encode_on_client), the "
          "caller's included (0 = the machine's cores, 1 = the calling thread only)");
ABSL_FLAG(bool, encode_on_client, true,
          "put: encode the blocks here and send them encoded (raw, lossless, and residual with "
          "a target, of the fast profile); the server checks and stores them as they are. false: "
          "send them dense and let the server encode (thin clients). Compact-profile, baseline "
          "and layered puts are always sent dense");
ABSL_FLAG(bool, learned_lossless, false,
          "put: lossless of the fast profile also codes each block against the latest learned "
          "predictor state, kept when smaller (~1.56x vs 1.12x on held-out fp16 text, but "
          "~0.1-0.3 GB/s per core to encode instead of ~2; bench/lossless.md)");
ABSL_FLAG(double, predictor_refresh_seconds, 10,
          "put: how long an encoding residual put uses the latest learned predictor state "
          "version it found before asking the server again (0 = before every put; a freed "
          "version is noticed at once: the put is encoded again)");

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
  const double refresh = absl::GetFlag(FLAGS_predictor_refresh_seconds);
  if (!(refresh >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--predictor_refresh_seconds: ", refresh, " (must be >= 0)"));
  }
  options->predictor_refresh = absl::Seconds(refresh);
  options->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options->token = absl::GetFlag(FLAGS_token);
  if (options->token.empty()) {
    if (const char* env = std::getenv("KVTRIE_TOKEN"); env != nullptr) options->token = env;
  }
  return absl::OkStatus();
}

}  // namespace kvtrie

namespace kvtrie {

void ApplyPutFlags(PutOptions* options) {
  options->encode_on_client = absl::GetFlag(FLAGS_encode_on_client);
  options->learned_lossless = absl::GetFlag(FLAGS_learned_lossless);
}

}  // namespace kvtrie
