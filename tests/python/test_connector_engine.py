"""KvtrieConnector under an engine that schedules like vLLM (engine.py): several requests a step,
chunked prefill, local prefix-cache hits, preemption, torch fp16 / bf16 caches in vLLM's layouts,
two TP ranks, asynchronous saves. The real stories260K model computes from the paged caches, over
real prompts (tests/data: four sessions sharing a 369-token GPL-3 preamble, Genesis, a story),
against a real kvtrie-server. Each test is one row of issue 23's table; "cold" is the same engine
(same dtype, layout) without a connector, so a loaded prefix must give its logits bit for bit."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvtrie  # noqa: E402
from conftest import MODEL, TESTDATA, read_dump  # noqa: E402
from kvtrie.connector import KVConnectorRole, KvtrieConnector, detect_layout, KvLayout  # noqa: E402

pytestmark = pytest.mark.skipif(not MODEL.exists(),
                                reason=f"needs the model {MODEL} (or $KVTRIE_MODEL)")

PREFIX = 368  # the sessions' shared preamble, in full 16-token blocks
RESIDUAL_TARGET = 0.05
MAX_REL_DNLL = 0.02  # as test_connector.py's residual bound


def tokens(name: str) -> list:
    return read_dump(TESTDATA / name)[0].tolist()


def session(i: int) -> list:
    return tokens(f"sessions/s{i}")


@pytest.fixture(scope="module")
def model():
    from llama_numpy import LlamaModel
    return LlamaModel(str(MODEL))


_COLD = {}


def cold(model, prompt, dtype=torch.float16, layout="flash_attn", max_tokens=4):
    """Logits and outputs of `prompt` alone, no connector, no prefix cache (memoized)."""
    from engine import Engine, Request
    key = (tuple(prompt), dtype, layout, max_tokens)
    if key not in _COLD:
        e = Engine(model, dtype=dtype, layout=layout, prefix_cache=False, num_blocks=40)
        _COLD[key] = e.run([Request("cold", list(prompt), max_tokens)])["cold"]
    return _COLD[key]


def assert_cold(model, req, dtype=torch.float16, layout="flash_attn"):
    """Every row `req` computed equals the cold run's, bit for bit, and so do its outputs."""
    c = cold(model, req.prompt_token_ids, dtype, layout, req.max_tokens)
    assert req.output_token_ids == c.output_token_ids, req.request_id
    assert len(req.prompt_token_ids) - 1 in req.logits
    for pos, row in req.logits.items():
        assert np.array_equal(row, c.logits[pos]), f"{req.request_id}: position {pos}"


def connectors(target, namespace, tp=1, client_wrap=None, **cfg):
    # Blocking lookups unless a test asks: these tests act on a request's first step (hooks,
    # answers); test_connector_vllm_rules.py runs the asynchronous ones (the default).
    config = {"target": target, "model_id": "stories260K", "namespace": namespace,
              "encoding": "lossless", "tp_size": tp, "timeout": 10, "async_lookup": False,
              **cfg}
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config=config)
    workers = []
    for r in range(tp):
        client = None
        if client_wrap is not None:
            model_id = "stories260K" + (f"@tp{r}of{tp}" if tp > 1 else "")
            client = client_wrap(kvtrie.Client(target, model_id, namespace=namespace, timeout=10))
        workers.append(KvtrieConnector(role=KVConnectorRole.WORKER,
                                       config={**config, "tp_rank": r}, client=client))
    return sched, workers


def engine(model, target, namespace, tp=1, dtype=torch.float16, layout="flash_attn",
           client_wrap=None, cfg=None, **kw):
    from engine import Engine
    cfg = {"kv_load_failure_policy": kw.get("kv_load_failure_policy", "recompute"), **(cfg or {})}
    sched, workers = connectors(target, namespace, tp, client_wrap, **cfg)
    return Engine(model, sched, workers, tp=tp, dtype=dtype, layout=layout, **kw)


def req(rid, prompt, **kw):
    from engine import Request
    return Request(rid, list(prompt), **kw)


