// client/client.h
//
// kvtrie::Client — the C++ client of a kvtrie server (kvtrie.v1.KVCache over gRPC).
//
// KV crosses this API in the *sequence layout* of codec/kv_dump.h: K and V each
// [num_layers][num_kv_heads][num_tokens][head_dim] in the model's dtype. The client cuts it into
// blocks of block_tokens tokens for Put and reassembles blocks from Get, so callers never see the
// block layout. Only full blocks are stored; a tail of num_tokens % block_tokens is not.
//
// Errors: the server's gRPC status converted to absl::Status with the same code and message
// (INVALID_ARGUMENT naming the field, NOT_FOUND, DATA_LOSS, UNAVAILABLE when the server is down),
// after the retries of ClientOptions::retry (an ABORTED Put is sent again, so a caller sees
// ABORTED only when every attempt was).
// Thread-safe: one Client may be used from many threads.
#ifndef KVTRIE_CLIENT_CLIENT_H_
#define KVTRIE_CLIENT_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/call_registry.h"
#include "client/put_stream.h"
#include "client/retry.h"
#include "codec/kv_dump.h"
#include "codec/predictor_state.h"
#include "codec/thread_pool.h"
#include "kvtrie/v1/kvtrie.grpc.pb.h"

namespace kvtrie {

struct ClientOptions {
  std::string target = "127.0.0.1:50051";      // HOST:PORT
  std::string ns;                              // namespace of every call
  absl::Duration timeout = absl::Seconds(60);  // per call
  // TLS: set `tls` (LoadTlsFiles does, from PEM files). An empty root CA means the system's;
  // a client certificate and key are for mutual TLS.
  bool tls = false;
  std::string tls_root_pem = {};
  std::string tls_cert_pem = {};
  std::string tls_key_pem = {};
  std::string tls_server_name = {};  // overrides the name checked in the server's certificate
  // Sent as `authorization: Bearer <token>` on every call (servers run with --tokens_file).
  std::string token = {};
  // Threads that decode the blocks of a Get RESIDUAL and encode those of a Put
  // (PutOptions::encode_on_client; the caller's included): fast-profile blocks, with or without a
  // learned state, are coded in parallel, a window of 4 per thread at a time. 0 = the machine's
  // cores (the default); 1 = on the calling thread only. CLI and worker: --codec_threads; Python:
  // Client(codec_threads=).
  int codec_threads = 0;
  // How long an encoding Put uses the latest learned predictor state version it found (Inspect)
  // before asking again; a version the server has since freed is noticed sooner (the Put answers
  // FAILED_PRECONDITION with the reason STALE_PREDICTOR_VERSION, client/status_reason.h, and is
  // encoded again against the new latest).
  // 0 = ask before every RESIDUAL Put. CLI and worker: --predictor_refresh_seconds; Python:
  // Client(predictor_refresh=seconds).
  absl::Duration predictor_refresh = absl::Seconds(10);
  // Lookup and Get send token ids as LookupRequest/GetRequest.token_ids_packed (4 bytes each,
  // parsed without varint decoding); false: as varint token_ids, for servers older than the field.
  bool packed_token_ids = true;
  // Put and PutStream send a Put again (whole) when it ends ABORTED (the server stored nothing:
  // its prefix kept changing under concurrent Puts) or UNAVAILABLE; Lookup, Stats, Inspect and
  // GetPredictor are sent again after UNAVAILABLE, and Get after UNAVAILABLE or ABORTED (a
  // centroid or learned state a RESIDUAL block names was deleted after the Get listed it: the new
  // Get reads the block re-encoded). Each attempt has its own `timeout`. The caller sees the last
  // attempt's status. Delete and Pin are never retried. The channel re-resolves and reconnects
  // at this policy's pace (gRPC's own: DNS at most every 30 s, reconnects up to 120 s apart).
  RetryPolicy retry = {};
};

// Reads PEM files into `options` and turns TLS on when any is given (`ca` alone: TLS with that
// CA; `cert` and `key`: the client's certificate for mutual TLS). Empty paths are skipped.
// Errors: INVALID_ARGUMENT naming the flag (--tls_ca, --tls_cert, --tls_key) of a file that cannot
// be read, or a certificate without its key.
absl::Status LoadTlsFiles(const std::string& ca, const std::string& cert, const std::string& key,
                          ClientOptions* options);

struct PutOptions {
  // ENCODING_UNSPECIFIED: the server's --default_encoding. The client learns which one it is from
  // the response of its first such Put (sent dense) and encodes the later ones itself when it can
  // (see encode_on_client), for a minute; then one Put goes dense again to learn it anew.
  v1::Encoding encoding = v1::ENCODING_UNSPECIFIED;
  double target_rel_rms = 0;  // lossy encodings; 0 = server default
  uint32_t bits = 0;          // baselines with a bit width; 0 = default
  uint32_t block_tokens = 16;
  // Blocks [0, first_block) are not sent (e.g. Lookup said they are stored); the server
  // acknowledges them as deduplicated if stored, and rejects the Put if they are not.
  uint32_t first_block = 0;
  // Layers per PutBlock message (0 = the whole block in one message).
  uint32_t layers_per_message = 0;
  // RESIDUAL / LOSSLESS coder (kvtrie.v1.EncodingSpec.Profile). PROFILE_UNSPECIFIED is FAST (the
  // client encodes it; sent dense, the server's --default_profile, fast unless configured).
  // PROFILE_COMPACT (~15 % fewer bits, ~10x slower) is encoded by the server only.
  v1::EncodingSpec::Profile profile = v1::EncodingSpec::PROFILE_UNSPECIFIED;
  // Put only (the normal path): encode every block here, on ClientOptions::codec_threads, and
  // send it as PutBlock.encoded; the server checks it and stores it as it is (the bytes a dense
  // Put of it would store against the same state), so wire, disk and server CPU scale with the
  // encoded bytes. Done whenever the client can code the request: RAW, or LOSSLESS / RESIDUAL of
  // the fast profile (PROFILE_FAST or unset), RESIDUAL with target_rel_rms > 0 (the server's
  // default target is not known here), ENCODING_UNSPECIFIED once the client has learned the
  // server's default (above), and layers_per_message = 0. Any other Put (compact profile,
  // baselines, a layered Put, OpenPut's PutStream) is sent dense, as is every Put with false
  // (thin clients: the CLI's --dense_puts, Python's encode_on_client=False). RESIDUAL is coded
  // against the model's latest learned predictor state (Inspect, at most every
  // ClientOptions::predictor_refresh, then GetPredictor, cached); when the server answers
  // FAILED_PRECONDITION with the reason STALE_PREDICTOR_VERSION (client/status_reason.h: the state
  // was freed), the client asks for the
  // latest again, encodes the Put against it and sends it once more: the caller sees no error.
  bool encode_on_client = true;
  // LOSSLESS of PROFILE_FAST: also code each block against the latest learned state, kept when
  // smaller (EncodingSpec.learned_lossless: ~1.56x vs 1.12x on held-out fp16 text, but ~0.1-0.3
  // GB/s per core to encode instead of ~2; bench/lossless.md). Here when encode_on_client, else
  // asked of the server. CLI and worker: --learned_lossless; Python: put(...,
  // learned_lossless=True).
  bool learned_lossless = false;
};

struct GetOptions {
  v1::GetMode mode = v1::GET_MODE_RECONSTRUCTED;  // RESIDUAL: the client decodes (client → codec)
  uint32_t max_blocks = 0;                        // 0 = all matched blocks
  // RECONSTRUCTED only: fetch layers [layer_begin, layer_end) of each block (0/0 = all; layer_end
  // 0 = num_layers). The result's num_layers is then layer_end - layer_begin and its k / v hold
  // only those layers (layer_begin first). Errors: the server's INVALID_ARGUMENT naming
  // layer_begin (a range in RESIDUAL mode, an empty range) or layer_end (past num_layers).
  uint32_t layer_begin = 0;
  uint32_t layer_end = 0;
};

class Client {
 public:
  // Creates a channel to options.target (does not wait for the server).
  static std::unique_ptr<Client> Create(const ClientOptions& options);

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Longest stored block-aligned prefix of `token_ids`.
  absl::StatusOr<v1::LookupResponse> Lookup(const std::string& model_id,
                                            absl::Span<const uint32_t> token_ids);

