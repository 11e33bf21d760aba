// Rendezvous routing, shard lists, DNS membership through a fake resolver table, MergeStats, and
// a ShardedClient whose shards are all unreachable (every call a miss, none an error).
#include "client/shard_router.h"

#include <atomic>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/sharded_client.h"
#include "gtest/gtest.h"

namespace kvtrie {
namespace {

std::vector<Shard> Named(std::vector<std::string> names) {
  std::vector<Shard> out;
  for (size_t i = 0; i < names.size(); ++i) {
    out.push_back({names[i], "10.0.0." + std::to_string(i + 1) + ":50051"});
  }
  return out;
}

// Prefix i: a first block of 16 token ids that differs per i (the routing key; token values
// only feed a hash here).
std::vector<uint32_t> Prefix(uint32_t i, size_t tokens = 32) {
  std::vector<uint32_t> t(tokens);
  for (size_t j = 0; j < tokens; ++j) t[j] = static_cast<uint32_t>((i * 7919 + j * 31) % 512);
  t[0] = i;
  return t;
}

std::string OwnerName(const std::vector<Shard>& shards, uint32_t i) {
  return shards[OwnerIndex(shards, RouteKey("ns", "m", Prefix(i), 16))].name;
}

TEST(ParseShardList, SortsByNameAndNamesTheFlagOnErrors) {
  absl::StatusOr<std::vector<Shard>> s = ParseShardList(" b=h2:2, a=h1:1 ,c=[::1]:3");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->size(), 3u);
  EXPECT_EQ((*s)[0], (Shard{"a", "h1:1"}));
  EXPECT_EQ((*s)[1], (Shard{"b", "h2:2"}));
  EXPECT_EQ((*s)[2], (Shard{"c", "[::1]:3"}));
  for (const char* bad : {"", "a", "a=host", "=h:1", "a=h:1,a=h:2"}) {
    absl::StatusOr<std::vector<Shard>> r = ParseShardList(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("shards"), std::string::npos) << r.status();
  }
}

TEST(Rendezvous, OwnerDependsOnNamesNotAddressesOrOrder) {
  std::vector<Shard> a = Named({"kvtrie-0", "kvtrie-1", "kvtrie-2"});
  std::vector<Shard> b = {{"kvtrie-2", "x:1"}, {"kvtrie-0", "y:2"}, {"kvtrie-1", "z:3"}};
  for (uint32_t i = 0; i < 500; ++i) {
    EXPECT_EQ(OwnerName(a, i), b[OwnerIndex(b, RouteKey("ns", "m", Prefix(i), 16))].name) << i;
  }
  EXPECT_EQ(OwnerIndex({}, 1), -1);
}

TEST(Rendezvous, ExtensionsOfAPrefixShareItsOwnerAndNamespacesAreApart) {
  std::vector<Shard> s = Named({"kvtrie-0", "kvtrie-1", "kvtrie-2"});
  int ns_differs = 0;
  for (uint32_t i = 0; i < 300; ++i) {
    const std::vector<uint32_t> full = Prefix(i, 64);
    const uint64_t k16 = RouteKey("ns", "m", absl::MakeSpan(full).subspan(0, 16), 16);
    EXPECT_EQ(RouteKey("ns", "m", full, 16), k16);  // only the first block routes
    EXPECT_EQ(RouteKey("ns", "m", absl::MakeSpan(full).subspan(0, 40), 16), k16);
    ns_differs += OwnerIndex(s, RouteKey("other", "m", full, 16)) != OwnerIndex(s, k16);
  }
  // Another namespace is another key: about 2/3 of prefixes land elsewhere with 3 shards.
  EXPECT_GT(ns_differs, 150);
  EXPECT_LT(ns_differs, 250);
}

TEST(Rendezvous, BalancedAndAFourthShardMovesAQuarterOnlyToItself) {
  const std::vector<Shard> three = Named({"kvtrie-0", "kvtrie-1", "kvtrie-2"});
  const std::vector<Shard> four = Named({"kvtrie-0", "kvtrie-1", "kvtrie-2", "kvtrie-3"});
  const std::vector<Shard> two = Named({"kvtrie-0", "kvtrie-2"});  // kvtrie-1 lost
  constexpr uint32_t kKeys = 6000;
  std::map<std::string, int> load;
  int moved = 0, moved_on_loss = 0;
  for (uint32_t i = 0; i < kKeys; ++i) {
    const std::string o3 = OwnerName(three, i), o4 = OwnerName(four, i), o2 = OwnerName(two, i);
    ++load[o3];
    if (o3 != o4) {
      ++moved;
      EXPECT_EQ(o4, "kvtrie-3") << i;  // a key moves only to the new shard
    }
    if (o3 != o2) {
      ++moved_on_loss;
      EXPECT_EQ(o3, "kvtrie-1") << i;  // only the lost shard's keys move
    }
  }
  for (const auto& [name, n] : load) {
    EXPECT_GT(n, kKeys / 3 * 0.9) << name;
    EXPECT_LT(n, kKeys / 3 * 1.1) << name;
  }
  EXPECT_GT(moved, kKeys / 4 * 0.9);
  EXPECT_LT(moved, kKeys / 4 * 1.1);
  EXPECT_EQ(moved_on_loss, load["kvtrie-1"]);
}

TEST(ShardRouterDns, ResolvesRefreshesAndKeepsTheOldSetWhenDnsFails) {
  auto table = std::make_shared<StaticResolver>();
  const std::string name = "_grpc._tcp.kvtrie.default.svc.cluster.local";
  // A stepped clock: "not before refresh_interval" must not depend on the machine's speed.
  auto now = std::make_shared<std::atomic<int64_t>>(0);  // ms
  ShardRouterOptions o;
  o.refresh_interval = absl::Milliseconds(200);
  o.min_refresh_interval = absl::Milliseconds(20);
  o.now = [now] { return absl::UnixEpoch() + absl::Milliseconds(now->load()); };
  // Nothing in the table yet: the first resolution fails.
  absl::StatusOr<std::unique_ptr<ShardRouter>> none = ShardRouter::FromDns(name, table, o);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);

