#include "client/call_registry.h"

#include "absl/time/clock.h"

namespace kvtrie {

void CallRegistry::Add(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  calls_[ctx] = absl::Now();
}

void CallRegistry::Remove(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  calls_.erase(ctx);
}

int CallRegistry::CancelAll() {
  absl::MutexLock lock(&mu_);
  for (const auto& [ctx, start] : calls_) ctx->TryCancel();
  return static_cast<int>(calls_.size());
}

absl::Time CallRegistry::OldestStart() const {
  absl::MutexLock lock(&mu_);
  absl::Time oldest = absl::InfiniteFuture();
  for (const auto& [ctx, start] : calls_) oldest = std::min(oldest, start);
  return oldest;
}

void ContextDeleter::operator()(grpc::ClientContext* ctx) const {
  if (registry != nullptr) registry->Remove(ctx);
  delete ctx;
}

}  // namespace kvtrie
