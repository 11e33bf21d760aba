#include "client/shard_health.h"

#include <utility>
#include <vector>

#include "absl/time/clock.h"

namespace kvtrie {

ShardHealth::ShardHealth(const ShardHealthOptions& options) : options_(options) {
  if (options_.probe_deadline > absl::ZeroDuration()) prober_ = std::thread([this] { Run(); });
}

ShardHealth::~ShardHealth() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (prober_.joinable()) prober_.join();
}

void ShardHealth::Track(const std::string& name, std::shared_ptr<Client> client) {
  absl::MutexLock lock(&mu_);
  states_[name] = State{std::move(client)};
}

void ShardHealth::MarkDown(const std::string& name) {
  if (!prober_.joinable()) return;
  absl::MutexLock lock(&mu_);
  auto it = states_.find(name);
  if (it == states_.end() || it->second.down) return;
  it->second.down = true;
  it->second.next_probe = absl::Now() + options_.probe_interval;
}

bool ShardHealth::IsDown(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = states_.find(name);
  return it != states_.end() && it->second.down;
}

ShardHealth::Counters ShardHealth::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

void ShardHealth::Run() {
  // A quarter of the deadline: a hung shard's first call ends within ~2.25 x probe_deadline.
  const absl::Duration tick =
      std::clamp(options_.probe_deadline / 4, absl::Milliseconds(5), absl::Milliseconds(100));
  const auto stopped = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; };
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopped), tick)) {
    // The shards due for a check: down ones at their pace, up ones whose oldest call in flight
    // has waited probe_deadline (each at most once per probe_deadline).
    const absl::Time now = absl::Now();
    std::vector<std::pair<std::string, std::shared_ptr<Client>>> due;
    for (auto& [name, st] : states_) {
      if (now < st.next_probe) continue;
      if (st.down || now - st.client->calls().OldestStart() >= options_.probe_deadline) {
        due.emplace_back(name, st.client);
      }
    }
    for (auto& [name, client] : due) {
      mu_.Unlock();  // no lock across the check
      const bool ok = client->CheckHealth(options_.probe_deadline).ok();
      mu_.Lock();
      ++counters_.probes;
      if (!ok) ++counters_.probe_failures;
      // Cancelled under mu_ (CancelAll only cancels, it waits for nothing): a call it ends
      // returns to a caller who then reads counters() with its cancellation counted.
      if (!ok) counters_.calls_cancelled += static_cast<uint64_t>(client->calls().CancelAll());
      auto it = states_.find(name);
      if (it == states_.end() || it->second.client != client) continue;  // replaced meanwhile
      it->second.down = !ok;
      it->second.next_probe =
          absl::Now() + (ok ? options_.probe_deadline : options_.probe_interval);
      if (stop_) break;
    }
  }
}

}  // namespace kvtrie
