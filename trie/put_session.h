// trie/put_session.h
//
// PutSession: one Put stream of a KvStore (started by KvStore::BeginPut). Blocks may arrive whole
// or as layer ranges, in any order; they are buffered (at most max_put_bytes, and all sessions
// together at most max_inflight_put_bytes) and, at Finish, encoded — each new block predicted
// from its parent's reconstruction, or as a residual of a near-duplicate centroid when smaller —
// and committed together in one RocksDB batch, so a Put is all or nothing: a failed or truncated
// stream stores nothing. A Put whose prefix changes under it (a concurrent Put, Delete or
// eviction) matches and encodes again, up to 4 times.
// Not thread-safe (one stream, one caller). The store must outlive it.
#ifndef KVTRIE_TRIE_PUT_SESSION_H_
#define KVTRIE_TRIE_PUT_SESSION_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "trie/store_types.h"

namespace kvtrie {

class ModelShard;
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

  // Ends the stream: encodes and commits every new block. Errors: INVALID_ARGUMENT if a block is
  // incomplete (`kv: block 3 is missing layers [2, 5)`) or a full block of token_ids is neither
  // stored nor sent (`kv: ... never sent`); ABORTED if the prefix kept changing; RESOURCE_EXHAUSTED
  // if the disk budget is held by pins; UNAVAILABLE if the store failed. Nothing is stored unless
  // this returns OK.
  absl::StatusOr<PutSummary> Finish();

 private:
  struct Pending {
    std::vector<uint8_t> kv;  // the dense block
    std::vector<bool> have;   // one flag per layer
    uint32_t layers_missing = 0;
  };

  ModelShard* const shard_;
  ShardContext* const context_;
  const ModelInfo model_;
  const std::vector<uint32_t> token_ids_;
  const std::vector<float> surprisal_bits_;
  const EncodeOptions encode_;
  const uint32_t num_blocks_;  // full blocks in token_ids_
  uint64_t buffered_bytes_ = 0;
  std::map<uint32_t, Pending> pending_;  // by block index
  bool failed_ = false;
};

}  // namespace kvtrie

#endif  // KVTRIE_TRIE_PUT_SESSION_H_
