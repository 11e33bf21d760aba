// client/python/kvtrie_module.cc
//
// _kvtrie: the pybind11 extension inside the Python package kvtrie (client/python/kvtrie). It
// wraps kvtrie::Client (client/client.h) and kvtrie::PutStream (client/put_stream.h), and, in
// shard_binding.cc, kvtrie::ShardedClient; the conversions both use are py_convert.h's. The
// public, documented API is the pure-Python kvtrie.Client (kvtrie/_client.py) and
// kvtrie.ShardedClient (kvtrie/sharded.py), which call this.
//
// Arrays: K and V are numpy arrays [layers, kv_heads, tokens, head_dim], C-contiguous, of float16,
// float32, or uint16 holding bfloat16 bit patterns (an ml_dtypes 'bfloat16' array counts as bf16
// too). They are read in place, without a copy; Get returns arrays that own the client's buffers,
// without a copy. Every RPC, block gather and RESIDUAL decode runs with the GIL released, so
// other Python threads run meanwhile and one client serves many threads.
// TLS and the bearer token are ClientOptions' (client/client.h); kvtrie/__init__.py reads the PEM
// files and passes their text here.
// Errors: a non-OK absl::Status raises kvtrie.Error(code, message, reason) (kvtrie/_errors.py),
// code the gRPC status code, reason the server's machine-readable one (client/status_reason.h);
// argument errors found here are INVALID_ARGUMENT naming the argument.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/proto_json.h"
#include "client/put_stream.h"
#include "client/python/py_convert.h"
#include "client/status_reason.h"

namespace py = pybind11;

