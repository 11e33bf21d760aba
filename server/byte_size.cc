#include "server/byte_size.h"

#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvtrie {
namespace {

struct Unit {
  const char* name;
  uint64_t factor;
};

constexpr Unit kUnits[] = {
    {"TiB", 1ull << 40},
    {"GiB", 1ull << 30},
    {"MiB", 1ull << 20},
    {"KiB", 1ull << 10},
    {"kiB", 1ull << 10},
    {"TB", 1000000000000ull},
    {"GB", 1000000000ull},
    {"MB", 1000000ull},
    {"kB", 1000ull},
    {"KB", 1000ull},
    {"B", 1},
};

}  // namespace

bool ParseByteSize(absl::string_view text, uint64_t* out, std::string* error) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  uint64_t factor = 1;
  for (const Unit& u : kUnits) {
    if (absl::EndsWith(s, u.name)) {
      factor = u.factor;
      s.remove_suffix(std::char_traits<char>::length(u.name));
      s = absl::StripTrailingAsciiWhitespace(s);
      break;
    }
  }
  if (s.empty()) {
    *error = absl::StrCat("'", text, "' is not a byte size (e.g. 4096, 512KiB, 8GiB, 1MB)");
    return false;
  }
  uint64_t whole = 0;
  if (absl::SimpleAtoi(s, &whole)) {
    if (whole > std::numeric_limits<uint64_t>::max() / factor) {
      *error = absl::StrCat("'", text, "' overflows 64 bits");
      return false;
    }
    *out = whole * factor;
    return true;
  }
  double value = 0;
  if (!absl::SimpleAtod(s, &value) || !std::isfinite(value) || value < 0 ||
      s.find_first_not_of("0123456789.") != absl::string_view::npos) {
    *error = absl::StrCat("'", text, "' is not a byte size (e.g. 4096, 512KiB, 8GiB, 1MB)");
    return false;
  }
  const double bytes = std::floor(value * static_cast<double>(factor));
  if (bytes >= 18446744073709551615.0) {
    *error = absl::StrCat("'", text, "' overflows 64 bits");
    return false;
  }
  *out = static_cast<uint64_t>(bytes);
  return true;
}

std::string FormatByteSize(uint64_t bytes) {
  if (bytes == 0) return "0";
  // The exact unit with the smallest number ("2GB", not "1953125KiB").
  const Unit* best = nullptr;
  for (const Unit& u : kUnits) {
    if (u.factor == 1 || bytes % u.factor != 0 || u.name == std::string("kiB") ||
        u.name == std::string("KB")) {
      continue;
    }
    if (best == nullptr || u.factor > best->factor) best = &u;
  }
  return best == nullptr ? absl::StrCat(bytes) : absl::StrCat(bytes / best->factor, best->name);
}

bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error) {
  return ParseByteSize(text, &out->bytes, error);
}

std::string AbslUnparseFlag(ByteSize size) { return FormatByteSize(size.bytes); }

}  // namespace kvtrie
