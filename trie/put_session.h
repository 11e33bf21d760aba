// trie/put_session.h
//
// PutSession: one Put stream of a KvStore (started by KvStore::BeginPut). Blocks may arrive whole
// or as layer ranges, in any order; they are buffered (at most max_put_bytes of dense KV — a
// client-encoded block counts its dense size, so an encoded RAW Put of max_put_bytes fits — and
// all sessions together at most max_inflight_put_bytes of what they hold), encoded, and committed
// together in one RocksDB batch at Finish, so a Put is all or nothing: a failed or truncated
// stream stores nothing. A Put whose prefix changes under it (a concurrent Put, Delete or
// eviction) matches and encodes again, up to 4 times.
//
// Encoding: blocks that read no other block (RAW, and RESIDUAL / LOSSLESS of the fast profile,
// which ignores parent and reference contexts) are encoded as soon as their last layer arrives,
// on the store's codec pool (ShardContext::codec_pool, --codec_threads; inline when null) while
// the stream goes on, and their dense bytes are freed then; at most 2 per pool thread of one
// session wait or run at once (AddLayers blocks past that: backpressure on the stream). Blocks
// that were stored already when the session began are not encoded unless Finish needs them.
// Compact-profile blocks are encoded at Finish, in order — each predicted from its parent's
// reconstruction, or as a residual of a near-duplicate centroid when smaller.
//
// Not thread-safe (one stream, one caller). The store must outlive it.
#ifndef KVTRIE_TRIE_PUT_SESSION_H_
#define KVTRIE_TRIE_PUT_SESSION_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "codec/task_pool.h"
#include "trie/store_types.h"

namespace kvtrie {

class ModelShard;
class PredictorRegistry;  // trie/predictor_registry.h
class PredictorState;     // codec/predictor_state.h
struct ShardContext;

class PutSession {
 public:
  // `shard` is the (namespace, model) the Put goes to; `model` the request's model (validated).
  PutSession(ModelShard* shard, ShardContext* context, ModelInfo model,
             std::vector<uint32_t> token_ids, std::vector<float> surprisal_bits,
             EncodeOptions encode);
  PutSession(const PutSession&) = delete;
  PutSession& operator=(const PutSession&) = delete;
  ~PutSession();

  // Adds layers [layer_begin, layer_end) of block `block_index` (layer_end 0 = num_layers).
  // Errors: INVALID_ARGUMENT naming `block_index`, `layer_end` or `kv` (size, layers sent twice);
  // RESOURCE_EXHAUSTED past max_put_bytes or max_inflight_put_bytes. After an error the session
  // is unusable.
  absl::Status AddLayers(uint32_t block_index, uint32_t layer_begin, uint32_t layer_end,
                         absl::Span<const uint8_t> kv);
  // The same for a whole block (layers [0, num_layers)) whose bytes the session may keep
  // without a copy; `kv` is consumed whether or not this succeeds.
  absl::Status AddBlock(uint32_t block_index, std::string kv);

  // A whole block its client encoded (codec/block_codec.h envelope: RAW, LOSSLESS fast or
  // RESIDUAL fast, reference node id 0), stored as it came. Checked at once without decoding
  // (codec/block_verify.h), then decoded too as StoreOptions::verify_encoded_puts says; a block
  // coded against a learned state must name a version this shard keeps (held until the session
  // ends). `error` is what the client's encoder achieved (EncodedBlock's rel_rms_error_k / _v,
  // max_abs_error), kept as the node's error, marked client-reported. `encoded` is consumed.
  // A reported rel RMS error must be in [0, kMaxClientRelRmsError], max_abs_error finite and >= 0.
  // Errors: INVALID_ARGUMENT "kv: block 7 encoded: <what is wrong>" (or naming the error field);
  // FAILED_PRECONDITION naming `predictor_version` and the latest version; as AddLayers.
  struct ClientError {
    double rel_rms_error_k = 0;
    double rel_rms_error_v = 0;
    double max_abs_error = 0;
  };
  absl::Status AddEncodedBlock(uint32_t block_index, std::string encoded, ClientError error);
  // The largest rel RMS error a client may report: 4 is already four times the signal (issue 30).
  static constexpr double kMaxClientRelRmsError = 4.0;

