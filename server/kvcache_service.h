// server/kvcache_service.h
//
// The kvtrie.v1.KVCache gRPC service: request validation and the mapping between the public
// proto and the store (trie/kv_store.h). Every error names the offending field; see
// proto/kvtrie/v1/kvtrie.proto for the contract of each call.
//
// As a grpc::Service it uses gRPC's synchronous API (each call on a thread of gRPC's pool: the
// fuzzer serves it so); kvtrie-server serves it through GuardedService's callback reactors
// (server/guarded_service.h), which drive the same code one message at a time: NewPut
// (server/put_call.h) and NewGet (GetCall below). Thread-safe.
// A Get reads through the store's one read path (KvStore::NewReader, trie/block_reader.h), which
// reads each payload once and decodes a RECONSTRUCTED Get's blocks on the service's pool of
// `codec_threads`, the next window of blocks while the current one is written; the service only
// frames the blocks it yields into messages.
// Put streams are admitted by PutLimits (server/put_limits.h): a bounded number at once, a
// per-namespace budget of buffered bytes, an idle deadline. A Get whose block's centroid is
// deleted concurrently reads that block again (at most 3 times) before it answers ABORTED.
#ifndef KVTRIE_SERVER_KVCACHE_SERVICE_H_
#define KVTRIE_SERVER_KVCACHE_SERVICE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "codec/decode_chain.h"
#include "codec/thread_pool.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "server/get_sink.h"
#include "server/put_call.h"
#include "server/put_limits.h"
#include "server/service_options.h"
#include "trie/kv_store.h"

namespace kvtrie {

class KvCacheService final : public v1::KVCache::Service {
 public:
  // `store` must outlive the service.
  KvCacheService(KvStore* store, const ServiceOptions& options);
  ~KvCacheService() override;
  KvCacheService(const KvCacheService&) = delete;
  KvCacheService& operator=(const KvCacheService&) = delete;

  grpc::Status Lookup(grpc::ServerContext* context, const v1::LookupRequest* request,
                      v1::LookupResponse* response) override;
  grpc::Status Put(grpc::ServerContext* context, grpc::ServerReader<v1::PutRequest>* reader,
                   v1::PutResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::GetRequest* request,
                   grpc::ServerWriter<v1::GetResponse>* writer) override;
  grpc::Status Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                     v1::StatsResponse* response) override;
  grpc::Status Inspect(grpc::ServerContext* context, const v1::InspectRequest* request,
                       v1::InspectResponse* response) override;
  grpc::Status Delete(grpc::ServerContext* context, const v1::DeleteRequest* request,
                      v1::DeleteResponse* response) override;
  grpc::Status Pin(grpc::ServerContext* context, const v1::PinRequest* request,
                   v1::PinResponse* response) override;
  grpc::Status GetPredictor(grpc::ServerContext* context, const v1::GetPredictorRequest* request,
                            grpc::ServerWriter<v1::PredictorChunk>* writer) override;

  // Stats of namespace `ns`; "" is the whole server when `whole_server_if_empty` (an admin's
  // Stats{}), else the default namespace alone (a tenant's whose namespace is "").
  grpc::Status StatsIn(const std::string& ns, bool whole_server_if_empty,
                       v1::StatsResponse* response);
  // Lookup of `request` in namespace `ns` (the request's own namespace field is not read).
  grpc::Status LookupIn(const std::string& ns, const v1::LookupRequest& request,
                        v1::LookupResponse* response);
  // The token ids a request carries (token_ids or token_ids_packed).
  static uint32_t TokenCount(const v1::LookupRequest& request);
  static uint32_t TokenCount(const v1::GetRequest& request);

