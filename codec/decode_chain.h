// codec/decode_chain.h
//
// Decodes the blocks of one trie path in order, root first. A block may predict from its parent
// (the previous block's reconstruction, kept here) and from a reference block — a near-duplicate's
// centroid, named by node id in the block's header and reconstructed by a caller-supplied
// fetcher (the store reads it, a client asks the server). A block coded against its centroid at a
// position offset (codec/reference_shift.h) also needs the centroid's parent, named in its
// envelope (BlockHeader::reference_shift.reference_parent_node_id) and fetched the same way. The
// last kMaxReferences references are cached. Used by the store (reconstruction, Put), the service
// (Get) and the client (Get of RESIDUAL blocks), so the parent/centroid context is built in one
// place.
//
// Learned predictors (issue 11): a block coded against a PredictorState names its version in its
// envelope (BlockHeader::predictor_version). The chain gets that state from a caller-supplied
// FetchPredictor (the store reads it, a client asks the server and caches it), keeps the last
// kMaxPredictors, and hands it to DecodeBlock with the block's token ids (given to Next), the
// block's first position and the token before it, which the chain tracks itself: the first block
// is at position 0 with no previous token, unless StartAt says otherwise (a path decoded from
// the middle).
//
// Blocks are [num_layers][2][num_kv_heads][block_tokens][head_dim] in the model dtype
// (codec/block_codec.h). Not thread-safe: one chain per path being decoded.
#ifndef KVTRIE_CODEC_DECODE_CHAIN_H_
#define KVTRIE_CODEC_DECODE_CHAIN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"

namespace kvtrie {

class PredictorState;  // codec/predictor_state.h

class DecodeChain {
 public:
  // Writes the reconstruction of reference node `node_id` into `out` (geometry.num_bytes()).
  using FetchReference = std::function<absl::Status(uint64_t node_id, absl::Span<uint8_t> out)>;
  static constexpr size_t kMaxReferences = 64;
  // The predictor state of `version` (> 0) of the path's (namespace, model).
  using FetchPredictor =
      std::function<absl::StatusOr<std::shared_ptr<const PredictorState>>(uint32_t version)>;
  static constexpr size_t kMaxPredictors = 8;

  // `fetch` may be null when no block of the path has a reference (or every reference is given
  // with AddReference); `fetch_predictor` when no block names a predictor version (or every state
  // is given with AddPredictor).
  DecodeChain(const BlockGeometry& geometry, FetchReference fetch,
              FetchPredictor fetch_predictor = nullptr);

  // The next block is at absolute position `first_position` (block index * block_tokens) and
  // `previous_token` is the token before it (-1 = none); `parent` (empty, or the previous block's
  // reconstruction) becomes the parent. For decoding a path from the middle.
  void StartAt(uint32_t first_position, int32_t previous_token,
               absl::Span<const uint8_t> parent = {});

  // Decodes the next block of the path into `out` (geometry.num_bytes() bytes) and keeps it as
  // the parent of the next. `reference_node_id` is the block's centroid (0 = none). `tokens`: the
  // block's block_tokens token ids (needed only by blocks that name a predictor version; may be
  // empty otherwise, and then the next block has no known previous token). `verified`: the bytes'
  // CRC-32C was checked already (a store's payload), so it is not again. Errors: DecodeBlock's
  // (DATA_LOSS on a bad checksum; FAILED_PRECONDITION naming the version when no state or no
  // tokens are at hand); the fetchers' errors, unchanged, for the reference, the reference's
  // parent and the predictor state.
  absl::Status Next(absl::string_view encoded, uint64_t reference_node_id, absl::Span<uint8_t> out,
                    absl::Span<const int32_t> tokens = {}, bool verified = false);
  // As Next, but the block's bytes are already dense (a raw copy): only kept as the parent.
  void NextDense(absl::Span<const uint8_t> block, absl::Span<const int32_t> tokens = {});
  // As NextDense without a copy: `owner` keeps `block` alive and unchanged while it is the parent.
  void NextDenseShared(std::shared_ptr<const void> owner, absl::Span<const uint8_t> block,
                       absl::Span<const int32_t> tokens = {});
  // The next Next's `out` is owned by `owner` and is not changed after it returns: the chain then
  // keeps it as the parent without a copy (instead of copying it).
  void SetOutputOwner(std::shared_ptr<const void> owner) { out_owner_ = std::move(owner); }

  // Supplies predictor state `state` (e.g. the one just encoded against), so it is not fetched.
  void AddPredictor(std::shared_ptr<const PredictorState> state);

  // Supplies the reconstruction of reference `node_id` (e.g. just encoded against), so it is not
  // fetched.
  void AddReference(uint64_t node_id, absl::Span<const uint8_t> block);
  // Makes room for `n` (<= kMaxReferences) more references without dropping any added after this
  // call: call it before adding a block's centroid and its parent.
  void ReserveReferences(size_t n);
  // The reference node ids block `encoded` needs besides `reference_node_id` (its header's): the
  // shifted centroid's parent, or 0. An envelope that fails ParseBlock gives 0 (Next reports it).
  // `verified`: as Next's.
  static uint64_t ReferenceParentOf(absl::string_view encoded, uint64_t reference_node_id,
                                    bool verified = false);
  bool HasReference(uint64_t node_id) const { return references_.contains(node_id); }

  // The previous block's reconstruction (empty before the first).
  absl::Span<const uint8_t> parent() const { return parent_; }
  const BlockGeometry& geometry() const { return geometry_; }
  // Where the next block starts and the token before it.
  uint32_t first_position() const { return first_position_; }
  int32_t previous_token() const { return previous_token_; }

 private:
  // Advances the position past one block of `tokens`.
  void Advance(absl::Span<const int32_t> tokens);

  // The cached reconstruction of `node_id`, fetched if missing. REQUIRES: ReserveReferences.
  absl::StatusOr<absl::Span<const uint8_t>> Reference(uint64_t node_id);

  const BlockGeometry geometry_;
  const FetchReference fetch_;
  const FetchPredictor fetch_predictor_;
  uint32_t first_position_ = 0;
  int32_t previous_token_ = -1;
  std::map<uint32_t, std::shared_ptr<const PredictorState>> predictors_;  // version -> state
  std::vector<uint8_t> parent_copy_;                                      // the parent, when copied
  std::shared_ptr<const void> parent_owner_;  // the parent's owner, when not copied
  absl::Span<const uint8_t> parent_;          // into parent_copy_ or parent_owner_'s bytes
  std::shared_ptr<const void> out_owner_;     // SetOutputOwner's, for the next Next
  std::map<uint64_t, std::vector<uint8_t>> references_;  // node id -> reconstruction
};

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_DECODE_CHAIN_H_
