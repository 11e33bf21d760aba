"""Fake vllm: KVConnectorBase_V1, KVConnectorRole and KVConnectorMetadata with the signatures of
vLLM's base.py at the commit pinned in tests/python/data/vllm_kv_connector_v1.json (built from
that data: every method with its parameters, kinds, defaults, abstractness, static / class
method or property, and return annotation). The non-abstract methods behave as vLLM documents
its defaults (metadata bound and cleared, ``get_finished`` -> ``(None, None)``,
``request_finished`` -> ``(False, None)``, no load errors, otherwise nothing)."""

from __future__ import annotations

import enum
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Dict

PINNED: Dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[6] / "data" / "vllm_kv_connector_v1.json").read_text())

KVConnectorRole = enum.Enum(  # type: ignore[misc]
    "KVConnectorRole", PINNED["KVConnectorRole"]["members"], module=__name__)


class KVConnectorMetadata(ABC):  # noqa: B024 - as vLLM's: abstract, no methods
    """Scheduler -> worker metadata (vLLM's abstract base)."""


def _set_meta(self, meta):
    self._connector_metadata = meta


def _get_meta(self):
    assert self._connector_metadata is not None
    return self._connector_metadata


# Behaviour of the non-abstract methods, by name (vLLM's documented defaults); others: None.
_BEHAVIOUR: Dict[str, Callable[..., Any]] = {
    "__init__": lambda self, a: _init(self, a["vllm_config"], a["role"], a["kv_cache_config"]),
    "bind_connector_metadata": lambda self, a: _set_meta(self, a["connector_metadata"]),
    "clear_connector_metadata": lambda self, a: _set_meta(self, None),
    "_get_connector_metadata": lambda self, a: _get_meta(self),
    "has_connector_metadata": lambda self, a: self._connector_metadata is not None,
    "get_finished": lambda self, a: (None, None),
    "get_block_ids_with_load_errors": lambda self, a: set(),
    "request_finished": lambda self, a: (False, None),
    "take_events": lambda self, a: (),
    "has_pending_push_work": lambda self, a: False,
    "requires_piecewise_for_cudagraph": lambda cls, a: False,
    "role": lambda self, a: self._role,
    "prefer_cross_layer_blocks": lambda self, a: False,
    "supports_eagle_prefix_cache_hashing": lambda self, a: False,
    "requires_kv_delivery": lambda self, a: self._kv_transfer_config.is_kv_producer,
}


def _behave(name: str, first: Any, args: Dict[str, Any]) -> Any:
    return _BEHAVIOUR.get(name, lambda _, __: None)(first, args)


def _abstract(name: str, first: Any, args: Dict[str, Any]) -> Any:
    raise NotImplementedError(name)


def _function(entry: Dict[str, Any]) -> Callable[..., Any]:
    """A function with exactly the pinned parameters (names, kinds, defaults)."""
    params, defaults, star_done = [], {}, False
    kinds = [p["kind"] for p in entry["parameters"]]
    for i, p in enumerate(entry["parameters"]):
        text = p["name"]
        if p["kind"] == "VAR_POSITIONAL":
            text, star_done = "*" + text, True
        elif p["kind"] == "VAR_KEYWORD":
            text = "**" + text
        elif p["kind"] == "KEYWORD_ONLY" and not star_done:
            params.append("*")
            star_done = True
        if p["has_default"]:
            defaults[f"_d{i}"] = eval(p["default"], {})  # noqa: S307 - pinned literals
            text += f"=_d{i}"
        params.append(text)
        if p["kind"] == "POSITIONAL_ONLY" and (i + 1 == len(kinds)
                                               or kinds[i + 1] != "POSITIONAL_ONLY"):
            params.append("/")
    first = entry["parameters"][0]["name"] if entry["parameters"] else "None"
    impl = "_abstract" if entry["abstract"] else "_behave"
    namespace = {"_behave": _behave, "_abstract": _abstract, **defaults}
    src = (f"def {entry['name']}({', '.join(params)}):\n"
           f"    return {impl}({entry['name']!r}, {first}, locals())\n")
    exec(src, namespace)  # noqa: S102 - source built from the pinned signature data
    fn = namespace[entry["name"]]
    fn.__annotations__ = {p["name"]: p["annotation"] for p in entry["parameters"]
                          if p["annotation"]}
    if entry["returns"] is not None:
        fn.__annotations__["return"] = entry["returns"]
    return fn


def _member(entry: Dict[str, Any]) -> Any:
    fn = _function(entry)
    if entry["abstract"]:
        fn = abstractmethod(fn)
    if entry["kind"] == "property":
        return property(fn)
    if entry["kind"] == "classmethod":
        return classmethod(fn)
    if entry["kind"] == "staticmethod":
        return staticmethod(fn)
    return fn


def _init(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:  # as vLLM's
    self._connector_metadata = None
    self._vllm_config = vllm_config
    if vllm_config.kv_transfer_config is None:
        raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
    self._kv_transfer_config = vllm_config.kv_transfer_config
    self._kv_cache_config = kv_cache_config
    self._role = role
    self.use_eagle_prefix_cache_hashing = False


def _make_base() -> type:
    members: Dict[str, Any] = {m["name"]: _member(m) for m in PINNED["methods"]}
    members["__init__"] = _function(PINNED["constructor"])  # pinned signature, vLLM's behaviour
    members["__doc__"] = "Base class for KV connectors (fake: pinned signatures, no vLLM)."
    members["__module__"] = __name__
    return type(PINNED["class"], (ABC,), members)


KVConnectorBase_V1 = _make_base()


def _make_interface(name: str) -> type:
    """An abstract class of base.py beside the base (SupportsHMA, KVConnectorWorkerMetadata,
    KVConnectorHandshakeMetadata) with its pinned methods."""
    spec = PINNED["interfaces"][name]
    members: Dict[str, Any] = {m["name"]: _member(m) for m in spec["methods"]}
    members["__module__"] = __name__
    return type(name, (ABC,), members)


SupportsHMA = _make_interface("SupportsHMA")
KVConnectorWorkerMetadata = _make_interface("KVConnectorWorkerMetadata")
KVConnectorHandshakeMetadata = _make_interface("KVConnectorHandshakeMetadata")


def supports_hma(connector: Any) -> bool:  # as vLLM's
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)
