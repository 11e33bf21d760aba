#include "server/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {

absl::Status CheckPem(const char* flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  if (!absl::StrContains(text.str(), "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' holds no PEM block"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsOptions& o) {
  if (o.cert_file.empty() && o.key_file.empty()) {
    if (!o.client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca: needs --tls_cert and --tls_key");
    }
    if (o.require_client_cert) {
      return absl::InvalidArgumentError(
          "--tls_require_client_cert: needs --tls_cert, --tls_key and --tls_client_ca");
    }
    return grpc::InsecureServerCredentials();
  }
  if (o.cert_file.empty()) return absl::InvalidArgumentError("--tls_cert: needed with --tls_key");
  if (o.key_file.empty()) return absl::InvalidArgumentError("--tls_key: needed with --tls_cert");
  if (o.require_client_cert && o.client_ca_file.empty()) {
    return absl::InvalidArgumentError("--tls_require_client_cert: needs --tls_client_ca");
  }
  if (auto s = CheckPem("--tls_cert", o.cert_file); !s.ok()) return s;
  if (auto s = CheckPem("--tls_key", o.key_file); !s.ok()) return s;
  if (!o.client_ca_file.empty()) {
    if (auto s = CheckPem("--tls_client_ca", o.client_ca_file); !s.ok()) return s;
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      o.key_file, o.cert_file, o.client_ca_file, std::max(1u, o.refresh_seconds));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!o.client_ca_file.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(o.require_client_cert
                                      ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                      : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace kvtrie