def lookup(target, namespace, prompt, model_id="stories260K"):
    return kvtrie.Client(target, model_id, namespace=namespace).lookup(prompt)


# ---------------- one test a row of the table ----------------


def test_bf16_loads_are_bit_exact(model, server):
    e = engine(model, server.target, "bf16", dtype=torch.bfloat16, prefix_cache=False)
    e.run([req("s0", session(0))])
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert e.workers[0].stats["load_failed_tokens"] == 0
    assert_cold(model, out, torch.bfloat16)
    k, _, n = kvtrie.Client(server.target, "stories260K", namespace="bf16").get(session(1))
    assert n == 512 and k.dtype == np.uint16  # stored as bfloat16


def test_a_local_hit_then_an_external_one_loads_only_beyond_the_local(model, server):
    engine(model, server.target, "local").run([req("s0", session(0))])  # stored in kvtrie
    e = engine(model, server.target, "local")  # a fresh engine: nothing local
    e.sched._client.lookup = (lambda orig: lambda t: 0 if len(t) < 200 else orig(t))(
        e.sched._client.lookup)  # the short prompt computes (no external hit)
    e.run([req("short", session(1)[:8 * 16 + 5])])  # now 8 pages of the preamble are local
    out = e.run([req("s1", session(1))])["s1"]
    assert out.local_hit_tokens == [128] and out.external_tokens == [PREFIX - 128]
    assert e.workers[0].stats["loaded_tokens"] == PREFIX - 128
    assert_cold(model, out)


def test_chunked_prefill_pages_arrive_per_chunk(model, server):
    e = engine(model, server.target, "chunked", max_tokens_per_step=48, prefix_cache=False)
    first = e.run([req("s0", session(0))])["s0"]
    assert e.workers[0].stats["save_errors"] == 0
    assert lookup(server.target, "chunked", session(0)) == 512  # saved at the last chunk
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert_cold(model, first)
    assert_cold(model, out)
    assert lookup(server.target, "chunked", session(1)) == 512


def test_preempted_requests_resume_with_new_pages(model, server):
    # 64 pages for four 512-token prompts prefilled 48 tokens a step each, three at a time:
    # the last running one is preempted.
    e = engine(model, server.target, "preempt", num_blocks=64, max_tokens_per_step=128,
               max_chunk=48, prefix_cache=False)
    done = e.run([req(f"s{i}", session(i), max_tokens=6) for i in range(4)])
    assert e.preemptions >= 1
    assert any(r.num_preemptions for r in done.values())
    for r in done.values():
        assert_cold(model, r)
    # What was stored under each prompt is its own KV: a fresh engine loads it, the cold logits.
    f = engine(model, server.target, "preempt", num_blocks=160)
    again = f.run([req(f"again{i}", session(i)) for i in range(4)])
    for i, r in enumerate(again.values()):
        assert lookup(server.target, "preempt", session(i)) == 512
        assert r.external_tokens == [511] and r.logits.keys() == {511, 512, 513, 514}
        assert_cold(model, r)


