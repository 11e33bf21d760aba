// codec/kv_dump.h
//
// Reads and writes a KV dump folder, the exchange format of shared/data/README.md:
//   k.npy, v.npy    float16 (or bf16 as '<V2' / fp32 '<f4'), shape [num_layers, num_kv_heads,
//                   num_tokens, head_dim], C order; K after RoPE
//   manifest.json   {"token_ids": [...], "surprisal_bits": [null | bits, ...], "layers": L,
//                    "kv_heads": H, "head_dim": D, "model_file": "...", ...}
// surprisal_bits[i] = -log2 p(token_i | tokens_<i) in bits; null (BOS) is read as 0.
#ifndef KVTRIE_CODEC_KV_DUMP_H_
#define KVTRIE_CODEC_KV_DUMP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/block_geometry.h"

namespace kvtrie {

// A dense tensor from a .npy file.
struct NpyArray {
  DType dtype = DType::kFp16;
  std::vector<size_t> shape;
  std::vector<uint8_t> data;  // C order, little-endian
};

// Errors: NOT_FOUND if the file is missing; INVALID_ARGUMENT if it is not a little-endian C-order
// '<f2', '<f4' or bf16 ('<V2' / '|V2') array.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const NpyArray& array);

struct KvDump {
  std::string model_id;  // manifest "model_file" without extension, else "model"
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kFp16;
  std::vector<uint32_t> token_ids;
  std::vector<float> surprisal_bits;  // one per token (0 for BOS)
  std::vector<uint8_t> k;             // [num_layers][num_kv_heads][num_tokens][head_dim]
  std::vector<uint8_t> v;             // same shape
  size_t num_tokens() const { return token_ids.size(); }
};

// Reads `dir`/k.npy, v.npy and manifest.json and checks they agree. Errors: NOT_FOUND for a missing
// file; INVALID_ARGUMENT naming the field where shapes, token counts or manifest fields disagree.
absl::StatusOr<KvDump> ReadKvDump(const std::string& dir);
// Reads only manifest.json (token ids, surprisal, geometry); k and v stay empty.
absl::StatusOr<KvDump> ReadKvManifest(const std::string& dir);
// Writes k.npy, v.npy and manifest.json into `dir` (created if missing).
absl::Status WriteKvDump(const std::string& dir, const KvDump& dump);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_KV_DUMP_H_
