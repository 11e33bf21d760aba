// client/put_stream.h
//
// kvtrie::PutStream — one Put (kvtrie.v1 KVCache.Put) whose KV is sent piece by piece, so an
// inference worker can store a sequence layer by layer while it computes the next layer
// (PutBlock carries a layer range of a block). Opened by Client::OpenPut, which sends the
// PutHeader; then WriteLayers for any layer ranges in any order (every layer of every sent block
// exactly once, as the server requires), then Commit. A stream destroyed or cancelled before
// Commit stores nothing (the server drops a Put without its PutCommit).
//
// KV crosses this API in the sequence layout of codec/kv_dump.h, restricted to a layer range
// and a token span: K and V each [layer_end - layer_begin][num_kv_heads][span_tokens][head_dim]
// in the model's dtype, holding tokens [token_offset, token_offset + span_tokens) of the header's
// sequence. Every full block of the header inside the span, from the PutOptions' first_block on,
// is sent; a tail shorter than a block is not.
//
// Errors: WriteLayers returns INVALID_ARGUMENT naming the argument (`layer_begin`,
// `token_offset`, `k`, `v`) when it does not fit the header, without ending the stream; once
// the server has ended the stream (it rejected a message) every later call returns the server's
// status (INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED, ...). Commit returns the
// server's PutResponse or error.
//
// Retries (ClientOptions::retry): the stream keeps a copy of every message it sent (up to
// RetryPolicy::max_put_stream_replay_bytes), and when the server ends the Put ABORTED (it stored
// nothing: the prefix kept changing under concurrent Puts) or UNAVAILABLE, it opens a new Put,
// sends the header and every block again and, at Commit, commits again — after a jittered
// backoff, up to max_attempts Puts in all. The caller sees ABORTED only when every attempt was,
// or when the copy outgrew its bound (then the caller, who holds the KV, may Put again).
// Not thread-safe: one thread at a time (a worker's save thread).
#ifndef KVTRIE_CLIENT_PUT_STREAM_H_
#define KVTRIE_CLIENT_PUT_STREAM_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/call_registry.h"
#include "codec/block_geometry.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"

namespace kvtrie {

class Client;

class PutStream {
 public:
  PutStream(const PutStream&) = delete;
  PutStream& operator=(const PutStream&) = delete;
  ~PutStream();  // cancels an uncommitted stream

  // The header's geometry (block_tokens included) and token count.
  const BlockGeometry& geometry() const { return g_; }
  size_t num_tokens() const { return num_tokens_; }

  // Sends layers [layer_begin, layer_end) of every full block in tokens
  // [token_offset, token_offset + span_tokens); `k` and `v` as in the file comment.
  // REQUIRES: token_offset % block_tokens == 0 (else INVALID_ARGUMENT `token_offset`).
  absl::Status WriteLayers(uint32_t layer_begin, uint32_t layer_end, size_t token_offset,
                           size_t span_tokens, absl::Span<const uint8_t> k,
                           absl::Span<const uint8_t> v);

  // Sends the PutCommit and waits for the server's answer. The stream is finished afterwards.
  absl::StatusOr<v1::PutResponse> Commit();

  // Ends the stream without committing (nothing is stored). Idempotent.
  void Cancel();

 private:
  friend class Client;
  // REQUIRES: `client` outlives the stream.
  PutStream(Client* client, std::vector<v1::PutRequest> header, const BlockGeometry& g,
            uint32_t first_block, uint32_t layers_per_message);
  // Opens a Put and sends the header and the kept messages. Returns false if a write failed.
  bool Open();
  // Sends `req` and keeps a copy of it while the copies stay within the bound.
  bool Send(const v1::PutRequest& req);
  // Finishes the stream after a failed Write (or Commit) and returns the server's status; then,
  // while that is ABORTED or UNAVAILABLE, the copy is whole and attempts remain, waits and opens
  // the Put again. OK once a new Put has been sent everything again; else the status is sticky.
  absl::Status Broken();
  // Whether a failed Put with status `s` is sent again.
  bool ShouldRetry(const absl::Status& s) const;

  Client* const client_;
  const std::vector<v1::PutRequest> header_;
  ContextPtr ctx_;
  v1::PutResponse resp_;
  std::unique_ptr<grpc::ClientWriter<v1::PutRequest>> writer_;
  const BlockGeometry g_;
  const size_t num_tokens_;
  const uint32_t first_block_;
  const uint32_t layers_per_message_;
  v1::PutRequest req_;                // reused message
  std::vector<uint8_t> block_;        // one gathered block (layer range)
  std::vector<v1::PutRequest> sent_;  // the PutBlock messages sent, while replayable_
  size_t sent_bytes_ = 0;
  bool replayable_ = true;  // sent_ holds every block message sent
  int attempt_ = 1;         // Puts opened so far
  absl::Status status_;     // sticky: the server's status once the stream broke
  bool finished_ = false;
};

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_PUT_STREAM_H_
