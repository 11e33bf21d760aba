// client/client_flags.h
//
// The connection flags shared by the `kvtrie` CLI and `kvtrie-worker`:
//   --tls_ca=FILE      CA bundle (PEM) the server's certificate must chain to; turns TLS on
//   --tls_cert=FILE    client certificate (PEM), for mutual TLS (with --tls_key)
//   --tls_key=FILE     its private key (PEM)
//   --tls_server_name  the name expected in the server's certificate (default: the target host)
//   --token=TOKEN      bearer token (default: $KVTRIE_TOKEN), for servers with --tokens_file
#ifndef KVTRIE_CLIENT_CLIENT_FLAGS_H_
#define KVTRIE_CLIENT_CLIENT_FLAGS_H_

#include "absl/status/status.h"
#include "client/client.h"

namespace kvtrie {

// Fills options' TLS and token fields from the flags. Errors: as LoadTlsFiles.
absl::Status ApplyClientFlags(ClientOptions* options);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_CLIENT_FLAGS_H_
