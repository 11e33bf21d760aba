// client/client_flags.h
//
// The connection flags shared by the `kvtrie` CLI and `kvtrie-worker`:
//   --tls_ca=FILE      CA bundle (PEM) the server's certificate must chain to; turns TLS on
//   --tls_cert=FILE    client certificate (PEM), for mutual TLS (with --tls_key)
//   --tls_key=FILE     its private key (PEM)
//   --tls_server_name  the name expected in the server's certificate (default: the target host)
//   --token=TOKEN      bearer token (default: $KVTRIE_TOKEN), for servers with --tokens_file
//   --retry_attempts=N attempts of a call, the first included (5; 1 = never retry): an ABORTED or
//                      UNAVAILABLE Put is sent again, as ClientOptions::retry says
//   --retry_initial_backoff_ms, --retry_max_backoff_ms   the jittered backoff (100, 2000)
//   --codec_threads=N  threads that encode Puts and decode RESIDUAL Gets (0 = the cores)
//   --predictor_refresh_seconds=S   ClientOptions::predictor_refresh (10)
//   --encode_on_client (true)   PutOptions::encode_on_client; =false sends Puts dense (thin
//                      clients: the server encodes)
//   --learned_lossless (false)  PutOptions::learned_lossless: fast lossless against the learned
//                      state (smaller, slower to encode)
#ifndef KVTRIE_CLIENT_CLIENT_FLAGS_H_
#define KVTRIE_CLIENT_CLIENT_FLAGS_H_

#include "absl/status/status.h"
#include "client/client.h"

namespace kvtrie {

// Fills options' TLS, token and retry fields from the flags. Errors: as LoadTlsFiles, and
// INVALID_ARGUMENT naming a retry flag out of range.
absl::Status ApplyClientFlags(ClientOptions* options);

// Fills options' encode_on_client and learned_lossless from --encode_on_client and
// --learned_lossless.
void ApplyPutFlags(PutOptions* options);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_CLIENT_FLAGS_H_