  // Streams every full block of `kv` (from options.first_block on) with its header.
  // kv.model_id, geometry, token_ids and surprisal_bits (empty or one per token) are sent as is.
  // An ABORTED or UNAVAILABLE Put is sent again, whole, after a backoff (ClientOptions::retry).
  absl::StatusOr<v1::PutResponse> Put(const KvDump& kv, const PutOptions& options = {});

  // Opens a Put whose KV is sent piece by piece (layer by layer as a worker computes it): see
  // client/put_stream.h. Its blocks travel dense (the server encodes them; encode_on_client does
  // not apply). `header`'s model_id, geometry, token_ids and surprisal_bits make the
  // PutHeader; its k and v are not read. Errors: INVALID_ARGUMENT for a bad geometry or
  // surprisal_bits count; the stream itself reports the server's errors.
  absl::StatusOr<std::unique_ptr<PutStream>> OpenPut(const KvDump& header,
                                                     const PutOptions& options = {});

  // KV of the longest stored prefix of `token_ids`, in sequence layout: the result's token_ids
  // are the matched tokens (empty on a miss) and k/v hold exactly those tokens. In RESIDUAL mode
  // the client decodes: blocks coded against a learned predictor state need it, fetched with
  // GetPredictor (once per version: cached).
  absl::StatusOr<KvDump> Get(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                             const GetOptions& options = {});
  // As Get, into `out`, whose k and v buffers are reused: a Get of the same size again neither
  // allocates nor clears them (the fastest way to read prefixes repeatedly). On an error `out`
  // holds part of the result. A Get the server ends with DATA_LOSS (a stored block that fails its
  // checksum or does not decode, which the server dropped with its subtree) is sent again once, at
  // once: it then returns the blocks before it, as a Get of a prefix stored only in part does.
  absl::Status GetInto(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                       const GetOptions& options, KvDump* out);

