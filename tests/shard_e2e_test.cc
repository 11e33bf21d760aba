// End-to-end: N real kvtrie-server processes used as one cache through kvtrie::ShardedClient
// (issue 21). The prefixes are the repository's real KV caches (tests/data): the four sessions
// and four near-duplicates whole, and 64-token windows cut from every dump at block-aligned
// offsets (real KV rows, re-cut so that there are enough distinct first blocks to route), stored
// LOSSLESS so that Gets are compared bit for bit.
#include <stdlib.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/sharded_client.h"
#include "codec/kv_dump.h"
#include "gtest/gtest.h"
#include "tests/prometheus_text.h"
#include "tests/server_process.h"

namespace kvtrie {
namespace {

using testing::ServerProcess;

constexpr uint32_t kWindow = 64;  // tokens per cut prefix (4 blocks)
constexpr char kNs[] = "shards";

KvDump Load(const std::string& name) {
  absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(d.ok()) << name << ": " << d.status();
  return d.ok() ? *d : KvDump{};
}

// Tokens [offset, offset + n) of `d`, with their K and V rows.
KvDump Slice(const KvDump& d, size_t offset, size_t n) {
  KvDump out = d;
  out.token_ids.assign(d.token_ids.begin() + offset, d.token_ids.begin() + offset + n);
  out.surprisal_bits.assign(d.surprisal_bits.begin() + offset,
                            d.surprisal_bits.begin() + offset + n);
  const size_t row = d.head_dim * 2, rows = d.num_layers * d.num_kv_heads;
  out.k.resize(rows * n * row);
  out.v.resize(rows * n * row);
  for (size_t r = 0; r < rows; ++r) {
    std::memcpy(&out.k[r * n * row], &d.k[(r * d.num_tokens() + offset) * row], n * row);
    std::memcpy(&out.v[r * n * row], &d.v[(r * d.num_tokens() + offset) * row], n * row);
  }
  return out;
}

// Every prefix the tests store: distinct first blocks except the sessions and near-duplicates,
// which share theirs (the 369-token preamble) as real workloads do.
const std::vector<KvDump>& Prefixes() {
  static const std::vector<KvDump>* prefixes = [] {
    auto* out = new std::vector<KvDump>();
    std::set<std::vector<uint32_t>> first_blocks;
    for (const char* name :
         {"sessions/s0", "sessions/s1", "sessions/s2", "sessions/s3", "neardup/n0", "neardup/n1",
          "neardup/n2", "neardup/n3", "genesis_1-3", "GPL-3", "story_prompt"}) {
      const KvDump d = Load(name);
      if (absl::StartsWith(name, "sessions/") || absl::StartsWith(name, "neardup/")) {
        out->push_back(Slice(d, 0, d.num_tokens() / 16 * 16));
      }
      for (size_t o = 16; o + kWindow <= d.num_tokens(); o += 32) {
        KvDump w = Slice(d, o, kWindow);
        if (first_blocks.insert({w.token_ids.begin(), w.token_ids.begin() + 16}).second) {
          out->push_back(std::move(w));
        }
      }
    }
    return out;
  }();
  return *prefixes;
}

PutOptions Lossless() {
  PutOptions p;
  p.encoding = v1::ENCODING_LOSSLESS;
  return p;
}

bool SameKv(const KvDump& got, const KvDump& want) {
  return got.token_ids == want.token_ids && got.k == want.k && got.v == want.v;
}

class ShardE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    ASSERT_GT(Prefixes().size(), 40u);
  }
  void TearDown() override {
    servers_.clear();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }

  std::string Name(int i) { return "kvtrie-" + std::to_string(i); }
  // Starts shard i on its own data folder (on `port` when nonzero: a restart at its address).
  void StartShard(int i, int port = 0, std::vector<std::string> flags = {}) {
    if (port != 0) flags.push_back("--listen=127.0.0.1:" + std::to_string(port));
    absl::StatusOr<std::unique_ptr<ServerProcess>> s =
        ServerProcess::Start(dir_ + "/" + Name(i), flags);
    ASSERT_TRUE(s.ok()) << s.status();
    servers_[i] = *std::move(s);
  }
  std::vector<Shard> Membership() {
    std::vector<Shard> out;
    for (const auto& [i, s] : servers_) out.push_back({Name(i), s->target()});
    return out;
  }
  std::string ShardList() {
    std::vector<std::string> items;
    for (const Shard& s : Membership()) items.push_back(s.name + "=" + s.target);
    return absl::StrJoin(items, ",");
  }
  ShardedClientOptions Options() {
    ShardedClientOptions o;
    o.client.ns = kNs;
    o.client.timeout = absl::Seconds(10);
    o.client.retry.max_attempts = 1;  // a lost shard is a miss at once
    o.client.retry.initial_backoff = absl::Milliseconds(50);
    o.client.retry.max_backoff = absl::Milliseconds(200);  // the channel's reconnect pace too
    o.down_initial_backoff = absl::Milliseconds(200);
    o.down_max_backoff = absl::Milliseconds(400);
    return o;
  }
  std::unique_ptr<ShardedClient> NewClient() {
    ShardedClientOptions o = Options();
    o.shards = ShardList();
    absl::StatusOr<std::unique_ptr<ShardedClient>> c = ShardedClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  std::unique_ptr<Client> Direct(int i) {
    return Client::Create({.target = servers_[i]->target(), .ns = kNs});
  }
  void PutAll(ShardedClient& c) {
    for (const KvDump& p : Prefixes()) {
      absl::StatusOr<v1::PutResponse> r = c.Put(p, Lossless());
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->stored_tokens(), p.num_tokens());
    }
  }