namespace kvtrie {
namespace py_convert {

StatusError::StatusError(const absl::Status& s)
    : std::runtime_error(std::string(s.message())),
      code(static_cast<int>(s.code())),
      reason(StatusReason(s)) {}

void Check(const absl::Status& s) {
  if (!s.ok()) throw StatusError(s);
}
[[noreturn]] void InvalidArgument(const std::string& message) {
  throw StatusError(absl::InvalidArgumentError(message));
}

py::object ErrorObject(const absl::Status& s) {
  return py::module_::import("kvtrie._errors")
      .attr("from_status")(static_cast<int>(s.code()), std::string(s.message()), StatusReason(s));
}

absl::Span<const uint32_t> SpanOf(const Tokens& t) {
  return absl::MakeConstSpan(t.data(), static_cast<size_t>(t.size()));
}

std::string ShapeString(const py::array& a) {
  std::vector<ssize_t> dims(a.shape(), a.shape() + a.ndim());
  return absl::StrCat("(", absl::StrJoin(dims, ", "), a.ndim() == 1 ? ",)" : ")");
}

std::string DTypeString(const py::array& a) {
  return py::str(static_cast<py::handle>(a.dtype())).cast<std::string>();
}

// `kv_dtype` (a DType value, 0 = from the array) names what one-byte arrays hold: uint8 arrays
// are vLLM's fp8 pages as well as plain bytes, so only the caller knows (ml_dtypes' float8 arrays
// say it themselves).
DType DTypeOf(const py::dtype& dt, const char* name, int kv_dtype) {
  const std::string shown = py::str(static_cast<const py::handle&>(dt)).cast<std::string>();
  if (kv_dtype != 0) {
    if (!IsValidDType(static_cast<uint32_t>(kv_dtype))) {
      InvalidArgument(absl::StrCat("kv_dtype: unknown value ", kv_dtype));
    }
    const DType d = static_cast<DType>(kv_dtype);
    if (static_cast<size_t>(dt.itemsize()) != DTypeBytes(d)) {
      InvalidArgument(absl::StrCat(name, ".dtype: ", shown, " does not hold kv_dtype ",
                                   DTypeName(d), " (", DTypeBytes(d), " byte elements)"));
    }
    return d;
  }
  if (py::str(dt.attr("byteorder")).cast<std::string>() == ">") {
    InvalidArgument(absl::StrCat(name, ".dtype: ", shown,
                                 " is big-endian; convert with .astype(dtype.newbyteorder('<'))"));
  }
  const char kind = dt.kind();
  const ssize_t size = dt.itemsize();
  if (kind == 'f' && size == 2) return DType::kFp16;
  if (kind == 'f' && size == 4) return DType::kFp32;
  if (kind == 'u' && size == 2) return DType::kBf16;
  const std::string dname = py::str(dt.attr("name")).cast<std::string>();
  if (size == 2 && dname == "bfloat16") return DType::kBf16;
  if (size == 1 && dname == "float8_e4m3fn") return DType::kFp8E4m3;
  if (size == 1 && dname == "float8_e5m2") return DType::kFp8E5m2;
  if (size == 1 && (kind == 'u' || kind == 'i' || kind == 'V')) {
    InvalidArgument(absl::StrCat(name, ".dtype: ", shown,
                                 " is ambiguous: pass kv_dtype='fp8_e4m3', 'fp8_e5m2' or 'uint8'"));
  }
  InvalidArgument(absl::StrCat(name, ".dtype: ", shown,
                               " is not float16, float32, bfloat16 (as uint16 bit patterns), or a "
                               "one-byte cache with kv_dtype"));
}

DType ArrayDType(const py::array& a, const char* name, int kv_dtype = 0) {
  return DTypeOf(a.dtype(), name, kv_dtype);
}

py::dtype NumpyDType(DType d) {
  switch (d) {
    case DType::kFp16:
      return py::dtype("float16");
    case DType::kFp32:
      return py::dtype("float32");
    case DType::kBf16:
      return py::dtype("uint16");
    case DType::kFp8E4m3:
    case DType::kFp8E5m2:
    case DType::kUint8:
      return py::dtype("uint8");  // the bytes as stored (vLLM's fp8 pages are uint8 tensors)
  }
  return py::dtype("uint8");
}

KvArrays CheckKv(const py::array& k, const py::array& v, int kv_dtype) {
  for (const auto& [a, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    if (a->ndim() != 4) {
      InvalidArgument(absl::StrCat(
          name, ".shape: expected [layers, kv_heads, tokens, head_dim], got ", ShapeString(*a)));
    }
    if (!(a->flags() & py::array::c_style)) {
      InvalidArgument(absl::StrCat(name, ": not C-contiguous (use numpy.ascontiguousarray)"));
    }
  }
  KvArrays out;
  out.dtype = ArrayDType(k, "k", kv_dtype);
  const DType vd = ArrayDType(v, "v", kv_dtype);
  if (vd != out.dtype || k.dtype().kind() != v.dtype().kind()) {
    InvalidArgument(
        absl::StrCat("v.dtype: ", DTypeString(v), " differs from k.dtype ", DTypeString(k)));
  }
  static const char* kAxes[4] = {"layers", "kv_heads", "tokens", "head_dim"};
  for (int i = 0; i < 4; ++i) {
    if (k.shape(i) != v.shape(i)) {
      InvalidArgument(absl::StrCat("v.shape: ", ShapeString(v), " differs from k.shape ",
                                   ShapeString(k), " (axis ", i, ", ", kAxes[i], ")"));
    }
    if (k.shape(i) > std::numeric_limits<uint32_t>::max()) {
      InvalidArgument(absl::StrCat("k.shape: axis ", i, " (", kAxes[i], ") is too large"));
    }
    out.dims[i] = static_cast<uint32_t>(k.shape(i));
  }
  out.k = static_cast<const uint8_t*>(k.data());
  out.v = static_cast<const uint8_t*>(v.data());
  out.bytes = static_cast<size_t>(k.nbytes());
  return out;
}

py::object Json(const google::protobuf::Message& m) {
  return py::module_::import("json").attr("loads")(ProtoToJson(m).dump());
}

// PutResponse as the dict kvtrie.PutResult._from_json reads (what Json() would give, without the
// JSON round trip: a Put of a long prefix answers with one BlockResult per block).
py::dict PutResponseDict(const v1::PutResponse& r) {
  py::list blocks;
  for (const v1::BlockResult& b : r.blocks()) {
    py::dict d;
    d["block_index"] = b.block_index();
    d["disposition"] = v1::BlockDisposition_Name(b.disposition());
    d["node_id"] = b.node_id();
    d["bytes_logical"] = b.bytes_logical();
    d["bytes_stored"] = b.bytes_stored();
    d["bits_per_component"] = b.bits_per_component();
    d["rel_rms_error_k"] = b.rel_rms_error_k();
    d["rel_rms_error_v"] = b.rel_rms_error_v();
    d["encoding"] = v1::Encoding_Name(b.encoding());
    d["max_abs_error"] = b.max_abs_error();
    blocks.append(std::move(d));
  }
  py::dict out;
  out["stored_tokens"] = r.stored_tokens();
  out["tail_tokens_ignored"] = r.tail_tokens_ignored();
  out["blocks_stored"] = r.blocks_stored();
  out["blocks_deduplicated"] = r.blocks_deduplicated();
  out["blocks"] = std::move(blocks);
  return out;
}

PutOptions MakePutOptions(int encoding, double target_rel_rms, uint32_t bits, uint32_t block_tokens,
                          uint32_t first_block, uint32_t layers_per_message, int profile) {
  PutOptions o;
  o.profile = static_cast<v1::EncodingSpec::Profile>(profile);
  o.encoding = static_cast<v1::Encoding>(encoding);
  o.target_rel_rms = target_rel_rms;
  o.bits = bits;
  o.block_tokens = block_tokens;
  o.first_block = first_block;
  o.layers_per_message = layers_per_message;
  return o;
}

// The PutHeader's content: spec, tokens, surprisal (k and v stay empty).
KvDump Header(const std::string& model_id, const Tokens& tokens,
              const std::optional<Floats>& surprisal, uint32_t layers, uint32_t heads,
              uint32_t head_dim, DType dtype) {
  KvDump h;
  h.model_id = model_id;
  h.num_layers = layers;
  h.num_kv_heads = heads;
  h.head_dim = head_dim;
  h.dtype = dtype;
  h.token_ids.assign(tokens.data(), tokens.data() + tokens.size());
  if (surprisal) {
    if (static_cast<size_t>(surprisal->size()) != h.token_ids.size()) {
      InvalidArgument(absl::StrCat("surprisal: ", surprisal->size(), " values for ",
                                   h.token_ids.size(), " tokens (give one per token, or None)"));
    }
    h.surprisal_bits.assign(surprisal->data(), surprisal->data() + surprisal->size());
  }
  return h;
}

py::tuple GetResult(KvDump&& result) {
  auto* dump = new KvDump(std::move(result));
  py::capsule owner(dump, [](void* p) { delete static_cast<KvDump*>(p); });
  const size_t n = dump->num_tokens();
  if (n == 0) {
    py::array empty(py::dtype("float16"), std::vector<ssize_t>{0, 0, 0, 0});
    return py::make_tuple(empty, empty, 0, py::none());
  }
  const std::vector<ssize_t> shape = {dump->num_layers, dump->num_kv_heads, static_cast<ssize_t>(n),
                                      dump->head_dim};
  const py::dtype dt = NumpyDType(dump->dtype);
  py::array k(dt, shape, {}, dump->k.data(), owner);
  py::array v(dt, shape, {}, dump->v.data(), owner);
  return py::make_tuple(k, v, n,
                        py::make_tuple(dump->num_layers, dump->num_kv_heads, dump->head_dim, dt,
                                       std::string(DTypeName(dump->dtype))));
}

ClientOptions MakeClientOptions(const std::string& target, const std::string& ns,
                                const std::string& token, double timeout_s, bool tls,
                                const std::string& root_pem, const std::string& cert_pem,
                                const std::string& key_pem, const std::string& server_name,
                                int retry_attempts, double retry_initial_backoff_s,
                                double retry_max_backoff_s, int codec_threads,
                                double predictor_refresh_s) {
  if (!(timeout_s > 0)) InvalidArgument("timeout: must be > 0 seconds");
  if (cert_pem.empty() != key_pem.empty()) {
    InvalidArgument(cert_pem.empty() ? "tls.cert: needed with tls.key"
                                     : "tls.key: needed with tls.cert");
  }
  if (!tls && !(root_pem.empty() && cert_pem.empty() && server_name.empty())) {
    InvalidArgument("tls: PEM data or server_name given with TLS off");
  }
  ClientOptions o;
  o.target = target;
  o.ns = ns;
  o.token = token;
  o.tls = tls;
  o.tls_root_pem = root_pem;
  o.tls_cert_pem = cert_pem;
  o.tls_key_pem = key_pem;
  o.tls_server_name = server_name;
  o.timeout = absl::Milliseconds(timeout_s * 1000);
  if (retry_attempts < 1) {
    InvalidArgument(
        absl::StrCat("retry_attempts: ", retry_attempts, " (must be >= 1; 1 = never retry)"));
  }
  if (!(retry_initial_backoff_s >= 0) || !(retry_max_backoff_s >= retry_initial_backoff_s)) {
    InvalidArgument(absl::StrCat("retry_max_backoff: ", retry_max_backoff_s,
                                 " s must be >= retry_initial_backoff ", retry_initial_backoff_s,
                                 " s >= 0"));
  }
  o.retry.max_attempts = retry_attempts;
  o.retry.initial_backoff = absl::Milliseconds(retry_initial_backoff_s * 1000);
  o.retry.max_backoff = absl::Milliseconds(retry_max_backoff_s * 1000);
  Check(ValidateRetryPolicy(o.retry));
  if (codec_threads < 0) {
    InvalidArgument(
        absl::StrCat("codec_threads: ", codec_threads, " (must be >= 0; 0 = the machine's cores)"));
  }
  o.codec_threads = codec_threads;
  if (!(predictor_refresh_s >= 0)) {
    InvalidArgument(absl::StrCat("predictor_refresh: ", predictor_refresh_s, " s (must be >= 0)"));
  }
  o.predictor_refresh = absl::Milliseconds(predictor_refresh_s * 1000);
  return o;
}

}  // namespace py_convert

namespace {

using namespace py_convert;  // NOLINT(build/namespaces): this file's own helpers

using PyPutStream = PyLayerPutStream<PutStream>;

class PyClient {
 public:
  // tls: off when false; on with root_pem (empty: the system's roots), cert_pem + key_pem for
  // mutual TLS, server_name overriding the name checked in the server's certificate.
  PyClient(const std::string& target, const std::string& model_id, const std::string& ns,
           const std::string& token, double timeout_s, bool tls, const std::string& root_pem,
           const std::string& cert_pem, const std::string& key_pem, const std::string& server_name,
           int retry_attempts, double retry_initial_backoff_s, double retry_max_backoff_s,
           int codec_threads, double predictor_refresh_s)
      : model_id_(model_id) {
    if (model_id.empty()) InvalidArgument("model_id: must not be empty");
    client_ = Client::Create(MakeClientOptions(
        target, ns, token, timeout_s, tls, root_pem, cert_pem, key_pem, server_name, retry_attempts,
        retry_initial_backoff_s, retry_max_backoff_s, codec_threads, predictor_refresh_s));
  }

