#include "codec/lossless.h"

#include <zstd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

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

}  // namespace kvtrie