  // Three shards with every prefix put through a client in its warm-up window (60 s, copying
  // losslessly), then a fourth shard joins: *before holds each prefix's owner before it joined.
  std::unique_ptr<ShardedClient> WarmUpClientAfterAFourthShard(std::vector<std::string>* before) {
    for (int i = 0; i < 3; ++i) StartShard(i);
    ShardedClientOptions o = Options();
    o.shards = ShardList();
    o.warmup_window = absl::Seconds(60);
    o.warmup_put = Lossless();
    absl::StatusOr<std::unique_ptr<ShardedClient>> made = ShardedClient::Create(o);
    EXPECT_TRUE(made.ok()) << made.status();
    if (!made.ok()) return nullptr;
    PutAll(**made);
    for (const KvDump& p : Prefixes()) {
      before->push_back((*made)->OwnerOf(p.model_id, p.token_ids).name);
    }
    StartShard(3);
    EXPECT_TRUE((*made)->SetShards(Membership()).ok());
    return *std::move(made);
  }

  std::string dir_;
  std::map<int, std::unique_ptr<ServerProcess>> servers_;
};

TEST_F(ShardE2E, EachPrefixLandsOnItsOwnerOnlyAndGetsAreBitExact) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  std::unique_ptr<ShardedClient> c = NewClient();
  ASSERT_NE(c, nullptr);
  PutAll(*c);
  std::map<std::string, int> owned;
  for (const KvDump& p : Prefixes()) {
    const std::string owner = c->OwnerOf(p.model_id, p.token_ids).name;
    ++owned[owner];
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<v1::LookupResponse> l = Direct(i)->Lookup(p.model_id, p.token_ids);
      ASSERT_TRUE(l.ok()) << l.status();
      // On its owner whole; on the others nothing (the first block is not there either).
      EXPECT_EQ(l->matched_tokens(), Name(i) == owner ? p.num_tokens() : 0u) << Name(i);
    }
    absl::StatusOr<KvDump> g = c->Get(p.model_id, p.token_ids);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(SameKv(*g, p)) << "prefix at token " << p.token_ids[0] << " on " << owner;
  }
  // Every shard owns some: the keys spread.
  ASSERT_EQ(owned.size(), 3u);
  for (const auto& [name, n] : owned) EXPECT_GT(n, static_cast<int>(Prefixes().size()) / 8);
  // The fan-out Stats add up to the blocks put: each shard stored only its own.
  std::vector<v1::StatsResponse> stats;
  for (const ShardedClient::ShardStats& s : c->StatsAll(kNs)) {
    ASSERT_TRUE(s.status.ok()) << s.shard.name << ": " << s.status;
    EXPECT_GT(s.stats.nodes(), 0u) << s.shard.name;
    stats.push_back(s.stats);
  }
  uint64_t nodes = 0;
  for (const auto& s : stats) nodes += s.nodes();
  EXPECT_EQ(MergeStats(stats).nodes(), nodes);
  EXPECT_EQ(c->counters().lost_calls, 0u);
}

