"""KvtrieConnector against vLLM's KV connector interface, without vLLM.

vLLM's KVConnectorBase_V1 (vllm/distributed/kv_transfer/kv_connector/v1/base.py at the commit
pinned in data/vllm_kv_connector_v1.json, extracted as data by extract_vllm_api.py) is checked
against the class: every abstract method implemented, every overridden method's parameters
compatible (names, kinds, defaults; extra keyword-only parameters with defaults allowed), static /
class methods and properties kept, the constructor vLLM's factory calls, and the return contracts
by calling each method on a small request against a real kvtrie-server. The connector is imported
*for real* under a fake `vllm` package (fake_vllm/, built from the same data): it must derive from
its KVConnectorBase_V1 and load through vLLM's factory way (kv_connector_module_path + class
name). A vLLM that is present but broken must surface; only an absent one falls back.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

from conftest import TESTDATA, read_dump
from kvtrie.connector import KvtrieConnector as StandaloneConnector

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_vllm"
API = json.loads((HERE / "data" / "vllm_kv_connector_v1.json").read_text())
PINNED_COMMIT = "003df2961dd8830c317a61f9745ccd557da9fa06"
ABSTRACT = {m["name"] for m in API["methods"] if m["abstract"]}


def _is_ours(name: str) -> bool:
    return name == "kvtrie.connector" or name == "vllm" or name.startswith("vllm.")


@pytest.fixture(scope="module")
def vllm_mode():
    """(kvtrie.connector, the fake vllm's base module): the connector imported afresh with the
    fake vllm on sys.path; the modules imported before are put back afterwards."""
    import kvtrie
    saved = {n: m for n, m in sys.modules.items() if _is_ours(n)}
    saved_attr = getattr(kvtrie, "connector", None)
    for n in saved:
        del sys.modules[n]
    sys.path.insert(0, str(FAKE))
    importlib.invalidate_caches()
    try:
        yield (importlib.import_module("kvtrie.connector"),
               importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base"))
    finally:
        sys.path.remove(str(FAKE))
        for n in [n for n in sys.modules if _is_ours(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
        if saved_attr is not None:
            kvtrie.connector = saved_attr


# ---------------- signatures ----------------


def _static_kind(cls: type, name: str) -> str:
    attr = inspect.getattr_static(cls, name)
    for kind in (property, classmethod, staticmethod):
        if isinstance(attr, kind):
            return kind.__name__
    return "method"


def _params(cls: type, name: str) -> List[inspect.Parameter]:
    attr = inspect.getattr_static(cls, name)
    fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
    return list(inspect.signature(fn).parameters.values())


def _defined_by(cls: type, name: str, base: type) -> Optional[type]:
    """The class in cls's MRO before `base` that defines `name`, or None."""
    for c in cls.__mro__:
        if c is base or c is object:
            return None
        if name in vars(c):
            return c
    return None


def incompatibilities(cls: type, entry: Dict[str, Any]) -> List[str]:
    """How `cls`'s override of the pinned method `entry` would break a call vLLM makes."""
    name, out = entry["name"], []
    kind = _static_kind(cls, name)
    if kind != entry["kind"]:
        return [f"{name}: a {kind}, vLLM's is a {entry['kind']}"]
    if kind == "property":
        return []
    ours = _params(cls, name)
    theirs = entry["parameters"]
    if kind != "staticmethod":  # self / cls: positional, any name
        ours, theirs = ours[1:], theirs[1:]
    by_name = {p.name: p for p in ours}
    positional = [p for p in ours if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in ours)
    var_kw = any(p.kind == p.VAR_KEYWORD for p in ours)
    for i, t in enumerate(theirs):
        if t["kind"] == "VAR_POSITIONAL" and not var_pos:
            out.append(f"{name}: no *{t['name']}")
        elif t["kind"] == "VAR_KEYWORD" and not var_kw:
            out.append(f"{name}: no **{t['name']}")
        elif t["kind"] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
            if i >= len(positional) and not var_pos:
                out.append(f"{name}: takes no positional argument {i + 1} ({t['name']})")
            elif i < len(positional) and t["kind"] == "POSITIONAL_OR_KEYWORD" and \
                    positional[i].name != t["name"]:
                out.append(f"{name}: argument {i + 1} is {positional[i].name}, "
                           f"vLLM's {t['name']}")
            elif (i < len(positional) and t["has_default"]
                  and positional[i].default is inspect.Parameter.empty):
                out.append(f"{name}: {t['name']} needs a default ({t['default']})")
        elif t["kind"] == "KEYWORD_ONLY":
            p = by_name.get(t["name"])
            if p is None and not var_kw:
                out.append(f"{name}: no keyword {t['name']}")
            elif p is not None and t["has_default"] and p.default is inspect.Parameter.empty:
                out.append(f"{name}: {t['name']} needs a default ({t['default']})")
    names = {t["name"] for t in theirs}
    for i, p in enumerate(ours):  # extra parameters: only with defaults, and not positional-only
        if p.name in names or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            out.append(f"{name}: extra parameter {p.name} without a default")
        elif p.kind == p.POSITIONAL_ONLY:
            out.append(f"{name}: extra positional-only parameter {p.name}")
    return out


def check_class(cls: type, base: type = object) -> List[str]:
    problems = []
    for entry in API["methods"] + [API["constructor"]]:
        if _defined_by(cls, entry["name"], base) is None:
            if entry["abstract"]:
                problems.append(f"{entry['name']}: abstract in vLLM, not implemented")
            continue
        problems += incompatibilities(cls, entry)
    return problems


def test_pinned_data_is_whole():
    assert API["vllm_commit"] == PINNED_COMMIT
    names = {m["name"] for m in API["methods"]}
    assert ABSTRACT == {"start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                        "get_num_new_matched_tokens", "update_state_after_alloc",
                        "build_connector_meta"}
    assert {"get_finished", "request_finished", "get_block_ids_with_load_errors",
            "build_prom_metrics", "requires_piecewise_for_cudagraph", "role"} <= names
    assert [p["name"] for p in API["constructor"]["parameters"]] == [
        "self", "vllm_config", "role", "kv_cache_config"]
    assert API["KVConnectorRole"]["members"] == {"SCHEDULER": 0, "WORKER": 1}


def test_fake_base_has_the_pinned_signatures(vllm_mode):
    _, base = vllm_mode
    b = base.KVConnectorBase_V1
    assert b.__abstractmethods__ == ABSTRACT
    for entry in API["methods"] + [API["constructor"]]:
        assert _static_kind(b, entry["name"]) == entry["kind"], entry["name"]
        got = [(p.name, p.kind.name) for p in _params(b, entry["name"])]
        assert got == [(p["name"], p["kind"]) for p in entry["parameters"]], entry["name"]


def test_checker_catches_what_breaks_a_call():
    """The checker itself can fail: a missing abstract method, a renamed argument, a missing
    **kwargs, a class method turned plain, an extra required parameter."""
    class Bad:
        def start_load_kv(self, forward_context):  # no **kwargs
            pass

        def wait_for_layer_load(self, name):  # renamed
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, extra, **kwargs):
            pass

        def requires_piecewise_for_cudagraph(self, extra_config):  # not a classmethod
            return False

    problems = "\n".join(check_class(Bad))
    for needle in ("start_load_kv: no **kwargs", "wait_for_layer_load: argument 1 is name",
                   "save_kv_layer: extra parameter extra", "requires_piecewise_for_cudagraph: "
                   "a method, vLLM's is a classmethod", "wait_for_save: abstract in vLLM",
                   "build_connector_meta: abstract in vLLM"):
        assert needle in problems


