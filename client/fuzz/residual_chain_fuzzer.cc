// client/fuzz/residual_chain_fuzzer.cc
//
// libFuzzer target for the client's RESIDUAL decode chain (client/residual_chain.h): what a
// hostile or broken server could stream to Client::Get in RESIDUAL mode. Input: byte 0 picks the
// geometry's dtype, then records of [u8 flags][u8 block_index][u8 reference_node_id][u16 length]
// [bytes]: the bytes are an encoded block as stored (flags even; almost always stopped by its
// CRC-32C) or (flags odd) [u8 encoding][u8 params length][params][payload] wrapped in a valid
// envelope of the model's geometry, so the decoders behind the checksum run; the centroid fetch
// returns a block of ~1.0 (or NOT_FOUND for odd node ids). Decoding stops at the first error, as
// Client::Get does. Never a crash or out-of-bounds access; a decoded block is exactly
// geometry.num_bytes(). Seeds in client/fuzz/residual_chain_corpus (real residual blocks of
// tests/data with their parents).
#include <cstdint>
#include <string>
#include <vector>

#include "client/residual_chain.h"
#include "codec/block_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // The geometry of tests/data (stories260K): 5 layers, 4 KV heads, head_dim 8, 16 tokens.
  const kvtrie::BlockGeometry g{
      .num_layers = 5,
      .num_kv_heads = 4,
      .block_tokens = 16,
      .head_dim = 8,
      .dtype = (data[0] & 1) ? kvtrie::DType::kBf16 : kvtrie::DType::kFp16};
  kvtrie::ResidualChain chain(g, [&](uint64_t node_id) -> absl::StatusOr<std::vector<uint8_t>> {
    if (node_id & 1) return absl::NotFoundError("node_id: not stored");
    return std::vector<uint8_t>(g.num_bytes(), 0x3c);
  });
  std::vector<uint8_t> out(g.num_bytes());
  const std::vector<uint32_t> tokens(g.block_tokens, 1);
  size_t pos = 1;
  while (pos + 5 <= size) {
    const uint8_t flags = data[pos];
    const uint32_t index = data[pos + 1];
    const uint64_t reference = data[pos + 2];
    size_t n = data[pos + 3] | (data[pos + 4] << 8);
    pos += 5;
    n = std::min(n, size - pos);
    std::string encoded(reinterpret_cast<const char*>(data + pos), n);
    pos += n;
    if ((flags & 1) && encoded.size() >= 2) {
      const auto encoding = static_cast<kvtrie::Encoding>(1 + static_cast<uint8_t>(encoded[0]) % 6);
      const absl::string_view rest = absl::string_view(encoded).substr(2);
      const size_t split = std::min<size_t>(static_cast<uint8_t>(encoded[1]), rest.size());
      encoded = kvtrie::internal::WriteEnvelope(encoding, g, (flags & 2) ? reference : 0,
                                                rest.substr(0, split), rest.substr(split));
    }
    if (!chain.Decode(index, reference, 0, tokens, encoded, absl::MakeSpan(out)).ok()) break;
  }
  return 0;
}