TEST_F(ShardE2E, AKilledShardIsAMissNeverAnErrorAndServesItsDataAfterRestart) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  std::unique_ptr<ShardedClient> c = NewClient();
  ASSERT_NE(c, nullptr);
  PutAll(*c);
  const int victim = 1;
  const int port = servers_[victim]->port();

  // Readers and a writer run while the victim is killed.
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0}, wrong{0}, hits{0}, misses{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (size_t n = t; !stop.load(); n += 3) {
        const KvDump& p = Prefixes()[n % Prefixes().size()];
        absl::StatusOr<KvDump> g = c->Get(p.model_id, p.token_ids);
        if (!g.ok()) {
          ++errors;
        } else if (g->token_ids.empty()) {
          ++misses;
        } else if (SameKv(*g, p)) {
          ++hits;
        } else {
          ++wrong;
        }
        absl::StatusOr<v1::LookupResponse> l = c->Lookup(p.model_id, p.token_ids);
        if (!l.ok()) ++errors;
        if (n % 5 == 0 && !c->Put(p, Lossless()).ok()) ++errors;
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  servers_[victim]->Kill();
  absl::SleepFor(absl::Milliseconds(1500));
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(hits.load(), 0);
  EXPECT_GT(misses.load(), 0);  // the victim's prefixes
  EXPECT_GT(c->counters().shard_failures, 0u);

  // While it is down: its prefixes miss, every other prefix still hits bit-exactly.
  int victims = 0;
  for (const KvDump& p : Prefixes()) {
    absl::StatusOr<KvDump> g = c->Get(p.model_id, p.token_ids);
    ASSERT_TRUE(g.ok()) << g.status();
    if (c->OwnerOf(p.model_id, p.token_ids).name == Name(victim)) {
      ++victims;
      EXPECT_TRUE(g->token_ids.empty());
      absl::StatusOr<v1::PutResponse> put = c->Put(p, Lossless());
      ASSERT_TRUE(put.ok()) << put.status();
      EXPECT_EQ(put->stored_tokens(), 0u);  // skipped
    } else {
      EXPECT_TRUE(SameKv(*g, p));
    }
  }
  ASSERT_GT(victims, 0);
  EXPECT_GT(c->counters().puts_skipped, 0u);

  // Restarted at its address on its data folder: what it persisted is served again (the client
  // retries the shard once its backoff ends, and its channel reconnects).
  StartShard(victim, port);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  int served = 0;
  while (absl::Now() < deadline) {
    served = 0;
    for (const KvDump& p : Prefixes()) {
      if (c->OwnerOf(p.model_id, p.token_ids).name != Name(victim)) continue;
      absl::StatusOr<KvDump> g = c->Get(p.model_id, p.token_ids);
      ASSERT_TRUE(g.ok()) << g.status();
      if (!g->token_ids.empty()) {
        EXPECT_TRUE(SameKv(*g, p));
        ++served;
      }
    }
    if (served == victims) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(served, victims) << servers_[victim]->log();
}

TEST_F(ShardE2E, DnsMembershipAddsAFourthShardMovingAboutAQuarter) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  // The membership comes from a resolver table (what a headless Service's SRV records give).
  const std::string dns = "_grpc._tcp.kvtrie.default.svc.cluster.local";
  auto table = std::make_shared<StaticResolver>();
  table->Set(dns, Membership());
  ShardedClientOptions o = Options();
  o.shards_dns = dns;
  o.resolver = table;
  o.router.refresh_interval = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<ShardedClient>> made = ShardedClient::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  ShardedClient& c = **made;
  ASSERT_EQ(c.shards().size(), 3u);
  PutAll(c);
  std::vector<std::string> before;
  for (const KvDump& p : Prefixes()) before.push_back(c.OwnerOf(p.model_id, p.token_ids).name);

  StartShard(3);
  table->Set(dns, Membership());
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(c.shards().size(), 4u);  // re-resolved
  int moved = 0, kept_hits = 0;
  for (size_t n = 0; n < Prefixes().size(); ++n) {
    const KvDump& p = Prefixes()[n];
    const std::string now = c.OwnerOf(p.model_id, p.token_ids).name;
    absl::StatusOr<KvDump> g = c.Get(p.model_id, p.token_ids);
    ASSERT_TRUE(g.ok()) << g.status();
    if (now != before[n]) {
      ++moved;
      EXPECT_EQ(now, Name(3));            // only to the new shard
      EXPECT_TRUE(g->token_ids.empty());  // recomputed, not copied: a miss until put again
      ASSERT_TRUE(c.Put(p, Lossless()).ok());
      absl::StatusOr<KvDump> again = c.Get(p.model_id, p.token_ids);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_TRUE(SameKv(*again, p));
    } else {
      kept_hits += SameKv(*g, p);
    }
  }
  const int total = static_cast<int>(Prefixes().size());
  EXPECT_EQ(kept_hits, total - moved);  // the rest keep hitting
  EXPECT_GT(moved, total / 10) << moved << " of " << total;
  EXPECT_LT(moved, total * 45 / 100) << moved << " of " << total;
  std::printf("[ shards ] 3 -> 4 shards: %d of %d prefixes changed owner (%.0f%%)\n", moved, total,
              100.0 * moved / total);
}

TEST_F(ShardE2E, WarmUpAsksThePreviousOwnerOnceAndCopiesToTheNewOne) {
  std::vector<std::string> before;
  std::unique_ptr<ShardedClient> made = WarmUpClientAfterAFourthShard(&before);
  ASSERT_NE(made, nullptr);
  ASSERT_FALSE(HasFailure());
  ShardedClient& c = *made;

  int moved = 0;
  for (size_t n = 0; n < Prefixes().size(); ++n) {
    const KvDump& p = Prefixes()[n];
    const bool was_moved = c.OwnerOf(p.model_id, p.token_ids).name != before[n];
    moved += was_moved;
    // Every prefix hits: the moved ones on their previous owner, bit-exact.
    absl::StatusOr<v1::LookupResponse> l = c.Lookup(p.model_id, p.token_ids);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->matched_tokens(), p.num_tokens());
    absl::StatusOr<KvDump> g = c.Get(p.model_id, p.token_ids);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(SameKv(*g, p));
    if (was_moved) {
      // ... and copied to the new owner, which now serves it itself.
      absl::StatusOr<v1::LookupResponse> on_new = Direct(3)->Lookup(p.model_id, p.token_ids);
      ASSERT_TRUE(on_new.ok()) << on_new.status();
      EXPECT_EQ(on_new->matched_tokens(), p.num_tokens());
    }
  }
  ASSERT_GT(moved, 0);
  const ShardedClient::Counters n = c.counters();
  EXPECT_EQ(n.warmup_copies, static_cast<uint64_t>(moved));
  EXPECT_EQ(n.warmup_hits, static_cast<uint64_t>(2 * moved));  // each moved Lookup and Get
  // A second pass hits the new owner: no more warm-up.
  for (const KvDump& p : Prefixes()) ASSERT_TRUE(c.Get(p.model_id, p.token_ids).ok());
  EXPECT_EQ(c.counters().warmup_hits, n.warmup_hits);
}

