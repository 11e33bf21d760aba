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
//
// Errors (the stream is then unusable): DATA_LOSS naming the block when it arrives out of order,
// its envelope fails its checks, its geometry differs from the model's, its reference id differs
// from GetBlock.reference_node_id, or a centroid has the wrong size; `fetch`'s errors; the codec's
// (FAILED_PRECONDITION for a prediction the client cannot supply).
// Not thread-safe (one Get).
#ifndef KVTRIE_CLIENT_RESIDUAL_CHAIN_H_
#define KVTRIE_CLIENT_RESIDUAL_CHAIN_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"
#include "codec/decode_chain.h"
#include "codec/thread_pool.h"

namespace kvtrie {

class ResidualChain {
 public:
  // The reconstruction of centroid node `node_id` (geometry.num_bytes() bytes).
  using FetchReference = std::function<absl::StatusOr<std::vector<uint8_t>>(uint64_t node_id)>;

  ResidualChain(const BlockGeometry& geometry, FetchReference fetch);
  ResidualChain(const ResidualChain&) = delete;  // the chain's fetcher points at this object
  ResidualChain& operator=(const ResidualChain&) = delete;

  // Decodes block `block_index` (0, 1, 2, ... in order) into `out` (geometry.num_bytes()).
  absl::Status Decode(uint32_t block_index, uint64_t reference_node_id, absl::string_view encoded,
                      absl::Span<uint8_t> out);

  // Decodes the next blocks at once, with the checks and errors of Decode (the first by position):
  // block_indices[i] (consecutive from the next expected), reference_node_ids[i] and encoded[i]
  // into outs[i]. Blocks that read neither their parent nor a centroid (the fast profile) are
  // decoded on `pool` (null: the caller) in parallel, the others in order on this thread. `done(i)`
  // is called once outs[i] holds block i, on the thread that decoded it (for example to scatter
  // it), and must be safe to call concurrently for different i.
  absl::Status DecodeMany(absl::Span<const uint32_t> block_indices,
                          absl::Span<const uint64_t> reference_node_ids,
                          absl::Span<const absl::string_view> encoded,
                          absl::Span<const absl::Span<uint8_t>> outs, ThreadPool* pool,
                          const std::function<void(size_t)>& done);

 private:
  const BlockGeometry geometry_;
  uint32_t next_block_ = 0;
  uint32_t current_block_ = 0;  // the block being decoded, for the fetcher's errors
  DecodeChain chain_;

  // Decode's checks of one block; `independent` says it reads no parent nor centroid.
  absl::Status Check(uint32_t block_index, uint32_t expected, uint64_t reference_node_id,
                     absl::string_view encoded, absl::Span<uint8_t> out, bool* independent);
};

}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_RESIDUAL_CHAIN_H_
