// server/kvcache_service.h
//
// The kvtrie.v1.KVCache gRPC service: request validation and the mapping between the public
// proto and the store (trie/kv_store.h). Every error names the offending field; see
// proto/kvtrie/v1/kvtrie.proto for the contract of each call.
//
// Uses gRPC's synchronous API: each call runs on a thread of gRPC's pool. Thread-safe.
// A Get RECONSTRUCTED sends raw blocks from their stored payloads and decodes the others on a
// pool of `codec_threads`, the next window of blocks while the current one is written.
// Put streams are admitted by PutLimits (server/put_limits.h): a bounded number at once, a
// per-namespace budget of buffered bytes, an idle deadline. A Get whose block's centroid is
// deleted concurrently reads that block again (at most 3 times) before it answers ABORTED.
#ifndef KVTRIE_SERVER_KVCACHE_SERVICE_H_
#define KVTRIE_SERVER_KVCACHE_SERVICE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "codec/thread_pool.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"
#include "server/get_sink.h"
#include "server/put_limits.h"
#include "trie/kv_store.h"

namespace kvtrie {

struct ServiceOptions {
  uint32_t max_tokens = 1u << 20;             // token ids one request may carry
  uint64_t max_get_message_bytes = 1u << 20;  // a GetBlock is split by layers above this
  EncodeOptions default_encoding;             // for ENCODING_UNSPECIFIED
  PutLimitOptions put_limits;                 // streams, per-namespace bytes, idle deadline
  int codec_threads = 1;  // threads that decode a Get's blocks (the handler's own included)
};

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

 private:
  struct GetSlot;
  // Reads block `b`'s payload into `slot`; a raw block is then ready to send, a fast-profile one
  // marked independent (decodable without its parent).
  grpc::Status PrepareGetSlot(const v1::GetRequest& request, const BlockRead& b,
                              const BlockGeometry& g, GetSlot* slot);
  // Decodes an independent block into a fresh buffer; on failure leaves it for DecodeOnChain.
  static void DecodeGetSlot(const BlockGeometry& g, GetSlot* slot);
  // Decodes block `i` as the next of `chain` through the store (which reports and drops a
  // corrupt block), retrying when its centroid was deleted meanwhile.
  grpc::Status DecodeOnChain(const v1::GetRequest& request, absl::Span<const uint32_t> tokens,
                             size_t i, GetResult* got, DecodeChain* chain, GetSlot* slot);

  KvStore* const store_;
  const ServiceOptions options_;
  PutLimits put_limits_;
  const std::unique_ptr<ThreadPool> codec_pool_;  // Get's decodes
};

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_KVCACHE_SERVICE_H_
