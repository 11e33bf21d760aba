#include "server/put_limits.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace kvtrie {

PutLimits::PutLimits(const PutLimitOptions& options) : options_(options) {
  if (options_.watchdog_thread && (options_.idle_timeout > absl::ZeroDuration() ||
                                   options_.admit_wait > absl::ZeroDuration())) {
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

absl::StatusOr<std::unique_ptr<PutLimits::Stream>> PutLimits::Admit(std::function<void()> cancel,
                                                                    const std::string& peer) {
  absl::MutexLock lock(&mu_);
  if (options_.max_concurrent_streams != 0 && streams_.size() >= options_.max_concurrent_streams) {
    return absl::ResourceExhaustedError(
        absl::StrCat("put: ", streams_.size(),
                     " Put streams are open, the server's --max_concurrent_put_streams=",
                     options_.max_concurrent_streams, "; retry later"));
  }
  const bool per_peer = options_.max_streams_per_peer != 0 && !peer.empty();
  if (per_peer) {
    auto it = peer_streams_.find(peer);
    if (it != peer_streams_.end() && it->second >= options_.max_streams_per_peer) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "put: peer ", peer, " holds ", it->second, " Put streams, the most one peer may hold (",
          "the server's --max_put_stream_share_per_peer of --max_concurrent_put_streams=",
          options_.max_concurrent_streams, "); finish or cancel one, or retry later"));
    }
  }
  std::unique_ptr<Stream> stream(new Stream(this, std::move(cancel)));
  if (per_peer) {
    stream->peer_ = peer;
    ++peer_streams_[peer];
  }
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
  std::vector<Done> granted;
  {
    absl::MutexLock lock(&mu_);
    if (streams_.erase(stream) == 0) return;
    if (!stream->peer_.empty()) {
      auto it = peer_streams_.find(stream->peer_);
      if (--it->second == 0) peer_streams_.erase(it);
    }
    if (stream->waiting_) {
      waiters_.erase(std::find(waiters_.begin(), waiters_.end(), stream));
      stream->waiting_ = false;
    }
    if (stream->bytes_ > 0) {
      auto it = ns_bytes_.find(stream->ns_);
      it->second -= stream->bytes_;
      if (it->second == 0) ns_bytes_.erase(it);
      total_bytes_ -= stream->bytes_;
      GrantWaitersLocked(&granted);
    }
  }
  for (Done& done : granted) done(absl::OkStatus());
}

namespace {

// Whether `bytes` more fit under `limit` (0 = unbounded) with `held` already charged.
bool Fits(uint64_t held, uint64_t bytes, uint64_t limit) {
  return limit == 0 || (bytes <= limit && held <= limit - bytes);
}

}  // namespace

bool PutLimits::FitsLocked(const Stream* stream, uint64_t bytes) const {
  auto it = ns_bytes_.find(stream->ns_);
  return Fits(total_bytes_, bytes, options_.max_inflight_bytes) &&
         Fits(it == ns_bytes_.end() ? 0 : it->second, bytes,
              options_.max_inflight_bytes_per_namespace);
}

void PutLimits::ChargeLocked(Stream* stream, uint64_t bytes) {
  stream->last_activity_ns_.store(NowNs(), std::memory_order_relaxed);
  ns_bytes_[stream->ns_] += bytes;
  total_bytes_ += bytes;
  stream->bytes_ += bytes;
  stream->unused_ += bytes;
}

absl::Status PutLimits::WaitedTooLongLocked(const Stream* stream, uint64_t bytes) const {
  auto it = ns_bytes_.find(stream->ns_);
  return absl::ResourceExhaustedError(absl::StrCat(
      "put: waited ", absl::ToDoubleSeconds(options_.admit_wait), " s for ", bytes,
      " bytes of in-flight Put memory; unfinished Puts hold ", total_bytes_,
      " (--max_inflight_put_bytes=", options_.max_inflight_bytes, "), namespace '", stream->ns_,
      "' ", it == ns_bytes_.end() ? 0 : it->second, " (--max_inflight_put_bytes_per_namespace=",
      options_.max_inflight_bytes_per_namespace, "); retry later"));
}

void PutLimits::GrantWaitersLocked(std::vector<Done>* granted) {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    Stream* w = *it;
    if (!FitsLocked(w, w->wait_bytes_)) {
      ++it;
      continue;
    }
    ChargeLocked(w, w->wait_bytes_);
    w->waiting_ = false;
    granted->push_back(std::move(w->wait_done_));
    w->wait_done_ = nullptr;
    it = waiters_.erase(it);
  }
}

