"""KvtrieConnector driven by a small engine loop (engine.py) running the real stories260K model
(a numpy forward pass, llama_numpy.py) over real prompts (the token ids of tests/data/sessions:
a 369-token GPL-3 preamble shared by four Genesis passages), against a real kvtrie-server."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvtrie
from conftest import MODEL, TESTDATA, ServerProcess, read_dump
from kvtrie.connector import KVConnectorRole, KvtrieConnector

pytestmark = pytest.mark.skipif(not MODEL.exists(),
                                reason=f"needs the model {MODEL} (or $KVTRIE_MODEL)")

PREFIX = 369 // 16 * 16  # 368: the shared preamble's full blocks
# Residual storage at this error target must keep the continuation's mean NLL within this
# relative bound of the cold run's (measured: see test_residual_prefix_stays_within_stated_dnll).
RESIDUAL_TARGET = 0.05
MAX_REL_DNLL = 0.02


def prompt(i: int) -> list:
    return read_dump(TESTDATA / "sessions" / f"s{i}")[0].tolist()


@pytest.fixture(scope="module")
def model():
    from llama_numpy import LlamaModel
    return LlamaModel(str(MODEL))


@pytest.fixture(scope="module")
def cold(model):
    """Cold runs (no connector) of s1, computed once."""
    from simple_engine import Engine
    return Engine(model).run("cold-s1", prompt(1))


class Recorder:
    """Wraps a kvtrie.Client: records which thread ran each get / layer write; with `gated`,
    a get first waits for `get_gate` and a finished write of layer 0 sets `layer0_sent`."""

    def __init__(self, client: kvtrie.Client):
        self.client = client
        self.events = []  # (what, thread name)
        self.gated = False
        self.get_gate = threading.Event()
        self.layer0_sent = threading.Event()
        self.gate_timed_out = False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def get(self, *args, **kwargs):
        if self.gated and not self.get_gate.wait(10):
            self.gate_timed_out = True
        self.events.append(("get", threading.current_thread().name))
        return self.client.get(*args, **kwargs)

    def put(self, *args, **kwargs):
        self.events.append(("put", threading.current_thread().name))
        return self.client.put(*args, **kwargs)

    def put_layers(self, *args, **kwargs):
        stream = self.client.put_layers(*args, **kwargs)
        outer = self

        class Stream:
            def write(self, layer, *a, **kw):
                stream.write(layer, *a, **kw)
                outer.events.append((f"write{layer}", threading.current_thread().name))
                if layer == 0:
                    outer.layer0_sent.set()

            def commit(self):
                outer.events.append(("commit", threading.current_thread().name))
                return stream.commit()

            def cancel(self):
                stream.cancel()

        return Stream()


def make_engine(model, target, namespace, block_size=16, **cfg):
    from simple_engine import Engine
    config = {"target": target, "model_id": "stories260K", "namespace": namespace, **cfg}
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config=config)
    worker = KvtrieConnector(role=KVConnectorRole.WORKER, config=config,
                             client=Recorder(kvtrie.Client(target, "stories260K",
                                                           namespace=namespace, timeout=10)))
    return Engine(model, sched, worker, block_size=block_size), sched, worker


def client_encoded(target, namespace) -> int:
    """Stored nodes of `namespace` whose blocks came encoded by a client (the server's Stats)."""
    stats = kvtrie.Client(target, "stories260K", namespace=namespace).stats()
    return int(stats.get("client_reported_error_nodes", 0))


def test_saves_are_encoded_on_the_worker_and_give_the_cold_logits(model, cold, server):
    # The connector's default: each save is gathered layer by layer during the forward pass and
    # put whole at wait_for_save, encoded on the worker (lossless of the fast profile).
    engine, sched, worker = make_engine(model, server.target, "encoded", encoding="lossless")
    first = engine.run("s0", prompt(0))
    assert first.loaded_tokens == 0 and worker.stats["saved_blocks"] == 32
    assert client_encoded(server.target, "encoded") == 32  # every block encoded by the worker
    rec = worker._client
    rec.events.clear()
    warm = engine.run("s1", prompt(1))
    assert warm.loaded_tokens == PREFIX and warm.recomputed_from is None
    assert worker.stats["loaded_tokens"] == PREFIX and worker.stats["load_failed_tokens"] == 0
    assert np.isnan(warm.logits[:PREFIX]).all()  # not computed: loaded
    # Same logits as the cold run, bit for bit, for the prompt's rest and the decoded tokens.
    assert np.array_equal(warm.logits[PREFIX:], cold.logits[PREFIX:])
    for a, b in zip(warm.decode_logits, cold.decode_logits):
        assert np.array_equal(a, b)
    new_blocks = 32 - PREFIX // 16
    assert worker.stats["saved_blocks"] == 32 + new_blocks and worker.stats["save_errors"] == 0
    assert client_encoded(server.target, "encoded") == 32 + new_blocks
    # One encoded put on the commit thread (after the step), no dense layer stream.
    saves = [(w, t) for w, t in rec.events if w != "get"]
    assert len(saves) == 1 and saves[0][0] == "put" and saves[0][1].startswith("kvtrie-commit")
    c = kvtrie.Client(server.target, "stories260K", namespace="encoded")
    assert c.lookup(prompt(1)) == 512
    k, v, n = c.get(prompt(1))
    assert n == 512
    again = engine.run("s1-again", prompt(1))  # the stored KV, loaded whole, is the model's
    assert again.loaded_tokens == 511
    assert np.array_equal(again.logits[511], cold.logits[511])


def test_shared_prefix_is_loaded_and_gives_the_cold_logits_lossless(model, cold, server):
    # A thin worker: each layer is sent dense as it is saved, during the forward pass.
    engine, sched, worker = make_engine(model, server.target, "lossless", encoding="lossless",
                                        encode_on_client=False)
    first = engine.run("s0", prompt(0))
    assert first.loaded_tokens == 0 and worker.stats["saved_blocks"] == 32
    calls = []
    orig_alloc = sched.update_state_after_alloc
    sched.update_state_after_alloc = lambda *a: (calls.append(a[2]), orig_alloc(*a))[1]
    # Overlap, made deterministic: the loader's Get waits until start_load_kv has returned (so
    # start_load_kv must not wait for it), and the engine's save of the last layer waits until
    # layer 0 was sent (so layer 0 must go out during the forward pass, not at wait_for_save).
    rec = worker._client
    rec.events.clear()
    rec.gated = True
    orig_start, orig_save = worker.start_load_kv, worker.save_kv_layer
    sent_during_forward = []

    def start_load_kv(ctx, **kw):
        orig_start(ctx, **kw)
        rec.get_gate.set()

    def save_kv_layer(name, kv_layer, attn_metadata, **kw):
        orig_save(name, kv_layer, attn_metadata, **kw)
        if name == engine.names[-1] and not sent_during_forward:
            sent_during_forward.append(rec.layer0_sent.wait(10))

    worker.start_load_kv, worker.save_kv_layer = start_load_kv, save_kv_layer
    warm = engine.run("s1", prompt(1))
    worker.start_load_kv, worker.save_kv_layer = orig_start, orig_save
    rec.gated = False
    assert not rec.gate_timed_out and sent_during_forward == [True]
    # The scheduler matched the shared preamble, the worker loaded it and computed the rest.
    assert calls == [PREFIX] and warm.loaded_tokens == PREFIX and warm.recomputed_from is None
    assert worker.stats["loaded_tokens"] == PREFIX and worker.stats["load_failed_tokens"] == 0
    assert np.isnan(warm.logits[:PREFIX]).all()  # not computed: loaded
    # Same logits as the cold run, bit for bit, for the prompt's rest and the decoded tokens.
    assert np.array_equal(warm.logits[PREFIX:], cold.logits[PREFIX:])
    for a, b in zip(warm.decode_logits, cold.decode_logits):
        assert np.array_equal(a, b)
    # Only the new blocks were sent and stored; s1 is now fully stored.
    assert worker.stats["saved_blocks"] == 32 + (32 - PREFIX // 16)
    assert worker.stats["save_errors"] == 0
    assert kvtrie.Client(server.target, "stories260K", namespace="lossless").lookup(prompt(1)) == 512
    assert client_encoded(server.target, "lossless") == 0  # the server encoded them
    # Load and save ran on the connector's threads: the Get on the loader, the layers on the
    # saver, in order, then the commit.
    threads = dict(rec.events)
    assert threads["get"].startswith("kvtrie-load")
    assert [w for w, _ in rec.events if w != "get"] == [f"write{l}" for l in range(5)] + ["commit"]
    assert all(threads[f"write{l}"].startswith("kvtrie-save") for l in range(5))
    assert threads["commit"].startswith("kvtrie-commit")  # after the step
    # A full hit loads all but the last token, which is computed for its logits.
    again = engine.run("s1-again", prompt(1))
    assert again.loaded_tokens == 511
    assert np.array_equal(again.logits[511], cold.logits[511])


def test_engine_pages_smaller_than_kvtrie_blocks(model, cold, server):
    # 8-token engine pages, 16-token kvtrie blocks: each kvtrie block spans two pages.
    engine, _, worker = make_engine(model, server.target, "pages8", block_size=8)
    engine.run("s0", prompt(0))
    warm = engine.run("s1", prompt(1))
    assert warm.loaded_tokens == PREFIX and worker.stats["load_failed_tokens"] == 0
    assert np.array_equal(warm.logits[PREFIX:], cold.logits[PREFIX:])


def test_residual_prefix_stays_within_stated_dnll(model, cold, server):
    from llama_numpy import nll_bits
    engine, _, worker = make_engine(model, server.target, "residual", encoding="residual",
                                    target_rel_rms=RESIDUAL_TARGET, get_mode="residual")
    engine.run("s0", prompt(0))
    warm = engine.run("s1", prompt(1))
    assert warm.loaded_tokens == PREFIX and worker.stats["load_failed_tokens"] == 0
    assert not np.array_equal(warm.logits[PREFIX:], cold.logits[PREFIX:])  # lossy, really loaded
    assert client_encoded(server.target, "residual") == 32 + (32 - PREFIX // 16)  # by the worker
    toks = prompt(1)
    nll_warm = nll_bits(warm.logits[PREFIX:511], toks[PREFIX + 1:]).mean()
    nll_cold = nll_bits(cold.logits[PREFIX:511], toks[PREFIX + 1:]).mean()
    rel = abs(nll_warm - nll_cold) / nll_cold
    print(f"residual@{RESIDUAL_TARGET}: NLL {nll_warm:.4f} vs cold {nll_cold:.4f} bits/token "
          f"(dNLL {100 * rel:.3f} %)")
    assert rel <= MAX_REL_DNLL


def test_a_prefix_evicted_after_the_lookup_is_recomputed(model, cold, server):
    engine, _, worker = make_engine(model, server.target, "evicted", encoding="lossless")
    engine.run("s0", prompt(0))
    c = kvtrie.Client(server.target, "stories260K", namespace="evicted")
    reported = []
    orig = worker.get_block_ids_with_load_errors
    worker.get_block_ids_with_load_errors = lambda: (lambda e: (reported.append(e), e)[1])(orig())
    # Between the scheduler's lookup and the worker's load, blocks 10.. of the prefix go away.
    engine.hook_between_schedule_and_load = lambda: c.delete(prompt(1)[:11 * 16])
    warm = engine.run("s1", prompt(1))
    assert warm.loaded_tokens == PREFIX and warm.recomputed_from == 160
    assert worker.stats["loaded_tokens"] == 160 and worker.stats["load_failed_tokens"] == PREFIX - 160
    assert len(reported[0]) == PREFIX // 16 - 10  # the engine blocks of kvtrie blocks 10..22
    assert np.array_equal(warm.logits[160:], cold.logits[160:])
    assert worker.stats["save_errors"] == 0 and c.lookup(prompt(1)) == 512  # saved by the redo


@pytest.mark.parametrize("how", ["raises", "raises_other", "skipped"])
def test_a_save_missing_a_layer_stores_nothing(model, cold, server, how):
    # One layer's save raises (kvtrie's Error, or any other exception: a bug, a torch error) or
    # never runs: the request is not committed, so nothing of it is stored (no zero-filled layer
    # served as KV), wait_for_save raises nothing (a failed save costs a miss, never the worker)
    # and the next prompt recomputes.
    ns = f"layer-{how}"
    engine, _, worker = make_engine(model, server.target, ns, encoding="lossless")
    calls = {"n": 0}
    if how.startswith("raises"):
        slots = worker._slots

        def failing_slots(*args):
            calls["n"] += 1
            if calls["n"] == 2:  # layer 1 of the one request
                if how == "raises_other":
                    raise IndexError("a bug in the gather")
                raise kvtrie.Error(kvtrie.StatusCode.INTERNAL, "gather failed")
            return slots(*args)
        worker._slots = failing_slots
    else:
        save_layer = worker._save_layer

        def skipping(r, layer, kv_layer):
            calls["n"] += 1
            if layer != 1:  # layer 1 never written: the commit must refuse the zeros
                save_layer(r, layer, kv_layer)
        worker._save_layer = skipping
    first = engine.run("s0", prompt(0))
    assert first.loaded_tokens == 0 and calls["n"] >= 2  # layer 1 was reached
    assert worker.stats["saved_blocks"] == 0 and worker.stats["save_errors"] >= 1
    c = kvtrie.Client(server.target, "stories260K", namespace=ns)
    assert c.lookup(prompt(0)) == 0 and c.lookup(prompt(1)) == 0
    if how.startswith("raises"):
        worker._slots = slots
    else:
        worker._save_layer = save_layer
    warm = engine.run("s1", prompt(1))  # a miss: computed, same logits as cold
    assert warm.loaded_tokens == 0 and np.array_equal(warm.logits, cold.logits)


def test_the_server_going_away_falls_back_to_recompute(model, cold, tmp_path):
    srv = ServerProcess(tmp_path / "data")
    engine, _, worker = make_engine(model, srv.target, "", encoding="lossless")
    engine.run("s0", prompt(0))
    engine.hook_between_schedule_and_load = srv.stop
    warm = engine.run("s1", prompt(1))  # no exception: the engine recomputes, the save is lost
    assert warm.loaded_tokens == PREFIX and warm.recomputed_from == 0
    assert np.array_equal(warm.logits, cold.logits)
    assert worker.stats["save_errors"] >= 1


@pytest.fixture()
def three_shards(tmp_path):
    servers = [ServerProcess(tmp_path / f"kvtrie-{i}") for i in range(3)]
    yield servers
    for s in servers:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.mark.parametrize("encode_on_client", [True, False])
def test_three_shards_route_by_prompt_and_a_killed_shard_is_recomputed(model, cold, three_shards,
                                                                      encode_on_client):
    # The connector given `shards` (no `target`): its own kvtrie.ShardedClient on both sides.
    from simple_engine import Engine
    shards = ",".join(f"kvtrie-{i}={s.target}" for i, s in enumerate(three_shards))
    config = {"shards": shards, "model_id": "stories260K", "namespace": "sharded",
              "encoding": "lossless", "timeout": 5, "shard_down_backoff": 0.2,
              "encode_on_client": encode_on_client}
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config=config)
    worker = KvtrieConnector(role=KVConnectorRole.WORKER, config=config)
    assert isinstance(worker._client, kvtrie.ShardedClient)
    engine = Engine(model, sched, worker)
    story = read_dump(TESTDATA / "story_prompt")[0].tolist()  # another first block
    owner_s, owner_story = worker._client.owner(prompt(0)), worker._client.owner(story)
    assert owner_s != owner_story  # in namespace "sharded": kvtrie-2 and kvtrie-0
    direct = {f"kvtrie-{i}": kvtrie.Client(s.target, "stories260K", namespace="sharded")
              for i, s in enumerate(three_shards)}

    engine.run("s0", prompt(0))
    first_story = engine.run("story", story)
    assert first_story.loaded_tokens == 0
    story_full = len(story) // 16 * 16
    assert worker.stats["saved_blocks"] == 32 + story_full // 16
    # Each prompt's blocks are on its owner and nowhere else.
    for name, c in direct.items():
        assert c.lookup(prompt(0)) == (512 if name == owner_s else 0)
        assert c.lookup(story) == (story_full if name == owner_story else 0)

    # The shared preamble is loaded from its owner: the cold logits, bit for bit.
    warm = engine.run("s1", prompt(1))
    assert warm.loaded_tokens == PREFIX and warm.recomputed_from is None
    assert np.array_equal(warm.logits[PREFIX:], cold.logits[PREFIX:])
    for a, b in zip(warm.decode_logits, cold.decode_logits):
        assert np.array_equal(a, b)
    assert direct[owner_s].lookup(prompt(1)) == 512

    # kill -9 the sessions' owner: s1 is a miss (computed in full, the cold logits, the save
    # skipped, no error); the story, on a live shard, still loads.
    saved = worker.stats["saved_blocks"]
    victim = three_shards[int(owner_s.split("-")[1])]
    victim.proc.kill()
    victim.proc.wait()
    lost = engine.run("s1-lost", prompt(1))
    assert lost.loaded_tokens == 0 and lost.recomputed_from is None
    assert np.array_equal(lost.logits, cold.logits)
    assert worker.stats["save_errors"] == 0 and worker.stats["saved_blocks"] == saved
    assert sched._client.counters["lost_calls"] >= 1
    assert worker._client.counters["puts_skipped"] >= 1
    hit = engine.run("story-again", story)
    assert hit.loaded_tokens == story_full
    assert np.array_equal(hit.logits[story_full:], first_story.logits[story_full:])