// A layer range the previous owner answers is not copied to the new owner as if it were the
// model: a later whole Get there returns every layer bit-exact, never the range's layers alone
// (the copy would register the model on the new owner with the range's layer count).
TEST_F(ShardE2E, WarmUpOfALayerRangeNeverStoresTheRangeAsTheModel) {
  std::vector<std::string> before;
  std::unique_ptr<ShardedClient> made = WarmUpClientAfterAFourthShard(&before);
  ASSERT_NE(made, nullptr);
  ASSERT_FALSE(HasFailure());
  ShardedClient& c = *made;
  int moved = 0;
  for (size_t n = 0; n < Prefixes().size(); ++n) {
    const KvDump& p = Prefixes()[n];
    if (c.OwnerOf(p.model_id, p.token_ids).name == before[n]) continue;
    ++moved;
    absl::StatusOr<KvDump> part =
        c.Get(p.model_id, p.token_ids, {.layer_begin = 1, .layer_end = 3});
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(part->num_layers, 2u);
    absl::StatusOr<KvDump> whole = c.Get(p.model_id, p.token_ids);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(whole->num_layers, p.num_layers);
    EXPECT_TRUE(SameKv(*whole, p));
  }
  ASSERT_GT(moved, 0);
}

TEST_F(ShardE2E, CliRoutesByShardsAndStatsFanOutEvenWithALostShard) {
  for (int i = 0; i < 2; ++i) StartShard(i);
  // kvtrie-9 is listed but nothing serves it: a lost shard from the start.
  const std::string shards = "--shards=" + ShardList() + ",kvtrie-9=127.0.0.1:1";
  const std::string cli = testing::BinaryPath("client/kvtrie");
  const std::vector<std::string> base = {cli, shards, std::string("--namespace=") + kNs,
                                         "--retry_attempts=1"};
  auto run = [&](std::vector<std::string> args, std::string* out) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), args.begin(), args.end());
    std::string err;
    const int rc = testing::RunCommand(argv, out, &err);
    EXPECT_NE(rc, 1) << err;  // never an error exit, whichever shard owns the prefix
    return rc;
  };
  std::unique_ptr<ShardedClient> c = NewClient();  // the two live shards, to know the owners
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->SetShards({{"kvtrie-0", servers_[0]->target()},
                            {"kvtrie-1", servers_[1]->target()},
                            {"kvtrie-9", "127.0.0.1:1"}})
                  .ok());
  int stored = 0, skipped = 0;
  std::string out;
  for (const char* name : {"sessions/s0", "genesis_1-3", "GPL-3", "story_prompt", "neardup/n1"}) {
    const std::string dir = std::string(KVTRIE_TESTDATA_DIR) + "/" + name;
    absl::StatusOr<KvDump> d = ReadKvManifest(dir);
    ASSERT_TRUE(d.ok()) << d.status();
    const bool lost = c->OwnerOf(d->model_id, d->token_ids).name == "kvtrie-9";
    ASSERT_EQ(run({"--encoding=lossless", "put", dir}, &out), 0);
    const int tokens = nlohmann::json::parse(out)["stored_tokens"];
    EXPECT_EQ(tokens == 0, lost) << name << ": " << out;
    (lost ? skipped : stored) += 1;
    const std::string got = dir_ + "/got";
    EXPECT_EQ(run({"get", dir, got}, &out), lost ? 3 : 0) << name << ": " << out;  // 3: a miss
    if (!lost) {
      absl::StatusOr<KvDump> back = ReadKvDump(got);
      absl::StatusOr<KvDump> want = ReadKvDump(dir);
      ASSERT_TRUE(back.ok() && want.ok());
      const KvDump full = Slice(*want, 0, back->num_tokens());
      EXPECT_EQ(back->num_tokens(), want->num_tokens() / 16 * 16) << name;
      EXPECT_TRUE(SameKv(*back, full)) << name;
    }
  }
  ASSERT_GT(stored, 0);
  std::printf("[ shards ] cli: %d dumps stored, %d skipped (owner lost)\n", stored, skipped);
  std::fflush(stdout);  // before the next fork

  ASSERT_EQ(run({"stats", "--all_shards"}, &out), 0);
  const nlohmann::json stats = nlohmann::json::parse(out);
  EXPECT_EQ(stats["shards_answered"], 2);
  EXPECT_EQ(stats["shards_total"], 3);
  EXPECT_TRUE(stats["shards"]["kvtrie-9"].contains("error")) << out;
  const uint64_t n0 = stats["shards"]["kvtrie-0"]["nodes"],
                 n1 = stats["shards"]["kvtrie-1"]["nodes"];
  EXPECT_EQ(stats["nodes"], n0 + n1);
  EXPECT_GT(n0 + n1, 0u);

  ASSERT_EQ(run({"inspect", "--model_id=stories260K"}, &out), 0);
  const nlohmann::json inspect = nlohmann::json::parse(out);
  EXPECT_TRUE(inspect["shards"].contains("kvtrie-0")) << out;
  EXPECT_TRUE(inspect["shards"]["kvtrie-9"].contains("error")) << out;

  // A bad list names the flag.
  std::string err;
  EXPECT_EQ(testing::RunCommand({cli, "--shards=kvtrie-0", "stats"}, &out, &err), 1);
  EXPECT_NE(err.find("--shards"), std::string::npos) << err;
}

