#include "codec/block_batch.h"

#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {

void Run(ThreadPool* pool, size_t n, const std::function<void(size_t)>& fn) {
  if (pool) return pool->ParallelFor(n, fn);
  for (size_t i = 0; i < n; ++i) fn(i);
}

absl::Status FirstError(const std::vector<absl::Status>& status) {
  for (size_t i = 0; i < status.size(); ++i) {
    if (!status[i].ok()) {
      return absl::Status(status[i].code(), absl::StrCat("block ", i, ": ", status[i].message()));
    }
  }
  return absl::OkStatus();
}

// True if the block may read its parent: a compact-profile residual block (its predictors are
// inside the entropy-coded payload, so this is decided by the header alone).
bool MayReadParent(absl::string_view block) {
  absl::StatusOr<BlockHeader> h = ParseBlock(block);
  return h.ok() && h->encoding == Encoding::kResidual && h->profile == Profile::kCompact;
}

}  // namespace

absl::Status DecodeBlocks(absl::Span<const absl::string_view> blocks,
                          absl::Span<const absl::Span<uint8_t>> outs, bool chain_parent,
                          ThreadPool* pool) {
  if (blocks.size() != outs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("outs: ", outs.size(), " buffers for ", blocks.size(), " blocks"));
  }
  const size_t n = blocks.size();
  std::vector<absl::Status> status(n);
  std::vector<char> chained(n, 0);
  if (chain_parent) {
    for (size_t i = 1; i < n; ++i) chained[i] = MayReadParent(blocks[i]);
  }
  Run(pool, n, [&](size_t i) {
    if (!chained[i]) status[i] = DecodeBlock(blocks[i], outs[i]);
  });
  for (size_t i = 1; i < n; ++i) {
    if (!chained[i]) continue;
    if (!status[i - 1].ok()) {
      status[i] = absl::FailedPreconditionError("the parent block did not decode");
      continue;
    }
    PredictionContext c;
    c.parent = outs[i - 1];
    status[i] = DecodeBlock(blocks[i], outs[i], c);
  }
  return FirstError(status);
}

absl::StatusOr<std::vector<EncodedBlock>> EncodeBlocks(
    const BlockGeometry& geometry, absl::Span<const absl::Span<const uint8_t>> kv,
    const EncodeOptions& options, ThreadPool* pool) {
  std::vector<EncodedBlock> out(kv.size());
  std::vector<absl::Status> status(kv.size());
  Run(pool, kv.size(), [&](size_t i) {
    absl::StatusOr<EncodedBlock> e = EncodeBlock(geometry, kv[i], options);
    if (e.ok()) {
      out[i] = *std::move(e);
    } else {
      status[i] = e.status();
    }
  });
  if (auto s = FirstError(status); !s.ok()) return s;
  return out;
}

}  // namespace kvtrie