  // The learned predictor state `version` of (options.ns, model_id) (codec/predictor_state.h),
  // fetched with GetPredictor, its size and CRC-32C checked, parsed, and cached by (namespace,
  // model_id, version) — a version is immutable — the last kMaxCachedPredictors. Errors: the
  // server's (NOT_FOUND naming `version`); DATA_LOSS if the chunks do not add up or the bytes do
  // not parse.
  static constexpr size_t kMaxCachedPredictors = 8;
  absl::StatusOr<std::shared_ptr<const PredictorState>> GetPredictor(const std::string& model_id,
                                                                     uint32_t version);

  absl::StatusOr<v1::StatsResponse> Stats(const std::string& ns_override = "");
  absl::StatusOr<v1::InspectResponse> Inspect(const std::string& model_id, uint64_t node_id);
  // `erase`: DeleteRequest.erase (nothing of the deleted blocks stays on the server's disk).
  absl::StatusOr<v1::DeleteResponse> Delete(const std::string& model_id,
                                            absl::Span<const uint32_t> token_ids,
                                            bool erase = false);
  // Pins the stored prefix `token_ids` for `ttl_seconds` (0 = until unpinned), or unpins it.
  // `extend_only` (PinRequest.extend_only): a lease that never shortens an existing pin.
  // NOT_FOUND if it is not stored.
  absl::StatusOr<v1::PinResponse> Pin(const std::string& model_id,
                                      absl::Span<const uint32_t> token_ids,
                                      uint64_t ttl_seconds = 0, bool unpin = false,
                                      bool extend_only = false);

  // The underlying stub, for calls this class does not wrap, and a context for them with this
  // client's deadline and token (in flight until it is freed: see calls()).
  v1::KVCache::Stub* stub() { return stub_.get(); }
  ContextPtr NewContext() const;