  std::vector<Shard> unsorted = Named({"kvtrie-0", "kvtrie-1"});
  std::swap(unsorted[0], unsorted[1]);  // DNS answers in any order
  table->Set(name, unsorted);
  absl::StatusOr<std::unique_ptr<ShardRouter>> r = ShardRouter::FromDns(name, table, o);
  ASSERT_TRUE(r.ok()) << r.status();
  ShardRouter& router = **r;
  EXPECT_EQ(router.Shards(), Named({"kvtrie-0", "kvtrie-1"}));
  const int resolves = table->resolves();

  // A third pod: seen after refresh_interval, not before.
  table->Set(name, Named({"kvtrie-0", "kvtrie-1", "kvtrie-2"}));
  EXPECT_EQ(router.Shards().size(), 2u);
  EXPECT_EQ(table->resolves(), resolves);
  *now += 199;
  EXPECT_EQ(router.Shards().size(), 2u);
  *now += 1;
  EXPECT_EQ(router.Shards().size(), 3u);
  EXPECT_EQ(table->resolves(), resolves + 1);

  // kvtrie-1 restarted at a new address: same name, so the same keys; only its target changes.
  std::vector<Shard> moved = Named({"kvtrie-0", "kvtrie-1", "kvtrie-2"});
  moved[1].target = "10.9.9.9:50051";
  table->Set(name, moved);
  const Shard before = router.Owner("ns", "m", Prefix(7));
  router.ReportFailure();  // a failure brings the next resolution to min_refresh_interval
  *now += 19;
  EXPECT_NE(router.Shards(), moved);
  *now += 1;
  EXPECT_EQ(router.Shards(), moved);
  EXPECT_EQ(router.Owner("ns", "m", Prefix(7)).name, before.name);

  // DNS down: the last set is kept.
  table->Set(name, {});
  router.ReportFailure();
  *now += 20;
  EXPECT_EQ(router.Shards(), moved);
  EXPECT_EQ(table->resolves(), resolves + 3);  // it did resolve, and kept the set
}

