#include "codec/centroid_lossless.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/lossless.h"

namespace kvtrie {
namespace {

template <typename U, typename S>
void Diff(absl::Span<const uint8_t> data, absl::Span<const uint8_t> reference,
          std::vector<uint8_t>* out) {
  const size_t n = data.size() / sizeof(U);
  out->resize(data.size());
  for (size_t i = 0; i < n; ++i) {
    U x, r;
    std::memcpy(&x, data.data() + i * sizeof(U), sizeof(U));
    std::memcpy(&r, reference.data() + i * sizeof(U), sizeof(U));
    const S d = static_cast<S>(static_cast<U>(x - r));
    // Zig-zag: 0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ...
    const U z = static_cast<U>((static_cast<U>(d) << 1) ^ static_cast<U>(d >> (8 * sizeof(U) - 1)));
    std::memcpy(out->data() + i * sizeof(U), &z, sizeof(U));
  }
}

template <typename U>
void Undiff(absl::Span<const uint8_t> zigzag, absl::Span<const uint8_t> reference,
            absl::Span<uint8_t> out) {
  const size_t n = out.size() / sizeof(U);
  for (size_t i = 0; i < n; ++i) {
    U z, r;
    std::memcpy(&z, zigzag.data() + i * sizeof(U), sizeof(U));
    std::memcpy(&r, reference.data() + i * sizeof(U), sizeof(U));
    const U d = static_cast<U>((z >> 1) ^ static_cast<U>(-static_cast<U>(z & 1)));
    const U x = static_cast<U>(r + d);
    std::memcpy(out.data() + i * sizeof(U), &x, sizeof(U));
  }
}

}  // namespace

void CompressCentroidDiff(absl::Span<const uint8_t> data, absl::Span<const uint8_t> reference,
                          size_t element_bytes, std::string* out) {
  std::vector<uint8_t> zigzag;
  if (element_bytes == 1) {  // fp8 / uint8 (block_geometry.h): their bytes
    Diff<uint8_t, int8_t>(data, reference, &zigzag);
  } else if (element_bytes == 2) {
    Diff<uint16_t, int16_t>(data, reference, &zigzag);
  } else {
    Diff<uint32_t, int32_t>(data, reference, &zigzag);
  }
  CompressBytePlanes(zigzag, element_bytes, out);
}

absl::Status DecompressCentroidDiff(absl::string_view compressed,
                                    absl::Span<const uint8_t> reference, size_t element_bytes,
                                    absl::Span<uint8_t> out) {
  if (reference.size() != out.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: ", reference.size(), " bytes, the block needs ", out.size()));
  }
  if (element_bytes != 1 && element_bytes != 2 && element_bytes != 4) {
    return absl::DataLossError(absl::StrCat("centroid diff: element size ", element_bytes));
  }
  std::vector<uint8_t> zigzag(out.size());
  if (auto s = DecompressBytePlanes(compressed, element_bytes, absl::MakeSpan(zigzag)); !s.ok()) {
    return s;
  }
  if (element_bytes == 1) {
    Undiff<uint8_t>(zigzag, reference, out);
  } else if (element_bytes == 2) {
    Undiff<uint16_t>(zigzag, reference, out);
  } else {
    Undiff<uint32_t>(zigzag, reference, out);
  }
  return absl::OkStatus();
}

}  // namespace kvtrie