  // grpc.health.v1.Health/Check of the whole server ("") on this client's channel, with its own
  // `deadline` (not options().timeout). OK when it answers SERVING; else the call's status, or
  // UNAVAILABLE naming the health status it answered.
  absl::Status CheckHealth(absl::Duration deadline);
  // The calls in flight on this client (every context NewContext made and not yet freed): how
  // long the oldest has waited, and a way to cancel them all (client/shard_health.h).
  CallRegistry& calls() { return *calls_; }

  const ClientOptions& options() const { return options_; }

 private:
  // One attempt of Put; `encode`: encoded (PutEncoded), else dense.
  absl::StatusOr<v1::PutResponse> PutOnce(const KvDump& kv, const BlockGeometry& g,
                                          const PutOptions& options, bool encode);
  // Calls `call` (a unary read: returns a grpc::Status) until it is not UNAVAILABLE or the
  // attempts run out.
  template <typename Call>
  absl::Status RetryRead(Call&& call);
  explicit Client(const ClientOptions& options);
  // One attempt of GetInto; `server_data_loss` is set when the server's status was DATA_LOSS.
  absl::Status GetOnce(const std::string& model_id, absl::Span<const uint32_t> token_ids,
                       const GetOptions& options, KvDump* out, bool* server_data_loss);
  // The reconstructed block of node `node_id` (a near-duplicate's centroid), fetched with
  // GetRequest.node_id in RECONSTRUCTED mode; `g` is the model's block geometry.
  absl::StatusOr<std::vector<uint8_t>> ReferenceBlock(const std::string& model_id, uint64_t node_id,
                                                      const BlockGeometry& g);

  // Put with options.encode_on_client, against the latest learned state.
  absl::StatusOr<v1::PutResponse> PutEncoded(const KvDump& kv, const BlockGeometry& g,
                                             const PutOptions& options);
  // The latest learned predictor state of (options_.ns, model_id), null when there is none: the
  // version found by Inspect within predictor_refresh (or again when `refresh`), then
  // GetPredictor.
  absl::StatusOr<std::shared_ptr<const PredictorState>> LatestPredictor(const std::string& model_id,
                                                                        bool refresh);

  const ClientOptions options_;
  const std::shared_ptr<CallRegistry> calls_ = std::make_shared<CallRegistry>();
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KVCache::Stub> stub_;
  std::unique_ptr<ThreadPool> codec_pool_;  // when codec_threads (0: the cores) > 1
  using PredictorKey = std::tuple<std::string, std::string, uint32_t>;  // (ns, model_id, version)
  absl::Mutex predictors_mu_;  // guards predictors_ (never held across an RPC)
  std::map<PredictorKey, std::pair<uint64_t, std::shared_ptr<const PredictorState>>> predictors_
      ABSL_GUARDED_BY(predictors_mu_);  // value: (last use, state)
  uint64_t predictor_uses_ ABSL_GUARDED_BY(predictors_mu_) = 0;
  // model_id -> (latest version, 0 = none; when Inspect said so), of options_.ns.
  std::map<std::string, std::pair<uint32_t, absl::Time>> latest_predictor_
      ABSL_GUARDED_BY(predictors_mu_);
  // The server's --default_encoding as the response of a dense ENCODING_UNSPECIFIED Put showed it
  // (ENCODING_UNSPECIFIED until then), and when; used for kDefaultEncodingTtl, then learned again
  // (a server restarted with another default is followed within that time).
  static constexpr absl::Duration kDefaultEncodingTtl = absl::Minutes(1);
  absl::Mutex default_encoding_mu_;  // guards default_encoding_ and default_encoding_at_
  v1::Encoding default_encoding_ ABSL_GUARDED_BY(default_encoding_mu_) = v1::ENCODING_UNSPECIFIED;
  absl::Time default_encoding_at_ ABSL_GUARDED_BY(default_encoding_mu_) = absl::InfinitePast();
};

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_CLIENT_H_
