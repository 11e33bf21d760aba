// server/tls.h
//
// The server's transport credentials: plaintext, TLS, or mutual TLS, from PEM files.
// The files are watched (gRPC's FileWatcherCertificateProvider): a certificate or key replaced
// on disk, e.g. by cert-manager or a Kubernetes Secret update, is served to new connections
// within `refresh_seconds`, without a restart. Replace the key and certificate together (write
// new files, then rename over the old ones).
#ifndef KVTRIE_SERVER_TLS_H_
#define KVTRIE_SERVER_TLS_H_

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvtrie {

struct TlsOptions {
  std::string cert_file;             // server certificate chain (PEM); empty = plaintext
  std::string key_file;              // its private key (PEM)
  std::string client_ca_file;        // CA bundle that client certificates must chain to (PEM)
  bool require_client_cert = false;  // mTLS: refuse a client that sends no valid certificate
  unsigned refresh_seconds = 60;     // how often the files are checked for changes
};

// Plaintext when cert_file and key_file are empty. Errors: INVALID_ARGUMENT naming the flag
// (`--tls_key` missing, a file that cannot be read or holds no PEM block, a client CA without a
// server certificate, --tls_require_client_cert without --tls_client_ca).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& options);

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_TLS_H_