def test_keys_include_adapter_multimodal_hashes_and_salt(model, server):
    from engine import LoRARequest, MultiModalFeature
    e = engine(model, server.target, "identity")
    p = session(0)[:200]
    e.run([req("a", p, lora_request=LoRARequest("tuned", 1))])
    variants = {
        "plain": {}, "other-lora": {"lora_request": LoRARequest("other", 2)},
        "image": {"mm_features": [MultiModalFeature("img-1")]}, "salt": {"cache_salt": "tenant-b"},
    }
    for rid, kw in variants.items():  # each misses: its KV is not the adapter's
        assert e.sched.get_num_new_matched_tokens(req(rid, p, **kw), 0) == (0, False), rid
    fresh = engine(model, server.target, "identity")  # nothing local: the hit is kvtrie's
    hit = fresh.run([req("b", p, lora_request=LoRARequest("tuned", 1))])["b"]
    assert hit.local_hit_tokens == [0] and hit.external_tokens == [192]
    assert_cold(model, hit)
    e.run([req("img", p, mm_features=[MultiModalFeature("img-1")])])
    assert e.sched.get_num_new_matched_tokens(
        req("img2", p, mm_features=[MultiModalFeature("img-2")]), 0) == (0, False)
    assert e.sched.get_num_new_matched_tokens(
        req("img3", p, mm_features=[MultiModalFeature("img-1")]), 0) == (192, False)
    # No token ids (prompt embeddings): a miss, nothing tracked, no crash.
    r = req("embeds", p)
    r.prompt_token_ids, r.prompt_embeds = None, object()
    assert e.sched.get_num_new_matched_tokens(r, 0) == (0, False)
    e.sched.update_state_after_alloc(r, [1, 2], 0)
    from engine import CachedRequestData, SchedulerOutput
    meta = e.sched.build_connector_meta(SchedulerOutput([], CachedRequestData(), {"embeds": 5},
                                                        set()))
    assert meta.requests == []
    assert e.sched.request_finished(r, [1, 2]) == (False, None)


def test_tensor_parallel_ranks_store_their_own_heads(model, server):
    e = engine(model, server.target, "tp", tp=2, prefix_cache=False)
    e.run([req("s0", session(0))])
    for rank in range(2):
        assert lookup(server.target, "tp", session(0), f"stories260K@tp{rank}of2") == 512
        k, _, _ = kvtrie.Client(server.target, f"stories260K@tp{rank}of2",
                                namespace="tp").get(session(0))
        assert k.shape == (5, 2, 512, 8)  # half of the 4 KV heads each
    assert lookup(server.target, "tp", session(0)) == 0  # nothing under the unsplit model
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert_cold(model, out)  # the heads of each rank are its own


@pytest.mark.parametrize("layout,dtype", [("flash_infer", torch.float16),
                                          ("flash_infer", torch.bfloat16),
                                          ("flash_infer_hnd", torch.bfloat16),
                                          ("mla", torch.bfloat16)])
def test_every_layout(model, server, layout, dtype):
    ns = f"layout-{layout}-{str(dtype)[6:]}"
    # The engine's declared block size tells HND ([blocks, 2, heads, block_size, ...]) apart.
    e = engine(model, server.target, ns, dtype=dtype, layout=layout, prefix_cache=False,
               cfg={"block_size": 16, "num_blocks": 96})
    assert e.workers[0]._layouts[e.names[0]] is KvLayout(layout)
    e.run([req("s0", session(0))])
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert_cold(model, out, dtype, layout)


def test_layout_detection_checks_shapes():
    assert detect_layout((2, 64, 16, 4, 8)) is KvLayout.FLASH_ATTN
    assert detect_layout((64, 2, 16, 4, 8), block_size=16) is KvLayout.FLASH_INFER
    with pytest.raises(ValueError, match="more than one"):  # NHD or HND: needs the block size
        detect_layout((64, 2, 16, 4, 8))
    assert detect_layout((64, 2, 4, 16, 8), 64, 16) is KvLayout.FLASH_INFER_HND
    assert detect_layout((64, 16, 576)) is KvLayout.MLA
    with pytest.raises(ValueError, match=r"kv cache shape \[2, 2, 16, 4, 8\]: more than one"):
        detect_layout((2, 2, 16, 4, 8))
    with pytest.raises(ValueError, match="no known layout"):
        detect_layout((64, 16, 4, 8))
    with pytest.raises(ValueError, match="no known layout"):
        detect_layout((2, 64, 16, 4, 8), num_blocks=32)  # not the declared number of blocks


