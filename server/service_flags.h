// server/service_flags.h
//
// The serving flags of kvtrie-server and the options they fill: ServiceOptions
// (server/service_options.h: requests, the default encoding, Put stream admission) and
// GuardedServiceOptions (server/guarded_service.h: handler threads, Get deadlines, the folder
// rule), plus gRPC's transport cap on a received message. The flags are defined in
// service_flags.cc, beside the binding.
//
// Byte limits, each enforced in one layer:
//   --max_inflight_put_bytes, --max_inflight_put_bytes_per_namespace
//       PutLimits (server/put_limits.h) alone: a Put waits for room at its header, then is
//       refused naming the flag; the store's own copy of the total is left open
//       (server/store_flags.h);
//   --max_put_bytes
//       the store alone (PutSession); PutLimits only caps a Put's reservation at it;
//   --max_tokens -> max_message_bytes
//       one request message: Put's by PutCall, the others' by GuardedService (each message is
//       checked once); gRPC reads up to grpc_receive_cap so that kvtrie names the error;
//   --max_get_message_bytes
//       the size of Get's messages (GetCall).
#ifndef KVTRIE_SERVER_SERVICE_FLAGS_H_
#define KVTRIE_SERVER_SERVICE_FLAGS_H_

#include "absl/status/statusor.h"
#include "server/guarded_service.h"
#include "server/service_options.h"
#include "trie/store_types.h"

namespace kvtrie {

struct ServingOptions {
  ServiceOptions service;
  GuardedServiceOptions guarded;
  // grpc::ServerBuilder::SetMaxReceiveMessageSize: at least 64 MiB and 4 x max_message_bytes.
  int grpc_receive_cap = 0;
};

// The options of the current flag values, given the store's (`store`: its codec threads, its
// --max_put_bytes as the reservation cap, its --disk_bytes for the folder rule). Errors:
// INVALID_ARGUMENT naming the flag (--default_encoding unknown, --max_put_stream_share_per_peer
// not in (0, 1]).
absl::StatusOr<ServingOptions> ServingOptionsFromFlags(const StoreOptions& store);

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_SERVICE_FLAGS_H_
