// codec/kv_layout.h
//
// Moves KV between the sequence layout workers and dumps use — K and V as two tensors
// [num_layers][num_kv_heads][num_tokens][head_dim] (the layout of shared/data's k.npy / v.npy and
// of llama.cpp's per-layer caches) — and the block layout of block_geometry.h
// [num_layers][2][num_kv_heads][block_tokens][head_dim].
#ifndef KVTRIE_CODEC_KV_LAYOUT_H_
#define KVTRIE_CODEC_KV_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "codec/block_geometry.h"

namespace kvtrie {

// Copies tokens [block_index * block_tokens, (block_index + 1) * block_tokens) of `k` and `v`
// (each num_layers * num_kv_heads * num_tokens * head_dim elements of geometry.dtype) into `block`
// (geometry.num_bytes()). REQUIRES: the block lies within num_tokens; sizes as stated.
void GatherBlock(const BlockGeometry& geometry, size_t num_tokens, const uint8_t* k,
                 const uint8_t* v, size_t block_index, absl::Span<uint8_t> block);

// Writes layers [layer_begin, layer_end) of block `block_index` — `layers`, the block layout's
// [layer_end - layer_begin][2][num_kv_heads][block_tokens][head_dim] — into `k` and `v`.
// REQUIRES: layer_begin < layer_end <= num_layers, layers.size() = that range's bytes.
void ScatterLayers(const BlockGeometry& geometry, size_t num_tokens, uint32_t layer_begin,
                   uint32_t layer_end, absl::Span<const uint8_t> layers, size_t block_index,
                   uint8_t* k, uint8_t* v);

// As ScatterLayers, with the layers' bytes in consecutive pieces (e.g. the slices a message
// arrived in). REQUIRES: the pieces' sizes add up to the layer range's bytes.
void ScatterLayerPieces(const BlockGeometry& geometry, size_t num_tokens, uint32_t layer_begin,
                        uint32_t layer_end, absl::Span<const absl::Span<const uint8_t>> pieces,
                        size_t block_index, uint8_t* k, uint8_t* v);

// Inverse of GatherBlock: writes `block` into its tokens of `k` and `v`.
void ScatterBlock(const BlockGeometry& geometry, size_t num_tokens, absl::Span<const uint8_t> block,
                  size_t block_index, uint8_t* k, uint8_t* v);

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_KV_LAYOUT_H_
