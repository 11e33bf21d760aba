#include "client/retry.h"

#include <algorithm>
#include <cmath>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"

namespace kvtrie {

absl::Status ValidateRetryPolicy(const RetryPolicy& policy) {
  if (policy.max_attempts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("retry.max_attempts: ", policy.max_attempts,
                                                   " (must be >= 1; 1 = never retry)"));
  }
  if (policy.initial_backoff < absl::ZeroDuration() ||
      policy.max_backoff < policy.initial_backoff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "retry.max_backoff: ", absl::FormatDuration(policy.max_backoff),
        " must be >= initial_backoff ", absl::FormatDuration(policy.initial_backoff), " >= 0"));
  }
  if (!(policy.multiplier >= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.multiplier: ", policy.multiplier, " (must be >= 1)"));
  }
  return absl::OkStatus();
}

bool RetryablePutCode(absl::StatusCode code) {
  return code == absl::StatusCode::kAborted || code == absl::StatusCode::kUnavailable;
}

bool RetryableReadCode(absl::StatusCode code) { return code == absl::StatusCode::kUnavailable; }

absl::Duration RetryBackoff(const RetryPolicy& policy, int attempt) {
  const double growth = std::pow(policy.multiplier, std::max(0, attempt - 1));
  const absl::Duration d =
      std::min(policy.max_backoff, policy.initial_backoff * std::min(growth, 1e6));
  thread_local absl::BitGen gen;
  return d * absl::Uniform(gen, 0.5, 1.0);
}

}  // namespace kvtrie
