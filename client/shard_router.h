// client/shard_router.h
//
// Which of N kvtrie servers (shards) owns a prefix, and who the shards are.
//
// Routing: rendezvous (highest random weight) hashing. The owner of a prefix is the shard whose
// name maximizes Score(name, RouteKey(namespace, model_id, first route_tokens token ids)), both
// XXH3-64 (libxxhash). A prefix, its extensions and its near-duplicates that share the first
// block therefore live on one shard (their trie, clusters and learned state stay whole). Adding
// or removing one of N shards moves only the keys whose owner changed (~1/N); a restarted shard
// (same name) owns exactly what it owned before. Shard identity is the stable name (a
// StatefulSet pod's `kvtrie-0`), never the address: a shard whose address changes keeps its keys.
//
// Membership: an explicit list (`ParseShardList`, "name=host:port,...") or a DNS name resolved
// through a `ShardResolver` (the seam a test fills with a fake table): SRV records of a headless
// Service (`_grpc._tcp.kvtrie.default.svc.cluster.local`: each target's first label is the
// shard's name, e.g. kvtrie-0), else the A records of "host:port", each named by its reverse
// (PTR) name's first label, or its address when it has none. `ShardRouter` re-resolves at most
// every refresh_interval, and sooner (at most every min_refresh_interval) after ReportFailure.
// Thread-safe.
#ifndef KVTRIE_CLIENT_SHARD_ROUTER_H_
#define KVTRIE_CLIENT_SHARD_ROUTER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvtrie {

struct Shard {
  std::string name;    // stable identity: what the routing hashes
  std::string target;  // HOST:PORT a channel connects to
  bool operator==(const Shard& o) const { return name == o.name && target == o.target; }
};

// "name=host:port,name=host:port" (spaces around items allowed), sorted by name. Errors:
// INVALID_ARGUMENT naming `shards`: an item without '=' or ':', an empty name, a duplicate name,
// an empty list.
absl::StatusOr<std::vector<Shard>> ParseShardList(absl::string_view list);

// The hash of what routes a prefix: namespace, model_id and its first `route_tokens` token ids
// (all of them when it has fewer; such a prefix holds no full block when route_tokens is the
// block size, so it can only miss).
uint64_t RouteKey(absl::string_view ns, absl::string_view model_id,
                  absl::Span<const uint32_t> token_ids, size_t route_tokens);
// The weight of shard `name` for `route_key`; the owner has the highest (ties: the smaller name).
uint64_t ShardScore(absl::string_view name, uint64_t route_key);
// Index in `shards` of the owner of `route_key`; -1 when `shards` is empty.
int OwnerIndex(absl::Span<const Shard> shards, uint64_t route_key);

// Resolves a DNS name into the current shards. Implementations must be thread-safe.
class ShardResolver {
 public:
  virtual ~ShardResolver() = default;
  // Errors: UNAVAILABLE when the name does not resolve (or resolves to nothing).
  virtual absl::StatusOr<std::vector<Shard>> Resolve(const std::string& name) = 0;
};

// The system's resolver: a name starting with '_' is an SRV name (libresolv res_nquery), answered
// with its targets (shard name = the target's first label, target = "host:port" of the SRV
// record); "host:port" (port default 50051) is getaddrinfo's addresses, named by reverse lookup.
std::unique_ptr<ShardResolver> NewSystemResolver();

// A fixed table name -> shards, for tests and for the explicit list. Names not in it are
// UNAVAILABLE. Set replaces an entry (a test changes the membership with it).
class StaticResolver : public ShardResolver {
 public:
  void Set(const std::string& name, std::vector<Shard> shards);
  absl::StatusOr<std::vector<Shard>> Resolve(const std::string& name) override;
  int resolves() const;  // calls of Resolve so far

 private:
  mutable absl::Mutex mu_;  // guards table_ and resolves_
  std::vector<std::pair<std::string, std::vector<Shard>>> table_ ABSL_GUARDED_BY(mu_);
  int resolves_ ABSL_GUARDED_BY(mu_) = 0;
};

struct ShardRouterOptions {
  size_t route_tokens = 16;  // the first block; must be the same in every client of the shards
  absl::Duration refresh_interval = absl::Seconds(30);     // DNS membership: re-resolve pace
  absl::Duration min_refresh_interval = absl::Seconds(1);  // ... after ReportFailure
  // The clock of the refresh pace and of PreviousOwner's window (tests step it; null = absl::Now).
  std::function<absl::Time()> now;
};

class ShardRouter {
 public:
  // A fixed membership. Errors: INVALID_ARGUMENT naming `shards` (empty, duplicate name).
  static absl::StatusOr<std::unique_ptr<ShardRouter>> FromList(std::vector<Shard> shards,
                                                               const ShardRouterOptions& options);
  // Membership from `resolver` (not null) for `dns_name`, resolved now. Errors: the resolver's
  // (UNAVAILABLE) when the first resolution fails.
  static absl::StatusOr<std::unique_ptr<ShardRouter>> FromDns(
      std::string dns_name, std::shared_ptr<ShardResolver> resolver,
      const ShardRouterOptions& options);

  // The current shards, sorted by name. Re-resolves first when the DNS membership is due (the
  // calling thread resolves, without holding the lock; a failed resolution keeps the old set).
  std::vector<Shard> Shards();
  // The owner of the prefix `token_ids` of (ns, model_id) among Shards() (an empty Shard{} only
  // when there are none, which FromList and FromDns never leave).
  Shard Owner(absl::string_view ns, absl::string_view model_id,
              absl::Span<const uint32_t> token_ids);
  // The second shard in the prefix's rendezvous order (the one that would own it without its
  // owner): where a replicated (pinned) prefix's copy lives. nullopt with fewer than 2 shards.
  std::optional<Shard> SecondOwner(absl::string_view ns, absl::string_view model_id,
                                   absl::Span<const uint32_t> token_ids);
  // A call to a shard failed (down, past its deadline): the DNS membership is re-resolved at the
  // next call past min_refresh_interval.
  void ReportFailure();
  // Replaces the membership (an explicit list changed). Errors: as FromList.
  absl::Status SetShards(std::vector<Shard> shards);
  // During `window` after the shard names last changed: the owner of the prefix in the set
  // before, when it is another shard than today's (for a Get that misses on its new owner to ask
  // the old one once, mcrouter's warm-up); else nullopt.
  std::optional<Shard> PreviousOwner(absl::string_view ns, absl::string_view model_id,
                                     absl::Span<const uint32_t> token_ids, absl::Duration window);
  // Bumped on every change of the membership.
  uint64_t generation() const;

  const ShardRouterOptions& options() const { return options_; }

 private:
  ShardRouter(const ShardRouterOptions& options) : options_(options) {}
  void MaybeRefresh();
  absl::Time Now() const { return options_.now ? options_.now() : absl::Now(); }

  const ShardRouterOptions options_;
  std::string dns_name_;                     // empty: explicit list
  std::shared_ptr<ShardResolver> resolver_;  // null: explicit list
  // guards shards_, previous_, changed_at_, generation_, next_refresh_, refreshing_
  mutable absl::Mutex mu_;
  std::vector<Shard> shards_ ABSL_GUARDED_BY(mu_);
  std::vector<Shard> previous_ ABSL_GUARDED_BY(mu_);  // before the last change of names
  absl::Time changed_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time next_refresh_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool refreshing_ ABSL_GUARDED_BY(mu_) = false;  // one thread resolves at a time
};

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_SHARD_ROUTER_H_
