// client/python/shard_binding.cc
//
// kvtrie.ShardedClient's C++ half (kvtrie/sharded.py is a thin wrapper): _ShardedClient wraps
// kvtrie::ShardedClient (client/sharded_client.h), so that Python and C++ clients share one
// routing, one failure and backoff policy, one set of lost-shard codes and one set of health
// checks. Its calls have kvtrie._Client's signatures (kvtrie_module.cc), so kvtrie.Client's
// Python methods drive either; stats and inspect answer for every shard.
//   _ShardedClient(model_id, namespace, ..., shards, shards_dns, ...)   (see ShardedClientOptions)
//   _shard_owner(names, namespace, model_id, tokens, route_tokens) -> index of the owner in names
//   _parse_shards("name=host:port,...") -> [(name, target)], sorted by name
//   _resolve_shards(dns_name) -> [(name, target)]   (SRV, or A records of host:port)
//   _lost_shard_code(code) -> bool   (LostShardCode: a status of the shard, not of the call)
// Errors raise kvtrie.Error (INVALID_ARGUMENT naming the argument, UNAVAILABLE for DNS).
// Every RPC runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/python/py_convert.h"
#include "client/shard_router.h"
#include "client/sharded_client.h"

namespace py = pybind11;

namespace kvtrie {
namespace {

using namespace py_convert;  // NOLINT(build/namespaces): the extension's helpers

std::vector<std::pair<std::string, std::string>> Pairs(const std::vector<Shard>& shards) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Shard& s : shards) out.emplace_back(s.name, s.target);
  return out;
}

absl::Duration Seconds(double s) { return absl::Milliseconds(s * 1000); }

using PyShardedPutStream = PyLayerPutStream<ShardedPutStream>;

class PyShardedClient {
 public:
  PyShardedClient(const std::string& model_id, const ClientOptions& client,
                  const std::string& shards, const std::string& shards_dns, int route_tokens,
                  double refresh_interval, double down_backoff, double down_max_backoff,
                  double warmup_window, const PutOptions& warmup_put, int pin_replicas,
                  double probe_deadline, double probe_interval)
      : model_id_(model_id) {
    if (model_id.empty()) InvalidArgument("model_id: must not be empty");
    if (route_tokens < 1) InvalidArgument("route_tokens: must be >= 1");
    if (!(refresh_interval > 0)) InvalidArgument("refresh_interval: must be > 0 seconds");
    // As ShardedClient's: the backoff is min(down_backoff * 2^(n-1), down_max_backoff).
    if (!(down_backoff >= 0)) InvalidArgument("down_backoff: must be >= 0 seconds");
    // down_max_backoff None (here < 0): the CLI's cap, DefaultDownMaxBackoff(down_backoff).
    if (!(warmup_window >= 0)) InvalidArgument("warmup_window: must be >= 0");
    if (!(probe_deadline >= 0)) InvalidArgument("shard_probe_deadline: must be >= 0");
    if (!(probe_interval > 0)) InvalidArgument("shard_probe_interval: must be > 0");
    ShardedClientOptions o;
    o.client = client;
    o.shards = shards;
    o.shards_dns = shards_dns;
    o.router.route_tokens = static_cast<size_t>(route_tokens);
    o.router.refresh_interval = Seconds(refresh_interval);
    o.down_initial_backoff = Seconds(down_backoff);
    o.down_max_backoff = down_max_backoff < 0 ? DefaultDownMaxBackoff(o.down_initial_backoff)
                                              : Seconds(down_max_backoff);
    o.warmup_window = Seconds(warmup_window);
    o.warmup_put = warmup_put;
    o.pin_replicas = pin_replicas;
    o.health.probe_deadline = Seconds(probe_deadline);
    o.health.probe_interval = Seconds(probe_interval);
    absl::StatusOr<std::unique_ptr<ShardedClient>> c;
    {
      py::gil_scoped_release release;  // shards_dns is resolved now
      c = ShardedClient::Create(o);
    }
    Check(c.status());
    client_ = *std::move(c);
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

  // kvtrie._Client.put's arguments; the arrays are copied once into the KvDump that
  // ShardedClient::Put reads (a memcpy, small next to encoding or sending them).
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
    KvDump dump =
        Header(model_id_, tokens, surprisal, kv.dims[0], kv.dims[1], kv.dims[3], kv.dtype);
    PutOptions options = MakePutOptions(encoding, target_rel_rms, bits, block_tokens, first_block,
                                        layers_per_message, profile);
    options.encode_on_client = encode_on_client;
    options.learned_lossless = learned_lossless;
    absl::StatusOr<v1::PutResponse> r;
    {
      py::gil_scoped_release release;
      dump.k.assign(kv.k, kv.k + kv.bytes);
      dump.v.assign(kv.v, kv.v + kv.bytes);
      r = client_->Put(dump, options);
    }
    Check(r.status());
    return PutResponseDict(*r);
  }

