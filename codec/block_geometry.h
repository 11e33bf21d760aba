// codec/block_geometry.h
//
// The shape and element type of one KV block, and the dtype helpers the codec uses.
//
// A block holds `block_tokens` consecutive tokens of one sequence and their KV cache for every
// layer: a dense tensor [num_layers][2][num_kv_heads][block_tokens][head_dim] (2 = K then V),
// row-major, little-endian elements of `dtype`. This is the layout on the wire (kvtrie.v1
// PutBlock/GetBlock) and in the codec. A layer range [layer_begin, layer_end) of a block is the
// contiguous slice [layer_end - layer_begin][2][num_kv_heads][block_tokens][head_dim].
#ifndef KVTRIE_CODEC_BLOCK_GEOMETRY_H_
#define KVTRIE_CODEC_BLOCK_GEOMETRY_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvtrie {

// Element type of a KV tensor. Values match kvtrie.v1.DType.
enum class DType : uint8_t {
  kFp16 = 1,
  kBf16 = 2,
  kFp32 = 3,
  // One-byte dtypes (vLLM's --kv-cache-dtype fp8 caches, uint8 pages): stored bit-exact only
  // (RAW or LOSSLESS; the codec treats them as bytes and refuses every lossy encoding).
  kFp8E4m3 = 4,  // OCP FP8 E4M3 ("e4m3fn": no infinities, 0x7f / 0xff are NaN)
  kFp8E5m2 = 5,  // OCP FP8 E5M2 (the high byte of an fp16)
  kUint8 = 6,    // opaque bytes
};

// Bytes per element: 1 for fp8 / uint8, 2 for fp16/bf16, 4 for fp32.
size_t DTypeBytes(DType dtype);
// "fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "uint8".
absl::string_view DTypeName(DType dtype);
// True if `value` is one of the DType enumerators.
bool IsValidDType(uint32_t value);
// True for the one-byte dtypes (fp8_e4m3, fp8_e5m2, uint8): RAW or LOSSLESS only.
inline bool IsByteDType(DType dtype) {
  return dtype == DType::kFp8E4m3 || dtype == DType::kFp8E5m2 || dtype == DType::kUint8;
}

struct BlockGeometry {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t block_tokens = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kFp16;

  // Elements in one K or V plane of one layer: num_kv_heads * block_tokens * head_dim.
  size_t plane_elements() const {
    return static_cast<size_t>(num_kv_heads) * block_tokens * head_dim;
  }
  // Elements of one layer (K and V): 2 * plane_elements().
  size_t layer_elements() const { return 2 * plane_elements(); }
  // Elements of the whole block: num_layers * layer_elements().
  size_t num_elements() const { return num_layers * layer_elements(); }
  // Bytes of the dense block in `dtype`.
  size_t num_bytes() const { return num_elements() * DTypeBytes(dtype); }
  // Bytes of layers [layer_begin, layer_end).
  size_t layer_range_bytes(uint32_t layer_begin, uint32_t layer_end) const {
    return (layer_end - layer_begin) * layer_elements() * DTypeBytes(dtype);
  }

  // Largest block accepted: 1 GiB (a 405B-parameter model's 16-token fp16 block is ~8 MiB).
  static constexpr uint64_t kMaxBlockBytes = 1ull << 30;

  // OK if every dimension is in [1, 65535], dtype is valid and the block has at most
  // kMaxBlockBytes bytes; otherwise INVALID_ARGUMENT naming the field (`num_layers`,
  // `num_kv_heads`, `block_tokens`, `head_dim`, `dtype`).
  absl::Status Validate() const;
  // "num_layers=5 num_kv_heads=4 block_tokens=16 head_dim=8 dtype=fp16".
  std::string DebugString() const;

  friend bool operator==(const BlockGeometry&, const BlockGeometry&) = default;
};

// IEEE half / bfloat16 conversions (round to nearest even on the way down).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
inline float Bf16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// The largest finite value of `dtype` (fp16 65504, bf16 0x7f7f, fp32 FLT_MAX).
inline float MaxFiniteValue(DType dtype) {
  switch (dtype) {
    case DType::kFp16:
      return 65504.0f;
    case DType::kBf16:
      return Bf16ToFloat(0x7f7f);
    case DType::kFp8E4m3:
      return 448.0f;
    case DType::kFp8E5m2:
      return 57344.0f;
    case DType::kUint8:
      return 255.0f;
    case DType::kFp32:
      break;
  }
  return std::numeric_limits<float>::max();
}
uint16_t FloatToBf16(float f);
// OCP FP8 decodes (E4M3 "fn": 0x7f / 0xff are NaN, no infinities; E5M2: an fp16's high byte).
float Fp8E4m3ToFloat(uint8_t b);
float Fp8E5m2ToFloat(uint8_t b);

// Converts `n` elements of `dtype` starting at `src` to float (fp8 decoded, uint8 as 0..255).
void ToFloat(DType dtype, const void* src, size_t n, float* dst);
// Converts `n` floats to `dtype` (rounding to nearest even; one-byte dtypes to the nearest
// representable value, saturating; no lossy path of the codec reaches them).
void FromFloat(DType dtype, const float* src, size_t n, void* dst);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_BLOCK_GEOMETRY_H_