void PutLimits::WatchdogLoop() {
  absl::Duration period = absl::Seconds(1);
  if (options_.idle_timeout > absl::ZeroDuration()) {
    period = std::min(period, options_.idle_timeout / 4);
  }
  if (options_.admit_wait > absl::ZeroDuration()) {
    period = std::min(period, options_.admit_wait / 4);
  }
  period = std::max(period, absl::Milliseconds(10));
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), period);
      if (stop_) break;
    }
    CheckDeadlines();
  }
}

void PutLimits::CheckDeadlines() {
  const int64_t idle_ns = absl::ToInt64Nanoseconds(options_.idle_timeout);
  {
    std::vector<std::pair<Done, absl::Status>> expired;
    {
      absl::MutexLock lock(&mu_);
      const int64_t now = NowNs();
      for (Stream* s : streams_) {
        if (idle_ns == 0) break;
        if (s->idle_cancelled_.load(std::memory_order_relaxed)) continue;
        if (s->committed_.load(std::memory_order_relaxed)) continue;
        if (s->waiting_) continue;  // waiting for memory is not idle
        // Handling a message (or queued for a handler thread) is the server's time, not idle.
        if (!s->awaiting_client_.load(std::memory_order_acquire)) continue;
        if (now - s->last_activity_ns_.load(std::memory_order_relaxed) < idle_ns) continue;
        s->idle_cancelled_.store(true, std::memory_order_release);
        spdlog::warn("put: stream of namespace '{}' idle for {} s, cancelled ({} bytes released)",
                     s->ns_, absl::ToDoubleSeconds(options_.idle_timeout), s->bytes_);
        s->cancel_();
      }
      const absl::Time t = absl::FromUnixNanos(now);
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        Stream* w = *it;
        if (w->wait_deadline_ > t) {
          ++it;
          continue;
        }
        expired.emplace_back(std::move(w->wait_done_), WaitedTooLongLocked(w, w->wait_bytes_));
        w->wait_done_ = nullptr;
        w->waiting_ = false;
        w->last_activity_ns_.store(now, std::memory_order_relaxed);
        it = waiters_.erase(it);
      }
    }
    for (auto& [done, status] : expired) done(std::move(status));
  }
}

PutLimits::Stream::Stream(PutLimits* owner, std::function<void()> cancel)
    : owner_(owner), cancel_(std::move(cancel)), last_activity_ns_(owner->NowNs()) {}

PutLimits::Stream::~Stream() { owner_->Release(this); }

void PutLimits::Stream::AwaitClient() {
  last_activity_ns_.store(owner_->NowNs(), std::memory_order_relaxed);
  awaiting_client_.store(true, std::memory_order_release);
}

void PutLimits::Stream::Touch() {
  awaiting_client_.store(false, std::memory_order_release);
  last_activity_ns_.store(owner_->NowNs(), std::memory_order_relaxed);
}

void PutLimits::Stream::SetNamespace(const std::string& ns) {
  absl::MutexLock lock(&owner_->mu_);
  ns_ = ns;
}

absl::Status PutLimits::Stream::ReserveWhole(uint64_t bytes,
                                             const std::function<bool()>& cancelled) {
  absl::Notification done;
  absl::Status result;
  ReserveWholeAsync(bytes, [&](absl::Status s) {
    result = std::move(s);
    done.Notify();
  });
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
    if (cancelled() && CancelWait()) {
      return absl::CancelledError("put: cancelled while waiting for memory");
    }
  }
  return result;
}

void PutLimits::Stream::ReserveWholeAsync(uint64_t bytes, std::function<void(absl::Status)> done) {
  const PutLimitOptions& o = owner_->options_;
  // A stream buffers at most max_put_bytes (the store refuses more), and no reservation can be
  // larger than a limit: reserve no more (blocks past it are charged, and refused, one by one:
  // a Put of a long stored prefix sends only its new blocks).
  for (uint64_t cap : {o.max_put_bytes, o.max_inflight_bytes, o.max_inflight_bytes_per_namespace}) {
    if (cap != 0) bytes = std::min(bytes, cap);
  }
  absl::Status now;
  {
    absl::MutexLock lock(&owner_->mu_);
    if (owner_->FitsLocked(this, bytes)) {
      owner_->ChargeLocked(this, bytes);
    } else if (o.admit_wait <= absl::ZeroDuration()) {
      now = owner_->WaitedTooLongLocked(this, bytes);
    } else {
      waiting_ = true;
      wait_bytes_ = bytes;
      wait_deadline_ = absl::FromUnixNanos(owner_->NowNs()) + o.admit_wait;
      wait_done_ = std::move(done);
      owner_->waiters_.push_back(this);
      return;
    }
  }
  done(std::move(now));
}

bool PutLimits::Stream::CancelWait() {
  absl::MutexLock lock(&owner_->mu_);
  if (!waiting_) return false;
  auto& w = owner_->waiters_;
  w.erase(std::find(w.begin(), w.end(), this));
  waiting_ = false;
  wait_done_ = nullptr;
  return true;
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
