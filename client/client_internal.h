// client/client_internal.h
//
// Private to kvtrie::Client's sources (client.cc: connection, health, Lookup and the small
// calls; client_put.cc: Put, its encoding and OpenPut; client_get.cc: Get and GetPredictor):
// the helpers they share. Not part of the client's API.
#ifndef KVTRIE_CLIENT_CLIENT_INTERNAL_H_
#define KVTRIE_CLIENT_CLIENT_INTERNAL_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/retry.h"
#include "client/status_reason.h"

namespace kvtrie {
namespace client_internal {

// A gRPC status as the client's absl::Status (its machine-readable reason kept).
inline absl::Status FromGrpc(const grpc::Status& s) { return FromGrpcStatus(s); }

// proto3 `string` fields must be UTF-8: a server cannot parse a message with invalid UTF-8 and
// answers only INTERNAL (unary) or sees the stream end (Put). Checked here to name the field.
absl::Status CheckUtf8(absl::string_view field, absl::string_view s);

// CheckUtf8 of the namespace and the model id.
absl::Status CheckNames(absl::string_view ns, absl::string_view model_id);

}  // namespace client_internal

// Calls `call` again while it fails with a code a read may retry, after the policy's backoff.
template <typename Call>
absl::Status Client::RetryRead(Call&& call) {
  for (int attempt = 1;; ++attempt) {
    absl::Status s = call();
    if (s.ok() || !RetryableReadCode(s.code()) || attempt >= options_.retry.max_attempts) return s;
    absl::SleepFor(RetryBackoff(options_.retry, attempt));
  }
}

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_CLIENT_INTERNAL_H_