def test_standalone_class_matches_the_interface():
    assert StandaloneConnector.__mro__[1] is object  # no vllm here: it stands alone
    assert check_class(StandaloneConnector) == []


def test_derives_from_vllm_base_and_matches_it(vllm_mode):
    mod, base = vllm_mode
    cls = mod.KvtrieConnector
    assert issubclass(cls, base.KVConnectorBase_V1)
    assert issubclass(mod.KvtrieConnectorMetadata, base.KVConnectorMetadata)
    assert mod.KVConnectorRole is base.KVConnectorRole
    assert not inspect.isabstract(cls), cls.__abstractmethods__
    assert check_class(cls, base.KVConnectorBase_V1) == []


def test_hybrid_interfaces_are_pinned_and_implemented(vllm_mode):
    # base.py's other classes (extract_vllm_api.py, "interfaces"): what the pin says of them.
    hma = API["interfaces"]["SupportsHMA"]
    assert hma["bases"] == ["ABC"]
    (entry,) = hma["methods"]
    assert entry["name"] == "request_finished_all_groups" and entry["abstract"]
    assert [p["name"] for p in entry["parameters"]] == ["self", "request", "block_ids"]
    assert entry["parameters"][2]["annotation"] == "tuple[list[int], ...]"
    assert entry["returns"] == "tuple[bool, dict[str, Any] | None]"
    (agg,) = API["interfaces"]["KVConnectorWorkerMetadata"]["methods"]
    assert agg["name"] == "aggregate" and agg["abstract"]
    assert API["interfaces"]["KVConnectorHandshakeMetadata"] == {"bases": ["ABC"], "methods": []}
    assert [f["name"] for f in API["functions"]] == ["supports_hma"]
    # The connector is SupportsHMA under vLLM (so vLLM keeps the hybrid allocator on), and its
    # request_finished_all_groups takes vLLM's arguments.
    mod, base = vllm_mode
    assert issubclass(mod.KvtrieConnector, base.SupportsHMA)
    assert base.supports_hma(mod.KvtrieConnector)
    assert not inspect.isabstract(mod.KvtrieConnector)
    assert incompatibilities(mod.KvtrieConnector, entry) == []
    assert incompatibilities(StandaloneConnector, entry) == []


