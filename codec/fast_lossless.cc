#include "codec/fast_lossless.h"

#include <zstd.h>

#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {

constexpr int kZstdLevel = 1;

// planes[b][i] = byte (eb - 1 - b) of element i.
void Split(const uint8_t* src, size_t n, size_t eb, uint8_t* planes) {
  if (eb == 2) {
    uint8_t* hi = planes;
    uint8_t* lo = planes + n;
    size_t i = 0;
#if defined(__SSE2__)
    const __m128i mask = _mm_set1_epi16(0xff);
    for (; i + 16 <= n; i += 16) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i + 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i),
                       _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i),
                       _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
    }
#endif
    for (; i < n; ++i) lo[i] = src[2 * i], hi[i] = src[2 * i + 1];
    return;
  }
  for (size_t b = 0; b < eb; ++b) {
    uint8_t* plane = planes + b * n;
    for (size_t i = 0; i < n; ++i) plane[i] = src[i * eb + eb - 1 - b];
  }
}

void Join(const uint8_t* hi, const uint8_t* rest, size_t n, size_t eb, uint8_t* dst) {
  if (eb == 2) {
    size_t i = 0;
#if defined(__SSE2__)
    for (; i + 16 <= n; i += 16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + i));
      const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rest + i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm_unpacklo_epi8(l, h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16), _mm_unpackhi_epi8(l, h));
    }
#endif
    for (; i < n; ++i) dst[2 * i] = rest[i], dst[2 * i + 1] = hi[i];
    return;
  }
  for (size_t i = 0; i < n; ++i) dst[i * eb + eb - 1] = hi[i];
  for (size_t b = 1; b < eb; ++b) {
    const uint8_t* plane = rest + (b - 1) * n;
    for (size_t i = 0; i < n; ++i) dst[i * eb + eb - 1 - b] = plane[i];
  }
}

}  // namespace

void CompressFastLossless(const BlockGeometry& g, absl::Span<const uint8_t> data,
                          std::string* out) {
  const size_t eb = DTypeBytes(g.dtype), n = data.size() / eb;
  std::vector<uint8_t> planes(data.size());
  Split(data.data(), n, eb, planes.data());
  const size_t bound = ZSTD_compressBound(n);
  const size_t old = out->size();
  out->resize(old + 4 + bound + (eb - 1) * n);
  const size_t f = ZSTD_compress(out->data() + old + 4, bound, planes.data(), n, kZstdLevel);
  // ZSTD_compress cannot fail with a bound-sized destination and a valid level.
  const uint32_t frame = ZSTD_isError(f) ? 0 : static_cast<uint32_t>(f);
  std::memcpy(out->data() + old, &frame, 4);
  std::memcpy(out->data() + old + 4 + frame, planes.data() + n, (eb - 1) * n);
  out->resize(old + 4 + frame + (eb - 1) * n);
}

absl::Status DecompressFastLossless(const BlockGeometry& g, absl::string_view payload,
                                    absl::Span<uint8_t> out) {
  const size_t eb = DTypeBytes(g.dtype), n = g.num_elements();
  if (out.size() != n * eb) return absl::InvalidArgumentError("out: wrong size");
  uint32_t frame = 0;
  if (payload.size() < 4) return absl::DataLossError("fast lossless payload: truncated");
  std::memcpy(&frame, payload.data(), 4);
  if (frame > payload.size() - 4 || payload.size() - 4 - frame != (eb - 1) * n) {
    return absl::DataLossError(absl::StrCat("fast lossless payload: ", payload.size(),
                                            " bytes do not match frame length ", frame));
  }
  std::vector<uint8_t> hi(n);
  const size_t got = ZSTD_decompress(hi.data(), n, payload.data() + 4, frame);
  if (ZSTD_isError(got) || got != n) {
    return absl::DataLossError(absl::StrCat("fast lossless payload: zstd: ",
                                            ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short"));
  }
  Join(hi.data(), reinterpret_cast<const uint8_t*>(payload.data()) + 4 + frame, n, eb, out.data());
  return absl::OkStatus();
}

}  // namespace kvtrie