TEST_F(ShardE2E, MetricsCarryTheShardLabelFromTheFlagOrPodName) {
  for (int i = 0; i < 2; ++i) {
    const std::string port_file = dir_ + "/metrics" + std::to_string(i) + ".port";
    std::vector<std::string> flags = {"--metrics_listen=127.0.0.1:0",
                                      "--metrics_port_file=" + port_file};
    if (i == 0) flags.push_back("--shard_name=kvtrie-0");
    if (i == 1) setenv("POD_NAME", "kvtrie-1", 1);  // what the StatefulSet's downward API sets
    absl::StatusOr<std::unique_ptr<ServerProcess>> s =
        ServerProcess::Start(dir_ + "/" + Name(i), flags);
    unsetenv("POD_NAME");
    ASSERT_TRUE(s.ok()) << s.status();
    servers_[i] = *std::move(s);
    std::unique_ptr<ShardedClient> c = NewClient();
    ASSERT_NE(c, nullptr);
    for (size_t n = 0; n < 8; ++n) {
      ASSERT_TRUE(c->Lookup(Prefixes()[n].model_id, Prefixes()[n].token_ids).ok());
    }
    int port = 0;
    std::ifstream(port_file) >> port;
    ASSERT_GT(port, 0);
    absl::StatusOr<PromText> text = ParsePromText(ScrapeMetrics(port));
    ASSERT_TRUE(text.ok()) << text.status();
    const std::string label = "shard=\"" + Name(i) + "\"";
    int lookups = 0;
    for (const auto& [series, value] : text->samples) {
      if (absl::StartsWith(series, "exposer_")) continue;  // prometheus-cpp's own, not kvtrie's
      EXPECT_NE(series.find(label), std::string::npos) << series;
      if (absl::StartsWith(series, "kvtrie_rpc_requests_total{") &&
          series.find("method=\"Lookup\"") != std::string::npos) {
        lookups += static_cast<int>(value);
      }
    }
    EXPECT_GT(lookups, 0);
  }
}

