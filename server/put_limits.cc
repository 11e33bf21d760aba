#include "server/put_limits.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvtrie {

PutLimits::PutLimits(const PutLimitOptions& options) : options_(options) {
  if (options_.idle_timeout > absl::ZeroDuration()) {
    watchdog_ = std::thread([this] { WatchdogLoop(); });
  }
}

PutLimits::~PutLimits() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
}

absl::StatusOr<std::unique_ptr<PutLimits::Stream>> PutLimits::Admit(std::function<void()> cancel) {
  absl::MutexLock lock(&mu_);
  if (options_.max_concurrent_streams != 0 && streams_.size() >= options_.max_concurrent_streams) {
    return absl::ResourceExhaustedError(
        absl::StrCat("put: ", streams_.size(),
                     " Put streams are open, the server's --max_concurrent_put_streams=",
                     options_.max_concurrent_streams, "; retry later"));
  }
  std::unique_ptr<Stream> stream(new Stream(this, std::move(cancel)));
  streams_.insert(stream.get());
  return stream;
}

int PutLimits::open_streams() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(streams_.size());
}

uint64_t PutLimits::inflight_bytes(const std::string& ns) const {
  absl::MutexLock lock(&mu_);
  auto it = ns_bytes_.find(ns);
  return it == ns_bytes_.end() ? 0 : it->second;
}

uint64_t PutLimits::total_inflight_bytes() const {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

void PutLimits::Release(Stream* stream) {
  absl::MutexLock lock(&mu_);
  if (streams_.erase(stream) == 0) return;
  if (stream->bytes_ > 0) {
    auto it = ns_bytes_.find(stream->ns_);
    it->second -= stream->bytes_;
    if (it->second == 0) ns_bytes_.erase(it);
    total_bytes_ -= stream->bytes_;
  }
}

void PutLimits::WatchdogLoop() {
  const absl::Duration period =
      std::clamp(options_.idle_timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
  const int64_t idle_ns = absl::ToInt64Nanoseconds(options_.idle_timeout);
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), period);
    if (stop_) break;
    const int64_t now = absl::GetCurrentTimeNanos();
    for (Stream* s : streams_) {
      if (s->idle_cancelled_.load(std::memory_order_relaxed)) continue;
      if (s->committed_.load(std::memory_order_relaxed)) continue;
      if (now - s->last_activity_ns_.load(std::memory_order_relaxed) < idle_ns) continue;
      s->idle_cancelled_.store(true, std::memory_order_release);
      spdlog::warn("put: stream of namespace '{}' idle for {} s, cancelled ({} bytes released)",
                   s->ns_, absl::ToDoubleSeconds(options_.idle_timeout), s->bytes_);
      s->cancel_();
    }
  }
}

PutLimits::Stream::Stream(PutLimits* owner, std::function<void()> cancel)
    : owner_(owner), cancel_(std::move(cancel)), last_activity_ns_(absl::GetCurrentTimeNanos()) {}

PutLimits::Stream::~Stream() { owner_->Release(this); }

void PutLimits::Stream::Touch() {
  last_activity_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
}

void PutLimits::Stream::SetNamespace(const std::string& ns) {
  absl::MutexLock lock(&owner_->mu_);
  ns_ = ns;
}

namespace {

// Whether `bytes` more fit under `limit` (0 = unbounded) with `held` already charged.
bool Fits(uint64_t held, uint64_t bytes, uint64_t limit) {
  return limit == 0 || (bytes <= limit && held <= limit - bytes);
}

}  // namespace

absl::Status PutLimits::Stream::ReserveWhole(uint64_t bytes,
                                             const std::function<bool()>& cancelled) {
  const PutLimitOptions& o = owner_->options_;
  // A stream buffers at most max_put_bytes (the store refuses more), and no reservation can be
  // larger than a limit: reserve no more (blocks past it are charged, and refused, one by one:
  // a Put of a long stored prefix sends only its new blocks).
  for (uint64_t cap : {o.max_put_bytes, o.max_inflight_bytes, o.max_inflight_bytes_per_namespace}) {
    if (cap != 0) bytes = std::min(bytes, cap);
  }
  const absl::Time deadline = absl::Now() + o.admit_wait;
  absl::MutexLock lock(&owner_->mu_);
  auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_->mu_) {
    auto it = owner_->ns_bytes_.find(ns_);
    return Fits(owner_->total_bytes_, bytes, o.max_inflight_bytes) &&
           Fits(it == owner_->ns_bytes_.end() ? 0 : it->second, bytes,
                o.max_inflight_bytes_per_namespace);
  };
  while (!fits()) {
    // Not idle while it waits: the idle deadline does not cancel it.
    last_activity_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
    if (cancelled()) return absl::CancelledError("put: cancelled while waiting for memory");
    const absl::Duration left = deadline - absl::Now();
    if (left > absl::ZeroDuration()) {
      owner_->mu_.AwaitWithTimeout(absl::Condition(&fits), std::min(left, absl::Milliseconds(100)));
    } else {
      auto it = owner_->ns_bytes_.find(ns_);
      return absl::ResourceExhaustedError(absl::StrCat(
          "put: waited ", absl::ToDoubleSeconds(o.admit_wait), " s for ", bytes,
          " bytes of in-flight Put memory; unfinished Puts hold ", owner_->total_bytes_,
          " (--max_inflight_put_bytes=", o.max_inflight_bytes, "), namespace '", ns_, "' ",
          it == owner_->ns_bytes_.end() ? 0 : it->second,
          " (--max_inflight_put_bytes_per_namespace=", o.max_inflight_bytes_per_namespace,
          "); retry later"));
    }
  }
  last_activity_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  owner_->ns_bytes_[ns_] += bytes;
  owner_->total_bytes_ += bytes;
  bytes_ += bytes;
  unused_ += bytes;
  return absl::OkStatus();
}

absl::Status PutLimits::Stream::Reserve(uint64_t bytes) {
  absl::MutexLock lock(&owner_->mu_);
  if (bytes <= unused_) {
    unused_ -= bytes;
    return absl::OkStatus();
  }
  bytes -= unused_;
  uint64_t& held = owner_->ns_bytes_[ns_];
  const uint64_t limit = owner_->options_.max_inflight_bytes_per_namespace;
  if (!Fits(held, bytes, limit)) {
    if (held == 0) owner_->ns_bytes_.erase(ns_);
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv: namespace '", ns_, "' has ", held, " bytes in unfinished Put streams; this block's ",
        bytes, " would pass the server's --max_inflight_put_bytes_per_namespace=", limit));
  }
  const uint64_t total_limit = owner_->options_.max_inflight_bytes;
  if (!Fits(owner_->total_bytes_, bytes, total_limit)) {
    if (held == 0) owner_->ns_bytes_.erase(ns_);
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv: unfinished Put streams hold ", owner_->total_bytes_, " bytes; this block's ", bytes,
        " would pass the server's --max_inflight_put_bytes=", total_limit, "; retry later"));
  }
  unused_ = 0;
  held += bytes;
  owner_->total_bytes_ += bytes;
  bytes_ += bytes;
  return absl::OkStatus();
}

}  // namespace kvtrie
