#include "client/shard_router.h"

#include <arpa/inet.h>
#include <arpa/nameser.h>
#include <netdb.h>
#include <netinet/in.h>
#include <resolv.h>
#include <sys/socket.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvtrie {
namespace {

absl::Status CheckShards(std::vector<Shard>& shards) {
  if (shards.empty()) return absl::InvalidArgumentError("shards: the list is empty");
  std::sort(shards.begin(), shards.end(),
            [](const Shard& a, const Shard& b) { return a.name < b.name; });
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].name.empty()) return absl::InvalidArgumentError("shards: a shard has no name");
    if (shards[i].target.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("shards: '", shards[i].name, "' has no target"));
    }
    if (i > 0 && shards[i].name == shards[i - 1].name) {
      return absl::InvalidArgumentError(
          absl::StrCat("shards: the name '", shards[i].name, "' is given twice"));
    }
  }
  return absl::OkStatus();
}

void AppendU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::string FirstLabel(absl::string_view host) {
  host = absl::StripSuffix(host, ".");
  return std::string(host.substr(0, host.find('.')));
}

class SystemResolver : public ShardResolver {
 public:
  absl::StatusOr<std::vector<Shard>> Resolve(const std::string& name) override {
    if (!name.empty() && name[0] == '_') return ResolveSrv(name);
    return ResolveA(name);
  }

 private:
  static absl::StatusOr<std::vector<Shard>> ResolveSrv(const std::string& name) {
    struct __res_state state;
    std::memset(&state, 0, sizeof(state));
    if (res_ninit(&state) != 0) return absl::UnavailableError("shards_dns: res_ninit failed");
    std::vector<unsigned char> answer(65536);
    const int len =
        res_nquery(&state, name.c_str(), ns_c_in, ns_t_srv, answer.data(), answer.size());
    res_nclose(&state);
    if (len < 0) {
      return absl::UnavailableError(absl::StrCat("shards_dns: no SRV records for '", name, "'"));
    }
    ns_msg msg;
    if (ns_initparse(answer.data(), len, &msg) != 0) {
      return absl::UnavailableError(absl::StrCat("shards_dns: bad SRV answer for '", name, "'"));
    }
    std::vector<Shard> shards;
    for (int i = 0; i < ns_msg_count(msg, ns_s_an); ++i) {
      ns_rr rr;
      if (ns_parserr(&msg, ns_s_an, i, &rr) != 0 || ns_rr_type(rr) != ns_t_srv) continue;
      if (ns_rr_rdlen(rr) < 7) continue;
      const unsigned char* rd = ns_rr_rdata(rr);
      const uint16_t port = static_cast<uint16_t>((rd[4] << 8) | rd[5]);
      char host[NS_MAXDNAME];
      if (dn_expand(ns_msg_base(msg), ns_msg_end(msg), rd + 6, host, sizeof(host)) < 0) continue;
      std::string h = std::string(absl::StripSuffix(host, "."));
      shards.push_back({FirstLabel(h), absl::StrCat(h, ":", port)});
    }
    if (shards.empty()) {
      return absl::UnavailableError(absl::StrCat("shards_dns: no SRV records for '", name, "'"));
    }
    return shards;
  }

  static absl::StatusOr<std::vector<Shard>> ResolveA(const std::string& name) {
    std::string host = name, port = "50051";
    if (size_t colon = name.rfind(':'); colon != std::string::npos) {
      host = name.substr(0, colon);
      port = name.substr(colon + 1);
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
      return absl::UnavailableError(
          absl::StrCat("shards_dns: '", name, "' does not resolve: ", gai_strerror(rc)));
    }
    std::set<std::pair<std::string, std::string>> seen;  // (name, target), sorted
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      char addr[NI_MAXHOST], rev[NI_MAXHOST];
      if (getnameinfo(a->ai_addr, a->ai_addrlen, addr, sizeof(addr), nullptr, 0, NI_NUMERICHOST) !=
          0) {
        continue;
      }
      const std::string target = a->ai_family == AF_INET6 ? absl::StrCat("[", addr, "]:", port)
                                                          : absl::StrCat(addr, ":", port);
      std::string shard_name = addr;  // no PTR record: the address is the best name there is
      if (getnameinfo(a->ai_addr, a->ai_addrlen, rev, sizeof(rev), nullptr, 0, NI_NAMEREQD) == 0) {
        shard_name = FirstLabel(rev);
      }
      seen.insert({shard_name, target});
    }
    freeaddrinfo(res);
    std::vector<Shard> shards;
    for (const auto& [n, t] : seen) {
      if (!shards.empty() && shards.back().name == n) continue;  // one address per name
      shards.push_back({n, t});
    }
    if (shards.empty()) {
      return absl::UnavailableError(absl::StrCat("shards_dns: '", name, "' has no addresses"));
    }
    return shards;
  }
};

}  // namespace

