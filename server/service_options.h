// server/service_options.h
//
// ServiceOptions: what the kvtrie.v1.KVCache service (server/kvcache_service.h) and its Put
// calls (server/put_call.h) are configured with. A header of its own so that the parts below
// the service (PutCall) can read them without including the service. kvtrie-server fills it
// from its flags (server/service_flags.h); the byte limits of Put streams are enforced by
// PutLimits (server/put_limits.h), a Put's own size by the store (StoreOptions::max_put_bytes).
#ifndef KVTRIE_SERVER_SERVICE_OPTIONS_H_
#define KVTRIE_SERVER_SERVICE_OPTIONS_H_

#include <cstdint>

#include "server/put_limits.h"
#include "trie/store_types.h"

namespace kvtrie {

struct ServiceOptions {
  uint32_t max_tokens = 1u << 20;             // token ids one request may carry
  uint64_t max_get_message_bytes = 1u << 20;  // a GetBlock is split by layers above this
  EncodeOptions default_encoding;             // for ENCODING_UNSPECIFIED
  PutLimitOptions put_limits;                 // streams, per-namespace bytes, idle deadline
  int codec_threads = 1;  // threads that decode a Get's blocks (the handler's own included)
  // Most bytes of one request message (0 = none): a larger Put message is refused naming what to
  // send instead (PutTokens, layer ranges). kvtrie-server lets gRPC read messages up to a larger
  // transport cap so that this names the error (server/service_flags.h).
  uint64_t max_message_bytes = 0;
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_SERVICE_OPTIONS_H_