# ---------------- return contracts, through vLLM's factory ----------------


@dataclass
class Request:  # the fields of vllm.v1.request.Request the connector may read
    request_id: str
    prompt_token_ids: List[int]
    num_computed_tokens: int = 0
    lora_request: Any = None
    cache_salt: Optional[str] = None
    mm_features: list = field(default_factory=list)
    prompt_embeds: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> List[int]:
        return self.prompt_token_ids


class KVCacheBlocks:
    def __init__(self, ids: List[int]):
        self._ids = list(ids)

    def get_block_ids(self):
        return (self._ids,)


def scheduler_output(req: Request, block_ids: List[int], num_tokens: int) -> SimpleNamespace:
    """vllm.v1.core.sched.output.SchedulerOutput of a step scheduling one new request."""
    new = SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                          block_ids=(list(block_ids),), num_computed_tokens=req.num_computed_tokens,
                          lora_request=None, mm_features=[], sampling_params=None,
                          pooling_params=None, prompt_embeds=None)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), resumed_from_preemption=[],
                             new_token_ids=[], all_token_ids={}, new_block_ids=[],
                             num_computed_tokens=[], num_output_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req.request_id: num_tokens},
                           total_num_scheduled_tokens=num_tokens, finished_req_ids=set(),
                           preempted_req_ids=set(), free_encoder_mm_hashes=[],
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           num_common_prefix_blocks=[0], kv_connector_metadata=None)


def vllm_config(target: str) -> SimpleNamespace:
    kt = SimpleNamespace(kv_connector="KvtrieConnector",
                         kv_connector_module_path="kvtrie.connector", kv_role="kv_both", is_kv_producer=True, is_kv_consumer=True,
                         engine_id="0", kv_load_failure_policy="recompute",
                         kv_connector_extra_config={"target": target, "model_id": "conformance",
                                                    "encoding": "lossless"})
    return SimpleNamespace(kv_transfer_config=kt,
                           model_config=SimpleNamespace(model="stories260K", dtype="float16"),
                           cache_config=SimpleNamespace(block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                           pipeline_parallel_size=1, rank=0))


def _pair_of_sets(x: Any) -> bool:
    return (isinstance(x, tuple) and len(x) == 2
            and all(e is None or isinstance(e, set) for e in x))


