#include "codec/kv_dump.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvtrie {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteFile(const std::string& path, absl::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::FailedPreconditionError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

// Extracts the value of 'key': from a numpy header dict literal.
absl::string_view HeaderField(absl::string_view header, absl::string_view key) {
  const std::string needle = absl::StrCat("'", key, "':");
  size_t pos = header.find(needle);
  if (pos == absl::string_view::npos) return {};
  absl::string_view rest = absl::StripLeadingAsciiWhitespace(header.substr(pos + needle.size()));
  if (!rest.empty() && rest[0] == '(') return rest.substr(0, rest.find(')') + 1);
  return rest.substr(0, rest.find_first_of(",}"));
}

}  // namespace

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(path);
  if (!bytes.ok()) return bytes.status();
  const std::string& b = *bytes;
  if (b.size() < 10 || b.compare(0, 6, "\x93NUMPY") != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a .npy file"));
  }
  const int major = static_cast<uint8_t>(b[6]);
  size_t header_len, header_start;
  if (major == 1) {
    header_len = static_cast<uint8_t>(b[8]) | static_cast<uint8_t>(b[9]) << 8;
    header_start = 10;
  } else {
    if (b.size() < 12) return absl::InvalidArgumentError(absl::StrCat(path, ": truncated"));
    header_len = static_cast<uint8_t>(b[8]) | static_cast<uint8_t>(b[9]) << 8 |
                 static_cast<uint8_t>(b[10]) << 16 |
                 static_cast<size_t>(static_cast<uint8_t>(b[11])) << 24;
    header_start = 12;
  }
  if (header_start + header_len > b.size()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated header"));
  }
  absl::string_view header(b.data() + header_start, header_len);
  NpyArray a;
  absl::string_view descr = absl::StripAsciiWhitespace(HeaderField(header, "descr"));
  descr = absl::StripSuffix(absl::StripPrefix(descr, "'"), "'");
  if (descr == "<f2") {
    a.dtype = DType::kFp16;
  } else if (descr == "<f4") {
    a.dtype = DType::kFp32;
  } else if (descr == "<V2" || descr == "|V2") {
    a.dtype = DType::kBf16;
  } else if (descr == "|u1" || descr == "<u1" || descr == "|V1") {
    a.dtype = DType::kUint8;  // the manifest's dtype says which one-byte dtype (fp8_e4m3, ...)
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": descr: unsupported dtype '", descr,
                                                   "' (want <f2, <f4, bf16 or |u1)"));
  }
  if (absl::StripAsciiWhitespace(HeaderField(header, "fortran_order")) != "False") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": fortran_order: must be False"));
  }
  absl::string_view shape = HeaderField(header, "shape");
  shape = absl::StripSuffix(absl::StripPrefix(shape, "("), ")");
  size_t count = 1;
  for (absl::string_view dim : absl::StrSplit(shape, ',', absl::SkipWhitespace())) {
    size_t d;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(dim), &d)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": shape: bad dimension '", dim, "'"));
    }
    a.shape.push_back(d);
    if (d != 0 && count > (std::numeric_limits<size_t>::max() / 8) / d) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": shape: too many elements"));
    }
    count *= d;
  }
  const size_t data_start = header_start + header_len;
  const size_t want = count * DTypeBytes(a.dtype);
  if (b.size() - data_start != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": data holds ", b.size() - data_start, " bytes, shape needs ", want));
  }
  a.data.assign(b.begin() + static_cast<ptrdiff_t>(data_start), b.end());
  return a;
}

absl::Status WriteNpy(const std::string& path, const NpyArray& array) {
  std::string shape = absl::StrJoin(array.shape, ", ");
  if (array.shape.size() == 1) shape += ",";
  const char* descr = array.dtype == DType::kFp16   ? "<f2"
                      : array.dtype == DType::kFp32 ? "<f4"
                      : IsByteDType(array.dtype)    ? "|u1"
                                                    : "<V2";
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", shape, "), }");
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::string out = "\x93NUMPY\x01";
  out.push_back('\0');
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  out.append(reinterpret_cast<const char*>(array.data.data()), array.data.size());
  return WriteFile(path, out);
}

