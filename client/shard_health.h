// client/shard_health.h
//
// kvtrie::ShardHealth — the sharded client's view of which shards answer, kept by a background
// prober with gRPC health checks (grpc.health.v1.Health/Check) that have a short deadline of
// their own (probe_deadline, 250 ms by default), independent of the calls' deadline (60 s).
//
// A shard that stops answering without closing its connection (SIGSTOP, a hung host, a full
// accept queue) would otherwise cost each call routed to it the whole call deadline, and again
// after every backoff. Here:
//  - a call to a shard that has waited probe_deadline makes the prober check the shard (at most
//    once per probe_deadline while calls wait; a slow but healthy shard answers the check and
//    its calls go on); when the check misses its deadline (or fails), every call in flight to
//    the shard is cancelled (CANCELLED: the sharded client answers a miss) and it is down;
//  - a shard down (so marked by the prober, or by MarkDown after a call failed) is checked every
//    probe_interval; calls to it are skipped (misses at once) until a check answers SERVING.
// So the first call to a hung shard costs about 2 x probe_deadline, and later calls nothing.
// Thread-safe.
#ifndef KVTRIE_CLIENT_SHARD_HEALTH_H_
#define KVTRIE_CLIENT_SHARD_HEALTH_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace kvtrie {

struct ShardHealthOptions {
  // The deadline of a health check, and how long a call waits before its shard is checked.
  // Zero: no prober (calls wait for their own deadline; a failed shard is skipped for its
  // backoff only). CLI: --shard_probe_deadline_ms; Python: shard_probe_deadline= (seconds).
  absl::Duration probe_deadline = absl::Milliseconds(250);
  // How often a down shard is checked. CLI: --shard_probe_interval_ms; Python:
  // shard_probe_interval=.
  absl::Duration probe_interval = absl::Milliseconds(500);
};

class ShardHealth {
 public:
  explicit ShardHealth(const ShardHealthOptions& options);
  ~ShardHealth();  // stops the prober (waits for a check in flight: at most probe_deadline)
  ShardHealth(const ShardHealth&) = delete;
  ShardHealth& operator=(const ShardHealth&) = delete;

  // The client that reaches shard `name` (a new one replaces the one before: its address
  // changed). Its calls are watched from now on; the shard starts up.
  void Track(const std::string& name, std::shared_ptr<Client> client);
  // A call to `name` failed with a lost shard's status: down until a check answers.
  void MarkDown(const std::string& name);
  // Down: skip it (its prefixes miss). Always false without a prober.
  bool IsDown(const std::string& name) const;

  struct Counters {
    uint64_t probes = 0;           // health checks sent
    uint64_t probe_failures = 0;   // of them, missed their deadline or did not answer SERVING
    uint64_t calls_cancelled = 0;  // calls in flight cancelled because their shard's check failed
  };
  Counters counters() const;
  const ShardHealthOptions& options() const { return options_; }

 private:
  struct State {
    std::shared_ptr<Client> client;
    bool down = false;
    absl::Time next_probe = absl::InfinitePast();  // down: the next check; up: no earlier check
  };
  void Run();

  const ShardHealthOptions options_;
  mutable absl::Mutex mu_;  // guards states_, counters_, stop_ (never held across a check)
  std::map<std::string, State> states_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread prober_;  // runs Run(); not started without probe_deadline
};

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_SHARD_HEALTH_H_