TEST(ShardRouter, PreviousOwnerOnlyForMovedKeysWithinTheWindow) {
  absl::StatusOr<std::unique_ptr<ShardRouter>> r =
      ShardRouter::FromList(Named({"kvtrie-0", "kvtrie-1", "kvtrie-2"}), {});
  ASSERT_TRUE(r.ok()) << r.status();
  ShardRouter& router = **r;
  EXPECT_FALSE(router.PreviousOwner("ns", "m", Prefix(1), absl::Hours(1)));  // no change yet
  std::vector<std::string> before;
  for (uint32_t i = 0; i < 200; ++i) before.push_back(router.Owner("ns", "m", Prefix(i)).name);
  // Addresses only: nobody's keys moved.
  std::vector<Shard> moved_ip = Named({"kvtrie-0", "kvtrie-1", "kvtrie-2"});
  moved_ip[0].target = "10.1.1.1:1";
  ASSERT_TRUE(router.SetShards(moved_ip).ok());
  EXPECT_FALSE(router.PreviousOwner("ns", "m", Prefix(1), absl::Hours(1)));
  ASSERT_TRUE(router.SetShards(Named({"kvtrie-0", "kvtrie-1", "kvtrie-2", "kvtrie-3"})).ok());
  int moved = 0;
  for (uint32_t i = 0; i < 200; ++i) {
    std::optional<Shard> prev = router.PreviousOwner("ns", "m", Prefix(i), absl::Hours(1));
    const bool did_move = router.Owner("ns", "m", Prefix(i)).name != before[i];
    ASSERT_EQ(prev.has_value(), did_move) << i;
    if (prev) {
      ++moved;
      EXPECT_EQ(prev->name, before[i]);
    }
    EXPECT_FALSE(router.PreviousOwner("ns", "m", Prefix(i), absl::ZeroDuration()));  // expired
  }
  EXPECT_GT(moved, 20);
}

TEST(ShardRouter, SecondOwnerIsTheOwnerWithoutTheOwnerAndSpreads) {
  const std::vector<std::string> names = {"kvtrie-0", "kvtrie-1", "kvtrie-2"};
  absl::StatusOr<std::unique_ptr<ShardRouter>> r = ShardRouter::FromList(Named(names), {});
  ASSERT_TRUE(r.ok()) << r.status();
  std::map<std::string, int> seconds;
  for (uint32_t i = 0; i < 300; ++i) {
    const Shard owner = (*r)->Owner("ns", "m", Prefix(i));
    std::optional<Shard> second = (*r)->SecondOwner("ns", "m", Prefix(i));
    ASSERT_TRUE(second.has_value());
    EXPECT_NE(second->name, owner.name);
    // Exactly the shard that owns the prefix once its owner is gone (where its keys would go).
    std::vector<std::string> rest;
    for (const std::string& n : names) {
      if (n != owner.name) rest.push_back(n);
    }
    absl::StatusOr<std::unique_ptr<ShardRouter>> without = ShardRouter::FromList(Named(rest), {});
    ASSERT_TRUE(without.ok());
    EXPECT_EQ((*without)->Owner("ns", "m", Prefix(i)).name, second->name) << i;
    ++seconds[second->name];
  }
  EXPECT_EQ(seconds.size(), 3u);  // the copies spread too
  absl::StatusOr<std::unique_ptr<ShardRouter>> single =
      ShardRouter::FromList(Named({"kvtrie-0"}), {});
  ASSERT_TRUE(single.ok());
  EXPECT_FALSE((*single)->SecondOwner("ns", "m", Prefix(1)).has_value());
}