absl::StatusOr<KvDump> ReadKvManifest(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "manifest.json").string();
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  nlohmann::json m = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  KvDump d;
  auto get_uint = [&](const char* key, uint32_t* out) -> absl::Status {
    if (!m.contains(key) || !m[key].is_number_unsigned() ||
        m[key].get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, ": missing or not a count"));
    }
    *out = m[key].get<uint32_t>();
    return absl::OkStatus();
  };
  if (auto s = get_uint("layers", &d.num_layers); !s.ok()) return s;
  if (auto s = get_uint("kv_heads", &d.num_kv_heads); !s.ok()) return s;
  if (auto s = get_uint("head_dim", &d.head_dim); !s.ok()) return s;
  const std::string dtype = m.value("dtype", "float16");
  if (dtype == "float16") {
    d.dtype = DType::kFp16;
  } else if (dtype == "bfloat16") {
    d.dtype = DType::kBf16;
  } else if (dtype == "float32") {
    d.dtype = DType::kFp32;
  } else if (dtype == "fp8_e4m3" || dtype == "float8_e4m3fn") {
    d.dtype = DType::kFp8E4m3;
  } else if (dtype == "fp8_e5m2" || dtype == "float8_e5m2") {
    d.dtype = DType::kFp8E5m2;
  } else if (dtype == "uint8") {
    d.dtype = DType::kUint8;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": dtype: unsupported '", dtype, "'"));
  }
  std::string model_file = m.value("model_file", "model");
  d.model_id = std::filesystem::path(model_file).stem().string();
  if (!m.contains("token_ids") || !m["token_ids"].is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": token_ids: missing"));
  }
  for (const auto& t : m["token_ids"]) {
    if (!t.is_number_unsigned() || t.get<uint64_t>() > std::numeric_limits<uint32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": token_ids: not all unsigned ints"));
    }
    d.token_ids.push_back(t.get<uint32_t>());
  }
  if (m.contains("surprisal_bits") && m["surprisal_bits"].is_array()) {
    for (const auto& s : m["surprisal_bits"]) {
      const double bits = s.is_number() ? s.get<double>() : 0.0;
      if (!(std::fabs(bits) <= std::numeric_limits<float>::max())) {  // NaN fails too
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": surprisal_bits: value ", d.surprisal_bits.size(), " is not a finite float"));
      }
      d.surprisal_bits.push_back(static_cast<float>(bits));
    }
    if (d.surprisal_bits.size() != d.token_ids.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": surprisal_bits: ", d.surprisal_bits.size(), " values for ",
                       d.token_ids.size(), " token_ids"));
    }
  } else {
    d.surprisal_bits.assign(d.token_ids.size(), 0.0f);
  }
  return d;
}

absl::StatusOr<KvDump> ReadKvDump(const std::string& dir) {
  absl::StatusOr<KvDump> d = ReadKvManifest(dir);
  if (!d.ok()) return d.status();
  const std::vector<size_t> want = {d->num_layers, d->num_kv_heads, d->num_tokens(), d->head_dim};
  for (const char* name : {"k.npy", "v.npy"}) {
    const std::string path = (std::filesystem::path(dir) / name).string();
    absl::StatusOr<NpyArray> a = ReadNpy(path);
    if (!a.ok()) return a.status();
    if (a->shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": shape [", absl::StrJoin(a->shape, ", "), "] does not match the manifest [",
          absl::StrJoin(want, ", "), "] (layers, kv_heads, token_ids, head_dim)"));
    }
    // An npy file's |u1 holds any one-byte dtype: the manifest names which.
    if (a->dtype != d->dtype && !(a->dtype == DType::kUint8 && IsByteDType(d->dtype))) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": dtype ", DTypeName(a->dtype), " does not match the manifest"));
    }
    (name[0] == 'k' ? d->k : d->v) = std::move(a->data);
  }
  return d;
}

absl::Status WriteKvDump(const std::string& dir, const KvDump& dump) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat(dir, ": ", ec.message()));
  NpyArray a;
  a.dtype = dump.dtype;
  a.shape = {dump.num_layers, dump.num_kv_heads, dump.num_tokens(), dump.head_dim};
  a.data = dump.k;
  if (auto s = WriteNpy((std::filesystem::path(dir) / "k.npy").string(), a); !s.ok()) return s;
  a.data = dump.v;
  if (auto s = WriteNpy((std::filesystem::path(dir) / "v.npy").string(), a); !s.ok()) return s;
  nlohmann::json m;
  m["model_file"] = dump.model_id + ".gguf";
  m["dtype"] = dump.dtype == DType::kFp16   ? "float16"
               : dump.dtype == DType::kBf16 ? "bfloat16"
               : dump.dtype == DType::kFp32 ? "float32"
                                            : std::string(DTypeName(dump.dtype));
  m["kv_layout"] = "[layers, kv_heads, tokens, head_dim]; K after RoPE";
  m["layers"] = dump.num_layers;
  m["kv_heads"] = dump.num_kv_heads;
  m["head_dim"] = dump.head_dim;
  m["n_tokens"] = dump.num_tokens();
  m["token_ids"] = dump.token_ids;
  nlohmann::json s = nlohmann::json::array();
  for (size_t i = 0; i < dump.surprisal_bits.size(); ++i) {
    if (i == 0) {
      s.push_back(nullptr);
    } else {
      s.push_back(dump.surprisal_bits[i]);
    }
  }
  m["surprisal_bits"] = s;
  m["surprisal_note"] = "surprisal_bits[i] = -log2 p(token_i | tokens_<i); null for BOS";
  return WriteFile((std::filesystem::path(dir) / "manifest.json").string(), m.dump(1));
}

}  // namespace kvtrie
