"""KvtrieConnector's incremental saves (issue 32, row 10): each step saves the kvtrie blocks it
completed, a chunked prefill per chunk and decode steps too, the generated tokens included, so a
conversation's next turn (its prompt: this turn's prompt, the answer, the user's new text) loads
the answer's KV instead of computing it. vLLM's OffloadingConnector and LMCache save as they
compute; before, kvtrie saved only the prompt's full blocks, once, at the prompt's end. The
engine (engine.py) and the real stories260K model against a real kvtrie-server, as
test_connector_engine.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvtrie  # noqa: E402
from conftest import MODEL  # noqa: E402
from test_connector_engine import assert_cold, engine, req, session, tokens  # noqa: E402

pytestmark = pytest.mark.skipif(not MODEL.exists(),
                                reason=f"needs the model {MODEL} (or $KVTRIE_MODEL)")

BT = 16  # kvtrie's block_tokens (the connector's default)


@pytest.fixture(scope="module")
def model():
    from llama_numpy import LlamaModel
    return LlamaModel(str(MODEL))


def flush_commits(e) -> None:
    """Waits until every worker's commits so far are done (the commit thread runs them in
    order: a no-op queued behind them)."""
    for w in e.workers:
        w._committer.submit(lambda: None).result(timeout=60)


def lookup(target, namespace, prompt):
    return kvtrie.Client(target, "stories260K", namespace=namespace).lookup(prompt)


def turns(model, target, namespace, cfg=None):
    """Turn 1 (a 200-token prompt, 40 generated tokens) on one engine; turn 2 (turn 1's prompt
    and answer and 48 new tokens) on a fresh engine (nothing local): what turn 2 loads."""
    first = session(0)[:200]
    one = engine(model, target, namespace, cfg=cfg).run([req("t1", first, max_tokens=40)])["t1"]
    second = first + one.output_token_ids + tokens("genesis_1-3")[:48]
    e = engine(model, target, namespace, prefix_cache=False, cfg=cfg)
    two = e.run([req("t2", second, max_tokens=4)])["t2"]
    assert_cold(model, two)  # the loaded answer's KV gives the cold logits bit for bit
    return one, two


def test_the_next_turn_loads_the_generated_tokens(model, server):
    one, two = turns(model, server.target, "turns")
    # Turn 1 computed the KV of its prompt and of all but its last generated token (sampled,
    # never fed back): 239 tokens, 14 full blocks; the prompt alone is 12 (192 tokens).
    computed = len(one.prompt_token_ids) + len(one.output_token_ids) - 1
    assert two.external_tokens == [computed // BT * BT] == [224]


def test_save_generated_false_saves_the_prompt_only(model, server):
    one, two = turns(model, server.target, "turns-off", cfg={"save_generated": False})
    assert two.external_tokens == [len(one.prompt_token_ids) // BT * BT] == [192]


def test_a_chunked_prefill_saves_each_chunk_as_it_completes(model, server):
    prompt = session(1)
    e = engine(model, server.target, "chunks", max_chunk=64)
    e.add_request(req("c", prompt, max_tokens=2))
    e.step()  # the first chunk: tokens [0, 64)
    flush_commits(e)
    assert lookup(server.target, "chunks", prompt) == 64  # stored before the prompt ends
    e.step()
    flush_commits(e)
    assert lookup(server.target, "chunks", prompt) == 128
    out = e.run()["c"]
    flush_commits(e)
    assert lookup(server.target, "chunks", prompt) == len(prompt) // BT * BT
    assert_cold(model, out)
    # Each chunk sent only its own blocks: one Put per chunk, none resent.
    assert e.workers[0].stats["saved_blocks"] == len(prompt) // BT
    # A fresh engine loads the whole prompt, bit-exact.
    again = engine(model, server.target, "chunks", prefix_cache=False).run(
        [req("c2", prompt)])["c2"]
    assert again.external_tokens == [len(prompt) - 1]  # all but the last, computed
    assert_cold(model, again)


class RecordingClient:
    """A worker's client that records its Puts: (kind, tokens, first_block)."""

    def __init__(self, client, calls):
        self._c, self.calls = client, calls

    def __getattr__(self, name):
        return getattr(self._c, name)

    def put(self, tokens, k, v, **kw):
        self.calls.append(("encoded", len(tokens), kw.get("first_block", 0)))
        return self._c.put(tokens, k, v, **kw)

    def put_layers(self, tokens, num_layers, **kw):
        self.calls.append(("layers", len(tokens), kw.get("first_block", 0)))
        return self._c.put_layers(tokens, num_layers, **kw)


def test_small_saves_after_a_long_prefix_do_not_copy_the_prefix(model, server):
    calls = []
    e = engine(model, server.target, "small-saves", max_chunk=256,
               client_wrap=lambda c: RecordingClient(c, calls))
    out = e.run([req("d", session(2), max_tokens=40)])["d"]
    assert_cold(model, out)
    # The chunks are encoded here (16 new blocks after 0, 16); each decode block (one new block
    # after 32, 33) goes layer-wise, dense: its cost is its block, not a copy of the prefix.
    assert calls == [("encoded", 256, 0), ("encoded", 512, 16), ("layers", 528, 32),
                     ("layers", 544, 33)]
