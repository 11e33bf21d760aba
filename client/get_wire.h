// client/get_wire.h
//
// Reads a Get stream's responses (kvtrie.v1.GetResponse) as the raw grpc::ByteBuffers gRPC
// received, so a block's `kv` bytes are never copied into a protobuf string: ParseGetResponse
// parses the framing (protobuf wire format: any field order, unknown fields skipped, the last of
// a repeated bytes field wins) and returns `kv` as views of the buffer's slices, which the client
// scatters straight into the sequence layout (codec/kv_layout.h ScatterLayerPieces). Every other
// field, `encoded` included, is parsed into the message.
#ifndef KVTRIE_CLIENT_GET_WIRE_H_
#define KVTRIE_CLIENT_GET_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <vector>

#include "absl/types/span.h"
#include "kvtrie/v1/kvtrie.pb.h"

namespace kvtrie {

// Parses `slices` (one serialized GetResponse) into `msg` (cleared first), leaving
// msg->block().kv() empty and `kv` the block's kv bytes in order, as views into `slices`.
// Returns false if the bytes are not a valid GetResponse.
bool ParseGetResponse(const std::vector<grpc::Slice>& slices, v1::GetResponse* msg,
                      std::vector<absl::Span<const uint8_t>>* kv);

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_GET_WIRE_H_