  std::unique_ptr<PyShardedPutStream> OpenPut(
      const Tokens& tokens, const std::optional<Floats>& surprisal, uint32_t layers, uint32_t heads,
      uint32_t head_dim, const py::dtype& dtype, int encoding, double target_rel_rms, uint32_t bits,
      uint32_t block_tokens, uint32_t first_block, uint32_t layers_per_message, int profile,
      int kv_dtype) {
    const DType d = DTypeOf(dtype, "k", kv_dtype);
    const KvDump header = Header(model_id_, tokens, surprisal, layers, heads, head_dim, d);
    const PutOptions options = MakePutOptions(encoding, target_rel_rms, bits, block_tokens,
                                              first_block, layers_per_message, profile);
    absl::StatusOr<std::unique_ptr<ShardedPutStream>> s;
    {
      py::gil_scoped_release release;
      s = client_->OpenPut(header, options);
    }
    Check(s.status());
    return std::make_unique<PyShardedPutStream>(*std::move(s));
  }

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

  py::object Delete(const Tokens& tokens, bool erase) {
    absl::StatusOr<v1::DeleteResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->Delete(model_id_, SpanOf(tokens), erase);
    }
    Check(r.status());
    return Json(*r);
  }

  // owner_only: no copy to (or unpin of) the replica.
  uint64_t Pin(const Tokens& tokens, uint64_t ttl_seconds, bool unpin, bool extend_only,
               bool owner_only) {
    absl::StatusOr<v1::PinResponse> r;
    {
      py::gil_scoped_release release;
      r = owner_only ? client_->PinOwner(model_id_, SpanOf(tokens), ttl_seconds, unpin, extend_only)
                     : client_->Pin(model_id_, SpanOf(tokens), ttl_seconds, unpin, extend_only);
    }
    Check(r.status());
    return r->node_id();
  }

  // {name: StatsResponse dict, or the kvtrie.Error of a lost shard}.
  py::dict StatsAll(const std::string& ns) {
    std::vector<ShardedClient::ShardStats> all;
    {
      py::gil_scoped_release release;
      all = client_->StatsAll(ns);
    }
    py::dict out;
    for (const ShardedClient::ShardStats& s : all) {
      out[py::str(s.shard.name)] = s.status.ok() ? Json(s.stats) : ErrorObject(s.status);
    }
    return out;
  }

  // MergeStats of the shards that answered, with shards_answered and shards_total.
  py::object Stats(const std::string& ns) {
    std::vector<ShardedClient::ShardStats> all;
    {
      py::gil_scoped_release release;
      all = client_->StatsAll(ns);
    }
    std::vector<v1::StatsResponse> answered;
    for (const ShardedClient::ShardStats& s : all) {
      if (s.status.ok()) answered.push_back(s.stats);
    }
    py::object out = Json(MergeStats(answered));
    out["shards_answered"] = answered.size();
    out["shards_total"] = all.size();
    return out;
  }

  // {name: InspectResponse dict, or the kvtrie.Error of a lost shard}.
  py::dict Inspect(uint64_t node_id) {
    std::vector<ShardedClient::ShardInspect> all;
    {
      py::gil_scoped_release release;
      all = client_->InspectAll(model_id_, node_id);
    }
    py::dict out;
    for (const ShardedClient::ShardInspect& s : all) {
      out[py::str(s.shard.name)] = s.status.ok() ? Json(s.inspect) : ErrorObject(s.status);
    }
    return out;
  }

  std::string Owner(const Tokens& tokens) {
    py::gil_scoped_release release;  // a DNS membership may be re-resolved
    return client_->OwnerOf(model_id_, SpanOf(tokens)).name;
  }
  std::vector<std::pair<std::string, std::string>> Shards() {
    py::gil_scoped_release release;
    return Pairs(client_->shards());
  }
  void SetShards(const std::string& list) {
    absl::StatusOr<std::vector<Shard>> s = ParseShardList(list);
    Check(s.status());
    Check(client_->SetShards(*std::move(s)));
  }

  py::dict Counters() const {
    const ShardedClient::Counters c = client_->counters();
    py::dict d;
    d["lost_calls"] = c.lost_calls;
    d["puts_skipped"] = c.puts_skipped;
    d["shard_failures"] = c.shard_failures;
    d["warmup_hits"] = c.warmup_hits;
    d["warmup_copies"] = c.warmup_copies;
    d["replica_copies"] = c.replica_copies;
    d["replica_hits"] = c.replica_hits;
    d["replica_failures"] = c.replica_failures;
    d["probes"] = c.probes;
    d["probe_failures"] = c.probe_failures;
    d["calls_cancelled"] = c.calls_cancelled;
    return d;
  }
  py::dict State(const std::string& name) const {
    const ShardedClient::ShardState s = client_->State(name);
    py::dict d;
    d["failures_in_a_row"] = s.failures_in_a_row;
    d["down_for"] = absl::ToDoubleSeconds(s.down_for);
    d["health_down"] = s.health_down;
    d["down"] = client_->IsDown(name);
    return d;
  }
  // The options the C++ client runs with, in the Python arguments' units.
  py::dict Options() const {
    const ShardedClientOptions& o = client_->options();
    py::dict d;
    d["route_tokens"] = o.router.route_tokens;
    d["down_backoff"] = absl::ToDoubleSeconds(o.down_initial_backoff);
    d["down_max_backoff"] = absl::ToDoubleSeconds(o.down_max_backoff);
    d["warmup_window"] = absl::ToDoubleSeconds(o.warmup_window);
    d["pin_replicas"] = o.pin_replicas;
    d["shard_probe_deadline"] = absl::ToDoubleSeconds(o.health.probe_deadline);
    d["shard_probe_interval"] = absl::ToDoubleSeconds(o.health.probe_interval);
    return d;
  }

 private:
  const std::string model_id_;
  std::unique_ptr<ShardedClient> client_;  // thread-safe
};