// Replication factor 2 for pinned prefixes (--pin_replicas=2): Pin copies the prefix to its
// second shard in rendezvous order, so after kill -9 of one shard every pinned prefix still hits
// bit-exactly (the copy is lossless), while unpinned prefixes of the victim miss. Measured beside
// a client without replicas: the hit rate of the pinned prefixes after losing one shard.
TEST_F(ShardE2E, PinnedPrefixesReplicatedTwiceSurviveAKilledShard) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  ShardedClientOptions o = Options();
  o.shards = ShardList();
  o.pin_replicas = 2;
  o.warmup_put = Lossless();
  absl::StatusOr<std::unique_ptr<ShardedClient>> created = ShardedClient::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  ShardedClient& c = **created;
  o.pin_replicas = 3;
  EXPECT_EQ(ShardedClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  PutAll(c);
  // Every other prefix is pinned (a system prompt of its own).
  std::vector<size_t> pinned, unpinned;
  for (size_t n = 0; n < Prefixes().size(); ++n) (n % 2 == 0 ? pinned : unpinned).push_back(n);
  for (size_t n : pinned) {
    const KvDump& p = Prefixes()[n];
    ASSERT_TRUE(c.Pin(p.model_id, p.token_ids).ok());
    int holders = 0;  // the owner and the second shard, whole; the third, nothing
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<v1::LookupResponse> l = Direct(i)->Lookup(p.model_id, p.token_ids);
      ASSERT_TRUE(l.ok()) << l.status();
      if (l->matched_tokens() == p.num_tokens()) ++holders;
    }
    EXPECT_EQ(holders, 2) << "prefix " << n;
  }
  EXPECT_EQ(c.counters().replica_copies, pinned.size());
  EXPECT_EQ(c.counters().replica_failures, 0u);
  // A delete reaches both copies (a replica must not outlive it).
  const KvDump& deleted = Prefixes()[pinned.back()];
  pinned.pop_back();
  ASSERT_TRUE(c.Delete(deleted.model_id, deleted.token_ids).ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_LT(Direct(i)->Lookup(deleted.model_id, deleted.token_ids)->matched_tokens(),
              deleted.num_tokens());
  }

  ShardedClientOptions plain = Options();
  plain.shards = ShardList();
  std::unique_ptr<ShardedClient> one = *ShardedClient::Create(plain);  // pin_replicas 1
  const int victim = 0;
  servers_[victim]->Kill();
  auto hit_rate = [&](ShardedClient& client, const std::vector<size_t>& which, int* victims) {
    int hits = 0;
    *victims = 0;
    for (size_t n : which) {
      const KvDump& p = Prefixes()[n];
      if (client.OwnerOf(p.model_id, p.token_ids).name == Name(victim)) ++*victims;
      absl::StatusOr<v1::LookupResponse> l = client.Lookup(p.model_id, p.token_ids);
      absl::StatusOr<KvDump> g = client.Get(p.model_id, p.token_ids);
      EXPECT_TRUE(l.ok() && g.ok()) << "prefix " << n;  // never an error
      if (!g.ok() || g->token_ids.empty()) continue;
      EXPECT_TRUE(SameKv(*g, p)) << "prefix " << n;
      EXPECT_EQ(l->matched_tokens(), p.num_tokens()) << "prefix " << n;
      ++hits;
    }
    return static_cast<double>(hits) / static_cast<double>(which.size());
  };
  int pinned_victims = 0, unpinned_victims = 0, ignored = 0;
  const double pinned_rate = hit_rate(c, pinned, &pinned_victims);
  const double unpinned_rate = hit_rate(c, unpinned, &unpinned_victims);
  const double unreplicated_rate = hit_rate(*one, pinned, &ignored);
  ASSERT_GT(pinned_victims, 0);
  ASSERT_GT(unpinned_victims, 0);
  EXPECT_EQ(pinned_rate, 1.0);
  EXPECT_LT(unpinned_rate, 1.0);
  EXPECT_LT(unreplicated_rate, 1.0);
  EXPECT_GE(c.counters().replica_hits, 2u * static_cast<uint64_t>(pinned_victims));
  std::printf(
      "after kill -9 of 1 of 3 shards: pinned prefixes hit %.1f%% with --pin_replicas=2 "
      "(%d of %zu owned by the victim), %.1f%% without; unpinned %.1f%%\n",
      100 * pinned_rate, pinned_victims, pinned.size(), 100 * unreplicated_rate,
      100 * unpinned_rate);
  ::testing::Test::RecordProperty("pinned_hit_rate_replicated", std::to_string(pinned_rate));
  ::testing::Test::RecordProperty("pinned_hit_rate_unreplicated",
                                  std::to_string(unreplicated_rate));
}

int ShardIndex(const Shard& s) { return std::stoi(s.name.substr(s.name.rfind('-') + 1)); }

// A Delete (of a prefix's last block and its subtree) whose owner is down still deletes the
// pinned replica's on the second shard (else a Get would fall back to it and serve the deleted
// KV), and returns the owner's error.
TEST_F(ShardE2E, DeleteWithItsOwnerDownStillDeletesTheReplica) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  ShardedClientOptions o = Options();
  o.shards = ShardList();
  o.pin_replicas = 2;
  o.down_initial_backoff = o.down_max_backoff = absl::Seconds(60);  // known down when deleting
  std::unique_ptr<ShardedClient> c = *ShardedClient::Create(o);
  const KvDump& p = Prefixes()[0];
  ASSERT_TRUE(c->Put(p, Lossless()).ok());
  ASSERT_TRUE(c->Pin(p.model_id, p.token_ids).ok());
  ASSERT_EQ(c->counters().replica_copies, 1u);
  const int owner = ShardIndex(c->OwnerOf(p.model_id, p.token_ids));
  servers_[owner]->Kill();
  ASSERT_TRUE(c->Lookup(p.model_id, p.token_ids).ok());  // the owner is lost: marked down
  ASSERT_GE(c->counters().shard_failures, 1u);
  EXPECT_EQ(c->Delete(p.model_id, p.token_ids).status().code(), absl::StatusCode::kUnavailable);
  for (int i = 0; i < 3; ++i) {
    if (i == owner) continue;
    EXPECT_LT(Direct(i)->Lookup(p.model_id, p.token_ids)->matched_tokens(), p.num_tokens())
        << "shard " << i;
  }
  absl::StatusOr<KvDump> g = c->Get(p.model_id, p.token_ids);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_LT(g->token_ids.size(), p.num_tokens());  // never the deleted block
}