  uint32_t Lookup(const Tokens& tokens) {
    absl::StatusOr<v1::LookupResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->Lookup(model_id_, SpanOf(tokens));
    }
    Check(r.status());
    return r->matched_tokens();
  }

  py::object Put(const Tokens& tokens, const py::array& k, const py::array& v,
                 const std::optional<Floats>& surprisal, int encoding, double target_rel_rms,
                 uint32_t bits, uint32_t block_tokens, uint32_t first_block,
                 uint32_t layers_per_message, bool encode_on_client, int profile,
                 bool learned_lossless, int kv_dtype) {
    const KvArrays kv = CheckKv(k, v, kv_dtype);
    if (static_cast<ssize_t>(kv.dims[2]) != tokens.size()) {
      InvalidArgument(absl::StrCat("tokens: ", tokens.size(), " token ids, but k has ", kv.dims[2],
                                   " tokens (k.shape ", ShapeString(k), ", axis 2)"));
    }
    const KvDump header =
        Header(model_id_, tokens, surprisal, kv.dims[0], kv.dims[1], kv.dims[3], kv.dtype);
    PutOptions options = MakePutOptions(encoding, target_rel_rms, bits, block_tokens, first_block,
                                        layers_per_message, profile);
    options.encode_on_client = encode_on_client;
    options.learned_lossless = learned_lossless;
    absl::StatusOr<v1::PutResponse> r;
    {
      py::gil_scoped_release release;
      r = [&]() -> absl::StatusOr<v1::PutResponse> {
        if (encode_on_client && layers_per_message == 0) {
          // Client::Put encodes what it can (and sends the rest dense); it reads a KvDump, so the
          // arrays are copied once (a memcpy, small next to encoding them).
          KvDump dump = header;
          dump.k.assign(kv.k, kv.k + kv.bytes);
          dump.v.assign(kv.v, kv.v + kv.bytes);
          return client_->Put(dump, options);
        }
        absl::StatusOr<std::unique_ptr<PutStream>> s = client_->OpenPut(header, options);
        if (!s.ok()) return s.status();
        if (auto w =
                (*s)->WriteLayers(0, kv.dims[0], 0, kv.dims[2], absl::MakeConstSpan(kv.k, kv.bytes),
                                  absl::MakeConstSpan(kv.v, kv.bytes));
            !w.ok()) {
          return w;
        }
        return (*s)->Commit();
      }();
    }
    Check(r.status());
    return PutResponseDict(*r);
  }