absl::StatusOr<std::vector<Shard>> ParseShardList(absl::string_view list) {
  std::vector<Shard> shards;
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos || item.substr(eq + 1).find(':') == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("shards: '", item, "' is not name=host:port"));
    }
    shards.push_back({std::string(item.substr(0, eq)), std::string(item.substr(eq + 1))});
  }
  if (absl::Status s = CheckShards(shards); !s.ok()) return s;
  return shards;
}

uint64_t RouteKey(absl::string_view ns, absl::string_view model_id,
                  absl::Span<const uint32_t> token_ids, size_t route_tokens) {
  std::string buf;
  const size_t n = std::min(route_tokens, token_ids.size());
  buf.reserve(8 + ns.size() + model_id.size() + 4 * n);
  AppendU32(&buf, static_cast<uint32_t>(ns.size()));
  buf.append(ns.data(), ns.size());
  AppendU32(&buf, static_cast<uint32_t>(model_id.size()));
  buf.append(model_id.data(), model_id.size());
  for (size_t i = 0; i < n; ++i) AppendU32(&buf, token_ids[i]);
  return XXH3_64bits(buf.data(), buf.size());
}

uint64_t ShardScore(absl::string_view name, uint64_t route_key) {
  unsigned char key[8];
  for (int i = 0; i < 8; ++i) key[i] = static_cast<unsigned char>(route_key >> (8 * i));
  return XXH3_64bits_withSeed(key, sizeof(key), XXH3_64bits(name.data(), name.size()));
}

int OwnerIndex(absl::Span<const Shard> shards, uint64_t route_key) {
  int best = -1;
  uint64_t best_score = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const uint64_t s = ShardScore(shards[i].name, route_key);
    if (best < 0 || s > best_score ||
        (s == best_score && shards[i].name < shards[static_cast<size_t>(best)].name)) {
      best = static_cast<int>(i);
      best_score = s;
    }
  }
  return best;
}

std::unique_ptr<ShardResolver> NewSystemResolver() { return std::make_unique<SystemResolver>(); }

void StaticResolver::Set(const std::string& name, std::vector<Shard> shards) {
  absl::MutexLock lock(&mu_);
  for (auto& [n, s] : table_) {
    if (n == name) {
      s = std::move(shards);
      return;
    }
  }
  table_.emplace_back(name, std::move(shards));
}

absl::StatusOr<std::vector<Shard>> StaticResolver::Resolve(const std::string& name) {
  absl::MutexLock lock(&mu_);
  ++resolves_;
  for (const auto& [n, s] : table_) {
    if (n == name && !s.empty()) return s;
  }
  return absl::UnavailableError(absl::StrCat("shards_dns: '", name, "' does not resolve"));
}

int StaticResolver::resolves() const {
  absl::MutexLock lock(&mu_);
  return resolves_;
}

absl::StatusOr<std::unique_ptr<ShardRouter>> ShardRouter::FromList(
    std::vector<Shard> shards, const ShardRouterOptions& options) {
  std::unique_ptr<ShardRouter> r(new ShardRouter(options));
  if (absl::Status s = r->SetShards(std::move(shards)); !s.ok()) return s;
  return r;
}