  // Ends the stream: hands the shard one plan (PutEncoder::ApplyPut: its blocks, dense or
  // encoded, and their context), which encodes what is left and commits every new block. Errors:
  // INVALID_ARGUMENT if a block is incomplete (`kv: block 3 is missing layers [2, 5)`) or a full
  // block of token_ids is neither stored nor sent (`kv: ... never sent`); ABORTED if the prefix
  // kept changing; RESOURCE_EXHAUSTED if the disk budget is held by pins; UNAVAILABLE if the store
  // failed. Nothing is stored unless this returns OK.
  absl::StatusOr<PutSummary> Finish();

 private:
  struct Pending {
    std::string kv;          // the dense block (empty once encoded on arrival)
    std::vector<bool> have;  // one flag per layer
    uint32_t layers_missing = 0;
    // Encoded on arrival (early_): written by the encoding task, read after encoders_.Wait().
    std::unique_ptr<absl::StatusOr<std::shared_ptr<const EncodedBlock>>> encoded;
    // AddEncodedBlock: encoded by the client, in this encoding (encoded is set, kv empty).
    bool client_encoded = false;
    Encoding client_encoding = Encoding::kRaw;
    bool client_decoded = false;  // and decoded here (verify_encoded_puts sampled it)
  };

  // INVALID_ARGUMENT (failing the session) unless block_index is a full block of token_ids.
  absl::Status CheckIndex(uint32_t block_index);
  // The block's entry; a new one reserves its dense bytes. Fails the session on error.
  // `reserve`: the bytes it buffers (0 = the dense block).
  absl::StatusOr<Pending*> Admit(uint32_t block_index, uint64_t reserve = 0);
  // AddEncodedBlock's state lookup: the version held for this session (acquired once).
  absl::StatusOr<const PredictorState*> AcquireVersion(uint32_t version);
  // A block got its last layer: encodes it (early_ blocks only) on the pool.
  void BlockComplete(uint32_t block_index, Pending* p);
  absl::Status Fail(absl::Status s);

  ModelShard* const shard_;
  ShardContext* const context_;
  const ModelInfo model_;
  const std::vector<uint32_t> token_ids_;
  const std::vector<float> surprisal_bits_;
  const EncodeOptions encode_;
  const uint32_t sample_phase_;     // VerifyEncoded::kSample decodes (index + this) % 8 == 0
  const uint32_t num_blocks_;       // full blocks in token_ids_
  const bool early_;                // blocks read no other block: encode them on arrival
  const uint32_t stored_at_begin_;  // full blocks of token_ids_ stored when the session began
  uint64_t buffered_bytes_ = 0;     // held in memory (an encoded block: its size), against inflight
  // Dense bytes of the blocks buffered: what max_put_bytes bounds (a Put's dense KV, as the
  // server's PutLimits reserve it; an encoded RAW block's envelope is not counted against it).
  uint64_t buffered_dense_bytes_ = 0;
  std::map<uint32_t, Pending> pending_;  // by block index
  bool failed_ = false;
  // early_ RESIDUAL: the latest learned state when the session began (null: none), acquired from
  // early_registry_ and released by the destructor; every block encoded on arrival uses it.
  std::shared_ptr<PredictorRegistry> early_registry_;
  std::shared_ptr<const PredictorState> early_learned_;
  // Versions named by client-encoded blocks, held (pending) until the session ends.
  std::map<uint32_t, std::shared_ptr<const PredictorState>> client_versions_;
  std::unique_ptr<TaskGroup> encoders_;  // early_ encodes on context_->codec_pool; waited first
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_PUT_SESSION_H_
