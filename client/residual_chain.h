// client/residual_chain.h
//
// ResidualChain: decodes the blocks of a Get in RESIDUAL mode (GetBlock.encoded, the stored
// encoding of codec/block_codec.h) as the C++ client receives them. The parent/centroid context
// and its caching are codec/decode_chain.h's DecodeChain (the one the store and the service use);
// this class adds the checks a client must make on what the wire gives it: block order, the
// envelope, the geometry, the reference id and the size of a fetched centroid. Block i may be
// predicted from block i-1's reconstruction (its parent) and, when its envelope names a centroid
// (reference_node_id != 0), from that centroid block's reconstruction, which `fetch` returns
// (the client reads it with GetRequest.node_id); a centroid used at a position offset
// (codec/reference_shift.h) also needs the centroid's parent, named in the block's envelope and
// fetched with the same `fetch`. DecodeChain caches the last DecodeChain::kMaxReferences of them.
// A block coded against the model's learned predictor state (GetBlock.predictor_version != 0,
// named in its envelope too) is decoded with the state `fetch_predictor` returns (the client
// fetches it with GetPredictor and caches it) and the block's token ids, position and previous
// token.
//
// Errors (the stream is then unusable): DATA_LOSS naming the block when it arrives out of order,
// its envelope fails its checks, its geometry differs from the model's, its reference id differs
// from GetBlock.reference_node_id, its predictor version differs from GetBlock.predictor_version,
// a centroid has the wrong size, or a fetched state is of another version or geometry; the
// fetchers' errors; the codec's
// (FAILED_PRECONDITION for a prediction the client cannot supply).
// Not thread-safe (one Get).
#ifndef KVTRIE_CLIENT_RESIDUAL_CHAIN_H_
#define KVTRIE_CLIENT_RESIDUAL_CHAIN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/decode_chain.h"
#include "codec/predictor_state.h"
#include "codec/thread_pool.h"

namespace kvtrie {

class ResidualChain {
 public:
  // The reconstruction of centroid node `node_id` (geometry.num_bytes() bytes).
  using FetchReference = std::function<absl::StatusOr<std::vector<uint8_t>>(uint64_t node_id)>;
  // The learned predictor state `version` of the Get's (namespace, model).
  using FetchPredictor =
      std::function<absl::StatusOr<std::shared_ptr<const PredictorState>>(uint32_t version)>;

  // `fetch_predictor` may be null when no block names a learned state.
  ResidualChain(const BlockGeometry& geometry, FetchReference fetch,
                FetchPredictor fetch_predictor = nullptr);
  ResidualChain(const ResidualChain&) = delete;  // the chain's fetcher points at this object
  ResidualChain& operator=(const ResidualChain&) = delete;

  // Decodes block `block_index` (0, 1, 2, ... in order) into `out` (geometry.num_bytes()).
  // `tokens` are the block's token ids (block_tokens): the learned predictors' context (the
  // chain tracks the position and the previous token).
  absl::Status Decode(uint32_t block_index, uint64_t reference_node_id, uint32_t predictor_version,
                      absl::Span<const uint32_t> tokens, absl::string_view encoded,
                      absl::Span<uint8_t> out);

  // Decodes the next blocks at once, with the checks and errors of Decode (the first by position):
  // block_indices[i] (consecutive from the next expected), reference_node_ids[i],
  // predictor_versions[i] and encoded[i] into outs[i]; `prefix_tokens` are the token ids of the
  // whole matched prefix (block b's are [b * block_tokens, (b + 1) * block_tokens)). Blocks that
  // read neither their parent nor a centroid (the fast profile, codec/decode_alone.h: with or
  // without a learned state) are decoded on `pool` (null: the caller) in parallel, the others in
  // order on this thread after them. The learned states the parallel blocks name are fetched
  // first, each version once, on this thread (`fetch_predictor` need not be thread-safe). `done(i)`
  // is called once outs[i] holds block i, on the thread that decoded it (for example to scatter
  // it), and must be safe to call concurrently for different i. On an error, blocks after the
  // failing one may have been decoded (and `done` called for them).
  absl::Status DecodeMany(absl::Span<const uint32_t> block_indices,
                          absl::Span<const uint64_t> reference_node_ids,
                          absl::Span<const uint32_t> predictor_versions,
                          absl::Span<const uint32_t> prefix_tokens,
                          absl::Span<const absl::string_view> encoded,
                          absl::Span<const absl::Span<uint8_t>> outs, ThreadPool* pool,
                          const std::function<void(size_t)>& done);

 private:
  const BlockGeometry geometry_;
  uint32_t next_block_ = 0;
  uint32_t current_block_ = 0;  // the block being decoded, for the fetcher's errors
  int32_t last_token_ = -1;     // the last token of the block before next_block_ (-1: none)
  const FetchPredictor fetch_predictor_;
  std::shared_ptr<const PredictorState> last_state_;  // the last state fetched (checked)
  DecodeChain chain_;

  // Decode's checks of one block; `independent` says it reads no parent, centroid or state.
  absl::Status Check(uint32_t block_index, uint32_t expected, uint64_t reference_node_id,
                     uint32_t predictor_version, size_t token_count, absl::string_view encoded,
                     absl::Span<uint8_t> out, bool* independent);
  // The state `predictor_version` (> 0) names: the last one fetched, or fetched (the client
  // caches) and checked against the version and the model's geometry.
  absl::StatusOr<std::shared_ptr<const PredictorState>> FetchState(uint32_t block_index,
                                                                   uint32_t predictor_version);
  // Fetches and hands the chain the state `predictor_version` names (none for 0).
  absl::Status UseState(uint32_t block_index, uint32_t predictor_version);
  // Decodes a block on the chain, at its position, after the previous block's last token.
  absl::Status NextOnChain(uint32_t block_index, uint64_t reference_node_id,
                           absl::Span<const uint32_t> tokens, absl::string_view encoded,
                           absl::Span<uint8_t> out);
};

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_RESIDUAL_CHAIN_H_
