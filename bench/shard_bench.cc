// bench/shard_bench.cc
//
// N kvtrie servers as one cache (issue 21), on this machine, real servers on loopback ports
// (tests/server_process.h), real KV (tests/data: 64-token windows of every dump at --stride-token
// offsets, distinct first blocks, 40 KB of K+V each; the server's default encoding):
//   1. aggregate Put and Get throughput through kvtrie::ShardedClient with 1, 2 and 3 shards
//      (--threads client threads; ratio to 1 shard), and the plain Client on 1 server (the cost
//      of routing). On a machine of few cores the servers share them: the point is that routing
//      costs nothing, not that it scales;
//   2. the hit rate kept after a fourth shard is added to 3 loaded ones (without and with the
//      warm-up from the previous owner), and after one of 3 is killed (-9): Gets of every
//      prefix, misses counted, errors must be 0;
//   3. key skew (max/mean prefixes per shard) for the real prefixes and for --random_prefixes
//      random first blocks, over 3, 4 and 16 shard names.
//
//   deploy/build.sh -j2 shard_bench kvtrie-server && build/bench/shard_bench [--threads=4]
//   [--rounds=3]   (prints markdown; bench/shard_bench.md is one run)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/shard_router.h"
#include "client/sharded_client.h"
#include "codec/kv_dump.h"
#include "tests/server_process.h"

ABSL_FLAG(int, threads, 4, "client threads of the throughput runs");
ABSL_FLAG(int, rounds, 3, "Get passes over every prefix per throughput run");
ABSL_FLAG(int, stride, 4, "tokens between the starts of two windows cut from a dump");
ABSL_FLAG(int, random_prefixes, 100000, "random first blocks of the key-skew table");

namespace kvtrie {
namespace {

using Clock = std::chrono::steady_clock;
using testing::ServerProcess;

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

std::vector<KvDump> Prefixes() {
  std::vector<KvDump> out;
  std::set<std::vector<uint32_t>> first;
  for (const char* name :
       {"sessions/s0", "sessions/s1", "sessions/s2", "sessions/s3", "neardup/n0", "neardup/n1",
        "neardup/n2", "neardup/n3", "genesis_1-3", "GPL-3", "story_prompt"}) {
    absl::StatusOr<KvDump> d = ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/" + name);
    if (!d.ok()) {
      std::fprintf(stderr, "%s: %s\n", name, std::string(d.status().message()).c_str());
      std::exit(1);
    }
    const size_t stride = static_cast<size_t>(absl::GetFlag(FLAGS_stride));
    for (size_t o = 0; o + 64 <= d->num_tokens(); o += stride) {
      KvDump w = Slice(*d, o, 64);
      if (first.insert({w.token_ids.begin(), w.token_ids.begin() + 16}).second) {
        out.push_back(std::move(w));
      }
    }
  }
  return out;
}

struct Cluster {
  std::string dir;
  std::vector<std::unique_ptr<ServerProcess>> servers;
  std::vector<Shard> Membership() const {
    std::vector<Shard> out;
    for (size_t i = 0; i < servers.size(); ++i) {
      out.push_back({"kvtrie-" + std::to_string(i), servers[i]->target()});
    }
    return out;
  }
  void Add() {
    const std::string d = absl::StrCat(dir, "/kvtrie-", servers.size());
    absl::StatusOr<std::unique_ptr<ServerProcess>> s = ServerProcess::Start(d);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.status().message()).c_str());
      std::exit(1);
    }
    servers.push_back(*std::move(s));
  }
};

std::string List(const std::vector<Shard>& shards) {
  std::vector<std::string> items;
  for (const Shard& s : shards) items.push_back(s.name + "=" + s.target);
  return absl::StrJoin(items, ",");
}

std::unique_ptr<ShardedClient> Sharded(const std::vector<Shard>& shards,
                                       absl::Duration warmup = absl::ZeroDuration()) {
  ShardedClientOptions o;
  o.warmup_window = warmup;
  o.shards = List(shards);
  o.client.ns = "bench";
  o.client.timeout = absl::Seconds(10);
  o.client.retry.max_attempts = 1;
  absl::StatusOr<std::unique_ptr<ShardedClient>> c = ShardedClient::Create(o);
  if (!c.ok()) std::exit(1);
  return *std::move(c);
}