PyShardedClient* NewShardedClient(
    const std::string& model_id, const std::string& ns, const std::string& token, double timeout,
    bool tls, const std::string& root_pem, const std::string& cert_pem, const std::string& key_pem,
    const std::string& server_name, int retry_attempts, double retry_initial_backoff,
    double retry_max_backoff, int codec_threads, double predictor_refresh,
    const std::string& shards, const std::string& shards_dns, int route_tokens,
    double refresh_interval, double down_backoff, double down_max_backoff, double warmup_window,
    int warmup_encoding, int warmup_profile, double warmup_target_rel_rms, uint32_t warmup_bits,
    bool warmup_encode_on_client, bool warmup_learned_lossless, uint32_t block_tokens,
    int pin_replicas, double probe_deadline, double probe_interval) {
  const ClientOptions client = MakeClientOptions(
      "", ns, token, timeout, tls, root_pem, cert_pem, key_pem, server_name, retry_attempts,
      retry_initial_backoff, retry_max_backoff, codec_threads, predictor_refresh);
  PutOptions warmup_put = MakePutOptions(warmup_encoding, warmup_target_rel_rms, warmup_bits,
                                         block_tokens, 0, 0, warmup_profile);
  warmup_put.encode_on_client = warmup_encode_on_client;
  warmup_put.learned_lossless = warmup_learned_lossless;
  return new PyShardedClient(model_id, client, shards, shards_dns, route_tokens, refresh_interval,
                             down_backoff, down_max_backoff, warmup_window, warmup_put,
                             pin_replicas, probe_deadline, probe_interval);
}

}  // namespace