  std::unique_ptr<PyPutStream> OpenPut(const Tokens& tokens, const std::optional<Floats>& surprisal,
                                       uint32_t layers, uint32_t heads, uint32_t head_dim,
                                       const py::dtype& dtype, int encoding, double target_rel_rms,
                                       uint32_t bits, uint32_t block_tokens, uint32_t first_block,
                                       uint32_t layers_per_message, int profile, int kv_dtype) {
    const DType d = DTypeOf(dtype, "k", kv_dtype);
    const KvDump header = Header(model_id_, tokens, surprisal, layers, heads, head_dim, d);
    const PutOptions options = MakePutOptions(encoding, target_rel_rms, bits, block_tokens,
                                              first_block, layers_per_message, profile);
    absl::StatusOr<std::unique_ptr<PutStream>> s;
    {
      py::gil_scoped_release release;
      s = client_->OpenPut(header, options);
    }
    Check(s.status());
    return std::make_unique<PyPutStream>(*std::move(s));
  }

  // (k, v, matched_tokens, spec): spec = (layers, kv_heads, head_dim, numpy dtype, kv dtype
  // name: "fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "uint8") on a hit,
  // None on a miss (then k and v are empty).
  py::tuple Get(const Tokens& tokens, int mode, uint32_t max_blocks, uint32_t layer_begin,
                uint32_t layer_end) {
    GetOptions o;
    o.mode = static_cast<v1::GetMode>(mode);
    o.max_blocks = max_blocks;
    o.layer_begin = layer_begin;
    o.layer_end = layer_end;
    absl::StatusOr<KvDump> r;
    {
      py::gil_scoped_release release;
      r = client_->Get(model_id_, SpanOf(tokens), o);
    }
    Check(r.status());
    return GetResult(*std::move(r));
  }

