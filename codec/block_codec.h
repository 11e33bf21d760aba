// codec/block_codec.h
//
// Encodes one KV block — a tensor [num_layers][2][num_kv_heads][block_tokens][head_dim] in the
// model's dtype (see block_geometry.h) — into a self-describing byte string, and back.
//
// Encoded block, version 1 (all integers little-endian):
//   0   4  magic "KVB1"
//   4   1  format_version (1)
//   5   1  encoding (Encoding)
//   6   1  dtype (DType)
//   7   1  flags (reserved, 0)
//   8   2  num_layers    10  2  num_kv_heads    12  2  block_tokens    14  2  head_dim
//   16  8  reference node id (the centroid a residual is taken against; 0 = none)
//   24  4  params_len P, then P bytes of encoding parameters (quantizer steps, predictor choice)
//   ..  4  payload_len N, then N bytes of payload
//   ..  4  CRC-32C of every byte before it
// A block that fails any of these checks is rejected with DATA_LOSS, never decoded.
//
// Thread-safe: these are pure functions.
// Source: the paper's layer 2 (predictive delta coding), Magarshak 2026 §2; the envelope follows
// LevelDB's block trailer (type byte + masked CRC32C), unmasked here.
#ifndef KVTRIE_CODEC_BLOCK_CODEC_H_
#define KVTRIE_CODEC_BLOCK_CODEC_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "codec/block_geometry.h"

namespace kvtrie {

// How a block is stored. Values match kvtrie.v1.Encoding.
enum class Encoding : uint8_t {
  kRaw = 1,       // the tensor bytes as given
  kLossless = 2,  // bit-exact: byte planes of the dtype, each zstd-compressed
};
bool IsValidEncoding(uint32_t value);
absl::string_view EncodingName(Encoding encoding);

struct EncodeOptions {
  Encoding encoding = Encoding::kLossless;
  // Lossy encodings: target relative RMS error ||x - x'|| / ||x|| per (layer, K/V), e.g. 0.01.
  double target_rel_rms = 0.0;
};

// What the decoder may need besides the encoded bytes. Spans are empty when absent.
struct PredictionContext {
  // The reconstructed parent block (same geometry), for predictors that start from it.
  absl::Span<const uint8_t> parent;
  // The reconstructed reference (centroid) block named in the header.
  absl::Span<const uint8_t> reference;
};

// The result of encoding one block.
struct EncodedBlock {
  std::string bytes;              // the self-describing encoded block
  double bits_per_component = 0;  // 8 * bytes.size() / geometry.num_elements()
  double rel_rms_error_k = 0;     // ||K - K'|| / ||K|| over the block; 0 when lossless
  double rel_rms_error_v = 0;     // same for V
  double max_abs_error = 0;       // max |x - x'| over the block
};

// Encodes `kv` (exactly geometry.num_bytes() bytes). Errors: INVALID_ARGUMENT naming the field if
// the geometry is invalid or `kv` has the wrong size.
absl::StatusOr<EncodedBlock> EncodeBlock(const BlockGeometry& geometry,
                                         absl::Span<const uint8_t> kv, const EncodeOptions& options,
                                         const PredictionContext& context = {});

// The parsed envelope of an encoded block; views point into the encoded bytes.
struct BlockHeader {
  uint32_t format_version = 0;
  Encoding encoding = Encoding::kRaw;
  BlockGeometry geometry;
  uint64_t reference_node_id = 0;
  absl::string_view params;
  absl::string_view payload;
};

// Parses and checks the envelope (magic, version, lengths, CRC-32C). Errors: DATA_LOSS.
absl::StatusOr<BlockHeader> ParseBlock(absl::string_view encoded);

// Decodes `encoded` into `out` (geometry.num_bytes() bytes, dtype of the header).
// Errors: DATA_LOSS on a bad checksum, truncated or malformed input; INVALID_ARGUMENT if `out`
// has the wrong size; FAILED_PRECONDITION if the block needs a context span that is empty.
absl::Status DecodeBlock(absl::string_view encoded, absl::Span<uint8_t> out,
                         const PredictionContext& context = {});

namespace internal {
// Builds the envelope around `params` and `payload`.
std::string WriteEnvelope(Encoding encoding, const BlockGeometry& geometry,
                          uint64_t reference_node_id, absl::string_view params,
                          absl::string_view payload);
}  // namespace internal

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_BLOCK_CODEC_H_