def test_factory_loads_it_and_return_contracts_hold(vllm_mode, server):
    """vLLM's factory builds a scheduler and a worker connector from --kv-transfer-config; one
    request of 48 real tokens (tests/data/sessions/s0, the stories260K KV) is saved, then a second
    with the same prompt is matched and loaded, every call's return checked on the way."""
    mod, base = vllm_mode
    factory = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.factory")
    cfg = vllm_config(server.target)
    sched = factory.KVConnectorFactory.create_connector(cfg, base.KVConnectorRole.SCHEDULER, None)
    worker = factory.KVConnectorFactory.create_connector(cfg, base.KVConnectorRole.WORKER, None)
    assert type(sched) is mod.KvtrieConnector and isinstance(sched, base.KVConnectorBase_V1)
    assert sched.role is base.KVConnectorRole.SCHEDULER
    assert worker.role is base.KVConnectorRole.WORKER
    # Per-layer hooks run inside attention: piecewise CUDA graphs; a cache never holds a
    # request back for delivery.
    assert mod.KvtrieConnector.requires_piecewise_for_cudagraph({}) is True
    assert worker.requires_kv_delivery is False and sched.requires_kv_delivery is False

    tokens, _, k, v = read_dump(TESTDATA / "sessions" / "s0")
    n, bs = 48, 16
    prompt = [int(t) for t in tokens[:n]]
    layers, heads, _, hd = k.shape
    names = [f"model.layers.{l}.self_attn.attn" for l in range(layers)]
    caches = {nm: np.zeros((2, 16, bs, heads, hd), np.float16) for nm in names}
    worker.register_kv_caches(caches)

    def step(req: Request, blocks: List[int], ext: int, forward) -> None:
        req.num_computed_tokens = ext  # vLLM: local (0) + external, before building the meta
        meta = sched.build_connector_meta(scheduler_output(req, blocks, n - ext))
        assert isinstance(meta, base.KVConnectorMetadata)
        worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        assert worker.has_connector_metadata()
        assert worker.start_load_kv(SimpleNamespace(attn_metadata=None)) is None
        for l, nm in enumerate(names):
            assert worker.wait_for_layer_load(nm) is None
            forward(l, nm)
            assert worker.save_kv_layer(nm, caches[nm], None) is None
        assert worker.wait_for_save() is None
        errors = worker.get_block_ids_with_load_errors()
        assert isinstance(errors, set) and not errors
        assert _pair_of_sets(worker.get_finished(set()))
        worker.clear_connector_metadata()
        assert not worker.has_connector_metadata()

    def finish(req: Request, blocks: List[int]) -> None:
        done = sched.request_finished(req, blocks)
        assert isinstance(done, tuple) and len(done) == 2 and isinstance(done[0], bool)
        assert done[1] is None or isinstance(done[1], dict)
        deadline = time.monotonic() + 30  # an asynchronous save ends in get_finished's first set
        while done[0]:
            sending, _ = worker.get_finished({req.request_id})
            if sending and req.request_id in sending:
                break
            assert time.monotonic() < deadline, "an asynchronous save never finished"
            time.sleep(0.05)

    # 1: nothing stored; the forward pass writes the real KV, the connector saves it.
    def matched_tokens(req: Request) -> Any:
        # vLLM's Scheduler.schedule skips a request while the connector answers None (an
        # asynchronous lookup in flight) and asks again in a later step.
        deadline = time.monotonic() + 30
        while (got := sched.get_num_new_matched_tokens(req, 0))[0] is None:
            assert isinstance(got, tuple) and got[1] is False
            assert time.monotonic() < deadline, "a lookup never answered"
            time.sleep(0.01)
        return got

    first = Request("r1", prompt)
    got = matched_tokens(first)
    assert isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], bool)
    assert got == (0, False)
    blocks1 = [3, 7, 1]
    assert sched.update_state_after_alloc(first, KVCacheBlocks(blocks1), 0) is None

    def write(l: int, nm: str) -> None:
        for t in range(n):
            caches[nm][0, blocks1[t // bs], t % bs] = k[l, :, t]
            caches[nm][1, blocks1[t // bs], t % bs] = v[l, :, t]

    step(first, blocks1, 0, write)
    finish(first, blocks1)

    # 2: the same prompt: matched (all but the last token), loaded into other blocks.
    second = Request("r2", prompt)
    matched, is_async = matched_tokens(second)
    assert isinstance(matched, int) and 32 <= matched < n
    blocks2 = [9, 2, 12]
    assert sched.update_state_after_alloc(second, KVCacheBlocks(blocks2), matched) is None
    if is_async:  # loaded between steps: wait for get_finished's second set
        deadline = time.monotonic() + 30
        while not (worker.get_finished(set())[1] or set()) & {"r2"}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    step(second, blocks2, matched, lambda l, nm: None)
    for l, nm in enumerate(names):
        for t in range(matched):
            assert np.array_equal(caches[nm][0, blocks2[t // bs], t % bs], k[l, :, t]), (l, t)
            assert np.array_equal(caches[nm][1, blocks2[t // bs], t % bs], v[l, :, t]), (l, t)
    finish(second, blocks2)

    # The counters of both sides reach vLLM's Prometheus metrics (the fake's recording
    # counters), per engine: what the two requests did, no more.
    metrics = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    types = {metrics.Gauge: metrics.Gauge, metrics.Counter: metrics.Counter,
             metrics.Histogram: metrics.Histogram}
    prom = mod.KvtrieConnector.build_prom_metrics(cfg, types, ["model_name", "engine"],
                                                  {0: ["stories260K", "0"], 1: ["x", "1"]})
    assert isinstance(prom, metrics.KVConnectorPromMetrics)
    data = dict(sched.get_kv_connector_stats().data)
    w = mod.KvtrieConnector.build_kv_connector_stats(worker.get_kv_connector_stats().data)
    for key, value in w.data.items():
        data[key] = data.get(key, 0) + value
    prom.observe(data, engine_idx=0)
    got = {key: c[0].value for key, c in prom.counters.items()}
    token_bytes = 2 * layers * heads * hd * 2  # K and V, fp16
    assert got["lookups"] == 2 and got["lookup_hits"] == 1
    assert got["loaded_tokens"] == matched and got["loaded_bytes"] == matched * token_bytes
    assert got["load_failed_tokens"] == 0 and got["load_failures"] == 0
    assert got["saved_blocks"] == 3 and got["saved_bytes"] == n * token_bytes
    assert got["save_errors"] == 0
    assert all(c[1].value == 0 for c in prom.counters.values())  # the other engine: untouched
    worker.shutdown()
    sched.shutdown()


def test_prom_metrics_none_without_vllm():
    env = dict(os.environ)  # a fresh interpreter: the module's fake vllm stays out of it
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p) != FAKE)
    code = ("import kvtrie.connector as c; C = c.KvtrieConnector; "
            "print(C.build_prom_metrics(None, {}, [], {}), "
            "C.requires_piecewise_for_cudagraph({}), "
            "C(config={'model_id': 'm'}).requires_kv_delivery)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "True", "False"]


# ---------------- import: absent vs broken vLLM ----------------


def _import_connector(extra_path: Optional[Path]) -> subprocess.CompletedProcess:
    """`import kvtrie.connector` in a fresh interpreter, with extra_path first on sys.path."""
    env = dict(os.environ)
    paths = ([str(extra_path)] if extra_path else []) + [
        p for p in sys.path if p and Path(p) != FAKE]  # (the fixture may have put it there)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    code = ("import kvtrie.connector as c; "
            "print(c.KvtrieConnector.__mro__[1].__module__, c.KvtrieConnector.__mro__[1].__name__)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def _broken_fake(tmp_path: Path, base_py: str) -> Path:
    """A copy of the fake vllm whose v1/base.py is `base_py`."""
    import shutil
    root = tmp_path / "broken"
    shutil.copytree(FAKE, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "vllm/distributed/kv_transfer/kv_connector/v1/base.py").write_text(
        textwrap.dedent(base_py))
    return root


def test_absent_vllm_falls_back():
    r = _import_connector(None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["builtins", "object"]


def test_present_vllm_is_used_in_a_fresh_interpreter():
    r = _import_connector(FAKE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["vllm.distributed.kv_transfer.kv_connector.v1.base",
                                "KVConnectorBase_V1"]


def test_vllm_missing_a_dependency_of_its_own_surfaces(tmp_path):
    r = _import_connector(_broken_fake(tmp_path, "import torch_kvtrie_absent_module\n"))
    assert r.returncode != 0
    assert "ModuleNotFoundError: No module named 'torch_kvtrie_absent_module'" in r.stderr


def test_vllm_raising_another_error_surfaces(tmp_path):
    r = _import_connector(_broken_fake(tmp_path, "raise RuntimeError('CUDA driver too old')\n"))
    assert r.returncode != 0
    assert "RuntimeError: CUDA driver too old" in r.stderr


def test_vllm_without_the_v1_connector_api_surfaces(tmp_path):
    root = _broken_fake(tmp_path, "")
    (root / "vllm/distributed/kv_transfer/kv_connector/v1/base.py").unlink()
    (root / "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py").unlink()
    r = _import_connector(root)
    assert r.returncode != 0
    assert "No module named 'vllm.distributed.kv_transfer.kv_connector.v1" in r.stderr
