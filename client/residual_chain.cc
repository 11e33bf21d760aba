#include "client/residual_chain.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/block_codec.h"

namespace kvtrie {

namespace {

absl::Status BlockLoss(uint32_t block_index, absl::string_view what) {
  return absl::DataLossError(absl::StrCat("get: block ", block_index, ": ", what));
}

}  // namespace

ResidualChain::ResidualChain(const BlockGeometry& geometry, FetchReference fetch)
    : geometry_(geometry),
      chain_(geometry,
             [this, fetch = std::move(fetch)](uint64_t node_id,
                                              absl::Span<uint8_t> out) -> absl::Status {
               absl::StatusOr<std::vector<uint8_t>> ref = fetch(node_id);
               if (!ref.ok()) return ref.status();
               if (ref->size() != out.size()) {
                 return BlockLoss(current_block_, absl::StrCat("centroid ", node_id, " has ",
                                                               ref->size(), " bytes"));
               }
               std::memcpy(out.data(), ref->data(), out.size());
               return absl::OkStatus();
             }) {}

absl::Status ResidualChain::Check(uint32_t block_index, uint32_t expected,
                                  uint64_t reference_node_id, absl::string_view encoded,
                                  absl::Span<uint8_t> out, bool* independent) {
  if (block_index != expected) {
    return BlockLoss(block_index,
                     absl::StrCat("arrived out of order (expected block ", expected, ")"));
  }
  if (out.size() != geometry_.num_bytes()) {
    return BlockLoss(block_index, "output buffer of the wrong size");
  }
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);  // checks the CRC-32C
  if (!h.ok()) return BlockLoss(block_index, h.status().message());
  if (!(h->geometry == geometry_)) {
    return BlockLoss(block_index, absl::StrCat("encoded as ", h->geometry.DebugString(),
                                               ", the model is ", geometry_.DebugString()));
  }
  if (h->reference_node_id != reference_node_id) {
    return BlockLoss(block_index, absl::StrCat("encoded against node ", h->reference_node_id,
                                               ", reference_node_id says ", reference_node_id));
  }
  *independent = h->profile == Profile::kFast && h->reference_node_id == 0;
  return absl::OkStatus();
}

absl::Status ResidualChain::Decode(uint32_t block_index, uint64_t reference_node_id,
                                   absl::string_view encoded, absl::Span<uint8_t> out) {
  bool independent = false;
  if (auto s = Check(block_index, next_block_, reference_node_id, encoded, out, &independent);
      !s.ok()) {
    return s;
  }
  current_block_ = block_index;
  // Check verified the CRC: the chain does not again.
  if (absl::Status s =
          chain_.Next(encoded, reference_node_id, out, /*tokens=*/{}, /*verified=*/true);
      !s.ok()) {
    return s;
  }
  ++next_block_;
  return absl::OkStatus();
}

absl::Status ResidualChain::DecodeMany(absl::Span<const uint32_t> block_indices,
                                       absl::Span<const uint64_t> reference_node_ids,
                                       absl::Span<const absl::string_view> encoded,
                                       absl::Span<const absl::Span<uint8_t>> outs, ThreadPool* pool,
                                       const std::function<void(size_t)>& done) {
  const size_t n = encoded.size();
  if (block_indices.size() != n || reference_node_ids.size() != n || outs.size() != n) {
    return absl::InvalidArgumentError("DecodeMany: spans of different lengths");
  }
  std::vector<char> independent(n, 0);
  std::vector<size_t> parallel;
  for (size_t i = 0; i < n; ++i) {
    bool ind = false;
    if (auto s = Check(block_indices[i], next_block_ + static_cast<uint32_t>(i),
                       reference_node_ids[i], encoded[i], outs[i], &ind);
        !s.ok()) {
      return s;
    }
    independent[i] = ind;
    if (ind) parallel.push_back(i);
  }
  std::vector<absl::Status> status(n);
  auto decode = [&](size_t k) {
    const size_t i = parallel[k];
    status[i] = DecodeVerifiedBlock(encoded[i], outs[i]);
    if (status[i].ok()) done(i);
  };
  if (pool != nullptr) {
    pool->ParallelFor(parallel.size(), decode);
  } else {
    for (size_t k = 0; k < parallel.size(); ++k) decode(k);
  }
  for (size_t i = 0; i < n; ++i) {
    current_block_ = block_indices[i];
    if (independent[i]) {
      if (!status[i].ok()) return BlockLoss(block_indices[i], status[i].message());
      // The chain keeps a block as the parent only where the next block (this batch's, or the
      // first of the next call) may read it.
      if (i + 1 == n || !independent[i + 1]) chain_.NextDense(outs[i]);
    } else {
      absl::Status s = chain_.Next(encoded[i], reference_node_ids[i], outs[i], /*tokens=*/{},
                                   /*verified=*/true);
      if (!s.ok()) return s;
      done(i);
    }
  }
  next_block_ += static_cast<uint32_t>(n);
  return absl::OkStatus();
}

}  // namespace kvtrie