  // Put and Get over the stream interfaces, so a wrapper (server/guarded_service.h) can rewrite
  // or observe the messages.
  grpc::Status PutStream(grpc::ServerContext* context,
                         grpc::ServerReaderInterface<v1::PutRequest>* reader,
                         v1::PutResponse* response);
  // Get's messages go to `sink` (server/get_sink.h): the zero-copy one puts the stored payloads
  // and decoded buffers on the wire without copying them.
  grpc::Status GetStream(grpc::ServerContext* context, const v1::GetRequest* request,
                         GetSink* sink);
  grpc::Status GetPredictorStream(grpc::ServerContext* context,
                                  const v1::GetPredictorRequest* request,
                                  grpc::ServerWriterInterface<v1::PredictorChunk>* writer);
  // GetPredictor's state, checked (errors name the field) and read whole, then sent in chunks:
  // chunk k of `state` (0 <= k < PredictorChunks(state)).
  grpc::Status ReadPredictor(const v1::GetPredictorRequest& request, std::string* state);
  size_t PredictorChunks(const std::string& state) const;
  void PredictorChunkAt(const v1::GetPredictorRequest& request, const std::string& state,
                        uint32_t crc, size_t k, v1::PredictorChunk* chunk) const;

  // One Put stream, driven one message at a time (server/put_call.h). `context` is cancelled
  // by the idle deadline and must outlive the call.
  std::unique_ptr<PutCall> NewPut(grpc::ServerContextBase* context);
  // One Get, its response messages made one at a time (see GetCall).
  class GetCall;
  std::unique_ptr<GetCall> NewGet(grpc::ServerContextBase* context, v1::GetRequest request);

 private:
  KvStore* const store_;
  const ServiceOptions options_;
  PutLimits put_limits_;
  // Decodes the blocks of Gets RECONSTRUCTED, handed to each Get's store reader
  // (KvStore::NewReader): shared by every Get, --codec_threads threads (the handler's included).
  const std::unique_ptr<ThreadPool> codec_pool_;
};

// One Get: Start checks the request (errors name the field), opens the store's reader of its
// prefix (KvStore::NewReader) and makes the header message; each Next makes the following
// message (a block, or a layer range of one) from the block the reader yields, which the caller
// puts on the wire before asking for the next, until `end`. The reader of a RECONSTRUCTED Get
// decodes the window of blocks after the one being sent on the service's codec pool, so block
// i + 1 is made while block i is on the wire; Next may block while the reader decodes a block on
// the chain (compact profile, centroids) or waits for that window. Not thread-safe: one caller.
// The service and `context` must outlive it; the destructor waits for a window being decoded.
class KvCacheService::GetCall {
 public:
  // A GetResponse after the header: `block` (kv and encoded empty) with `bytes` as its kv, or
  // as its encoded when `encoded`; `owner` keeps `bytes` alive (see server/get_sink.h).
  struct Message {
    v1::GetBlock block;
    bool encoded = false;
    absl::string_view bytes;
    std::shared_ptr<const void> owner;
  };

  GetCall(KvCacheService* service, grpc::ServerContextBase* context, v1::GetRequest request);
  ~GetCall();
  GetCall(const GetCall&) = delete;
  GetCall& operator=(const GetCall&) = delete;

  const v1::GetRequest& request() const { return request_; }
  grpc::Status Start(v1::GetResponse* header);
  // The next message into `out`, or `end` (OK) after the last. CANCELLED when the client went.
  grpc::Status Next(Message* out, bool* end);

 private:
  v1::GetBlock MetaOf(size_t i) const;

  KvCacheService* const service_;
  grpc::ServerContextBase* const context_;
  const v1::GetRequest request_;
  std::vector<uint32_t> scratch_;
  absl::Span<const uint32_t> tokens_;
  bool residual_ = false;
  // RECONSTRUCTED: the layers [layer_begin_, layer_end_) of each block are sent (the request's
  // range; all layers by default).
  uint32_t layer_begin_ = 0;
  uint32_t layer_end_ = 0;
  uint32_t layers_per_message_ = 1;
  std::unique_ptr<BlockReader> reader_;
  // RECONSTRUCTED: the block being sent, while `sending_` (layer layer_ next).
  bool sending_ = false;
  BlockReader::Block block_;
  uint32_t layer_ = 0;
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_KVCACHE_SERVICE_H_
