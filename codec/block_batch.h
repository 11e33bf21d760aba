// codec/block_batch.h
//
// Encodes and decodes many blocks at once on a ThreadPool (thread_pool.h), one block per task.
// Blocks that do not read another block (raw, lossless, the baselines, and every block of the
// fast profile) are independent; a compact-profile residual block may read its parent, so with
// `chain_parent` DecodeBlocks gives block i the decoded block i - 1 as context.parent and decodes
// those blocks in order, after the independent ones (which run in parallel first).
// `pool` may be null: everything then runs on the calling thread. Thread-safe.
#ifndef KVTRIE_CODEC_BLOCK_BATCH_H_
#define KVTRIE_CODEC_BLOCK_BATCH_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_codec.h"
#include "codec/thread_pool.h"

namespace kvtrie {

// Decodes blocks[i] into outs[i] (each geometry.num_bytes() of its header). Returns the first
// error by block index (as DecodeBlock would, with "block i: " in front); the outputs of other
// blocks are then unspecified. Errors: INVALID_ARGUMENT if the spans differ in length.
absl::Status DecodeBlocks(absl::Span<const absl::string_view> blocks,
                          absl::Span<const absl::Span<uint8_t>> outs, bool chain_parent,
                          ThreadPool* pool);

// Encodes every block of `kv` (each geometry.num_bytes()) with `options` and no context (no
// parent, reference or external prediction). Errors: the first EncodeBlock error, with
// "block i: " in front.
absl::StatusOr<std::vector<EncodedBlock>> EncodeBlocks(
    const BlockGeometry& geometry, absl::Span<const absl::Span<const uint8_t>> kv,
    const EncodeOptions& options, ThreadPool* pool);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_BLOCK_BATCH_H_