// Inside the warm-up window a Delete also reaches the previous owner: the next Get misses
// instead of copying the deleted KV back from there.
TEST_F(ShardE2E, DeleteInTheWarmUpWindowReachesThePreviousOwner) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  ShardedClientOptions o = Options();
  o.shards = ShardList();
  o.warmup_window = absl::Seconds(60);
  std::unique_ptr<ShardedClient> c = *ShardedClient::Create(o);
  PutAll(*c);
  std::vector<int> before;
  for (const KvDump& p : Prefixes())
    before.push_back(ShardIndex(c->OwnerOf(p.model_id, p.token_ids)));
  StartShard(3);
  ASSERT_TRUE(c->SetShards(Membership()).ok());
  int moved = 0;
  for (size_t n = 0; n < Prefixes().size(); ++n) {
    const KvDump& p = Prefixes()[n];
    if (ShardIndex(c->OwnerOf(p.model_id, p.token_ids)) == before[n]) continue;
    ++moved;
    // The new owner stores nothing of it yet: its status (NOT_FOUND) is returned.
    EXPECT_FALSE(c->Delete(p.model_id, p.token_ids).ok());
    EXPECT_LT(Direct(before[n])->Lookup(p.model_id, p.token_ids)->matched_tokens(), p.num_tokens());
    absl::StatusOr<KvDump> g = c->Get(p.model_id, p.token_ids);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_LT(g->token_ids.size(), p.num_tokens()) << "prefix " << n;
  }
  ASSERT_GT(moved, 0);
}

// The replica of a RESIDUAL (lossy) prefix is a bit-exact copy of the owner's reconstruction:
// the default copy PutOptions are LOSSLESS, not the server's default (residual here).
TEST_F(ShardE2E, ReplicaOfAResidualPrefixReadsBackAsTheOwnersReconstruction) {
  for (int i = 0; i < 3; ++i) StartShard(i, 0, {"--default_encoding=residual"});
  ShardedClientOptions o = Options();
  o.shards = ShardList();
  o.pin_replicas = 2;  // warmup_put left at its default
  std::unique_ptr<ShardedClient> c = *ShardedClient::Create(o);
  const KvDump& p = Prefixes()[0];
  PutOptions residual;
  residual.encoding = v1::ENCODING_RESIDUAL;
  residual.target_rel_rms = 0.1;
  ASSERT_TRUE(c->Put(p, residual).ok());
  ASSERT_TRUE(c->Pin(p.model_id, p.token_ids).ok());
  ASSERT_EQ(c->counters().replica_copies, 1u);
  const int owner = ShardIndex(c->OwnerOf(p.model_id, p.token_ids));
  absl::StatusOr<KvDump> want = Direct(owner)->Get(p.model_id, p.token_ids);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_FALSE(SameKv(*want, p));  // lossy at the owner
  int replicas = 0;
  for (int i = 0; i < 3; ++i) {
    if (i == owner) continue;
    absl::StatusOr<KvDump> got = Direct(i)->Get(p.model_id, p.token_ids);
    ASSERT_TRUE(got.ok()) << got.status();
    if (got->token_ids.empty()) continue;
    ++replicas;
    EXPECT_TRUE(SameKv(*got, *want)) << "shard " << i;
  }
  EXPECT_EQ(replicas, 1);
}

// The CLI's pin over shards with --pin_replicas=2: the pinned dump is on two shards, and after
// kill -9 of its owner `get` still finds it (exit 0, bit-exact) through the second shard.
TEST_F(ShardE2E, CliPinWithTwoReplicasSurvivesItsOwner) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  const std::string cli = testing::BinaryPath("client/kvtrie");
  const std::vector<std::string> base = {cli, "--shards=" + ShardList(),
                                         std::string("--namespace=") + kNs, "--retry_attempts=1",
                                         "--pin_replicas=2"};
  auto run = [&](std::vector<std::string> args, std::string* out) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), args.begin(), args.end());
    std::string err;
    const int rc = testing::RunCommand(argv, out, &err);
    EXPECT_NE(rc, 1) << err;
    return rc;
  };
  const std::string dir = std::string(KVTRIE_TESTDATA_DIR) + "/story_prompt";
  absl::StatusOr<KvDump> want = ReadKvDump(dir);
  ASSERT_TRUE(want.ok()) << want.status();
  const size_t full = want->num_tokens() / 16 * 16;
  std::string out;
  ASSERT_EQ(run({"--encoding=lossless", "put", dir}, &out), 0);
  ASSERT_EQ(run({"pin", dir, std::to_string(full)}, &out), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["replica_copies"], 1) << out;
  int holders = 0;
  for (int i = 0; i < 3; ++i) {
    holders += Direct(i)->Lookup(want->model_id, want->token_ids)->matched_tokens() == full;
  }
  EXPECT_EQ(holders, 2);
  std::unique_ptr<ShardedClient> c = NewClient();
  ASSERT_NE(c, nullptr);
  const std::string owner = c->OwnerOf(want->model_id, want->token_ids).name;
  servers_[owner.back() - '0']->Kill();
  const std::string got = dir_ + "/got";
  ASSERT_EQ(run({"get", dir, got}, &out), 0) << out;  // not 3: the second shard has it
  absl::StatusOr<KvDump> back = ReadKvDump(got);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(SameKv(*back, Slice(*want, 0, full)));
}

