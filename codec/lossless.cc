#include "codec/lossless.h"

#include <zstd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/rans.h"

namespace kvtrie {
namespace {
constexpr int kZstdLevel = 3;
}  // namespace

void CompressBytePlanes(absl::Span<const uint8_t> data, size_t element_bytes, std::string* out) {
  const size_t n = data.size() / element_bytes;
  std::vector<uint8_t> planes(data.size());
  // Most significant byte plane first: little-endian elements, so byte element_bytes-1 first.
  for (size_t b = 0; b < element_bytes; ++b) {
    uint8_t* plane = planes.data() + b * n;
    const size_t src_byte = element_bytes - 1 - b;
    for (size_t i = 0; i < n; ++i) plane[i] = data[i * element_bytes + src_byte];
  }
  const size_t bound = ZSTD_compressBound(planes.size());
  const size_t old = out->size();
  out->resize(old + bound);
  const size_t written =
      ZSTD_compress(out->data() + old, bound, planes.data(), planes.size(), kZstdLevel);
  // ZSTD_compress cannot fail with a bound-sized destination and a valid level.
  out->resize(old + (ZSTD_isError(written) ? 0 : written));
}

absl::Status DecompressBytePlanes(absl::string_view compressed, size_t element_bytes,
                                  absl::Span<uint8_t> out) {
  if (element_bytes == 0 || out.size() % element_bytes != 0) {
    return absl::InvalidArgumentError("element_bytes: does not divide the output size");
  }
  const unsigned long long content = ZSTD_getFrameContentSize(compressed.data(), compressed.size());
  if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN ||
      content != out.size()) {
    return absl::DataLossError(absl::StrCat("lossless payload: frame holds ", content,
                                            " bytes, block needs ", out.size()));
  }
  std::vector<uint8_t> planes(out.size());
  const size_t got =
      ZSTD_decompress(planes.data(), planes.size(), compressed.data(), compressed.size());
  if (ZSTD_isError(got) || got != out.size()) {
    return absl::DataLossError(absl::StrCat("lossless payload: zstd: ",
                                            ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short"));
  }
  const size_t n = out.size() / element_bytes;
  for (size_t b = 0; b < element_bytes; ++b) {
    const uint8_t* plane = planes.data() + b * n;
    const size_t dst_byte = element_bytes - 1 - b;
    for (size_t i = 0; i < n; ++i) out[i * element_bytes + dst_byte] = plane[i];
  }
  return absl::OkStatus();
}

namespace {

// The adaptive models of CompressHalfWords, in one place for encoder and decoder.
struct HalfWordModels {
  static constexpr int kNone = 16;
  std::vector<AdaptiveModel> n1, n2;
  HalfWordModels() : n1(2 * 17, AdaptiveModel(0.5)), n2(2 * 16 * 17, AdaptiveModel(1.0)) {}
  AdaptiveModel& N2(size_t kv, int n1v, int c2) { return n2[(kv * 16 + n1v) * 17 + c2]; }
};

// Calls fn(index, kv, previous_index or -1) over a block in coding order.
template <typename Fn>
void ForEachHalfWord(const BlockGeometry& g, Fn fn) {
  const size_t T = g.block_tokens, D = g.head_dim;
  for (size_t plane = 0; plane < 2 * g.num_layers; ++plane) {
    const size_t kv = plane % 2;
    for (size_t h = 0; h < g.num_kv_heads; ++h) {
      const size_t base = (plane * g.num_kv_heads + h) * T * D;
      for (size_t t = 0; t < T; ++t) {
        for (size_t d = 0; d < D; ++d) {
          const size_t i = base + t * D + d;
          fn(i, kv, t ? static_cast<long>(i - D) : -1L);
        }
      }
    }
  }
}

}  // namespace

void CompressHalfWords(const BlockGeometry& g, absl::Span<const uint8_t> data, std::string* out) {
  HalfWordModels m;
  RansEncoder enc;
  enc.Reserve(3 * (data.size() / 2));
  ForEachHalfWord(g, [&](size_t i, size_t kv, long prev) {
    const uint8_t hb = data[2 * i + 1], lb = data[2 * i];
    const int n1 = hb >> 4, n2 = hb & 15;
    int c1 = HalfWordModels::kNone, c2 = HalfWordModels::kNone;
    if (prev >= 0) {
      const uint8_t phb = data[2 * prev + 1];
      c1 = phb >> 4;
      if (c1 == n1) c2 = phb & 15;
    }
    enc.Put(m.n1[kv * 17 + c1], n1);
    enc.Put(m.N2(kv, n1, c2), n2);
    enc.PutBits(lb, 8);  // the low mantissa byte is noise: 8.00 bits of entropy on tests/data
  });
  enc.Finish(out);
}

absl::Status DecompressHalfWords(const BlockGeometry& g, absl::string_view compressed,
                                 absl::Span<uint8_t> out) {
  if (DTypeBytes(g.dtype) != 2 || out.size() != g.num_bytes()) {
    return absl::DataLossError("lossless payload: half-word coding of a non 2-byte block");
  }
  HalfWordModels m;
  RansDecoder dec(compressed);
  ForEachHalfWord(g, [&](size_t i, size_t kv, long prev) {
    int c1 = HalfWordModels::kNone, c2 = HalfWordModels::kNone;
    const int n1 = dec.Get(m.n1[kv * 17 + (prev >= 0 ? out[2 * prev + 1] >> 4 : c1)]);
    if (prev >= 0 && (out[2 * prev + 1] >> 4) == n1) c2 = out[2 * prev + 1] & 15;
    const int n2 = dec.Get(m.N2(kv, n1, c2));
    out[2 * i + 1] = static_cast<uint8_t>((n1 << 4) | n2);
    out[2 * i] = static_cast<uint8_t>(dec.GetBits(8));
  });
  return dec.Finish();
}

}  // namespace kvtrie
