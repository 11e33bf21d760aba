// server/byte_size.h
//
// ByteSize: a byte count for flags and the config file, written with an optional unit.
//   "8GiB", "512KiB", "1MiB"   binary: KiB = 1024, MiB = 1024^2, GiB = 1024^3, TiB = 1024^4
//   "1MB", "10GB", "2kB"       decimal: kB/KB = 1000, MB = 10^6, GB = 10^9, TB = 10^12
//   "4096", "4096B"            bytes
// Units are case-sensitive in their prefix letter except k/K; "1.5GiB" is allowed and rounds
// down to whole bytes. Errors: a message naming the text (absl flags prefix it with the flag).
#ifndef KVTRIE_SERVER_BYTE_SIZE_H_
#define KVTRIE_SERVER_BYTE_SIZE_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace kvtrie {

struct ByteSize {
  uint64_t bytes = 0;
};

// What `--help` says about the units (a string literal, appended to each byte flag's help).
#define KVTRIE_BYTE_UNITS_HELP \
  " (bytes; units: KiB/MiB/GiB/TiB = 1024^n, kB/MB/GB/TB = 1000^n, e.g. 8GiB)"

// Parses `text` into *out. Returns false and sets *error on bad input or overflow.
bool ParseByteSize(absl::string_view text, uint64_t* out, std::string* error);

// Shortest exact form: "8GiB", "1MB", "1000001".
std::string FormatByteSize(uint64_t bytes);

// Abseil flag support: ABSL_FLAG(kvtrie::ByteSize, memory_bytes, ...).
bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error);
std::string AbslUnparseFlag(ByteSize size);

}  // namespace kvtrie

#endif  // KVTRIE_SERVER_BYTE_SIZE_H_