TEST_F(ShardE2E, OpenPutPinOwnerAndStateFollowTheClientsPolicy) {
  for (int i = 0; i < 3; ++i) StartShard(i);
  ShardedClientOptions o = Options();
  o.shards = ShardList();
  o.pin_replicas = 2;
  o.down_initial_backoff = absl::Seconds(60);      // capped by down_max_backoff (400 ms)
  o.health.probe_deadline = absl::ZeroDuration();  // the backoff alone keeps a shard down
  absl::StatusOr<std::unique_ptr<ShardedClient>> made = ShardedClient::Create(o);
  ASSERT_TRUE(made.ok()) << made.status();
  ShardedClient& c = **made;
  const KvDump& p = Prefixes()[0];
  const std::string owner = c.OwnerOf(p.model_id, p.token_ids).name;
  const int owner_i = owner.back() - '0';

  // A layer-wise Put lands on the owner only.
  absl::StatusOr<std::unique_ptr<ShardedPutStream>> s = c.OpenPut(p, Lossless());
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)->WriteLayers(0, p.num_layers, 0, p.num_tokens(), p.k, p.v).ok());
  absl::StatusOr<v1::PutResponse> r = (*s)->Commit();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->stored_tokens(), p.num_tokens());
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<v1::LookupResponse> l = Direct(i)->Lookup(p.model_id, p.token_ids);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->matched_tokens(), i == owner_i ? p.num_tokens() : 0u) << Name(i);
  }

  // PinOwner copies nothing to the replica; Pin does.
  ASSERT_TRUE(c.PinOwner(p.model_id, p.token_ids, 60, false, true).ok());
  EXPECT_EQ(c.counters().replica_copies, 0u);
  ASSERT_TRUE(c.Pin(p.model_id, p.token_ids).ok());
  EXPECT_EQ(c.counters().replica_copies, 1u);

  // The owner killed: a stream to it stores nothing, and State shows one failure with its
  // backoff capped at down_max_backoff.
  EXPECT_EQ(c.State(owner).failures_in_a_row, 0);
  const KvDump* other = nullptr;
  for (const KvDump& q : Prefixes()) {
    if (&q != &p && c.OwnerOf(q.model_id, q.token_ids).name == owner) {
      other = &q;
      break;
    }
  }
  ASSERT_NE(other, nullptr);
  const int port = servers_[owner_i]->port();
  servers_[owner_i]->Kill();
  absl::StatusOr<std::unique_ptr<ShardedPutStream>> lost = c.OpenPut(*other, Lossless());
  ASSERT_TRUE(lost.ok()) << lost.status();
  EXPECT_TRUE(
      (*lost)->WriteLayers(0, other->num_layers, 0, other->num_tokens(), other->k, other->v).ok());
  absl::StatusOr<v1::PutResponse> none = (*lost)->Commit();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->stored_tokens(), 0u);
  EXPECT_TRUE((*lost)->lost());
  const ShardedClient::ShardState st = c.State(owner);
  EXPECT_EQ(st.failures_in_a_row, 1);
  EXPECT_GT(st.down_for, absl::ZeroDuration());
  EXPECT_LE(st.down_for, absl::Milliseconds(400));
  EXPECT_FALSE(st.health_down);
  EXPECT_EQ(c.counters().puts_skipped, 1u);
  EXPECT_EQ(c.counters().shard_failures, 1u);

  // Restarted at its address: its first answer ends the run of failures.
  StartShard(owner_i, port);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (c.State(owner).failures_in_a_row != 0 && absl::Now() < deadline) {
    ASSERT_TRUE(c.Lookup(other->model_id, other->token_ids).ok());
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(c.State(owner).failures_in_a_row, 0) << servers_[owner_i]->log();
  EXPECT_EQ(c.State(owner).down_for, absl::ZeroDuration());
}

}  // namespace
}  // namespace kvtrie
