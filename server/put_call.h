// server/put_call.h
//
// PutCall: the server side of one Put stream (kvtrie.v1.KVCache.Put), one message at a time, so
// the synchronous handler (KvCacheService::PutStream) and the callback reactor
// (server/guarded_service.h) share one implementation of its validation and storing. Every
// error names the offending field (see proto/kvtrie/v1/kvtrie.proto).
//
// The caller drives it as a state machine: each call returns what to do next:
//   kRead     read the next PutRequest and pass it to OnMessage (or call OnEnd when the stream
//             ended: the client half-closed or cancelled, or a message did not parse); the idle
//             deadline runs from here until the message arrives (stream()->Touch(), which
//             OnMessage calls; a reactor calls it as soon as the read completes);
//   kReserve  reserve reserve_bytes() on stream() (PutLimits::Stream::ReserveWhole, or
//             ReserveWholeAsync so no thread waits) and pass the outcome to OnReserved;
//   kDone     the call is over: status() and, when it is OK, response().
// Admission (Start) takes a slot of PutLimits and arms the idle deadline, which cancels the
// call through context->TryCancel(). Blocks go to a PutSession (trie/put_session.h), which
// encodes them on the codec pool as they arrive; OnMessage may block briefly there (the
// session's backpressure), and OnEnd after a commit encodes the compact-profile blocks and
// commits (seconds for a large Put), so a reactor runs these off gRPC's callback threads.
// Everything the call holds (slot, reserved bytes, buffered blocks) is released when it is
// destroyed, or when it fails.
//
// Not thread-safe: one driver. `store`, `limits` and `context` must outlive it.
#ifndef KVTRIE_SERVER_PUT_CALL_H_
#define KVTRIE_SERVER_PUT_CALL_H_

#include <grpcpp/server_context.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvtrie/v1/kvtrie.pb.h"
#include "server/put_limits.h"
#include "server/service_options.h"
#include "trie/kv_store.h"

namespace kvtrie {

class PutCall {
 public:
  enum class Next { kRead, kReserve, kDone };

  PutCall(KvStore* store, const ServiceOptions& options, PutLimits* limits,
          grpc::ServerContextBase* context);
  ~PutCall();
  PutCall(const PutCall&) = delete;
  PutCall& operator=(const PutCall&) = delete;

  // Admits the stream of `peer` (PutLimits::Admit: RESOURCE_EXHAUSTED past
  // --max_concurrent_put_streams or the peer's share of them): kRead or kDone.
  Next Start(const std::string& peer = "");
  // The next message of the stream (its block's bytes may be moved out).
  Next OnMessage(v1::PutRequest* request);
  // The stream ended without another message.
  Next OnEnd();
  // After kReserve: what to reserve, on which stream; then OnReserved with the outcome.
  uint64_t reserve_bytes() const { return reserve_bytes_; }
  PutLimits::Stream* stream() const { return stream_.get(); }
  Next OnReserved(const absl::Status& reserved);

  // After kDone.
  const grpc::Status& status() const { return status_; }
  v1::PutResponse* response() { return &response_; }

 private:
  enum class Phase { kStart, kHeader, kTokens, kBlocks, kDone };

  Next Fail(grpc::Status status);
  Next Read();  // kRead, the idle deadline armed (PutLimits::Stream::AwaitClient)
  // RESOURCE_EXHAUSTED naming the message and what to send instead when `request` is larger
  // than ServiceOptions::max_message_bytes.
  grpc::Status CheckSize(const v1::PutRequest& request) const;
  Next Header(v1::PutRequest* request);
  Next Tokens(v1::PutRequest* request);
  Next Block(v1::PutRequest* request);
  Next EncodedBlock(v1::PutBlock* block);  // PutBlock.encoded: a whole client-encoded block
  Next EndOfBlocks();
  grpc::Status CutShort() const;
  uint64_t WholeBytes() const;  // the dense bytes of the header's full blocks

  KvStore* const store_;
  const ServiceOptions& options_;
  PutLimits* const limits_;
  grpc::ServerContextBase* const context_;
  std::unique_ptr<PutLimits::Stream> stream_;
  Phase phase_ = Phase::kStart;
  // From the header.
  std::string ns_;
  ModelInfo model_;
  EncodeOptions encode_;
  std::vector<uint32_t> token_ids_;
  std::vector<float> surprisal_;
  // The first message after the header's tokens (or the end), held while the bytes are reserved.
  std::optional<v1::PutRequest> pending_;
  uint64_t reserve_bytes_ = 0;
  std::unique_ptr<PutSession> session_;
  // Read() also returns false when the client cancels, and IsCancelled() may not know yet: only
  // an explicit PutCommit tells a complete stream from a cut one.
  bool committed_ = false;
  grpc::Status status_;
  v1::PutResponse response_;
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_PUT_CALL_H_