void BindShards(py::module_& m) {
  m.def(
      "_shard_owner",
      [](const std::vector<std::string>& names, const std::string& ns, const std::string& model_id,
         const Tokens& tokens, size_t route_tokens) {
        std::vector<Shard> shards;
        for (const std::string& n : names) shards.push_back({n, ""});
        return OwnerIndex(shards, RouteKey(ns, model_id, SpanOf(tokens), route_tokens));
      },
      py::arg("names"), py::arg("namespace"), py::arg("model_id"), py::arg("tokens"),
      py::arg("route_tokens"));
  m.def("_parse_shards", [](const std::string& list) {
    absl::StatusOr<std::vector<Shard>> s = ParseShardList(list);
    Check(s.status());
    return Pairs(*s);
  });
  m.def("_resolve_shards", [](const std::string& name) {
    absl::StatusOr<std::vector<Shard>> s;
    {
      py::gil_scoped_release release;
      s = NewSystemResolver()->Resolve(name);
    }
    Check(s.status());
    return Pairs(*s);
  });
  m.def(
      "_lost_shard_code",
      [](int code) { return LostShardCode(static_cast<absl::StatusCode>(code)); }, py::arg("code"));

  py::class_<PyShardedPutStream>(m, "_ShardedPutStream")
      .def("write", &PyShardedPutStream::Write, py::arg("layer_begin"), py::arg("token_offset"),
           py::arg("k"), py::arg("v"))
      .def("commit", &PyShardedPutStream::Commit)
      .def("cancel", &PyShardedPutStream::Cancel);

  py::class_<PyShardedClient>(m, "_ShardedClient")
      .def(py::init(&NewShardedClient), py::arg("model_id"), py::arg("namespace"), py::arg("token"),
           py::arg("timeout"), py::arg("tls") = false, py::arg("tls_root_pem") = "",
           py::arg("tls_cert_pem") = "", py::arg("tls_key_pem") = "",
           py::arg("tls_server_name") = "", py::arg("retry_attempts") = 1,
           py::arg("retry_initial_backoff") = 0.1, py::arg("retry_max_backoff") = 2.0,
           py::arg("codec_threads") = 0, py::arg("predictor_refresh") = 10.0,
           py::arg("shards") = "", py::arg("shards_dns") = "", py::arg("route_tokens") = 16,
           py::arg("refresh_interval") = 30.0, py::arg("down_backoff") = 1.0,
           py::arg("down_max_backoff") = -1.0, py::arg("warmup_window") = 0.0,
           py::arg("warmup_encoding") = 0, py::arg("warmup_profile") = 0,
           py::arg("warmup_target_rel_rms") = 0.0, py::arg("warmup_bits") = 0,
           py::arg("warmup_encode_on_client") = true, py::arg("warmup_learned_lossless") = false,
           py::arg("block_tokens") = 16, py::arg("pin_replicas") = 1,
           py::arg("shard_probe_deadline") = 0.25, py::arg("shard_probe_interval") = 0.5)
      .def("lookup", &PyShardedClient::Lookup, py::arg("tokens"))
      .def("put", &PyShardedClient::Put, py::arg("tokens"), py::arg("k"), py::arg("v"),
           py::arg("surprisal"), py::arg("encoding"), py::arg("target_rel_rms"), py::arg("bits"),
           py::arg("block_tokens"), py::arg("first_block"), py::arg("layers_per_message"),
           py::arg("encode_on_client") = true, py::arg("profile") = 0,
           py::arg("learned_lossless") = false, py::arg("kv_dtype") = 0)
      .def("open_put", &PyShardedClient::OpenPut, py::keep_alive<0, 1>(), py::arg("tokens"),
           py::arg("surprisal"), py::arg("layers"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("dtype"), py::arg("encoding"), py::arg("target_rel_rms"), py::arg("bits"),
           py::arg("block_tokens"), py::arg("first_block"), py::arg("layers_per_message"),
           py::arg("profile") = 0, py::arg("kv_dtype") = 0)
      .def("get", &PyShardedClient::Get, py::arg("tokens"), py::arg("mode"), py::arg("max_blocks"),
           py::arg("layer_begin") = 0, py::arg("layer_end") = 0)
      .def("delete", &PyShardedClient::Delete, py::arg("tokens"), py::arg("erase") = false)
      .def("pin", &PyShardedClient::Pin, py::arg("tokens"), py::arg("ttl_seconds"),
           py::arg("unpin"), py::arg("extend_only") = false, py::arg("owner_only") = false)
      .def("stats", &PyShardedClient::Stats, py::arg("namespace"))
      .def("stats_all", &PyShardedClient::StatsAll, py::arg("namespace"))
      .def("inspect", &PyShardedClient::Inspect, py::arg("node_id"))
      .def("owner", &PyShardedClient::Owner, py::arg("tokens"))
      .def("shards", &PyShardedClient::Shards)
      .def("set_shards", &PyShardedClient::SetShards, py::arg("shards"))
      .def("counters", &PyShardedClient::Counters)
      .def("state", &PyShardedClient::State, py::arg("name"))
      .def("options", &PyShardedClient::Options);
}

}  // namespace kvtrie