absl::StatusOr<std::unique_ptr<ShardRouter>> ShardRouter::FromDns(
    std::string dns_name, std::shared_ptr<ShardResolver> resolver,
    const ShardRouterOptions& options) {
  absl::StatusOr<std::vector<Shard>> shards = resolver->Resolve(dns_name);
  if (!shards.ok()) return shards.status();
  std::unique_ptr<ShardRouter> r(new ShardRouter(options));
  r->dns_name_ = std::move(dns_name);
  r->resolver_ = std::move(resolver);
  if (absl::Status s = r->SetShards(*std::move(shards)); !s.ok()) return s;
  absl::MutexLock lock(&r->mu_);
  r->next_refresh_ = r->Now() + options.refresh_interval;
  return r;
}

absl::Status ShardRouter::SetShards(std::vector<Shard> shards) {
  if (absl::Status s = CheckShards(shards); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (shards != shards_) {
    // The set before (for PreviousOwner), unless only addresses changed: ownership did not.
    auto names = [](const std::vector<Shard>& v) {
      std::vector<std::string> n;
      for (const Shard& s : v) n.push_back(s.name);
      return n;
    };
    if (!shards_.empty() && names(shards_) != names(shards)) {
      previous_ = std::move(shards_);
      changed_at_ = Now();
    }
    shards_ = std::move(shards);
    ++generation_;
  }
  return absl::OkStatus();
}

std::optional<Shard> ShardRouter::PreviousOwner(absl::string_view ns, absl::string_view model_id,
                                                absl::Span<const uint32_t> token_ids,
                                                absl::Duration window) {
  const uint64_t key = RouteKey(ns, model_id, token_ids, options_.route_tokens);
  absl::MutexLock lock(&mu_);
  if (previous_.empty() || Now() - changed_at_ > window) return std::nullopt;
  const int before = OwnerIndex(previous_, key), now = OwnerIndex(shards_, key);
  if (before < 0 || now < 0) return std::nullopt;
  const Shard& was = previous_[static_cast<size_t>(before)];
  if (was.name == shards_[static_cast<size_t>(now)].name) return std::nullopt;
  // Its address now, if it is still a shard (a removed one keeps its old address).
  for (const Shard& s : shards_) {
    if (s.name == was.name) return s;
  }
  return was;
}

uint64_t ShardRouter::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

void ShardRouter::ReportFailure() {
  if (resolver_ == nullptr) return;
  absl::MutexLock lock(&mu_);
  next_refresh_ = std::min(next_refresh_, Now() + options_.min_refresh_interval);
}

void ShardRouter::MaybeRefresh() {
  if (resolver_ == nullptr) return;
  {
    absl::MutexLock lock(&mu_);
    if (refreshing_ || Now() < next_refresh_) return;
    refreshing_ = true;
    // Whatever the outcome, the next resolution is one interval away (a failed one keeps the
    // old set; ReportFailure brings it closer).
    next_refresh_ = Now() + options_.refresh_interval;
  }
  absl::StatusOr<std::vector<Shard>> shards = resolver_->Resolve(dns_name_);  // no lock held
  if (shards.ok()) SetShards(*std::move(shards)).IgnoreError();
  absl::MutexLock lock(&mu_);
  refreshing_ = false;
}

std::vector<Shard> ShardRouter::Shards() {
  MaybeRefresh();
  absl::MutexLock lock(&mu_);
  return shards_;
}

std::optional<Shard> ShardRouter::SecondOwner(absl::string_view ns, absl::string_view model_id,
                                              absl::Span<const uint32_t> token_ids) {
  MaybeRefresh();
  const uint64_t key = RouteKey(ns, model_id, token_ids, options_.route_tokens);
  absl::MutexLock lock(&mu_);
  const int first = OwnerIndex(shards_, key);
  if (first < 0 || shards_.size() < 2) return std::nullopt;
  std::vector<Shard> rest = shards_;
  rest.erase(rest.begin() + first);
  return rest[static_cast<size_t>(OwnerIndex(rest, key))];
}

Shard ShardRouter::Owner(absl::string_view ns, absl::string_view model_id,
                         absl::Span<const uint32_t> token_ids) {
  MaybeRefresh();
  const uint64_t key = RouteKey(ns, model_id, token_ids, options_.route_tokens);
  absl::MutexLock lock(&mu_);
  const int i = OwnerIndex(shards_, key);
  return i < 0 ? Shard{} : shards_[static_cast<size_t>(i)];
}

}  // namespace kvtrie
