// bench/contention_bench.cc
//
// Lookup latency of one namespace while other namespaces write (issue 9: per-model shards, no
// lock across RocksDB I/O). Starts the real kvtrie-server (tests/server_process.h) on a loopback
// port, stores one real prefix (tests/data/genesis_1-3, 512 tokens = 32 blocks of stories260K KV)
// in namespace "reader", then measures --lookups sequential Lookups of that prefix from one
// client:
//   idle     no other calls;
//   control  while --writers client threads (one Client each) Lookup a prefix stored in their
//            own namespace ("reader-0", ...) in a loop: as many busy clients, no store writes,
//            so what the writers add beyond it is the store's, not the machine's load;
//   cpu      while as many threads of this process spin (no call to the server): the machine's
//            CPU load alone;
//   writers  while --writers client threads (one Client each) Put into as many other namespaces
//            ("writer-0", ...) in a loop, each Put the real KV of the dump under a new prefix
//            (token 0 replaced by a fresh id, so every block is new and written to RocksDB).
// Both conditions run against a server without and one with --sync (every Put's batch is
// fsynced), interleaved: for each repeat, for each of {no sync, sync}: a fresh server, idle,
// control, cpu, writers, stop. Prints one row per repeat and condition, then the medians over the
// repeats and the ratio p99(writers) / p99(idle) of the same server (target: within 2x).
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
  double puts_per_s = 0;  // under load: the load threads' calls (Puts or Lookups) per second
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

// `lookups` Lookups of the reader's prefix while `threads` clients (one per namespace
// "other-<i>") run the load: Puts of new prefixes (`write`), or Lookups of a prefix stored in
// their namespace first (the control: the same number of busy clients, no store writes).
bool MeasureUnderLoad(const kvtrie::ClientOptions& o, kvtrie::Client& reader,
                      const kvtrie::KvDump& kv, int lookups, int threads_n, bool write,
                      Sample* busy, bool spin = false) {
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> calls{0};
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < threads_n; ++w) {
    threads.emplace_back([&, w] {
      if (spin) {  // CPU load only: no call to the server
        volatile uint64_t x = 0;
        started.fetch_add(1);
        while (!stop.load(std::memory_order_relaxed)) {
          for (int k = 0; k < 100000; ++k) x = x + k;
          calls.fetch_add(1);
        }
        return;
      }
      kvtrie::ClientOptions wo = o;
      wo.ns = std::string(write ? "writer-" : "reader-") + std::to_string(w);
      std::unique_ptr<kvtrie::Client> c = kvtrie::Client::Create(wo);
      kvtrie::KvDump mine = kv;
      if (!write && !c->Put(mine).ok()) failed = true;
      bool first = true;
      for (uint32_t i = 0; !stop.load() && !failed.load(); ++i) {
        absl::Status st;
        if (write) {
          mine.token_ids[0] = 1000000u + static_cast<uint32_t>(w) * 1000000u + i;  // a new prefix
          st = c->Put(mine).status();
        } else {
          st = c->Lookup(mine.model_id, mine.token_ids).status();
        }
        if (!st.ok()) {
          std::fprintf(stderr, "load %d: %s\n", w, std::string(st.message()).c_str());
          failed = true;
          break;
        }
        calls.fetch_add(1);
        if (first) started.fetch_add(1), first = false;
      }
      if (first) started.fetch_add(1);
    });
  }
  while (started.load() < threads_n && !failed.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const uint64_t calls0 = calls.load();
  const auto t0 = Clock::now();
  const bool ok = !failed.load() && MeasureLookups(reader, kv, lookups, busy);
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  busy->puts = calls.load() - calls0;
  busy->puts_per_s = busy->puts / secs;
  stop = true;
  for (std::thread& t : threads) t.join();
  return ok && !failed.load();
}