  // grpc.health.v1.Health/Check with its own deadline (seconds); raises when not SERVING.
  void CheckHealth(double deadline) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = client_->CheckHealth(absl::Seconds(deadline));
    }
    Check(s);
  }
  // Seconds the oldest call in flight on this client has waited (0 when none is).
  double OldestCallAge() const {
    const absl::Time oldest = client_->calls().OldestStart();
    return oldest == absl::InfiniteFuture() ? 0.0 : absl::ToDoubleSeconds(absl::Now() - oldest);
  }
  // Cancels every call in flight on this client (each raises CANCELLED); returns how many.
  int CancelCalls() { return client_->calls().CancelAll(); }

  py::object Stats(const std::string& ns) {
    absl::StatusOr<v1::StatsResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->Stats(ns);
    }
    Check(r.status());
    return Json(*r);
  }

  py::object Inspect(uint64_t node_id) {
    absl::StatusOr<v1::InspectResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->Inspect(model_id_, node_id);
    }
    Check(r.status());
    return Json(*r);
  }

  py::object Delete(const Tokens& tokens, bool erase) {
    absl::StatusOr<v1::DeleteResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->Delete(model_id_, SpanOf(tokens), erase);
    }
    Check(r.status());
    return Json(*r);
  }

  uint64_t Pin(const Tokens& tokens, uint64_t ttl_seconds, bool unpin, bool extend_only) {
    absl::StatusOr<v1::PinResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->Pin(model_id_, SpanOf(tokens), ttl_seconds, unpin, extend_only);
    }
    Check(r.status());
    return r->node_id();
  }

 private:
  const std::string model_id_;
  std::unique_ptr<Client> client_;  // thread-safe
};

}  // namespace
}  // namespace kvtrie

