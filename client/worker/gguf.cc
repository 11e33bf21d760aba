#include "client/worker/gguf.h"

#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/block_geometry.h"

namespace kvtrie::worker {
namespace {

constexpr uint64_t kMaxArrayElements = uint64_t{1} << 28;
constexpr uint64_t kMaxDims = 4;

// Bounds-checked little-endian cursor over the file image.
class Cursor {
 public:
  Cursor(const std::string& bytes, const std::string& name) : bytes_(bytes), name_(name) {}

  template <typename T>
  absl::Status Read(T* out) {
    if (pos_ + sizeof(T) > bytes_.size()) return Truncated();
    std::memcpy(out, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }
  absl::Status ReadString(std::string* out) {
    uint64_t n = 0;
    if (absl::Status s = Read(&n); !s.ok()) return s;
    if (n > bytes_.size() - pos_) return Truncated();
    out->assign(bytes_.data() + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }
  size_t pos() const { return pos_; }
  absl::Status Truncated() const {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": truncated GGUF header at byte ", pos_));
  }

 private:
  const std::string& bytes_;
  const std::string& name_;
  size_t pos_ = 0;
};

absl::Status ReadValue(Cursor& c, GgufValueType type, GgufValue* v, int depth) {
  v->type = type;
  switch (type) {
#define KVTRIE_GGUF_SCALAR(ENUM, CTYPE, FIELD)          \
  case GgufValueType::ENUM: {                           \
    CTYPE x{};                                          \
    if (absl::Status s = c.Read(&x); !s.ok()) return s; \
    v->FIELD = x;                                       \
    return absl::OkStatus();                            \
  }
    KVTRIE_GGUF_SCALAR(kUint8, uint8_t, u)
    KVTRIE_GGUF_SCALAR(kInt8, int8_t, i)
    KVTRIE_GGUF_SCALAR(kUint16, uint16_t, u)
    KVTRIE_GGUF_SCALAR(kInt16, int16_t, i)
    KVTRIE_GGUF_SCALAR(kUint32, uint32_t, u)
    KVTRIE_GGUF_SCALAR(kInt32, int32_t, i)
    KVTRIE_GGUF_SCALAR(kFloat32, float, f)
    KVTRIE_GGUF_SCALAR(kBool, uint8_t, u)
    KVTRIE_GGUF_SCALAR(kUint64, uint64_t, u)
    KVTRIE_GGUF_SCALAR(kInt64, int64_t, i)
    KVTRIE_GGUF_SCALAR(kFloat64, double, f)
#undef KVTRIE_GGUF_SCALAR
    case GgufValueType::kString:
      return c.ReadString(&v->s);
    case GgufValueType::kArray: {
      if (depth > 2) return absl::InvalidArgumentError("GGUF: arrays nested too deeply");
      uint32_t et = 0;
      uint64_t n = 0;
      if (absl::Status s = c.Read(&et); !s.ok()) return s;
      if (absl::Status s = c.Read(&n); !s.ok()) return s;
      if (et > static_cast<uint32_t>(GgufValueType::kFloat64) || n > kMaxArrayElements) {
        return absl::InvalidArgumentError(
            absl::StrCat("GGUF: bad array (element type ", et, ", ", n, " elements)"));
      }
      v->array_type = static_cast<GgufValueType>(et);
      v->array.resize(n);
      for (GgufValue& e : v->array) {
        if (absl::Status s = ReadValue(c, v->array_type, &e, depth + 1); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("GGUF: unknown value type ", static_cast<uint32_t>(type)));
}

bool IsUnsigned(GgufValueType t) {
  return t == GgufValueType::kUint8 || t == GgufValueType::kUint16 || t == GgufValueType::kUint32 ||
         t == GgufValueType::kUint64;
}
bool IsSigned(GgufValueType t) {
  return t == GgufValueType::kInt8 || t == GgufValueType::kInt16 || t == GgufValueType::kInt32 ||
         t == GgufValueType::kInt64;
}
bool IsFloat(GgufValueType t) {
  return t == GgufValueType::kFloat32 || t == GgufValueType::kFloat64;
}

}  // namespace

uint64_t GgufTensorInfo::num_elements() const {
  uint64_t n = 1;
  for (uint64_t d : ne) n *= d;
  return n;
}

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open GGUF model file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return Parse(std::move(ss).str(), path);
}

absl::StatusOr<GgufFile> GgufFile::Parse(std::string bytes, const std::string& name) {
  GgufFile file;
  file.bytes_ = std::move(bytes);
  Cursor c(file.bytes_, name);
  uint32_t magic = 0;
  if (absl::Status s = c.Read(&magic); !s.ok()) return s;
  if (std::memcmp(&magic, "GGUF", 4) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a GGUF file (bad magic)"));
  }
  if (absl::Status s = c.Read(&file.version_); !s.ok()) return s;
  if (file.version_ != 2 && file.version_ != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": GGUF version ", file.version_, " is not supported (2 and 3 are; big-endian no)"));
  }
  uint64_t tensor_count = 0, kv_count = 0;
  if (absl::Status s = c.Read(&tensor_count); !s.ok()) return s;
  if (absl::Status s = c.Read(&kv_count); !s.ok()) return s;
  if (tensor_count > kMaxArrayElements || kv_count > kMaxArrayElements) return c.Truncated();