def test_parallel_config_out_of_range_is_a_value_error_naming_it():
    base = {"target": "127.0.0.1:1", "model_id": "stories260K"}
    for cfg, field in [({"tp_size": 2, "tp_rank": 2}, "tp_rank"), ({"tp_size": 0}, "tp_size"),
                       ({"pp_size": -1}, "pp_size"), ({"load_layer_groups": 0}, "load_layer_groups")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            KvtrieConnector(role=KVConnectorRole.WORKER, config={**base, **cfg})


class GatedPuts:
    """A kvtrie.Client whose put waits for `gate` (the commit of a save in flight)."""

    def __init__(self, client):
        self.client, self.gate, self.puts = client, threading.Event(), 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    def put(self, *a, **kw):
        assert self.gate.wait(20)
        self.puts += 1
        return self.client.put(*a, **kw)


class GatedLastGroup:
    """A kvtrie.Client whose Get of the last layer group (all layers when not grouped) waits for
    `gate` (5 s at most), which the engine opens when it reaches the last layer: layer 0 can only
    compute before then if it did not wait for the last group. `log` records the order."""

    LAYERS = 5

    def __init__(self, client):
        self.client, self.gate, self.log = client, threading.Event(), []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def get(self, tokens, *a, layers=None, **kw):
        if layers is None or layers[1] == self.LAYERS:
            self.log.append(("last group sent", self.gate.wait(5)))
        return self.client.get(tokens, *a, **kw, **({} if layers is None else {"layers": layers}))


@pytest.mark.parametrize("groups", [4, 1])
def test_layer_zero_computes_while_later_layer_groups_stream(model, server, groups):
    ns = f"groups-{groups}"
    engine(model, server.target, ns, prefix_cache=False).run([req("s0", session(0))])
    e = engine(model, server.target, ns, client_wrap=GatedLastGroup, prefix_cache=False,
               cfg={"load_layer_groups": groups})
    w = e.workers[0]
    gated, wait = w._client, w.wait_for_layer_load

    def wait_and_log(name):
        layer = w._layer_index[name]
        if layer == GatedLastGroup.LAYERS - 1:
            gated.gate.set()
        wait(name)
        gated.log.append(("layer", layer))

    w.wait_for_layer_load = wait_and_log
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert_cold(model, out)  # loaded group by group: still bit for bit
    log = gated.log[:gated.log.index(("layer", 0)) + 1]
    if groups > 1:  # layer 0 computed before the last group was even asked for
        assert log == [("layer", 0)], gated.log
        assert ("last group sent", True) in gated.log
    else:  # one Get of all layers: layer 0 waited for it (the gate timed out)
        assert log == [("last group sent", False), ("layer", 0)], gated.log
    assert w.stats["loaded_tokens"] == PREFIX and w.stats["load_failed_tokens"] == 0


def test_a_range_get_equals_the_slice_of_the_whole_get(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="range")
    tokens_, _, k, v = read_dump(TESTDATA / "sessions" / "s0")
    c.put(tokens_, k, v, encoding="lossless")
    fk, fv, n = c.get(tokens_)
    assert n == 512
    for lb, le in [(0, 1), (1, 3), (2, 5), (4, 5)]:
        rk, rv, rn = c.get(tokens_, layers=(lb, le))
        assert rn == n and rk.shape == (le - lb,) + fk.shape[1:]
        assert np.array_equal(rk, fk[lb:le]) and np.array_equal(rv, fv[lb:le])
    for bad, field in [((0, 6), "layer_end"), ((3, 3), "layer_begin"), ((0, 2**32), "layer_end"),
                       ((2**32, 2**32 + 1), "layer_begin")]:
        with pytest.raises(kvtrie.Error) as e:
            c.get(tokens_, layers=bad)
        assert e.value.code == kvtrie.StatusCode.INVALID_ARGUMENT
        assert e.value.message.startswith(field), e.value.message
    with pytest.raises(kvtrie.Error) as e:
        c.get(tokens_, mode="residual", layers=(0, 2))
    assert e.value.message.startswith("layer_begin"), e.value.message


def test_saves_commit_after_the_step_and_hold_pages_until_get_finished(model, server):
    e = engine(model, server.target, "async", client_wrap=GatedPuts, max_tokens_per_step=1024)
    gated = e.workers[0]._client
    e.add_request(req("s0", session(0), max_tokens=1))
    e.step()  # the whole prompt and its one token: the save is scheduled, its commit blocked
    assert e.requests["s0"].finished and "s0" in e.held  # request_finished returned True
    held_pages = set(e.requests["s0"].block_ids)
    assert not held_pages & set(e.free)  # its pages are not free
    e.step()  # get_finished: not yet
    assert "s0" in e.held and gated.puts == 0
    gated.gate.set()
    e.run()
    assert not e.held and held_pages <= set(e.free) and gated.puts == 1
    assert lookup(server.target, "async", session(0)) == 512


def test_load_failures_are_reported_per_block_and_recomputed(model, server):
    e = engine(model, server.target, "failure", tp=2, prefix_cache=False)
    e.run([req("s0", session(0))])
    deleter = kvtrie.Client(server.target, "stories260K@tp1of2", namespace="failure")
    e.hook_before_execute = lambda so: (deleter.delete(session(1)[:11 * 16]),  # rank 1 only
                                        setattr(e, "hook_before_execute", None))
    reported = []
    orig = e.workers[1].get_block_ids_with_load_errors
    e.workers[1].get_block_ids_with_load_errors = lambda: (lambda s: (reported.append(s), s)[1])(
        orig())
    out = e.run([req("s1", session(1))])["s1"]
    assert out.external_tokens == [PREFIX]
    assert len(reported[0]) == PREFIX // 16 - 10  # the pages of kvtrie blocks 10..22
    assert e.workers[1].stats["loaded_tokens"] == 160
    assert min(out.logits) == 160  # recomputed from the first failed block on
    assert_cold(model, out)
    # Rank 0 loaded fine but computed the failed step over rank 1's missing heads: that KV must
    # not have been stored. A fresh engine loads s1 whole, on both ranks: the cold logits.
    again = engine(model, server.target, "failure", tp=2, prefix_cache=False).run(
        [req("s1-again", session(1))])["s1-again"]
    assert again.external_tokens == [511]
    assert_cold(model, again)
    stats = e.workers[1].get_kv_connector_stats()
    assert stats.data["load_failed_tokens"] == PREFIX - 160
    assert e.workers[1].get_kv_connector_stats() is None  # nothing new since
    # As vLLM aggregates the ranks' stats: rebuilt from their data, summed.
    total = KvtrieConnector.build_kv_connector_stats(dict(stats.data))
    total.aggregate(KvtrieConnector.build_kv_connector_stats({"load_failed_tokens": 8}))
    assert total.reduce()["load_failed_tokens"] == PREFIX - 160 + 8


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_that_loads_and_finishes_in_one_step(model, server, tp):
    # One rank saves it in that step; with two, the save waits for the request's next step
    # (another rank's failed load would make this step's KV wrong), which never comes.
    ns = f"one-step-tp{tp}"
    e = engine(model, server.target, ns, tp=tp, prefix_cache=False)
    e.run([req("s0", session(0))])
    out = e.run([req("s1", session(1), max_tokens=1)])["s1"]
    assert out.external_tokens == [PREFIX]
    assert_cold(model, out)
    model_id = "stories260K" + ("@tp0of2" if tp == 2 else "")
    assert lookup(server.target, ns, session(1), model_id) == (512 if tp == 1 else PREFIX)
    e.run([req("s2", session(2), max_tokens=2)])  # a next step: saved there
    assert lookup(server.target, ns, session(2), model_id) == 512


@pytest.mark.parametrize("tp", [1, 2])
def test_asynchronous_loads_are_reported_through_get_finished(model, server, tp):
    # async_load: the request waits for its load (vLLM's WAITING_FOR_REMOTE_KVS) and is
    # scheduled once every rank's get_finished reported it; a block lost after the lookup is
    # reported no later than that and recomputed.
    ns = f"async-load-tp{tp}"
    e = engine(model, server.target, ns, tp=tp, prefix_cache=False, cfg={"async_load": True})
    e.run([req("s0", session(0))])
    answers = []
    orig = e.sched.get_num_new_matched_tokens
    e.sched.get_num_new_matched_tokens = lambda r, n: (lambda a: (answers.append(a), a)[1])(
        orig(r, n))
    out = e.run([req("s1", session(1))])["s1"]
    assert answers == [(PREFIX, True)]
    assert out.external_tokens == [PREFIX] and min(out.logits) == PREFIX
    assert_cold(model, out)
    model_id = "stories260K" + (f"@tp{tp - 1}of{tp}" if tp > 1 else "")
    deleter = kvtrie.Client(server.target, model_id, namespace=ns)
    e.hook_before_execute = lambda so: (deleter.delete(session(2)[:11 * 16]),
                                        setattr(e, "hook_before_execute", None))
    lost = e.run([req("s2", session(2))])["s2"]
    assert lost.external_tokens == [PREFIX] and min(lost.logits) == 160
    assert_cold(model, lost)


# ---------------- the long mixed run ----------------


def mixed_prompts():
    s = [session(i) for i in range(4)]
    g, story = tokens("genesis_1-3"), tokens("story_prompt")
    return [("s0", s[0]), ("s1", s[1]), ("g-300", g[:300]), ("s2", s[2]), ("story", story),
            ("s1-400", s[1][:400]), ("s3", s[3]), ("g", g), ("s0-again", s[0]),
            ("story-200", story[:200]), ("s2-450", s[2][:450]), ("g-again", g)]


@pytest.mark.parametrize("encoding", ["lossless", "residual"])
def test_long_mixed_run(model, server, encoding):
    # Many requests, 3 arriving per wave, 96 tokens a step in chunks of 48, 64 pages (preemptions),
    # local hits, two TP ranks, bf16, loads in 2 layer groups (lossless); every continuation gives
    # the cold logits (lossless) or stays within the dNLL budget (residual, decoded on the worker).
    from llama_numpy import nll_bits
    cfg = {"encoding": encoding, "load_layer_groups": 2}  # loads in layer groups too
    if encoding == "residual":
        cfg.update(target_rel_rms=RESIDUAL_TARGET, get_mode="residual")
    e = engine(model, server.target, f"mixed-{encoding}", tp=2, dtype=torch.bfloat16,
               num_blocks=64, max_tokens_per_step=96, max_chunk=48, cfg=cfg)
    prompts = mixed_prompts()
    done = {}
    for wave in range(0, len(prompts), 3):
        done.update(e.run([req(rid, p) for rid, p in prompts[wave:wave + 3]]))
    assert e.preemptions >= 1
    assert sum(sum(r.local_hit_tokens) > 0 for r in done.values()) >= 2
    assert sum(sum(r.external_tokens) > 0 for r in done.values()) >= 4
    for w in e.workers:
        assert w.stats["save_errors"] == 0 and w.stats["load_failed_tokens"] == 0
    warm_bits, cold_bits = [], []  # NLL of every prompt position computed after a load
    for r in done.values():
        if encoding == "lossless":
            assert_cold(model, r, torch.bfloat16)
            continue
        if not sum(r.external_tokens):
            continue
        c = cold(model, r.prompt_token_ids, torch.bfloat16)
        pos = sorted(p for p in r.logits if p < len(r.prompt_token_ids) - 1)
        if not pos:
            continue
        nxt = [r.prompt_token_ids[p + 1] for p in pos]
        warm_bits += list(nll_bits(np.stack([r.logits[p] for p in pos]), nxt))
        cold_bits += list(nll_bits(np.stack([c.logits[p] for p in pos]), nxt))
    if encoding == "residual":  # pooled over the requests, as the single-prompt test's mean
        rel = abs(np.mean(warm_bits) - np.mean(cold_bits)) / np.mean(cold_bits)
        print(f"residual@{RESIDUAL_TARGET}: NLL {np.mean(warm_bits):.4f} vs cold "
              f"{np.mean(cold_bits):.4f} bits/token over {len(warm_bits)} positions "
              f"(dNLL {100 * rel:.3f} %)")
        assert len(warm_bits) > 200 and warm_bits != cold_bits and rel <= MAX_REL_DNLL
