#include "codec/kv_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvtrie {
namespace {

// Calls fn(seq_offset_bytes, block_offset_bytes, row_bytes, is_v) for each contiguous row.
// Layers [layer_begin, layer_end); block offsets are from layer_begin's start.
template <typename Fn>
void ForEachRow(const BlockGeometry& g, size_t num_tokens, size_t block_index, Fn fn,
                size_t layer_begin = 0, size_t layer_end = SIZE_MAX) {
  const size_t eb = DTypeBytes(g.dtype);
  const size_t row = static_cast<size_t>(g.block_tokens) * g.head_dim * eb;
  const size_t first_token = block_index * g.block_tokens;
  const size_t skipped = layer_begin * 2 * g.num_kv_heads * row;
  for (size_t l = layer_begin; l < std::min<size_t>(layer_end, g.num_layers); ++l) {
    for (size_t kv = 0; kv < 2; ++kv) {
      for (size_t h = 0; h < g.num_kv_heads; ++h) {
        const size_t seq = ((l * g.num_kv_heads + h) * num_tokens + first_token) * g.head_dim * eb;
        const size_t blk = ((l * 2 + kv) * g.num_kv_heads + h) * row;
        fn(seq, blk - skipped, row, kv == 1);
      }
    }
  }
}

}  // namespace

void GatherBlock(const BlockGeometry& geometry, size_t num_tokens, const uint8_t* k,
                 const uint8_t* v, size_t block_index, absl::Span<uint8_t> block) {
  ForEachRow(geometry, num_tokens, block_index, [&](size_t seq, size_t blk, size_t n, bool is_v) {
    std::memcpy(block.data() + blk, (is_v ? v : k) + seq, n);
  });
}

void ScatterBlock(const BlockGeometry& geometry, size_t num_tokens, absl::Span<const uint8_t> block,
                  size_t block_index, uint8_t* k, uint8_t* v) {
  ForEachRow(geometry, num_tokens, block_index, [&](size_t seq, size_t blk, size_t n, bool is_v) {
    std::memcpy((is_v ? v : k) + seq, block.data() + blk, n);
  });
}

void ScatterLayers(const BlockGeometry& geometry, size_t num_tokens, uint32_t layer_begin,
                   uint32_t layer_end, absl::Span<const uint8_t> layers, size_t block_index,
                   uint8_t* k, uint8_t* v) {
  ForEachRow(
      geometry, num_tokens, block_index,
      [&](size_t seq, size_t blk, size_t n, bool is_v) {
        std::memcpy((is_v ? v : k) + seq, layers.data() + blk, n);
      },
      layer_begin, layer_end);
}

void ScatterLayerPieces(const BlockGeometry& geometry, size_t num_tokens, uint32_t layer_begin,
                        uint32_t layer_end, absl::Span<const absl::Span<const uint8_t>> pieces,
                        size_t block_index, uint8_t* k, uint8_t* v) {
  size_t piece = 0, offset = 0;  // the cursor: rows come in block order, consecutive
  ForEachRow(
      geometry, num_tokens, block_index,
      [&](size_t seq, size_t, size_t n, bool is_v) {
        uint8_t* dst = (is_v ? v : k) + seq;
        while (n > 0 && piece < pieces.size()) {
          const size_t take = std::min(n, pieces[piece].size() - offset);
          std::memcpy(dst, pieces[piece].data() + offset, take);
          dst += take;
          n -= take;
          offset += take;
          if (offset == pieces[piece].size()) {
            ++piece;
            offset = 0;
          }
        }
      },
      layer_begin, layer_end);
}

}  // namespace kvtrie
