// client/packed_tokens.h
//
// Token ids on the wire as LookupRequest/GetRequest.token_ids_packed: little-endian uint32s,
// 4 bytes each (proto/kvtrie/v1/kvtrie.proto).
#ifndef KVTRIE_CLIENT_PACKED_TOKENS_H_
#define KVTRIE_CLIENT_PACKED_TOKENS_H_

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <string>

#include "absl/types/span.h"
#include "google/protobuf/message_lite.h"

namespace kvtrie {

// `token_ids` packed into `out` (resized to 4 bytes per id), on any byte order.
void PackTokens(absl::Span<const uint32_t> token_ids, std::string* out);

// One serialized gRPC message: `rest` (a request without its packed-ids field) serialized into
// `head`, then bytes field number `field` holding `token_ids` packed. The ids are not copied:
// the buffer's second slice points at token_ids' memory, and `head` backs the first, so both
// must outlive every use of the buffer (a synchronous RPC that sends it). Field order on the
// wire does not matter to a protobuf parser. REQUIRES: a little-endian host.
grpc::ByteBuffer WithPackedTokens(const google::protobuf::MessageLite& rest, uint32_t field,
                                  absl::Span<const uint32_t> token_ids, std::string* head);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_PACKED_TOKENS_H_
