// codec/testing_mutants.h
//
// Test helper (issue 30): mutants of real envelopes as a hostile client sends them — payload
// bytes altered and the CRC-32C trailer recomputed, so that every check before the codec's own
// decode passes. Not part of the library.
#ifndef KVTRIE_CODEC_TESTING_MUTANTS_H_
#define KVTRIE_CODEC_TESTING_MUTANTS_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "codec/block_codec.h"
#include "codec/block_verify.h"
#include "codec/crc32c.h"

namespace kvtrie {

// `encoded` with its last 4 bytes set to the CRC-32C of the bytes before them.
inline std::string FixEnvelopeCrc(std::string encoded) {
  const uint32_t crc = Crc32c(absl::string_view(encoded).substr(0, encoded.size() - 4));
  std::memcpy(encoded.data() + encoded.size() - 4, &crc, 4);  // little-endian hosts
  return encoded;
}

// `encoded` (a well-formed envelope) with byte `offset` of its payload XORed with `mask` and its
// CRC-32C fixed up. INVALID_ARGUMENT if `offset` is past the payload.
inline absl::StatusOr<std::string> MutatePayloadByte(absl::string_view encoded, size_t offset,
                                                     uint8_t mask) {
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  if (!h.ok()) return h.status();
  if (offset >= h->payload.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset: ", offset, " is past the payload of ", h->payload.size(), " bytes"));
  }
  std::string out(encoded);
  out[static_cast<size_t>(h->payload.data() - encoded.data()) + offset] ^= static_cast<char>(mask);
  return FixEnvelopeCrc(std::move(out));
}

// The mutants of issue 30 row 1: every MutatePayloadByte(encoded, i, 0xff) over the zstd frame
// of a fast LOSSLESS envelope (payload bytes [4, 4 + frame length)) that VerifyEncodedBlock
// (what --verify_encoded_puts=structure checks) accepts and that does not decode (DecodeBlock:
// DATA_LOSS "zstd: ..."), in payload order, at most `limit`. Most payload mutants of such a
// block decode to other values without an error (issue 30 row 4); these are the others.
inline std::vector<std::string> UndecodableLosslessMutants(const BlockGeometry& g,
                                                           absl::string_view encoded,
                                                           size_t limit = 1) {
  std::vector<std::string> found;
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  if (!h.ok() || h->encoding != Encoding::kLossless || h->payload.size() < 4) return found;
  uint32_t frame = 0;
  std::memcpy(&frame, h->payload.data(), 4);
  std::vector<uint8_t> out(g.num_bytes());
  for (size_t i = 4; i < 4 + static_cast<size_t>(frame) && found.size() < limit; ++i) {
    absl::StatusOr<std::string> m = MutatePayloadByte(encoded, i, 0xff);
    if (!m.ok() || !VerifyEncodedBlock(g, *m).ok()) continue;
    if (absl::IsDataLoss(DecodeBlock(*m, absl::MakeSpan(out)))) found.push_back(*std::move(m));
  }
  return found;
}

}  // namespace kvtrie

#endif  // KVTRIE_CODEC_TESTING_MUTANTS_H_
