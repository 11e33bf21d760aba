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
// Blocks are [num_layers][2][num_kv_heads][block_tokens][head_dim] in the model dtype
// (codec/block_codec.h). Not thread-safe: one chain per path being decoded.
#ifndef KVTRIE_CODEC_DECODE_CHAIN_H_
#define KVTRIE_CODEC_DECODE_CHAIN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"

namespace kvtrie {

class DecodeChain {
 public:
  // Writes the reconstruction of reference node `node_id` into `out` (geometry.num_bytes()).
  using FetchReference = std::function<absl::Status(uint64_t node_id, absl::Span<uint8_t> out)>;
  static constexpr size_t kMaxReferences = 64;

  // `fetch` may be null when no block of the path has a reference (or every reference is given
  // with AddReference).
  DecodeChain(const BlockGeometry& geometry, FetchReference fetch);

  // Decodes the next block of the path into `out` (geometry.num_bytes() bytes) and keeps it as
  // the parent of the next. `reference_node_id` is the block's centroid (0 = none). Errors:
  // DecodeBlock's (DATA_LOSS on a bad checksum); the fetcher's, unchanged, for the reference and
  // the reference's parent.
  absl::Status Next(absl::string_view encoded, uint64_t reference_node_id, absl::Span<uint8_t> out);
  // As Next, but the block's bytes are already dense (a raw copy): only kept as the parent.
  void NextDense(absl::Span<const uint8_t> block);

  // Supplies the reconstruction of reference `node_id` (e.g. just encoded against), so it is not
  // fetched.
  void AddReference(uint64_t node_id, absl::Span<const uint8_t> block);
  // Makes room for `n` (<= kMaxReferences) more references without dropping any added after this
  // call: call it before adding a block's centroid and its parent.
  void ReserveReferences(size_t n);
  // The reference node ids block `encoded` needs besides `reference_node_id` (its header's): the
  // shifted centroid's parent, or 0. An envelope that fails ParseBlock gives 0 (Next reports it).
  static uint64_t ReferenceParentOf(absl::string_view encoded, uint64_t reference_node_id);
  bool HasReference(uint64_t node_id) const { return references_.contains(node_id); }

  // The previous block's reconstruction (empty before the first).
  absl::Span<const uint8_t> parent() const { return parent_; }
  const BlockGeometry& geometry() const { return geometry_; }

 private:
  const BlockGeometry geometry_;
  const FetchReference fetch_;
  std::vector<uint8_t> parent_;
  // The cached reconstruction of `node_id`, fetched if missing. REQUIRES: ReserveReferences.
  absl::StatusOr<absl::Span<const uint8_t>> Reference(uint64_t node_id);

  std::map<uint64_t, std::vector<uint8_t>> references_;  // node id -> reconstruction
};

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_DECODE_CHAIN_H_