TEST(SystemResolver, ResolvesAHostPortIntoNamedShards) {
  // getaddrinfo of a name every machine has (/etc/hosts); each address gets a name (its PTR
  // name's first label, else the address) and the port.
  absl::StatusOr<std::vector<Shard>> s = NewSystemResolver()->Resolve("localhost:7000");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_FALSE(s->empty());
  for (const Shard& shard : *s) {
    EXPECT_FALSE(shard.name.empty());
    EXPECT_TRUE(absl::EndsWith(shard.target, ":7000")) << shard.target;
  }
  EXPECT_EQ(NewSystemResolver()->Resolve("no-such-host.invalid:1").status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(MergeStats, SumsCountersTakesMaximaAndRecomputesRatios) {
  v1::StatsResponse a, b;
  a.set_nodes(10);
  a.set_bytes_logical(1000);
  a.set_bytes_stored(250);
  a.set_bits_per_component(4);  // 500 elements
  a.set_max_depth(7);
  a.set_lossy_nodes(1);
  a.set_mean_rel_rms_error_k(0.01);
  a.add_path_surprisal_histogram()->set_count(3);
  b.set_nodes(5);
  b.set_bytes_logical(1000);
  b.set_bytes_stored(750);
  b.set_bits_per_component(8);  // 750 elements
  b.set_max_depth(3);
  b.set_lossy_nodes(3);
  b.set_mean_rel_rms_error_k(0.03);
  b.add_path_surprisal_histogram()->set_count(4);
  const v1::StatsResponse m = MergeStats({a, b});
  EXPECT_EQ(m.nodes(), 15u);
  EXPECT_EQ(m.bytes_stored(), 1000u);
  EXPECT_EQ(m.max_depth(), 7u);
  EXPECT_DOUBLE_EQ(m.compression_ratio(), 2.0);
  EXPECT_DOUBLE_EQ(m.bits_per_component(), 8.0 * 1000 / 1250);
  EXPECT_DOUBLE_EQ(m.mean_rel_rms_error_k(), (0.01 + 3 * 0.03) / 4);
  ASSERT_EQ(m.path_surprisal_histogram_size(), 1);
  EXPECT_EQ(m.path_surprisal_histogram(0).count(), 7u);
}

TEST(ShardedClient, UnreachableShardsAreMissesNeverErrors) {
  ShardedClientOptions o;
  o.shards = "a=127.0.0.1:1,b=127.0.0.1:2";  // nothing listens there: connection refused
  o.client.ns = "ns";
  o.client.timeout = absl::Seconds(5);
  o.client.retry.max_attempts = 1;
  o.down_initial_backoff = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<ShardedClient>> c = ShardedClient::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<uint32_t> tokens = Prefix(1);
  const std::string owner = (*c)->OwnerOf("m", tokens).name;

  absl::StatusOr<v1::LookupResponse> l = (*c)->Lookup("m", tokens);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->matched_tokens(), 0u);
  EXPECT_TRUE((*c)->IsDown(owner));
  EXPECT_EQ((*c)->counters().shard_failures, 1u);

  // Marked down: the next calls are misses at once, without another attempt.
  const absl::Time start = absl::Now();
  absl::StatusOr<KvDump> g = (*c)->Get("m", tokens);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->token_ids.empty());
  KvDump kv;
  kv.model_id = "m";
  kv.num_layers = kv.num_kv_heads = 1;
  kv.head_dim = 8;
  kv.token_ids = tokens;
  kv.k.assign(tokens.size() * 8 * 2, 0);
  kv.v = kv.k;
  absl::StatusOr<v1::PutResponse> p = (*c)->Put(kv);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->stored_tokens(), 0u);
  // No wait on the backoff (10 s); that no attempt was made is what the counters below check
  // (a margin, not a race: 2 s holds on a loaded machine under a sanitizer).
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  const ShardedClient::Counters n = (*c)->counters();
  EXPECT_EQ(n.lost_calls, 3u);
  EXPECT_EQ(n.puts_skipped, 1u);
  EXPECT_EQ(n.shard_failures, 1u);

  // Delete is not a cache read: the caller learns it did not happen.
  absl::StatusOr<v1::DeleteResponse> d = (*c)->Delete("m", tokens);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);

  // Stats fan out: one answer per shard, each with its status.
  std::vector<ShardedClient::ShardStats> all = (*c)->StatsAll();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].shard.name, "a");
  EXPECT_FALSE(all[0].status.ok());
  EXPECT_FALSE(all[1].status.ok());
}

TEST(ShardedClient, NeedsExactlyOneMembership) {
  ShardedClientOptions o;
  EXPECT_EQ(ShardedClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.shards = "a=h:1";
  o.shards_dns = "x:1";
  EXPECT_EQ(ShardedClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.shards = "";
  o.resolver = std::make_shared<StaticResolver>();
  EXPECT_EQ(ShardedClient::Create(o).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvtrie
