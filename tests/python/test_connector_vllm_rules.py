"""KvtrieConnector under the rules of vLLM's real scheduler and workers that the engine of
test_connector_engine.py did not have (issue 32). Each test is one row of the issue's table; the
engine (engine.py) first learns the behaviour from vLLM's source (the file and function are
cited there), then the connector is checked against it, with the real stories260K model and a
real kvtrie-server."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvtrie  # noqa: E402
import test_connector_engine  # noqa: E402
from conftest import MODEL, TESTDATA, ServerProcess, read_dump  # noqa: E402
from kvtrie.connector import KVConnectorRole, KvtrieConnector  # noqa: E402
from test_connector_engine import (PREFIX, assert_cold, mixed_prompts,  # noqa: E402
                                   req, session, tokens)

pytestmark = pytest.mark.skipif(not MODEL.exists(),
                                reason=f"needs the model {MODEL} (or $KVTRIE_MODEL)")


def aengine(*args, cfg=None, **kw):
    """test_connector_engine's engine with the connector's default, asynchronous lookups."""
    return test_connector_engine.engine(*args, cfg={"async_lookup": True, **(cfg or {})}, **kw)


@pytest.fixture(scope="module")
def model():
    from llama_numpy import LlamaModel
    return LlamaModel(str(MODEL))


# ---------------- row 2: skip_reading_prefix_cache ----------------


def test_prompt_logprobs_requests_load_nothing_but_are_saved(model, server):
    e = aengine(model, server.target, "skip-read")
    e.run([req("s0", session(0))])  # the preamble is stored (and in the local cache)
    out = e.run([req("s1", session(1), prompt_logprobs=1)])["s1"]
    assert out.skip_reading_prefix_cache  # vLLM's SamplingParams default for prompt_logprobs
    assert out.local_hit_tokens == [0] and out.external_tokens == [0]
    assert e.workers[0].stats["loaded_tokens"] == 0
    assert set(range(len(out.prompt_token_ids))) <= set(out.logits)  # every prompt position
    assert_cold(model, out)
    # Its KV is computed as any request's: saved, and the next plain request loads it.
    e2 = aengine(model, server.target, "skip-read", prefix_cache=False)
    again = e2.run([req("s1b", session(1))])["s1b"]
    assert again.external_tokens[0] > PREFIX  # s1's own blocks: saved by the skipping request
    assert_cold(model, again)


# ---------------- row 8: lookups off the scheduler's loop ----------------


class GatedLookups:
    """The scheduler's client, its Lookups of `prompt` held until `gate` is set (at most 20 s:
    a blocking connector then shows as a slow step, not a hang)."""

    def __init__(self, client, prompt):
        self._c, self._prompt, self.gate, self.calls = client, list(prompt), threading.Event(), 0

    def __getattr__(self, name):
        return getattr(self._c, name)

    def lookup(self, t):
        self.calls += 1
        if list(t) == self._prompt:
            self.gate.wait(20)
        return self._c.lookup(t)


def gate_lookups(e, prompt):
    g = GatedLookups(e.sched._client, prompt)
    e.sched._client = e.sched._clients[""] = g
    return g


def test_a_pending_lookup_defers_its_request_and_the_others_run(model, server):
    aengine(model, server.target, "async-lookup").run([req("s0", session(0))])  # stored
    e = aengine(model, server.target, "async-lookup", prefix_cache=False)
    g = gate_lookups(e, session(1))
    e.add_request(req("s1", session(1)))
    e.add_request(req("genesis", tokens("genesis_1-3")[:100]))
    pending = getattr(e.sched, "_lookups", {}).get("genesis")  # started by on_new_request
    if pending is not None:
        pending.result(timeout=20)  # genesis's lookup is answered; s1's is held
    t0 = time.monotonic()
    e.step()  # s1's lookup is not answered: skipped, genesis runs
    assert time.monotonic() - t0 < 10, "the scheduler waited for a lookup"
    assert [r.request_id for r in e.running] == ["genesis"]
    assert [r.request_id for r in e.waiting] == ["s1"] and e.lookup_deferrals >= 1
    e.step()
    assert [r.request_id for r in e.waiting] == ["s1"]  # still waiting, still at the head
    g.gate.set()
    out = e.run()["s1"]
    assert out.external_tokens == [PREFIX]  # the answer, once it came
    assert g.calls == 2  # one Lookup per request, however many steps asked
    assert_cold(model, out)
    assert_cold(model, e.requests["genesis"])


def test_the_answer_is_kept_until_the_request_is_allocated(server):
    t, _, k, v = read_dump(TESTDATA / "sessions" / "s0")  # the real KV of session 0
    kvtrie.Client(server.target, "stories260K", namespace="answer-kept").put(t, k, v)
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config={
        "target": server.target, "model_id": "stories260K", "namespace": "answer-kept"})
    g = gate_lookups(type("E", (), {"sched": sched})(), session(1))
    r = req("s1", session(1))
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)  # returned at once
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
    g.gate.set()
    deadline = time.monotonic() + 20
    while (n := sched.get_num_new_matched_tokens(r, 0)[0]) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert n == PREFIX and sched.get_num_new_matched_tokens(r, 32) == (PREFIX - 32, False)
    assert g.calls == 1
    sched.request_finished(r, [])  # forgotten: a new request of that id asks again
    sched.get_num_new_matched_tokens(r, 0)
    sched.shutdown()  # waits for the lookup threads
    assert g.calls == 2


def test_min_load_tokens_and_blocking_lookups(model, server):
    aengine(model, server.target, "min-load").run([req("s0", session(0))])
    e = aengine(model, server.target, "min-load", prefix_cache=False,
               cfg={"min_load_tokens": PREFIX + 16})
    assert e.run([req("s1", session(1))])["s1"].external_tokens == [0]  # below the threshold
    e = aengine(model, server.target, "min-load", prefix_cache=False,
               cfg={"async_lookup": False, "min_load_tokens": PREFIX})
    out = e.run([req("s2", session(2))])["s2"]
    assert out.external_tokens == [PREFIX] and e.lookup_deferrals == 0
    assert_cold(model, out)


def test_long_mixed_run_with_asynchronous_lookups(model, server):
    # test_connector_engine's mixed run (waves of 3, chunks, preemptions, local hits, two TP
    # ranks, bf16) with the connector's default lookups: deferred, never blocking, bit-exact.
    e = aengine(model, server.target, "mixed-async-lookup", tp=2, dtype=torch.bfloat16,
               num_blocks=64, max_tokens_per_step=96, max_chunk=48,
               cfg={"load_layer_groups": 2})
    prompts = mixed_prompts()
    done = {}
    for wave in range(0, len(prompts), 3):
        done.update(e.run([req(rid, p) for rid, p in prompts[wave:wave + 3]]))
    assert e.preemptions >= 1 and e.lookup_deferrals >= 1
    assert sum(sum(r.external_tokens) > 0 for r in done.values()) >= 4
    for w in e.workers:
        assert w.stats["save_errors"] == 0 and w.stats["load_failed_tokens"] == 0
    for r in done.values():
        assert_cold(model, r, torch.bfloat16)


# ---------------- row 1: a lease on the promised prefix; kv_load_failure_policy ----------------


@pytest.mark.parametrize("lease", [0, 30])
def test_a_lease_keeps_the_promised_prefix_until_it_is_loaded(model, tmp_path, lease):
    # A server whose disk budget holds 1.5 sessions: session 0 is stored; between s1's lookup
    # (the preamble, PREFIX tokens) and its load, a Put of another 512 tokens needs room, and
    # the server evicts session 0's least valuable leaves. Under vLLM's default policy "fail"
    # a promised load that fails fails the request: the lease (a Pin with a TTL taken by the
    # lookup) must keep the preamble; without it the request fails, and says so.
    srv = ServerProcess(tmp_path / "data", ["--disk_bytes=450000"])
    try:
        aengine(model, srv.target, "lease").run([req("s0", session(0))])
        e = aengine(model, srv.target, "lease", prefix_cache=False,
                    kv_load_failure_policy="fail", cfg={"lease_seconds": lease})
        t, _, k, v = read_dump(TESTDATA / "genesis_1-3")
        other = kvtrie.Client(srv.target, "stories260K", namespace="lease")
        put_errors = []

        def evict(so):  # in the step that loads s1, before the workers load
            if "s1" not in so.num_scheduled_tokens:
                return
            e.hook_before_execute = None
            try:
                other.put(t, k, v)
            except kvtrie.Error as err:  # the lease holds the preamble: no room
                put_errors.append(err.code)

        e.hook_before_execute = evict
        out = e.run([req("s1", session(1))])["s1"]
        assert out.external_tokens == [PREFIX]
        if lease:
            assert not out.failed and e.workers[0].stats["load_failed_tokens"] == 0
            assert e.sched.stats["leases"] >= 1
            assert_cold(model, out)
        else:  # the setup does evict the promised prefix
            assert out.failed and e.workers[0].stats["failed_requests"] == 1
            assert not put_errors
    finally:
        srv.stop()


def test_a_lease_never_shortens_an_operators_pin(model, tmp_path):
    # An operator pins the preamble until unpinned; the connector's lookup of s1 then leases that
    # very node for 1 s. A lease is a Pin with extend_only: the operator's pin stays, so once the
    # lease has long expired a Put that needs the room still cannot evict the preamble. (A plain
    # Pin with a TTL replaced the node's expiry: the preamble went after 1 s.)
    srv = ServerProcess(tmp_path / "data", ["--disk_bytes=450000"])
    try:
        aengine(model, srv.target, "lease").run([req("s0", session(0))])
        op = kvtrie.Client(srv.target, "stories260K", namespace="lease")
        op.pin(session(0)[:PREFIX])
        e = aengine(model, srv.target, "lease", prefix_cache=False, cfg={"lease_seconds": 1})
        out = e.run([req("s1", session(1))])["s1"]
        assert out.external_tokens == [PREFIX] and e.sched.stats["leases"] >= 1
        time.sleep(2.5)  # past the lease (a margin in the safe direction: longer is stricter)
        t, _, k, v = read_dump(TESTDATA / "genesis_1-3")
        try:
            op.put(t, k, v)
        except kvtrie.Error:
            pass  # the pinned preamble leaves no room
        assert op.lookup(session(0)) >= PREFIX
    finally:
        srv.stop()


def test_policy_fail_is_reported_at_startup(caplog, server):
    kt = SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={
        "target": server.target, "model_id": "m"})
    with caplog.at_level("WARNING", logger="kvtrie.connector"):
        KvtrieConnector(vllm_config(kt), KVConnectorRole.SCHEDULER).shutdown()
    assert "kv_load_failure_policy is 'fail'" in caplog.text  # vLLM's default
    caplog.clear()
    kt.kv_load_failure_policy = "recompute"
    with caplog.at_level("WARNING", logger="kvtrie.connector"):
        KvtrieConnector(vllm_config(kt), KVConnectorRole.SCHEDULER).shutdown()
    assert "kv_load_failure_policy" not in caplog.text


def vllm_config(kt, **model):
    return SimpleNamespace(
        kv_transfer_config=kt,
        model_config=SimpleNamespace(**{"model": "stories260K", "dtype": "float16",
                                        "revision": None, "quantization": None,
                                        "hf_config": SimpleNamespace(rope_scaling=None,
                                                                     rope_theta=10000.0),
                                        **model}),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        rank=0))


def vengine(model, target, namespace, kv_role="kv_both", cache=None, **model_fields):
    """An engine whose connectors vLLM's factory would build: from a vllm_config."""
    from engine import Engine
    kt = SimpleNamespace(kv_role=kv_role, kv_load_failure_policy="recompute",
                         kv_connector_extra_config={"target": target, "namespace": namespace,
                                                    "model_id": "stories260K", "timeout": 10,
                                                    "encoding": "lossless"})
    cfg = vllm_config(kt, **model_fields)
    cfg.cache_config.__dict__.update(cache or {})
    return Engine(model, KvtrieConnector(cfg, KVConnectorRole.SCHEDULER),
                  [KvtrieConnector(cfg, KVConnectorRole.WORKER)], prefix_cache=False)


# ---------------- row 4: the KV fingerprint; reset_cache ----------------


@pytest.mark.parametrize("change", [{"revision": "v2"}, {"dtype": "bfloat16"},
                                    {"quantization": "awq"},
                                    {"hf_config": SimpleNamespace(rope_scaling={"factor": 4.0},
                                                                  rope_theta=10000.0)},
                                    {"cache": {"cache_dtype": "bfloat16"}}])
def test_a_changed_deployment_under_the_same_name_misses(model, server, change):
    ns = "fingerprint-" + next(iter(change))
    vengine(model, server.target, ns).run([req("s0", session(0))])
    change = dict(change)
    e = vengine(model, server.target, ns, cache=change.pop("cache", None), **change)
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [0]  # another deployment's KV is never loaded
    assert "~" in e.sched._base_model and e.sched._base_model.startswith("stories260K~")
    same = vengine(model, server.target, ns)  # the first deployment again: hits
    assert same.run([req("s2", session(2))])["s2"].external_tokens == [PREFIX]


def test_reset_cache_bumps_an_epoch_that_reaches_the_workers(model, server):
    e = vengine(model, server.target, "reset")
    e.run([req("s0", session(0))])
    assert e.sched.reset_cache() is True and e.workers[0].reset_cache() is None
    assert e.run([req("s1", session(1))])["s1"].external_tokens == [0]  # nothing from before
    out = e.run([req("s2", session(2))])["s2"]  # s1 was saved under the new epoch
    assert out.external_tokens == [PREFIX]
    assert_cold(model, out)


# ---------------- row 9: kv_role; context parallelism refused ----------------


def test_a_producer_only_saves_and_a_consumer_only_loads(model, server):
    vengine(model, server.target, "roles").run([req("s0", session(0))])
    p = vengine(model, server.target, "roles", kv_role="kv_producer")
    assert p.run([req("s1", session(1))])["s1"].external_tokens == [0]  # no lookup, no load
    assert p.sched.stats["lookups"] == 0
    c = vengine(model, server.target, "roles", kv_role="kv_consumer")
    out = c.run([req("s2", session(2))])["s2"]
    assert out.external_tokens == [PREFIX]  # loads
    assert_cold(model, out)
    assert c.sched._client.lookup(session(1)) == 512  # the producer's save
    assert c.sched._client.lookup(session(2)) == PREFIX  # the consumer saved nothing


@pytest.mark.parametrize("name", ["decode_context_parallel_size",
                                  "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_naming_it(name):
    kt = SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={"model_id": "m"})
    cfg = vllm_config(kt)
    setattr(cfg.parallel_config, name, 2)
    with pytest.raises(ValueError, match=name):
        KvtrieConnector(cfg, KVConnectorRole.WORKER)


# ---------------- rows 6, 7: missed save_kv_layer calls; full CUDA graphs ----------------


def test_a_layer_save_kv_layer_missed_is_gathered_in_wait_for_save(model, server):
    e = aengine(model, server.target, "missed-layer", skip_save_layers={2})  # custom attention
    e.run([req("s0", session(0))])
    assert e.workers[0].stats["save_errors"] == 0
    out = aengine(model, server.target, "missed-layer", prefix_cache=False).run(
        [req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]  # every layer of s0's preamble was saved
    assert_cold(model, out)


def test_full_cuda_graphs_without_layerwise_hooks(model, server):
    assert KvtrieConnector.requires_piecewise_for_cudagraph({}) is True  # layer-wise: default
    assert KvtrieConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    cfg = {"layerwise": False}
    e = aengine(model, server.target, "full-graphs", full_cudagraph=True, cfg=cfg)
    e.run([req("s0", session(0))])  # no save_kv_layer at all: saved in wait_for_save
    e = aengine(model, server.target, "full-graphs", full_cudagraph=True, prefix_cache=False,
                tp=2, cfg=cfg)
    e.run([req("s0", session(0))])  # (each rank's heads)
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]  # loaded before the forward pass, no layer waits
    assert e.workers[0].stats["loaded_tokens"] == PREFIX
    assert_cold(model, out)


# ---------------- row 3: FP8 caches (uint8 pages), stored bit-exact ----------------


def fp8_engine(model, target, namespace, cache_dtype, kind, **cfg):
    """vLLM's --kv-cache-dtype ``cache_dtype``: the connectors from a vllm_config, the engine's
    pages uint8 holding ``kind`` (engine.py)."""
    from engine import Engine
    kt = SimpleNamespace(kv_role="kv_both", kv_load_failure_policy="recompute",
                         kv_connector_extra_config={
                             "target": target, "namespace": namespace, "model_id": "stories260K",
                             "timeout": 10, "async_lookup": False, **cfg})
    c = vllm_config(kt)
    c.cache_config.cache_dtype = cache_dtype
    return Engine(model, KvtrieConnector(c, KVConnectorRole.SCHEDULER),
                  [KvtrieConnector(c, KVConnectorRole.WORKER)], prefix_cache=False,
                  kv_cache_dtype=kind)


def cold_like(model, prompt, max_tokens=4, **engine_kw):
    """The logits and outputs of `prompt` alone in an engine of that kind, no connector."""
    from engine import Engine, Request
    e = Engine(model, prefix_cache=False, num_blocks=48, **engine_kw)
    return e.run([Request("cold", list(prompt), max_tokens)])["cold"]


def assert_same(out, cold):
    assert out.output_token_ids == cold.output_token_ids, out.request_id
    assert len(out.prompt_token_ids) - 1 in out.logits
    for pos, row in out.logits.items():
        assert np.array_equal(row, cold.logits[pos]), f"{out.request_id}: position {pos}"


@pytest.mark.parametrize("cache_dtype,kind", [("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_fp8_caches_are_saved_and_loaded_bit_exact(model, server, cache_dtype, kind):
    e = fp8_engine(model, server.target, f"fp8-{cache_dtype}", cache_dtype, kind)
    assert isinstance(e.caches[0][e.names[0]], torch.Tensor)
    assert e.caches[0][e.names[0]].dtype == torch.uint8  # vLLM's FP8 pages
    e.run([req("s0", session(0))])
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]  # s0's preamble, loaded into uint8 pages
    w = e.workers[0]
    assert w.stats["loaded_tokens"] == PREFIX and w.stats["save_errors"] == 0
    cold = cold_like(model, session(1), kv_cache_dtype=kind)
    assert_same(out, cold)  # every byte came back: the same logits as computing them
    # (and FP8 is not fp16: the test would see a cache that silently held fp16)
    c16 = cold_like(model, session(1))
    assert not np.array_equal(c16.logits[PREFIX], cold.logits[PREFIX])
    # Stored as the FP8 dtype, losslessly: the server's model says so.
    k, _, n = w._client.get(session(0))
    assert k.dtype == np.uint8 and n == 512 and w._client.spec.kv_dtype == kind


def test_fp8_settings_the_connector_cannot_store_are_refused_at_startup():
    kt = SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={"model_id": "m"})
    cfg = vllm_config(kt)
    cfg.cache_config.cache_dtype = "fp8_inc"
    with pytest.raises(ValueError, match="cache_dtype: 'fp8_inc'"):
        KvtrieConnector(cfg, KVConnectorRole.SCHEDULER)
    cfg.cache_config.cache_dtype = "fp8"
    cfg.cache_config.calculate_kv_scales = True
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        KvtrieConnector(cfg, KVConnectorRole.SCHEDULER)
    cfg.cache_config.calculate_kv_scales = False
    kt.kv_connector_extra_config = {"model_id": "m", "encoding": "residual"}
    with pytest.raises(ValueError, match="encoding: 'residual' is lossy; fp8_e4m3"):
        KvtrieConnector(cfg, KVConnectorRole.SCHEDULER)  # (cfg holds kt)
    worker = KvtrieConnector(role=KVConnectorRole.WORKER, config={"model_id": "m"})
    with pytest.raises(ValueError, match="no FP8 KV dtype is configured"):
        worker.register_kv_caches({"l0": torch.zeros(2, 4, 16, 2, 8, dtype=torch.uint8)})
    worker.shutdown()
    fp8 = KvtrieConnector(role=KVConnectorRole.WORKER, config={"model_id": "m",
                                                              "kv_dtype": "fp8_e4m3"})
    with pytest.raises(ValueError, match="kv_dtype is fp8_e4m3"):
        fp8.register_kv_caches({"l0": torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16)})
    fp8.register_kv_caches({"l0": torch.zeros(2, 4, 16, 2, 8, dtype=torch.uint8)})
    fp8.shutdown()


# ---------------- row 5: hybrid models (SupportsHMA) ----------------

SLIDING = (1, 3)  # stories260K's layers 1 and 3 attend to a window
WINDOW = 48


def hybrid_connectors(model, target, namespace, hma=True, groups=None, **cfg):
    from engine import kv_cache_config
    kcfg = groups or kv_cache_config(model.num_layers, 16, SLIDING, WINDOW, hybrid=hma)
    config = {"target": target, "model_id": "stories260K", "namespace": namespace,
              "encoding": "lossless", "timeout": 10, "async_lookup": False,
              "kv_load_failure_policy": "recompute", **cfg}
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config=config, kv_cache_config=kcfg)
    worker = KvtrieConnector(role=KVConnectorRole.WORKER, config=config, kv_cache_config=kcfg)
    return sched, worker


def hybrid_engine(model, target, namespace, hma=True, max_chunk=None, **cfg):
    from engine import Engine
    sched, worker = hybrid_connectors(model, target, namespace, hma, **cfg)
    return Engine(model, sched, [worker], prefix_cache=False, sliding_layers=SLIDING,
                  sliding_window=WINDOW, disable_hybrid_kv_cache_manager=not hma,
                  max_chunk=max_chunk)


@pytest.mark.parametrize("max_chunk", [None, 40])
def test_sliding_window_and_full_attention_groups_save_and_load(model, server, max_chunk):
    ns = f"hybrid-{max_chunk}"
    e = hybrid_engine(model, server.target, ns, max_chunk=max_chunk)
    assert e.hybrid  # the connector is SupportsHMA: vLLM keeps the hybrid allocator on
    s0 = e.run([req("s0", session(0))])["s0"]
    assert 0 in s0.sw_block_ids  # its window's pages slid out (the null block)
    w = e.workers[0]
    assert w.stats["save_errors"] == 0 and w.stats["saved_blocks"] == 32
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert w.stats["loaded_tokens"] == PREFIX
    cold = cold_like(model, session(1), sliding_layers=SLIDING, sliding_window=WINDOW)
    assert_same(out, cold)
    # The window matters: a full-attention run of the same prompt differs.
    assert not np.array_equal(cold_like(model, session(1)).logits[PREFIX], cold.logits[PREFIX])


def test_hybrid_allocator_off_is_one_group(model, server):
    # vLLM with --disable-hybrid-kv-cache-manager: one full-attention group; the sliding layers
    # keep every page (and still attend to their window).
    e = hybrid_engine(model, server.target, "hybrid-off", hma=False)
    assert not e.hybrid
    e.run([req("s0", session(0))])
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert_same(out, cold_like(model, session(1), sliding_layers=SLIDING,
                               sliding_window=WINDOW))


def test_hybrid_groups_the_connector_cannot_store_are_refused_at_startup(model):
    from engine import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec,
                        MambaSpec, SlidingWindowSpec, kv_cache_config, layer_names)
    names = layer_names(model.num_layers)

    def groups(*specs):
        return KVCacheConfig([KVCacheGroupSpec([n], sp) for n, sp in zip(names, specs)])
    with pytest.raises(ValueError, match=r"kv_cache_groups\[1\]: MambaSpec: a Mamba"):
        hybrid_connectors(model, "127.0.0.1:1", "x",
                          groups=groups(FullAttentionSpec(16), MambaSpec(16)))
    with pytest.raises(ValueError, match="block sizes .* differ"):
        hybrid_connectors(model, "127.0.0.1:1", "x",
                          groups=groups(FullAttentionSpec(16), SlidingWindowSpec(32, 64)))

    class UniformTypeKVCacheSpecs(KVCacheSpec):  # vLLM's: layers of different specs, one group
        pass
    with pytest.raises(ValueError, match="different cache specs in one group"):
        hybrid_connectors(model, "127.0.0.1:1", "x",
                          groups=groups(UniformTypeKVCacheSpecs(16)))
    with pytest.raises(ValueError, match="async_load: true with 2 KV cache groups"):
        hybrid_connectors(model, "127.0.0.1:1", "x", async_load=True)
    # An extra cache beside the groups' attention layers (e.g. an indexer's keys).
    _, worker = hybrid_connectors(model, "127.0.0.1:1", "x",
                                  groups=kv_cache_config(2, 16, (1,), WINDOW))
    caches = {n: torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16) for n in names[:2]}
    caches["model.layers.0.indexer.k_cache"] = torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="in no KV cache group"):
        worker.register_kv_caches(caches)
    worker.shutdown()


