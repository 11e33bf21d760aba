#include "server/auth.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/byte_size.h"

namespace kvtrie {
namespace {

using nlohmann::json;

absl::Status Bad(const std::string& where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokens file: ", where, ": ", what));
}

absl::Status CheckKeys(const json& j, const std::string& where,
                       const std::set<std::string>& allowed) {
  if (!j.is_object()) return Bad(where, "must be an object");
  for (const auto& [key, value] : j.items()) {
    if (!allowed.count(key)) return Bad(where, absl::StrCat("unknown key '", key, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Count(const json& j, const std::string& where, bool units) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (units && j.is_string()) {
    uint64_t v = 0;
    std::string error;
    if (ParseByteSize(j.get<std::string>(), &v, &error)) return v;
    return Bad(where, error);
  }
  return Bad(where, units ? "must be a non-negative integer or a size like \"10GiB\""
                          : "must be a non-negative integer");
}

absl::StatusOr<Quota> ParseQuota(const json& j, const std::string& where) {
  if (auto s = CheckKeys(j, where, {"stored_bytes", "nodes", "put_streams"}); !s.ok()) return s;
  Quota q;
  if (j.contains("stored_bytes")) {
    absl::StatusOr<uint64_t> v = Count(j["stored_bytes"], where + ".stored_bytes", true);
    if (!v.ok()) return v.status();
    q.stored_bytes = *v;
  }
  if (j.contains("nodes")) {
    absl::StatusOr<uint64_t> v = Count(j["nodes"], where + ".nodes", false);
    if (!v.ok()) return v.status();
    q.nodes = *v;
  }
  if (j.contains("put_streams")) {
    absl::StatusOr<uint64_t> v = Count(j["put_streams"], where + ".put_streams", false);
    if (!v.ok()) return v.status();
    if (*v > 1u << 20) return Bad(where + ".put_streams", "is above 1048576");
    q.put_streams = static_cast<uint32_t>(*v);
  }
  return q;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const TokenTable>> TokenTable::Parse(const std::string& text) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Bad("(top)", "not valid JSON");
  if (auto s = CheckKeys(root, "(top)", {"tenants"}); !s.ok()) return s;
  if (!root.contains("tenants") || !root["tenants"].is_array()) {
    return Bad("tenants", "required, an array");
  }
  auto table = std::make_shared<TokenTable>();
  std::set<std::string> names;
  for (size_t i = 0; i < root["tenants"].size(); ++i) {
    const json& t = root["tenants"][i];
    const std::string where = absl::StrCat("tenants[", i, "]");
    if (auto s = CheckKeys(t, where, {"name", "tokens", "namespaces", "admin", "quota"}); !s.ok())
      return s;
    auto tenant = std::make_unique<Tenant>();
    if (!t.contains("name") || !t["name"].is_string() || t["name"].get<std::string>().empty()) {
      return Bad(where + ".name", "required, a non-empty string");
    }
    tenant->name = t["name"].get<std::string>();
    if (!names.insert(tenant->name).second) {
      return Bad(where + ".name", absl::StrCat("duplicate tenant '", tenant->name, "'"));
    }
    if (t.contains("admin")) {
      if (!t["admin"].is_boolean()) return Bad(where + ".admin", "must be true or false");
      tenant->admin = t["admin"].get<bool>();
    }
    if (t.contains("namespaces")) {
      if (!t["namespaces"].is_array()) return Bad(where + ".namespaces", "must be an array");
      for (size_t n = 0; n < t["namespaces"].size(); ++n) {
        const json& ns = t["namespaces"][n];
        const std::string w = absl::StrCat(where, ".namespaces[", n, "]");
        if (!ns.is_string()) return Bad(w, "must be a string");
        if (ns.get<std::string>().find('\0') != std::string::npos) {
          return Bad(w, "must not contain NUL");
        }
        tenant->namespaces.push_back(ns.get<std::string>());
      }
    }
    if (!tenant->admin && tenant->namespaces.empty()) {
      return Bad(where + ".namespaces", "required for a tenant that is not admin");
    }
    if (t.contains("quota")) {
      absl::StatusOr<Quota> q = ParseQuota(t["quota"], where + ".quota");
      if (!q.ok()) return q.status();
      tenant->quota = *q;
    }
    if (!t.contains("tokens") || !t["tokens"].is_array() || t["tokens"].empty()) {
      return Bad(where + ".tokens", "required, a non-empty array of strings");
    }
    for (size_t k = 0; k < t["tokens"].size(); ++k) {
      const json& tok = t["tokens"][k];
      const std::string w = absl::StrCat(where, ".tokens[", k, "]");
      if (!tok.is_string() || tok.get<std::string>().size() < 8) {
        return Bad(w, "must be a string of at least 8 characters");
      }
      if (!table->by_token_.emplace(tok.get<std::string>(), tenant.get()).second) {
        return Bad(w, "duplicate token (another tenant or entry has it)");
      }
    }
    for (const std::string& ns : tenant->namespaces) {
      if (table->quota_by_ns_.emplace(ns, tenant->quota).second) table->namespaces_.push_back(ns);
    }
    table->tenants_.push_back(std::move(tenant));
  }
  return std::shared_ptr<const TokenTable>(std::move(table));
}

const Tenant* TokenTable::FindToken(const std::string& token) const {
  // Compares with every token, each in time independent of where they differ (a map lookup
  // would tell a caller through its timing how much of a guess was right).
  const Tenant* found = nullptr;
  for (const auto& [known, tenant] : by_token_) {
    unsigned char diff = known.size() == token.size() ? 0 : 1;
    for (size_t i = 0; i < known.size(); ++i) {
      diff |= static_cast<unsigned char>(known[i] ^ (i < token.size() ? token[i] : 0));
    }
    if (diff == 0) found = tenant;
  }
  return found;
}

Quota TokenTable::QuotaOf(const std::string& ns) const {
  auto it = quota_by_ns_.find(ns);
  return it == quota_by_ns_.end() ? Quota{} : it->second;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(
    const std::string& tokens_file) {
  std::unique_ptr<Authenticator> auth(new Authenticator(tokens_file));
  if (auth->enabled()) {
    if (absl::Status s = auth->Reload(); !s.ok()) return s;
  }
  return auth;
}

absl::Status Authenticator::Reload() {
  if (!enabled()) return absl::OkStatus();
  std::ifstream in(path_, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--tokens_file: cannot read ", path_));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<std::shared_ptr<const TokenTable>> table = TokenTable::Parse(text.str());
  if (!table.ok()) return table.status();
  absl::MutexLock lock(&mu_);
  table_ = *std::move(table);
  return absl::OkStatus();
}

std::shared_ptr<const TokenTable> Authenticator::table() const {
  absl::MutexLock lock(&mu_);
  return table_;
}

grpc::Status Authenticator::Authorize(const grpc::ServerContextBase& context,
                                      const std::string& requested_ns, Caller* caller) const {
  if (!enabled()) {
    *caller = Caller{nullptr, nullptr, requested_ns};
    return grpc::Status::OK;
  }
  std::shared_ptr<const TokenTable> table = this->table();
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "authorization: missing (send 'authorization: Bearer <token>' metadata)");
  }
  const std::string value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWith(value, kBearer)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "authorization: expected 'Bearer <token>'");
  }
  const Tenant* tenant = table->FindToken(value.substr(kBearer.size()));
  if (tenant == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization: unknown token");
  }
  std::string ns = requested_ns;
  if (ns.empty() && !tenant->namespaces.empty()) ns = tenant->namespaces.front();
  if (!tenant->admin && std::find(tenant->namespaces.begin(), tenant->namespaces.end(), ns) ==
                            tenant->namespaces.end()) {
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrCat("namespace: tenant '", tenant->name, "' may not use namespace '", ns,
                     "' (it may use '", absl::StrJoin(tenant->namespaces, "', '"), "')"));
  }
  *caller = Caller{std::move(table), tenant, std::move(ns)};
  return grpc::Status::OK;
}

}  // namespace kvtrie
