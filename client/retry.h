// client/retry.h
//
// When and how long the client waits before it sends a failed call again: bounded attempts and a
// jittered exponential backoff (ClientOptions::retry). Only what is safe to send again is
// retried (RetryablePutCode, RetryableReadCode).
// Thread-safe: the functions hold no state but a thread-local random generator.
#ifndef KVTRIE_CLIENT_RETRY_H_
#define KVTRIE_CLIENT_RETRY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvtrie {

struct RetryPolicy {
  // Attempts of one call, the first included: 1 = never retry.
  int max_attempts = 5;
  // The wait before attempt n+1 is drawn uniformly from [d/2, d], d = min(max_backoff,
  // initial_backoff * multiplier^(n-1)): 50-100 ms, 100-200 ms, 200-400 ms, 400-800 ms by default.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  double multiplier = 2.0;
  // A PutStream (Client::OpenPut) keeps a copy of the blocks it sent so that it can send them
  // again; past this many bytes it drops the copy and an ABORTED or UNAVAILABLE Put reaches the
  // caller (who still holds the KV). 0 = a PutStream never retries. Client::Put needs no copy.
  size_t max_put_stream_replay_bytes = size_t{256} << 20;
};

// Checks the policy. Errors: INVALID_ARGUMENT naming the field (`retry.max_attempts` < 1, a
// negative backoff, max_backoff < initial_backoff, multiplier < 1).
absl::Status ValidateRetryPolicy(const RetryPolicy& policy);

// A Put may be sent again, whole, after these codes: ABORTED (the server stored nothing: a Put
// is all or nothing) and UNAVAILABLE (the server was not reached, or the connection broke; a
// second Put of a stored prefix only deduplicates, so it stores the same data at most once).
bool RetryablePutCode(absl::StatusCode code);

// A call that changes nothing (Lookup, Stats, Inspect, GetPredictor) may be sent again after
// UNAVAILABLE.
bool RetryableReadCode(absl::StatusCode code);

// The wait before attempt `attempt` + 1 (attempt >= 1 is the one that failed), jittered.
absl::Duration RetryBackoff(const RetryPolicy& policy, int attempt);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_RETRY_H_