// Runs fn(i) for every i in [0, n) on `threads` threads; seconds taken.
template <typename Fn>
double Parallel(size_t n, int threads, Fn fn) {
  std::atomic<size_t> next{0};
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
    });
  }
  for (auto& t : ts) t.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Throughput {
  double puts_per_s = 0, gets_per_s = 0;
  int errors = 0, short_gets = 0;
};

// Puts every prefix, then Gets every prefix `rounds` times, through `put` and `get`.
template <typename PutFn, typename GetFn>
Throughput Measure(const std::vector<KvDump>& prefixes, PutFn put, GetFn get) {
  Throughput t;
  std::atomic<int> errors{0}, short_gets{0};
  const int threads = absl::GetFlag(FLAGS_threads), rounds = absl::GetFlag(FLAGS_rounds);
  const double put_s = Parallel(prefixes.size(), threads, [&](size_t i) {
    if (!put(prefixes[i])) ++errors;
  });
  const double get_s = Parallel(prefixes.size() * rounds, threads, [&](size_t i) {
    const KvDump& p = prefixes[i % prefixes.size()];
    absl::StatusOr<KvDump> g = get(p);
    if (!g.ok())
      ++errors;
    else if (g->num_tokens() != p.num_tokens())
      ++short_gets;
  });
  t.puts_per_s = prefixes.size() / put_s;
  t.gets_per_s = prefixes.size() * rounds / get_s;
  t.errors = errors;
  t.short_gets = short_gets;
  return t;
}

double Skew(const std::map<std::string, int>& counts, size_t shards) {
  int max = 0, total = 0;
  for (const auto& [n, c] : counts) {
    max = std::max(max, c);
    total += c;
  }
  return total == 0 ? 0 : max / (static_cast<double>(total) / shards);
}