def test_hybrid_request_finished_all_groups_keeps_the_pages_of_a_save(model, server):
    from engine import Request
    sched, worker = hybrid_connectors(model, server.target, "hybrid-finish")
    r = Request("r", session(0))
    assert sched.request_finished_all_groups(r, ([1, 2], [0, 3])) == (False, None)
    sched._saving.add("r")
    assert sched.request_finished_all_groups(r, ([1, 2], [0, 3])) == (True, None)
    sched.shutdown()
    worker.shutdown()


def test_hybrid_saves_never_read_pages_that_slid_out_of_the_window(model):
    # vLLM frees a sliding-window group's pages as they slide out without telling the connector
    # (its tables keep the old ids, which may belong to another request by now): a save that
    # would read tokens before the step's window start is dropped, counted, never stored.
    from engine import layer_names, make_cache
    from kvtrie.connector import KvtrieConnectorMetadata, RequestMeta
    sched, worker = hybrid_connectors(model, "127.0.0.1:1", "slid-out")
    worker.register_kv_caches({n: make_cache("flash_attn", 16, 16, 4, 8, torch.float16)
                               for n in layer_names(model.num_layers)})
    pages = list(range(1, 9))
    meta = KvtrieConnectorMetadata([RequestMeta(
        "r", list(range(128)), pages, save_tokens=128, stored_blocks=0,
        group_block_ids=[pages, pages], group_valid_from=[0, 64])])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in worker._names:
        worker.save_kv_layer(name, worker._caches[name], None)
    worker.wait_for_save()
    assert worker.stats["save_errors"] == 1  # the first sliding-window layer: request dropped
    assert worker.stats["saved_blocks"] == 0
    # The scheduler computes where a step's window starts (vLLM's get_num_skipped_tokens).
    assert sched._valid_from(200) == [0, (200 - WINDOW + 1) // 16 * 16]
    assert sched._valid_from(10) == [0, 0]
    sched.shutdown()
    worker.shutdown()
