// client/python/py_convert.h
//
// What the extension's two files (kvtrie_module.cc: kvtrie.Client; shard_binding.cc:
// kvtrie.ShardedClient) both need to cross between Python and the C++ client: statuses raised as
// kvtrie.Error, K/V numpy arrays checked and read in place, Put and Get results as the Python
// package reads them, and ClientOptions from the Python arguments. Internal to the extension.
#ifndef KVTRIE_CLIENT_PYTHON_PY_CONVERT_H_
#define KVTRIE_CLIENT_PYTHON_PY_CONVERT_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace kvtrie {
namespace py_convert {

namespace py = pybind11;

// A non-OK status on its way to Python (translated to kvtrie.Error by the module's translator).
struct StatusError : std::runtime_error {
  explicit StatusError(const absl::Status& s);
  int code;
  std::string reason;  // client/status_reason.h; "" when none
};

// Throws StatusError when `s` is not OK.
void Check(const absl::Status& s);
[[noreturn]] void InvalidArgument(const std::string& message);
// kvtrie.Error for `s` (kvtrie/_errors.py from_status), not raised.
py::object ErrorObject(const absl::Status& s);

using Tokens = py::array_t<uint32_t, py::array::c_style>;
using Floats = py::array_t<float, py::array::c_style>;
absl::Span<const uint32_t> SpanOf(const Tokens& t);
std::string ShapeString(const py::array& a);
std::string DTypeString(const py::array& a);

// K and V checked against each other: 4-D, the same shape and dtype, C-contiguous; `kv_dtype`
// a DType value naming what one-byte arrays hold (0: from the arrays). INVALID_ARGUMENT naming
// `k` / `v` otherwise.
struct KvArrays {
  DType dtype;
  uint32_t dims[4];  // layers, kv_heads, tokens, head_dim
  const uint8_t* k;
  const uint8_t* v;
  size_t bytes;
};
KvArrays CheckKv(const py::array& k, const py::array& v, int kv_dtype = 0);
DType DTypeOf(const py::dtype& dt, const char* name, int kv_dtype = 0);

// The PutHeader's content: spec, tokens, surprisal (k and v stay empty).
KvDump Header(const std::string& model_id, const Tokens& tokens,
              const std::optional<Floats>& surprisal, uint32_t layers, uint32_t heads,
              uint32_t head_dim, DType dtype);
PutOptions MakePutOptions(int encoding, double target_rel_rms, uint32_t bits, uint32_t block_tokens,
                          uint32_t first_block, uint32_t layers_per_message, int profile);

// A message as the dict json.loads gives of its JSON (client/proto_json.h).
py::object Json(const google::protobuf::Message& m);
// PutResponse as the dict kvtrie.PutResult._from_json reads.
py::dict PutResponseDict(const v1::PutResponse& r);
// A Get's result as kvtrie.Client.get reads it: (k, v, matched_tokens, spec), the arrays owning
// the dump's buffers (no copy); spec None on a miss.
py::tuple GetResult(KvDump&& dump);

// ClientOptions of kvtrie.Client's arguments (seconds as doubles), each checked (INVALID_ARGUMENT
// naming the Python argument).
ClientOptions MakeClientOptions(const std::string& target, const std::string& ns,
                                const std::string& token, double timeout_s, bool tls,
                                const std::string& root_pem, const std::string& cert_pem,
                                const std::string& key_pem, const std::string& server_name,
                                int retry_attempts, double retry_initial_backoff_s,
                                double retry_max_backoff_s, int codec_threads,
                                double predictor_refresh_s);

// The Python side of a layer-wise Put stream (PutStream, or ShardedPutStream over shards):
// checks each write's arrays against the stream's geometry and calls the stream with the GIL
// released, one call at a time.
template <typename Stream>
class PyLayerPutStream {
 public:
  explicit PyLayerPutStream(std::unique_ptr<Stream> s) : stream_(std::move(s)) {}

  void Write(uint32_t layer_begin, size_t token_offset, const py::array& k, const py::array& v) {
    const BlockGeometry& g = stream_->geometry();
    const KvArrays kv = CheckKv(k, v, IsByteDType(g.dtype) ? static_cast<int>(g.dtype) : 0);
    if (kv.dtype != g.dtype || kv.dims[1] != g.num_kv_heads || kv.dims[3] != g.head_dim) {
      InvalidArgument(absl::StrCat("k: shape ", ShapeString(k), " ", DTypeString(k),
                                   " does not fit the stream's ", g.DebugString()));
    }
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    Check(stream_->WriteLayers(layer_begin, layer_begin + kv.dims[0], token_offset, kv.dims[2],
                               absl::MakeConstSpan(kv.k, kv.bytes),
                               absl::MakeConstSpan(kv.v, kv.bytes)));
  }

  py::object Commit() {
    absl::StatusOr<v1::PutResponse> r;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      r = stream_->Commit();
    }
    Check(r.status());
    return PutResponseDict(*r);
  }

  void Cancel() {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    stream_->Cancel();
  }

 private:
  std::mutex mu_;  // one call at a time on stream_ (it is not thread-safe)
  std::unique_ptr<Stream> stream_;
};

}  // namespace py_convert
}  // namespace kvtrie

#endif  // KVTRIE_CLIENT_PYTHON_PY_CONVERT_H_
