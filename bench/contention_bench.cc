// bench/contention_bench.cc
//
// Lookup latency of one namespace while other namespaces write (issue 9: per-model shards, no
// lock across RocksDB I/O). Starts the real kvtrie-server (tests/server_process.h) on a loopback
// port, stores one real prefix (tests/data/genesis_1-3, 512 tokens = 32 blocks of stories260K KV)
// in namespace "reader", then measures --lookups sequential Lookups of that prefix from one
// client:
//   idle     no other calls;
//   writers  while --writers client threads (one Client each) Put into as many other namespaces
//            ("writer-0", ...) in a loop, each Put the real KV of the dump under a new prefix
//            (token 0 replaced by a fresh id, so every block is new and written to RocksDB).
// Both conditions run against a server without and one with --sync (every Put's batch is
// fsynced), interleaved: for each repeat, for each of {no sync, sync}: a fresh server, idle,
// writers, stop. Prints one row per repeat and condition, then the medians over the repeats and
// the ratio p99(writers) / p99(idle) of the same server (target: within 2x).
//
//   deploy/build.sh contention_bench kvtrie-server
//   build/bench/contention_bench [--repeats=3] [--lookups=2000] [--writers=16]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "codec/kv_dump.h"
#include "tests/server_process.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  double p50_us = 0, p99_us = 0;
  double puts_per_s = 0;  // writers only
  uint64_t puts = 0;
};

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

// `n` Lookups of `kv`'s prefix; every one must match all its blocks.
bool MeasureLookups(kvtrie::Client& client, const kvtrie::KvDump& kv, int n, Sample* out) {
  std::vector<double> us;
  us.reserve(n);
  const uint32_t want = static_cast<uint32_t>(kv.num_tokens() / 16);
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    absl::StatusOr<kvtrie::v1::LookupResponse> r = client.Lookup(kv.model_id, kv.token_ids);
    const auto t1 = Clock::now();
    if (!r.ok() || r->matched_blocks() != want) {
      std::fprintf(stderr, "lookup: %s (matched %u of %u)\n",
                   r.ok() ? "short match" : std::string(r.status().message()).c_str(),
                   r.ok() ? r->matched_blocks() : 0, want);
      return false;
    }
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  out->p50_us = Percentile(us, 0.5);
  out->p99_us = Percentile(us, 0.99);
  return true;
}

