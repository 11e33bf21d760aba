// client/python/shard_binding.cc
//
// The routing half of kvtrie.ShardedClient (kvtrie/sharded.py): the C++ router's functions
// (client/shard_router.h), so that Python and C++ clients send a prefix to the same shard.
//   _shard_owner(names, namespace, model_id, tokens, route_tokens) -> index of the owner in names
//   _parse_shards("name=host:port,...") -> [(name, target)], sorted by name
//   _resolve_shards(dns_name) -> [(name, target)]   (SRV, or A records of host:port)
// Errors raise kvtrie.Error (INVALID_ARGUMENT naming `shards`, UNAVAILABLE for DNS).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "client/shard_router.h"
#include "client/status_reason.h"

namespace py = pybind11;

namespace kvtrie {

// Raises the status as kvtrie.Error (kvtrie/_errors.py from_status).
[[noreturn]] void RaiseShardStatus(const absl::Status& s) {
  py::object err = py::module_::import("kvtrie._errors")
                       .attr("from_status")(static_cast<int>(s.code()), std::string(s.message()),
                                            StatusReason(s));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
  throw py::error_already_set();
}

std::vector<std::pair<std::string, std::string>> Pairs(const std::vector<Shard>& shards) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Shard& s : shards) out.emplace_back(s.name, s.target);
  return out;
}

void BindShards(py::module_& m) {
  m.def(
      "_shard_owner",
      [](const std::vector<std::string>& names, const std::string& ns, const std::string& model_id,
         const py::array_t<uint32_t, py::array::c_style>& tokens, size_t route_tokens) {
        std::vector<Shard> shards;
        for (const std::string& n : names) shards.push_back({n, ""});
        const uint64_t key = RouteKey(
            ns, model_id, absl::MakeConstSpan(tokens.data(), static_cast<size_t>(tokens.size())),
            route_tokens);
        return OwnerIndex(shards, key);
      },
      py::arg("names"), py::arg("namespace"), py::arg("model_id"), py::arg("tokens"),
      py::arg("route_tokens"));
  m.def("_parse_shards", [](const std::string& list) {
    absl::StatusOr<std::vector<Shard>> s = ParseShardList(list);
    if (!s.ok()) RaiseShardStatus(s.status());
    return Pairs(*s);
  });
  m.def("_resolve_shards", [](const std::string& name) {
    absl::StatusOr<std::vector<Shard>> s;
    {
      py::gil_scoped_release release;
      s = NewSystemResolver()->Resolve(name);
    }
    if (!s.ok()) RaiseShardStatus(s.status());
    return Pairs(*s);
  });
}

}  // namespace kvtrie
