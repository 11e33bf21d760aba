"""KvtrieConnector's KV cache events for routers (issue 32): BlockStored / BlockRemoved /
AllBlocksCleared with medium "KVTRIE", through the connector API vLLM uses for them (the worker's
get_kv_connector_kv_cache_events, the scheduler's update_connector_output and take_events; the
engine, engine.py, calls them as vLLM's model runner, KVOutputAggregator and scheduler do), with
the real stories260K model and a real kvtrie-server."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvtrie  # noqa: E402
from conftest import MODEL  # noqa: E402
from kvtrie._kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                               KvtrieKVEvents, block_hashes)
from test_connector_engine import PREFIX, engine, req, session  # noqa: E402

pytestmark = pytest.mark.skipif(not MODEL.exists(),
                                reason=f"needs the model {MODEL} (or $KVTRIE_MODEL)")

BT = 16
EV = {"kv_events": True}


@pytest.fixture(scope="module")
def model():
    from llama_numpy import LlamaModel
    return LlamaModel(str(MODEL))


def stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


def chain(events):
    """The stored events' blocks in order: (hashes, tokens), each event's parent the last hash
    before it."""
    hashes, toks = [], []
    for e in stored(events):
        assert e.medium == "KVTRIE" and e.block_size == BT
        assert e.parent_block_hash == (hashes[-1] if hashes else None)
        assert len(e.token_ids) == BT * len(e.block_hashes)
        hashes += e.block_hashes
        toks += e.token_ids
    return hashes, toks


def test_committed_saves_are_announced_as_block_stored(model, server):
    e = engine(model, server.target, "events", cfg=EV, max_chunk=128)
    out = e.run([req("s0", session(0), max_tokens=20)])["s0"]
    hashes, toks = chain(e.kv_events)
    computed = len(out.prompt_token_ids) + len(out.output_token_ids) - 1
    assert toks == out.all_token_ids[:computed // BT * BT]  # prompt chunks, then decode blocks
    assert len(stored(e.kv_events)) >= 5  # 4 chunks of 128, a decode block: one event each
    assert hashes == block_hashes("stories260K", out.all_token_ids, BT, len(hashes))
    # Another prompt with the same preamble: its blocks chain onto the preamble's hashes (what a
    # router matches), and only its new blocks are announced.
    e2 = engine(model, server.target, "events", cfg=EV, prefix_cache=False)
    e2.run([req("s1", session(1))])
    first = stored(e2.kv_events)[0]
    assert first.parent_block_hash == hashes[PREFIX // BT - 1]
    assert first.token_ids[:BT] == session(1)[PREFIX:PREFIX + BT]


def test_events_are_off_unless_asked_and_reported_once_under_tp(model, server):
    e = engine(model, server.target, "events-off")
    e.run([req("s0", session(0))])
    assert e.kv_events == []
    e = engine(model, server.target, "events-tp", tp=2, cfg=EV)
    e.run([req("s0", session(0))])
    hashes, toks = chain(e.kv_events)  # the first rank's, each block once
    assert toks == session(0)[:512] and len(hashes) == 32


def test_a_load_that_finds_blocks_gone_announces_block_removed(model, server):
    ns = "events-removed"
    engine(model, server.target, ns).run([req("s0", session(0))])
    e = engine(model, server.target, ns, prefix_cache=False, cfg=EV)
    deleter = kvtrie.Client(server.target, "stories260K", namespace=ns)
    e.hook_before_execute = lambda so: (deleter.delete(session(2)[:11 * 16]),
                                        setattr(e, "hook_before_execute", None))
    lost = e.run([req("s2", session(2))])["s2"]
    assert min(lost.logits) == 160  # the load stopped at the deleted block 10
    removed = [ev for ev in e.kv_events if isinstance(ev, BlockRemoved)]
    assert len(removed) == 1 and removed[0].medium == "KVTRIE"
    preamble = block_hashes("stories260K", session(2), BT, PREFIX // BT)
    assert removed[0].block_hashes == preamble[10:]
    # The recompute saves them again: announced as stored, after the removal.
    assert e.kv_events.index(removed[0]) < e.kv_events.index(stored(e.kv_events)[0])
    assert stored(e.kv_events)[0].block_hashes[0] == preamble[10]


def test_reset_cache_clears_and_new_blocks_hash_under_the_new_epoch(model, server):
    e = engine(model, server.target, "events-reset", cfg=EV)
    e.run([req("a", session(3)[:64])])
    before = chain(e.kv_events)[0]
    assert e.sched.reset_cache()
    e.kv_events.clear()
    e2 = engine(model, server.target, "events-reset", cfg=EV, prefix_cache=False)
    e2.sched = e.sched  # the same scheduler connector, now at epoch 1
    e2.run([req("b", session(3)[:64])])
    assert isinstance(e2.kv_events[0], AllBlocksCleared)
    after = chain(e2.kv_events[1:])[0]
    assert len(after) == len(before) == 4 and not set(after) & set(before)


def test_aggregation_keeps_what_every_reporting_worker_sent():
    a, b = KvtrieKVEvents(), KvtrieKVEvents()
    one = BlockRemoved(block_hashes=[1], medium="KVTRIE")
    two = BlockRemoved(block_hashes=[2], medium="KVTRIE")
    a.add_events([one, two])
    b.add_events([BlockRemoved(block_hashes=[1], medium="KVTRIE")])  # equal, another object
    a.add_events(b.get_all_events())
    a.increment_workers(b.get_number_of_workers())
    assert a.aggregate().get_all_events() == [one] and a.get_number_of_workers() == 1
