// server/get_sink.h
//
// Where a Get's response messages (kvtrie.v1.GetResponse) go. A block's bytes (GetBlock.kv or
// GetBlock.encoded) are handed over as a view plus an `owner` that keeps them alive, so the
// zero-copy sink can put the stored payload (or a decoded buffer) on the wire without copying it.
//
//   MessageGetSink    builds each GetResponse (copies the bytes): for a writer of the generated
//                     sync API (ServerWriterInterface<GetResponse>).
//   ByteBufferGetSink frames each GetResponse by hand into a grpc::ByteBuffer whose last slice
//                     is the bytes themselves (referenced, not copied; `owner` is released when
//                     gRPC drops the slice). The wire bytes are a valid serialized GetResponse:
//                     the block's other fields first, then field 5 (kv) or 6 (encoded), which
//                     protobuf parsers accept in any order.
// Not thread-safe: one writer per call.
#ifndef KVTRIE_SERVER_GET_SINK_H_
#define KVTRIE_SERVER_GET_SINK_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>

#include <memory>

#include "absl/strings/string_view.h"
#include "kvtrie/v1/kvtrie.pb.h"

namespace kvtrie {

class GetSink {
 public:
  virtual ~GetSink() = default;
  // Each returns false when the client is gone.
  virtual bool WriteHeader(const v1::GetResponse& header) = 0;
  // A GetResponse whose block is `block` (its kv and encoded empty) with `bytes` as its kv, or as
  // its encoded when `encoded`. `owner` keeps `bytes` alive and unchanged (may be null when the
  // sink copies, i.e. MessageGetSink).
  virtual bool WriteBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                          std::shared_ptr<const void> owner) = 0;
};

class MessageGetSink final : public GetSink {
 public:
  explicit MessageGetSink(grpc::internal::WriterInterface<v1::GetResponse>* writer)
      : writer_(writer) {}
  bool WriteHeader(const v1::GetResponse& header) override { return writer_->Write(header); }
  bool WriteBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                  std::shared_ptr<const void> owner) override;

 private:
  grpc::internal::WriterInterface<v1::GetResponse>* const writer_;
  v1::GetResponse msg_;
};

class ByteBufferGetSink final : public GetSink {
 public:
  explicit ByteBufferGetSink(grpc::internal::WriterInterface<grpc::ByteBuffer>* writer)
      : writer_(writer) {}
  bool WriteHeader(const v1::GetResponse& header) override;
  bool WriteBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                  std::shared_ptr<const void> owner) override;

 private:
  grpc::internal::WriterInterface<grpc::ByteBuffer>* const writer_;
};

// The serialized GetResponse of WriteBlock, as ByteBufferGetSink sends it.
grpc::ByteBuffer FrameGetBlock(const v1::GetBlock& block, bool encoded, absl::string_view bytes,
                               std::shared_ptr<const void> owner);

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_GET_SINK_H_
