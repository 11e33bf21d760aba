// codec/fuzz/decode_fuzzer.cc
//
// libFuzzer target for DecodeBlock: whatever the bytes, decoding returns a status (DATA_LOSS,
// FAILED_PRECONDITION, INVALID_ARGUMENT) or fills the output — never a crash, hang, or read out
// of bounds (AddressSanitizer). Input byte 0 picks the mode:
//   even: the rest is an encoded block as stored (almost always stopped by the CRC-32C);
//   odd:  byte 1 picks the encoding, byte 2 where params end; the rest becomes params + payload of
//         a small block wrapped in a *valid* envelope, so the decoders behind the checksum run;
//         with bit 2 of byte 0 the envelope names a reference and sets flags bit 7, so the params
//         start with a shifted reference's prefix (codec/reference_shift.h).
// Build (clang only; see codec/CMakeLists.txt):
//   CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz -G Ninja -DKVTRIE_BUILD_FUZZERS=ON
//   ninja -C build-fuzz codec_decode_fuzzer
// ctest runs it briefly (codec_decode_fuzzer_smoke). Run it longer, e.g. from bench/:
//   mkdir -p /tmp/fuzz-corpus && build-fuzz/codec/codec_decode_fuzzer /tmp/fuzz-corpus \
//       -max_total_time=600 -max_len=4096
#include <cstddef>
#include <cstdint>
#include <vector>

#include "codec/block_codec.h"
#include "codec/crc32c.h"

namespace {

constexpr size_t kMaxOutputBytes = 1 << 20;

void Decode(absl::string_view encoded, const kvtrie::BlockGeometry* g) {
  absl::StatusOr<kvtrie::BlockHeader> h = kvtrie::ParseBlock(encoded);
  if (!h.ok()) return;
  const size_t bytes = h->geometry.num_bytes();
  if (bytes > kMaxOutputBytes) return;
  std::vector<uint8_t> out(bytes), ctx(bytes, 0x3c);  // 0x3c3c: fp16 ~1.06
  kvtrie::PredictionContext c;
  if (g != nullptr) {
    c = {.parent = ctx,
         .reference = ctx,
         .reference_parent = ctx,
         .external = ctx,
         .surprisal_bits = {}};
  }
  (void)kvtrie::DecodeBlock(encoded, absl::MakeSpan(out), c);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const absl::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) {
    Decode(in, nullptr);
    return 0;
  }
  if (in.size() < 2) return 0;
  const kvtrie::BlockGeometry g{
      .num_layers = 2,
      .num_kv_heads = 2,
      .block_tokens = 4,
      .head_dim = 8,
      .dtype = (data[0] & 2) ? kvtrie::DType::kBf16 : kvtrie::DType::kFp16};
  const auto encoding = static_cast<kvtrie::Encoding>(1 + static_cast<uint8_t>(in[0]) % 6);
  const absl::string_view rest = in.substr(2);
  const size_t split = std::min<size_t>(static_cast<uint8_t>(in[1]), rest.size());
  const bool shifted = (data[0] & 4) != 0;
  std::string block = kvtrie::internal::WriteEnvelope(encoding, g, shifted ? 7 : 0,
                                                      rest.substr(0, split), rest.substr(split));
  if (shifted) {  // flags bit 7, and the CRC-32C again
    block[7] = static_cast<char>(static_cast<uint8_t>(block[7]) | 0x80);
    const uint32_t crc = kvtrie::Crc32c(absl::string_view(block).substr(0, block.size() - 4));
    for (int i = 0; i < 4; ++i) block[block.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  }
  Decode(block, &g);
  return 0;
}