// One server: idle, then writers. Returns false on any error.
bool RunServer(const kvtrie::KvDump& kv, bool sync, int lookups, int writers, int round,
               Sample* idle, Sample* busy) {
  const std::string dir = kvtrie::testing::FreshDir("contention_bench_" + std::to_string(round) +
                                                    (sync ? "_sync" : "_nosync"));
  std::vector<std::string> flags = {"--memory_bytes=1073741824", "--disk_bytes=4294967296"};
  if (sync) flags.push_back("--sync");
  absl::StatusOr<std::unique_ptr<kvtrie::testing::ServerProcess>> server =
      kvtrie::testing::ServerProcess::Start(dir + "/data", flags);
  if (!server.ok()) {
    std::fprintf(stderr, "kvtrie-server: %s\n", std::string(server.status().message()).c_str());
    return false;
  }
  kvtrie::ClientOptions o;
  o.target = (*server)->target();
  o.ns = "reader";
  std::unique_ptr<kvtrie::Client> reader = kvtrie::Client::Create(o);
  if (absl::StatusOr<kvtrie::v1::PutResponse> p = reader->Put(kv); !p.ok()) {
    std::fprintf(stderr, "put: %s\n", std::string(p.status().message()).c_str());
    return false;
  }
  // Warm the channel and the server's caches, then the idle figure.
  if (!MeasureLookups(*reader, kv, std::max(1, lookups / 10), idle)) return false;
  if (!MeasureLookups(*reader, kv, lookups, idle)) return false;

  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> puts{0};
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < writers; ++w) {
    threads.emplace_back([&, w] {
      kvtrie::ClientOptions wo = o;
      wo.ns = "writer-" + std::to_string(w);
      std::unique_ptr<kvtrie::Client> c = kvtrie::Client::Create(wo);
      kvtrie::KvDump mine = kv;
      bool first = true;
      for (uint32_t i = 0; !stop.load(); ++i) {
        mine.token_ids[0] = 1000000u + static_cast<uint32_t>(w) * 1000000u + i;  // a new prefix
        absl::StatusOr<kvtrie::v1::PutResponse> p = c->Put(mine);
        if (!p.ok()) {
          std::fprintf(stderr, "writer %d put: %s\n", w, std::string(p.status().message()).c_str());
          failed = true;
          break;
        }
        puts.fetch_add(1);
        if (first) started.fetch_add(1), first = false;
      }
      if (first) started.fetch_add(1);
    });
  }
  while (started.load() < writers && !failed.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const uint64_t puts0 = puts.load();
  const auto t0 = Clock::now();
  const bool ok = !failed.load() && MeasureLookups(*reader, kv, lookups, busy);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  busy->puts = puts.load() - puts0;
  busy->puts_per_s = busy->puts / secs;
  stop = true;
  for (std::thread& t : threads) t.join();
  (*server)->Stop();
  return ok && !failed.load();
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 3, lookups = 2000, writers = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--repeats=", 0) == 0) {
      repeats = std::stoi(a.substr(10));
    } else if (a.rfind("--lookups=", 0) == 0) {
      lookups = std::stoi(a.substr(10));
    } else if (a.rfind("--writers=", 0) == 0) {
      writers = std::stoi(a.substr(10));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  absl::StatusOr<kvtrie::KvDump> kv =
      kvtrie::ReadKvDump(std::string(KVTRIE_TESTDATA_DIR) + "/genesis_1-3");
  if (!kv.ok()) {
    std::fprintf(stderr, "%s\n", std::string(kv.status().message()).c_str());
    return 1;
  }
  std::printf(
      "Lookup of one stored prefix (%zu tokens, %zu blocks, model %s) from one client;\n"
      "writers: %d threads Put %zu-token real prefixes (new token ids) into %d other "
      "namespaces. %d lookups per condition, %d repeats, interleaved.\n\n",
      kv->num_tokens(), kv->num_tokens() / 16, kv->model_id.c_str(), writers, kv->num_tokens(),
      writers, lookups, repeats);
  std::printf(
      "| repeat | server | idle p50 us | idle p99 us | writers p50 us | writers p99 us | "
      "p99 ratio | Puts/s during |\n|---|---|---|---|---|---|---|---|\n");
  std::vector<double> ip50[2], ip99[2], bp50[2], bp99[2], ratio[2], pps[2];
  for (int r = 0; r < repeats; ++r) {
    for (int s = 0; s < 2; ++s) {
      Sample idle, busy;
      if (!RunServer(*kv, s == 1, lookups, writers, r, &idle, &busy)) return 1;
      const double q = busy.p99_us / idle.p99_us;
      std::printf("| %d | %s | %.0f | %.0f | %.0f | %.0f | %.2f | %.0f |\n", r + 1,
                  s ? "--sync" : "no sync", idle.p50_us, idle.p99_us, busy.p50_us, busy.p99_us, q,
                  busy.puts_per_s);
      std::fflush(stdout);
      ip50[s].push_back(idle.p50_us);
      ip99[s].push_back(idle.p99_us);
      bp50[s].push_back(busy.p50_us);
      bp99[s].push_back(busy.p99_us);
      ratio[s].push_back(q);
      pps[s].push_back(busy.puts_per_s);
    }
  }
  std::printf(
      "\nMedians over %d repeats:\n\n| server | idle p50 us | idle p99 us | writers p50 us | "
      "writers p99 us | p99(writers)/p99(idle) | Puts/s during |\n"
      "|---|---|---|---|---|---|---|\n",
      repeats);
  for (int s = 0; s < 2; ++s) {
    std::printf("| %s | %.0f | %.0f | %.0f | %.0f | %.2f | %.0f |\n", s ? "--sync" : "no sync",
                Median(ip50[s]), Median(ip99[s]), Median(bp50[s]), Median(bp99[s]),
                Median(ratio[s]), Median(pps[s]));
  }
  return 0;
}