int Main() {
  const std::vector<KvDump> prefixes = Prefixes();
  const double kb = prefixes[0].k.size() * 2 / 1024.0;
  std::printf(
      "# shard_bench\n\n%zu real prefixes (64 tokens, %.0f KB of KV each), %d client "
      "threads, %u cores on this machine shared by the servers and the clients.\n\n",
      prefixes.size(), kb, absl::GetFlag(FLAGS_threads), std::thread::hardware_concurrency());

  // 1. Throughput.
  std::printf(
      "## Aggregate throughput\n\n| setup | Put/s | Get/s | Put ratio | Get ratio | "
      "errors | short Gets |\n|---|---|---|---|---|---|---|\n");
  double base_put = 0, base_get = 0;
  {
    Cluster c{testing::FreshDir("shard_bench_plain"), {}};
    c.Add();
    std::unique_ptr<Client> client =
        Client::Create({.target = c.servers[0]->target(), .ns = "bench"});
    const Throughput t = Measure(
        prefixes, [&](const KvDump& p) { return client->Put(p).ok(); },
        [&](const KvDump& p) { return client->Get(p.model_id, p.token_ids); });
    base_put = t.puts_per_s;
    base_get = t.gets_per_s;
    std::printf("| plain Client, 1 server | %.0f | %.0f | 1.00 | 1.00 | %d | %d |\n", t.puts_per_s,
                t.gets_per_s, t.errors, t.short_gets);
  }
  for (int n = 1; n <= 3; ++n) {
    Cluster c{testing::FreshDir("shard_bench_" + std::to_string(n)), {}};
    for (int i = 0; i < n; ++i) c.Add();
    std::unique_ptr<ShardedClient> client = Sharded(c.Membership());
    const Throughput t = Measure(
        prefixes, [&](const KvDump& p) { return client->Put(p).ok(); },
        [&](const KvDump& p) { return client->Get(p.model_id, p.token_ids); });
    std::printf("| ShardedClient, %d shard%s | %.0f | %.0f | %.2f | %.2f | %d | %d |\n", n,
                n > 1 ? "s" : "", t.puts_per_s, t.gets_per_s, t.puts_per_s / base_put,
                t.gets_per_s / base_get, t.errors, t.short_gets);
  }

  // The routing itself: OwnerOf (hash of the key, one score per shard) per call.
  {
    std::vector<Shard> three;
    for (int i = 0; i < 3; ++i) three.push_back({"kvtrie-" + std::to_string(i), "x:1"});
    std::unique_ptr<ShardedClient> client = Sharded(three);
    constexpr int kCalls = 200000;
    size_t sink = 0;
    const auto t0 = Clock::now();
    for (int i = 0; i < kCalls; ++i) {
      const KvDump& p = prefixes[i % prefixes.size()];
      sink += client->OwnerOf(p.model_id, p.token_ids).name.size();
    }
    const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kCalls;
    std::printf("\nRouting a call (ShardedClient::OwnerOf, 3 shards): %.0f ns (%zu)\n", ns,
                sink % 10);
  }

  // 2. Hit rate kept after adding a shard and after losing one.
  std::printf(
      "\n## Hit rate kept\n\n| change | prefixes | hits | misses | errors | hit rate | "
      "expected |\n|---|---|---|---|---|---|---|\n");
  for (const char* change :
       {"add a 4th to 3", "add a 4th to 3, --shard_warmup_seconds=60", "kill -9 one of 3"}) {
    const bool warm = std::strstr(change, "warmup") != nullptr;
    Cluster c{testing::FreshDir("shard_bench_change"), {}};
    for (int i = 0; i < 3; ++i) c.Add();
    std::unique_ptr<ShardedClient> client =
        Sharded(c.Membership(), warm ? absl::Seconds(60) : absl::ZeroDuration());
    for (const KvDump& p : prefixes) client->Put(p).IgnoreError();
    const bool add = change[0] == 'a';
    if (add) {
      c.Add();
      client->SetShards(c.Membership()).IgnoreError();
    } else {
      c.servers[1]->Kill();
    }
    int hits = 0, misses = 0, errors = 0;
    for (const KvDump& p : prefixes) {
      absl::StatusOr<KvDump> g = client->Get(p.model_id, p.token_ids);
      if (!g.ok())
        ++errors;
      else if (g->num_tokens() == p.num_tokens())
        ++hits;
      else
        ++misses;
    }
    std::printf("| %s | %zu | %d | %d | %d | %.1f%% | %s |\n", change, prefixes.size(), hits,
                misses, errors, 100.0 * hits / prefixes.size(),
                warm  ? "100%"
                : add ? "~75%"
                      : "~67%");
  }

  // 3. Key skew.
  std::printf(
      "\n## Key skew (max / mean prefixes per shard; 1.00 = even)\n\n| keys | 3 shards "
      "| 4 shards | 16 shards |\n|---|---|---|---|\n");
  std::mt19937 rng(21);
  std::vector<uint64_t> random_keys;
  for (int i = 0; i < absl::GetFlag(FLAGS_random_prefixes); ++i) {
    std::vector<uint32_t> t(16);
    for (uint32_t& x : t) x = rng() % 32000;
    random_keys.push_back(RouteKey("bench", "stories260K", t, 16));
  }
  std::vector<uint64_t> real_keys;
  for (const KvDump& p : prefixes) {
    real_keys.push_back(RouteKey("bench", p.model_id, p.token_ids, 16));
  }
  for (const auto& [what, keys] :
       {std::pair<std::string, const std::vector<uint64_t>*>{
            absl::StrCat(real_keys.size(), " real prefixes"), &real_keys},
        {absl::StrCat(random_keys.size(), " random first blocks"), &random_keys}}) {
    std::printf("| %s |", what.c_str());
    for (size_t n : {3, 4, 16}) {
      std::vector<Shard> shards;
      for (size_t i = 0; i < n; ++i) shards.push_back({"kvtrie-" + std::to_string(i), "x:1"});
      std::map<std::string, int> counts;
      for (uint64_t k : *keys) ++counts[shards[OwnerIndex(shards, k)].name];
      std::printf(" %.2f |", Skew(counts, n));
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace kvtrie

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);  // nothing buffered when a server is forked
  return kvtrie::Main();
}
