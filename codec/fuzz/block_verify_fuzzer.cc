// codec/fuzz/block_verify_fuzzer.cc
//
// libFuzzer target for VerifyEncodedBlock (codec/block_verify.h), what the server runs on every
// block of an encoded Put, and for the decoder behind it: whatever the bytes, the verifier returns
// INVALID_ARGUMENT or a header, and a block it accepts decodes or fails with a status — never a
// crash, hang or read out of bounds (AddressSanitizer). The model is a small fp16 block (2
// layers, 2 KV heads, 4 tokens, head_dim 8). Input byte 0 picks the mode:
//   even: the rest is the encoded block as sent (almost always stopped by the CRC-32C);
//   odd:  byte 1 picks RAW, LOSSLESS fast or RESIDUAL fast, byte 2 where params end; the rest
//         becomes params + payload in a *valid* envelope, so the checks behind the CRC run; with
//         bit 1 of byte 0 the envelope names predictor version 1 (decoded without the state:
//         FAILED_PRECONDITION).
// Seeds (codec/fuzz/block_verify_corpus): odd-mode inputs made from real encodings of the model.
// ctest runs it briefly (block_verify_fuzzer_smoke); longer: bench/fuzz_long.sh.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "codec/block_codec.h"
#include "codec/block_verify.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const kvtrie::BlockGeometry g{.num_layers = 2,
                                .num_kv_heads = 2,
                                .block_tokens = 4,
                                .head_dim = 8,
                                .dtype = kvtrie::DType::kFp16};
  const absl::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string block;
  if ((data[0] & 1) == 0) {
    block = std::string(in);
  } else {
    if (in.size() < 2) return 0;
    static constexpr kvtrie::Encoding kEncodings[] = {
        kvtrie::Encoding::kRaw, kvtrie::Encoding::kLossless, kvtrie::Encoding::kResidual};
    const kvtrie::Encoding e = kEncodings[static_cast<uint8_t>(in[0]) % 3];
    const absl::string_view rest = in.substr(2);
    const size_t split = std::min<size_t>(static_cast<uint8_t>(in[1]), rest.size());
    const bool named = (data[0] & 2) != 0 && e == kvtrie::Encoding::kResidual;
    block = kvtrie::internal::WriteEnvelope(
        e, g, 0, rest.substr(0, split), rest.substr(split),
        e == kvtrie::Encoding::kRaw ? kvtrie::Profile::kCompact : kvtrie::Profile::kFast,
        named ? 1 : 0);
  }
  absl::StatusOr<kvtrie::BlockHeader> h = kvtrie::VerifyEncodedBlock(g, block);
  if (!h.ok()) {
    if (!absl::IsInvalidArgument(h.status())) std::abort();
    return 0;
  }
  std::vector<uint8_t> out(g.num_bytes());
  (void)kvtrie::DecodeBlock(block, absl::MakeSpan(out));
  return 0;
}
