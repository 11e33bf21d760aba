// client/worker/gguf.h
//
// A reader for GGUF model files, versions 2 and 3 (little-endian), enough to load a
// Llama-architecture model: the metadata key/value pairs (all GGUF value types, arrays included)
// and the tensor directory, with F32 and F16 tensor data converted to float.
// Source: the GGUF spec (ggml docs/gguf.md): magic "GGUF", uint32 version, uint64 tensor_count,
// uint64 kv_count, then kv pairs, tensor infos {name, n_dims, ne[n_dims] (fastest-varying first),
// ggml_type, offset}, padding to `general.alignment` (default 32), then tensor data.
//
// A tensor with ne = {in, out} is the row-major matrix W[out][in] (llama2.c's layout).
// The whole file is read into memory; a GgufFile owns it. Not thread-safe to mutate; const
// methods are safe to call concurrently.
#ifndef KVTRIE_CLIENT_WORKER_GGUF_H_
#define KVTRIE_CLIENT_WORKER_GGUF_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvtrie::worker {

// GGUF metadata value types (gguf_type).
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// ggml tensor element types this reader can convert (others are listed but not converted).
enum class GgmlType : uint32_t { kF32 = 0, kF16 = 1 };

// One metadata value. Scalars are widened: unsigned -> `u`, signed -> `i`, floats -> `f`,
// bool -> `u` (0/1). Arrays hold their elements in `array` with `array_type`.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint32;
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  std::string s;
  GgufValueType array_type = GgufValueType::kUint32;
  std::vector<GgufValue> array;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> ne;  // dimensions, fastest-varying first
  uint32_t type = 0;         // ggml_type
  uint64_t offset = 0;       // from the start of the data section
  uint64_t num_elements() const;
};

class GgufFile {
 public:
  // Reads and parses `path`. Errors: NOT_FOUND if it cannot be opened; INVALID_ARGUMENT naming
  // what is wrong for a bad magic, an unsupported version (only 2 and 3), a truncated header, or
  // a tensor whose data lies outside the file.
  static absl::StatusOr<GgufFile> Open(const std::string& path);
  // Parses an in-memory image (same errors, with `name` in messages).
  static absl::StatusOr<GgufFile> Parse(std::string bytes, const std::string& name);

  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  // nullptr when absent.
  const GgufValue* Find(absl::string_view key) const;
  const GgufTensorInfo* FindTensor(absl::string_view name) const;

  // Typed metadata access. Errors: NOT_FOUND naming the key when absent; INVALID_ARGUMENT when
  // the value has another type (any integer type is accepted by GetUint if non-negative, any
  // numeric type by GetFloat).
  absl::StatusOr<uint64_t> GetUint(absl::string_view key) const;
  absl::StatusOr<double> GetFloat(absl::string_view key) const;
  absl::StatusOr<std::string> GetString(absl::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(absl::string_view key) const;
  absl::StatusOr<std::vector<float>> GetFloatArray(absl::string_view key) const;

  // The tensor's elements as float32, in storage order. Errors: NOT_FOUND naming the tensor;
  // UNIMPLEMENTED for types other than F32 and F16 (quantized tensors).
  absl::StatusOr<std::vector<float>> TensorAsFloat(absl::string_view name) const;

 private:
  GgufFile() = default;

  std::string bytes_;
  uint32_t version_ = 0;
  size_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
};

}  // namespace kvtrie::worker

#endif  // KVTRIE_CLIENT_WORKER_GGUF_H_
