// server/auth.h
//
// Tenants: bearer tokens, the namespaces each may use, an admin role, per-namespace quotas.
//
// The tokens file (--tokens_file) is JSON:
//   {"tenants": [
//     {"name": "team-a", "tokens": ["s3cret-a"], "namespaces": ["team-a", "team-a-lossy"],
//      "quota": {"stored_bytes": "10GiB", "nodes": 1000000, "put_streams": 8}},
//     {"name": "ops", "tokens": ["s3cret-ops"], "admin": true}]}
// A tenant's first namespace is its default (a request with an empty namespace uses it). An admin
// may name any namespace, and "" means the whole server to Stats. A quota applies to each of the
// tenant's namespaces; a missing field or 0 is unlimited; stored_bytes takes units (ByteSize).
// Unknown keys, duplicate tokens and empty token strings are errors naming the entry.
//
// A client sends `authorization: Bearer <token>` metadata on every call. With auth on:
//   no or unknown token            -> UNAUTHENTICATED naming `authorization`
//   a namespace it may not use     -> PERMISSION_DENIED naming `namespace`
// With no tokens file auth is off: every request keeps the namespace it names.
//
// Thread-safe; Reload() swaps the table atomically (calls in flight keep the one they started
// with), and keeps the old table if the new file is bad.
#ifndef KVTRIE_SERVER_AUTH_H_
#define KVTRIE_SERVER_AUTH_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvtrie {

struct Quota {
  uint64_t stored_bytes = 0;  // payload bytes the namespace may store (0 = unlimited)
  uint64_t nodes = 0;         // trie nodes (blocks) the namespace may hold
  uint32_t put_streams = 0;   // Put streams in flight at once
};

struct Tenant {
  std::string name;
  std::vector<std::string> namespaces;  // first = default
  bool admin = false;
  Quota quota;
};

// A parsed tokens file. Immutable.
class TokenTable {
 public:
  // Errors: INVALID_ARGUMENT naming the entry ("tenants[1].tokens[0]: duplicate token").
  static absl::StatusOr<std::shared_ptr<const TokenTable>> Parse(const std::string& json);

  const Tenant* FindToken(const std::string& token) const;  // null if unknown
  // The quota of `ns` (that of the first tenant listing it; unlimited if none does).
  Quota QuotaOf(const std::string& ns) const;
  // Every namespace some tenant lists, in file order, no duplicates.
  const std::vector<std::string>& namespaces() const { return namespaces_; }
  size_t num_tenants() const { return tenants_.size(); }

 private:
  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::map<std::string, const Tenant*> by_token_;
  std::map<std::string, Quota> quota_by_ns_;
  std::vector<std::string> namespaces_;
};

// Who is calling and which namespace the request acts on.
struct Caller {
  std::shared_ptr<const TokenTable> table;  // keeps `tenant` alive; null when auth is off
  const Tenant* tenant = nullptr;           // null when auth is off
  std::string ns;                           // the namespace to use
  bool admin() const { return tenant == nullptr || tenant->admin; }
};

class Authenticator {
 public:
  // `tokens_file` empty: auth off. Errors: the file cannot be read or parsed.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(const std::string& tokens_file);

  bool enabled() const { return !path_.empty(); }
  // Re-reads the tokens file; on error keeps the current table and returns the error.
  absl::Status Reload();

  // Decides the namespace of a request naming `requested_ns` (see the top of this file).
  grpc::Status Authorize(const grpc::ServerContextBase& context, const std::string& requested_ns,
                         Caller* caller) const;

  std::shared_ptr<const TokenTable> table() const;  // null when auth is off

 private:
  explicit Authenticator(std::string path) : path_(std::move(path)) {}
  const std::string path_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_AUTH_H_
