// codec/testing_mutate.h
//
// Test helper: a hostile client's forgery of a real envelope (envelope.h) — bytes of its
// params or payload changed and the CRC-32C recomputed, so that the envelope still parses and
// only decoding (and the content checksum) can tell. Not part of the library.
#ifndef KVTRIE_CODEC_TESTING_MUTATE_H_
#define KVTRIE_CODEC_TESTING_MUTATE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "codec/crc32c.h"
#include "codec/envelope.h"
#include "codec/little_endian.h"

namespace kvtrie::testing {

// Where a mutation lands: the payload's or the params' bytes.
enum class MutateWhere { kPayload, kParams };

// Returns `encoded` with byte `offset` of its payload (or params), taken modulo their size,
// XORed with `mask` (nonzero) and the CRC-32C fixed up. Returns "" if `encoded` does not parse
// or the region is empty.
inline std::string MutateFixCrc(absl::string_view encoded, size_t offset, uint8_t mask,
                                MutateWhere where = MutateWhere::kPayload) {
  absl::StatusOr<BlockHeader> h = ParseBlock(encoded);
  if (!h.ok()) return "";
  const absl::string_view region = where == MutateWhere::kPayload ? h->payload : h->params;
  if (region.empty()) return "";
  std::string out(encoded);
  const size_t at = static_cast<size_t>(region.data() - encoded.data()) + offset % region.size();
  out[at] = static_cast<char>(static_cast<uint8_t>(out[at]) ^ mask);
  out.resize(out.size() - 4);
  internal::PutLE<uint32_t>(&out, Crc32c(out));
  return out;
}

}  // namespace kvtrie::testing

#endif  // KVTRIE_CODEC_TESTING_MUTATE_H_