namespace kvtrie {
void BindShards(py::module_& m);  // shard_binding.cc: kvtrie.ShardedClient
}  // namespace kvtrie

PYBIND11_MODULE(_kvtrie, m) {
  kvtrie::BindShards(m);
  using kvtrie::PyClient;
  using kvtrie::PyPutStream;
  m.doc() =
      "The C++ core of the kvtrie package (kvtrie::Client over gRPC). Use kvtrie.Client, not this.";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kvtrie::py_convert::StatusError& e) {
      try {
        py::object err =
            py::module_::import("kvtrie._errors").attr("from_status")(e.code, e.what(), e.reason);
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
      } catch (py::error_already_set& inner) {
        inner.restore();
      }
    }
  });

  py::class_<PyPutStream>(m, "_PutStream")
      .def("write", &PyPutStream::Write, py::arg("layer_begin"), py::arg("token_offset"),
           py::arg("k"), py::arg("v"))
      .def("commit", &PyPutStream::Commit)
      .def("cancel", &PyPutStream::Cancel);

  py::class_<PyClient>(m, "_Client")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&,
                    double, bool, const std::string&, const std::string&, const std::string&,
                    const std::string&, int, double, double, int, double>(),
           py::arg("target"), py::arg("model_id"), py::arg("namespace"), py::arg("token"),
           py::arg("timeout"), py::arg("tls") = false, py::arg("tls_root_pem") = "",
           py::arg("tls_cert_pem") = "", py::arg("tls_key_pem") = "",
           py::arg("tls_server_name") = "", py::arg("retry_attempts") = 5,
           py::arg("retry_initial_backoff") = 0.1, py::arg("retry_max_backoff") = 2.0,
           py::arg("codec_threads") = 0, py::arg("predictor_refresh") = 10.0)
      .def("lookup", &PyClient::Lookup, py::arg("tokens"))
      .def("put", &PyClient::Put, py::arg("tokens"), py::arg("k"), py::arg("v"),
           py::arg("surprisal"), py::arg("encoding"), py::arg("target_rel_rms"), py::arg("bits"),
           py::arg("block_tokens"), py::arg("first_block"), py::arg("layers_per_message"),
           py::arg("encode_on_client") = true, py::arg("profile") = 0,
           py::arg("learned_lossless") = false, py::arg("kv_dtype") = 0)
      .def("open_put", &PyClient::OpenPut, py::arg("tokens"), py::arg("surprisal"),
           py::arg("layers"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("dtype"),
           py::arg("encoding"), py::arg("target_rel_rms"), py::arg("bits"), py::arg("block_tokens"),
           py::arg("first_block"), py::arg("layers_per_message"), py::arg("profile") = 0,
           py::arg("kv_dtype") = 0)
      .def("get", &PyClient::Get, py::arg("tokens"), py::arg("mode"), py::arg("max_blocks"),
           py::arg("layer_begin") = 0, py::arg("layer_end") = 0)
      .def("check_health", &PyClient::CheckHealth, py::arg("deadline"))
      .def("oldest_call_age", &PyClient::OldestCallAge)
      .def("cancel_calls", &PyClient::CancelCalls)
      .def("stats", &PyClient::Stats, py::arg("namespace"))
      .def("inspect", &PyClient::Inspect, py::arg("node_id"))
      .def("delete", &PyClient::Delete, py::arg("tokens"), py::arg("erase") = false)
      .def("pin", &PyClient::Pin, py::arg("tokens"), py::arg("ttl_seconds"), py::arg("unpin"),
           py::arg("extend_only") = false);
}
