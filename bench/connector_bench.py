"""Time to first token through the vLLM-shaped test engine (tests/python/engine.py) with
KvtrieConnector and a kvtrie-server on loopback: a request whose prefix kvtrie holds (loaded)
vs the same request computed, and what saving costs the step: the time the engine's thread
spends in save_kv_layer and wait_for_save (the gather out of the paged cache; the encode and
Put commit after the step, on the connector's thread, timed until get_finished reports it).

stories260K's context is 512 tokens, so the 256..4,096-token prefixes run a Llama-shaped model
with random weights (LlamaModel.random: dim 256, 4 layers, 8 query / 4 KV heads of 32, float64
numpy on the CPU): timing only, never a compression claim. Random token ids; the suffix after
the prefix is 16 tokens; one prefill step (no chunking); bf16, lossless, encoded on the worker;
the medians of --repeats.

Run (from the repository root, after deploy/build.sh -j2 kvtrie-server kvtrie_python):
    PYTHONPATH=build/client/python /usr/bin/python3 bench/connector_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from conftest import ServerProcess  # noqa: E402
from engine import Engine, Request  # noqa: E402
from kvtrie.connector import KVConnectorRole, KvtrieConnector  # noqa: E402
from llama_numpy import LlamaModel  # noqa: E402


def make_engine(model, target, namespace):
    cfg = {"target": target, "model_id": "random-llama", "namespace": namespace,
           "encoding": "lossless"}
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config=cfg)
    worker = KvtrieConnector(role=KVConnectorRole.WORKER, config=cfg)
    spent = {"save": 0.0}  # seconds the engine's thread spent in the connector's save calls

    def timed(f):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                spent["save"] += time.perf_counter() - t
        return call
    worker.save_kv_layer = timed(worker.save_kv_layer)
    worker.wait_for_save = timed(worker.wait_for_save)
    e = Engine(model, sched, [worker], dtype=torch.bfloat16, num_blocks=600,
               max_tokens_per_step=8192, prefix_cache=False)
    e.spent = spent
    return e


def ttft(engine, rid, prompt):
    """(seconds to the first token, seconds of the first step, seconds of it in save calls,
    seconds from the step's end until the save was committed, tokens loaded)."""
    t0 = time.perf_counter()
    engine.add_request(Request(rid, prompt, max_tokens=1))
    engine.step()
    r = engine.requests[rid]
    assert r.first_token_time is not None
    first = r.first_token_time - t0
    t1 = time.perf_counter()
    engine.run()  # the save's commit (after the step), then the pages back
    return (first, engine.step_times[0], engine.spent["save"], time.perf_counter() - t1,
            r.external_tokens[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", default="256,512,1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    model = LlamaModel.random()
    rng = np.random.RandomState(1)
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(Path(tmp) / "data")
        try:
            print("| prefix tokens | recomputed TTFT (ms) | loaded TTFT (ms) | speedup | "
                  "save calls in the step (ms) | share of the step | commit after the step (ms) |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for p in [int(x) for x in args.prefixes.split(",")]:
                cold, warm, save, share, commit = [], [], [], [], []
                for rep in range(args.repeats):
                    prefix = rng.randint(0, model.vocab_size, p).tolist()
                    ns = f"p{p}-{rep}"
                    a = prefix + rng.randint(0, model.vocab_size, 16).tolist()
                    b = prefix + rng.randint(0, model.vocab_size, 16).tolist()
                    t, step, spent, after, loaded = ttft(make_engine(model, srv.target, ns), "a", a)
                    assert loaded == 0
                    cold.append(t)
                    save.append(spent)
                    share.append(spent / step)
                    commit.append(after)
                    t, _, _, _, loaded = ttft(make_engine(model, srv.target, ns), "b", b)
                    assert loaded == p, (loaded, p)
                    warm.append(t)
                c, w = statistics.median(cold), statistics.median(warm)
                print(f"| {p} | {1e3 * c:.1f} | {1e3 * w:.1f} | {c / w:.1f}x | "
                      f"{1e3 * statistics.median(save):.1f} | "
                      f"{100 * statistics.median(share):.2f} % | "
                      f"{1e3 * statistics.median(commit):.1f} |", flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