  for (uint64_t k = 0; k < kv_count; ++k) {
    std::string key;
    uint32_t type = 0;
    if (absl::Status s = c.ReadString(&key); !s.ok()) return s;
    if (absl::Status s = c.Read(&type); !s.ok()) return s;
    GgufValue value;
    if (absl::Status s = ReadValue(c, static_cast<GgufValueType>(type), &value, 0); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": metadata ", key, ": ", s.message()));
    }
    file.metadata_[key] = std::move(value);
  }

  file.tensors_.resize(tensor_count);
  for (GgufTensorInfo& t : file.tensors_) {
    uint32_t n_dims = 0;
    if (absl::Status s = c.ReadString(&t.name); !s.ok()) return s;
    if (absl::Status s = c.Read(&n_dims); !s.ok()) return s;
    if (n_dims == 0 || n_dims > kMaxDims) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": tensor ", t.name, ": n_dims ", n_dims, " not in [1, 4]"));
    }
    t.ne.resize(n_dims);
    for (uint64_t& d : t.ne) {
      if (absl::Status s = c.Read(&d); !s.ok()) return s;
    }
    if (absl::Status s = c.Read(&t.type); !s.ok()) return s;
    if (absl::Status s = c.Read(&t.offset); !s.ok()) return s;
  }

  uint64_t alignment = 32;
  if (const GgufValue* a = file.Find("general.alignment"); a != nullptr && a->u > 0) {
    alignment = a->u;
  }
  file.data_offset_ = (c.pos() + alignment - 1) / alignment * alignment;
  for (const GgufTensorInfo& t : file.tensors_) {
    uint64_t elem_bytes = t.type == static_cast<uint32_t>(GgmlType::kF32)   ? 4
                          : t.type == static_cast<uint32_t>(GgmlType::kF16) ? 2
                                                                            : 0;
    uint64_t end = file.data_offset_ + t.offset + t.num_elements() * elem_bytes;
    if (end > file.bytes_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": tensor ", t.name, ": data ends at byte ", end,
                       " past the end of the file (", file.bytes_.size(), " bytes)"));
    }
  }
  return file;
}

const GgufValue* GgufFile::Find(absl::string_view key) const {
  auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::FindTensor(absl::string_view name) const {
  for (const GgufTensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<uint64_t> GgufFile::GetUint(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("GGUF metadata ", key, ": absent"));
  if (IsUnsigned(v->type) || v->type == GgufValueType::kBool) return v->u;
  if (IsSigned(v->type) && v->i >= 0) return static_cast<uint64_t>(v->i);
  return absl::InvalidArgumentError(
      absl::StrCat("GGUF metadata ", key, ": not a non-negative integer"));
}

absl::StatusOr<double> GgufFile::GetFloat(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("GGUF metadata ", key, ": absent"));
  if (IsFloat(v->type)) return v->f;
  if (IsUnsigned(v->type)) return static_cast<double>(v->u);
  if (IsSigned(v->type)) return static_cast<double>(v->i);
  return absl::InvalidArgumentError(absl::StrCat("GGUF metadata ", key, ": not a number"));
}

absl::StatusOr<std::string> GgufFile::GetString(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("GGUF metadata ", key, ": absent"));
  if (v->type != GgufValueType::kString) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF metadata ", key, ": not a string"));
  }
  return v->s;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("GGUF metadata ", key, ": absent"));
  if (v->type != GgufValueType::kArray || v->array_type != GgufValueType::kString) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF metadata ", key, ": not an array of strings"));
  }
  std::vector<std::string> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) out.push_back(e.s);
  return out;
}

absl::StatusOr<std::vector<float>> GgufFile::GetFloatArray(absl::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return absl::NotFoundError(absl::StrCat("GGUF metadata ", key, ": absent"));
  if (v->type != GgufValueType::kArray || !IsFloat(v->array_type)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GGUF metadata ", key, ": not an array of floats"));
  }
  std::vector<float> out;
  out.reserve(v->array.size());
  for (const GgufValue& e : v->array) out.push_back(static_cast<float>(e.f));
  return out;
}

absl::StatusOr<std::vector<float>> GgufFile::TensorAsFloat(absl::string_view name) const {
  const GgufTensorInfo* t = FindTensor(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat("GGUF tensor ", name, ": absent"));
  const size_t n = t->num_elements();
  const char* src = bytes_.data() + data_offset_ + t->offset;
  std::vector<float> out(n);
  if (t->type == static_cast<uint32_t>(GgmlType::kF32)) {
    std::memcpy(out.data(), src, n * 4);
  } else if (t->type == static_cast<uint32_t>(GgmlType::kF16)) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = HalfToFloat(h);
    }
  } else {
    return absl::UnimplementedError(absl::StrCat("GGUF tensor ", name, ": ggml type ", t->type,
                                                 " is not supported (only F32 and F16)"));
  }
  return out;
}

}  // namespace kvtrie::worker