// One server: idle, then 16 Lookup clients (control), then writers. False on any error.
bool RunServer(const kvtrie::KvDump& kv, bool sync, int lookups, int writers, int round,
               Sample* idle, Sample* control, Sample* spin, Sample* busy) {
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

  bool ok = MeasureUnderLoad(o, *reader, kv, lookups, writers, /*write=*/false, control) &&
            MeasureUnderLoad(o, *reader, kv, lookups, writers, /*write=*/false, spin,
                             /*spin=*/true) &&
            MeasureUnderLoad(o, *reader, kv, lookups, writers, /*write=*/true, busy);
  (*server)->Stop();
  return ok;
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
      "Lookup of one stored prefix (%zu tokens, %zu blocks, model %s) from one client.\n"
      "control: %d threads Lookup their own stored prefix in %d other namespaces (no writes);\n"
      "cpu: as many threads in this process spin (CPU load only, no call to the server);\n"
      "writers: %d threads Put %zu-token real prefixes (new token ids) into %d other "
      "namespaces.\n%d lookups per condition, %d repeats, servers interleaved. Latencies in us; "
      "calls/s = the load threads' calls during the measurement.\n\n",
      kv->num_tokens(), kv->num_tokens() / 16, kv->model_id.c_str(), writers, writers, writers,
      kv->num_tokens(), writers, lookups, repeats);
  std::printf(
      "| repeat | server | idle p50 | idle p99 | control p50 | control p99 | cpu p50 | cpu p99 | "
      "writers p50 | writers p99 | p99 writers/idle | p99 writers/control | p99 writers/cpu | "
      "Lookups/s control | Puts/s writers |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);  // before a server is forked
  // Per server kind: idle, control, writers samples; ratios.
  std::vector<Sample> all[2][4];
  std::vector<double> r_idle[2], r_ctl[2], r_cpu[2];
  for (int r = 0; r < repeats; ++r) {
    for (int s = 0; s < 2; ++s) {
      Sample idle, control, spin, busy;
      if (!RunServer(*kv, s == 1, lookups, writers, r, &idle, &control, &spin, &busy)) return 1;
      const double qi = busy.p99_us / idle.p99_us, qc = busy.p99_us / control.p99_us,
                   qs = busy.p99_us / spin.p99_us;
      std::printf(
          "| %d | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.2f "
          "| %.0f | %.0f |\n",
          r + 1, s ? "--sync" : "no sync", idle.p50_us, idle.p99_us, control.p50_us, control.p99_us,
          spin.p50_us, spin.p99_us, busy.p50_us, busy.p99_us, qi, qc, qs, control.puts_per_s,
          busy.puts_per_s);
      r_cpu[s].push_back(qs);
      std::fflush(stdout);
      all[s][0].push_back(idle);
      all[s][1].push_back(control);
      all[s][2].push_back(busy);
      all[s][3].push_back(spin);
      r_idle[s].push_back(qi);
      r_ctl[s].push_back(qc);
    }
  }
  std::printf(
      "\nMedians over %d repeats:\n\n| server | idle p50 | idle p99 | control p50 | control p99 | "
      "cpu p50 | cpu p99 | writers p50 | writers p99 | p99(writers)/p99(idle) | "
      "p99(writers)/p99(control) | p99(writers)/p99(cpu) | Lookups/s control | Puts/s writers |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      repeats);
  const auto med = [](const std::vector<Sample>& v, double Sample::*f) {
    std::vector<double> x;
    for (const Sample& s : v) x.push_back(s.*f);
    return Median(x);
  };
  for (int s = 0; s < 2; ++s) {
    std::printf(
        "| %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.2f | %.0f "
        "| %.0f |\n",
        s ? "--sync" : "no sync", med(all[s][0], &Sample::p50_us), med(all[s][0], &Sample::p99_us),
        med(all[s][1], &Sample::p50_us), med(all[s][1], &Sample::p99_us),
        med(all[s][3], &Sample::p50_us), med(all[s][3], &Sample::p99_us),
        med(all[s][2], &Sample::p50_us), med(all[s][2], &Sample::p99_us), Median(r_idle[s]),
        Median(r_ctl[s]), Median(r_cpu[s]), med(all[s][1], &Sample::puts_per_s),
        med(all[s][2], &Sample::puts_per_s));
  }
  return 0;
}
