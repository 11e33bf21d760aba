"""Asynchronous vs blocking lookups (issue 32, row 8) through the vLLM-shaped test engine
(tests/python/engine.py, which defers a request whose lookup answers None as vLLM's
Scheduler.schedule does) with KvtrieConnector and a kvtrie-server on loopback.

32 requests arrive at once; each is one of tests/data's four sessions' 368-token preamble
(stored beforehand, so every request loads it) plus 64 random tokens, max_tokens=4, stories260K
(the real model), fp16 pages, no local prefix cache (every request asks kvtrie), a 4,096-token
step budget. Per mode: time to first token of each request from its arrival, and the time the
engine's scheduler thread spends in the connector's scheduler calls per step (on_new_request,
get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, request_finished).
--lookup_delay_ms adds that much to each Lookup (before it is sent), standing in for a server
across a network (loopback answers in well under a millisecond).

Run (from the repository root, after deploy/build.sh kvtrie-server kvtrie_python):
    PYTHONPATH=build/client/python /usr/bin/python3 bench/connector_lookup_bench.py
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

from conftest import MODEL, TESTDATA, ServerProcess, read_dump  # noqa: E402
from engine import Engine, Request  # noqa: E402
from kvtrie.connector import KVConnectorRole, KvtrieConnector  # noqa: E402
from llama_numpy import LlamaModel  # noqa: E402

SCHED_CALLS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
               "build_connector_meta", "request_finished")


class SlowLookups:
    def __init__(self, client, delay):
        self._c, self._delay = client, delay

    def __getattr__(self, name):
        return getattr(self._c, name)

    def lookup(self, t):
        time.sleep(self._delay)
        return self._c.lookup(t)


def make_engine(model, target, namespace, async_lookup, delay):
    cfg = {"target": target, "model_id": "stories260K", "namespace": namespace,
           "encoding": "lossless", "async_lookup": async_lookup}
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config=cfg)
    if delay > 0:
        sched._client = sched._clients[""] = SlowLookups(sched._client, delay)
    worker = KvtrieConnector(role=KVConnectorRole.WORKER, config=cfg)
    spent = [0.0]

    def timed(f):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return call
    for name in SCHED_CALLS:
        setattr(sched, name, timed(getattr(sched, name)))
    e = Engine(model, sched, [worker], num_blocks=1200, max_tokens_per_step=4096,
               prefix_cache=False)
    e.spent = spent
    return e


def run(model, target, async_lookup, delay, n, seed):
    rng = np.random.RandomState(seed)
    sessions = [read_dump(TESTDATA / "sessions" / f"s{i}")[0].tolist()[:368] for i in range(4)]
    e = make_engine(model, target, "lookup-bench", async_lookup, delay)
    per_step = []
    t0 = time.perf_counter()
    for i in range(n):
        prompt = sessions[i % 4] + rng.randint(1, model.vocab_size, 64).tolist()
        e.add_request(Request(f"r{i}", prompt, max_tokens=4))
    while e.waiting or e.running or e.remote:
        before = e.spent[0]
        e.step()
        per_step.append(e.spent[0] - before)
        if not e.running and e.waiting:
            time.sleep(0.0005)
    e.run()
    ttft = [r.first_token_time - t0 for r in e.requests.values()]
    ext = [sum(r.external_tokens) for r in e.requests.values()]
    assert all(x == 368 for x in ext), ext
    e.sched.shutdown()
    e.workers[0].shutdown()
    return ttft, per_step, e.lookup_deferrals, len(e.step_times)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--lookup_delay_ms", default="0,5")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = LlamaModel(str(MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(Path(tmp) / "data")
        try:
            from kvtrie import Client
            c = Client(srv.target, "stories260K", namespace="lookup-bench")
            for i in range(4):  # every request's 368-token preamble is stored
                t, _, k, v = read_dump(TESTDATA / "sessions" / f"s{i}")
                c.put(t, k, v)
            print("| lookup delay | lookups | TTFT p50 (ms) | TTFT p99 (ms) | connector in the "
                  "scheduler per step p50 / p99 (ms) | deferrals | steps |")
            print("|---:|---|---:|---:|---:|---:|---:|")
            seed = 0  # each run's random suffixes are new (the runs save their prompts)
            for d in [float(x) for x in args.lookup_delay_ms.split(",")]:
                for mode in (False, True):
                    ttfts, steps, defer, nsteps = [], [], [], []
                    for rep in range(args.repeats):
                        seed += 1
                        t, s, dfr, ns = run(model, srv.target, mode, d / 1000, args.requests,
                                            seed)
                        ttfts += t
                        steps += s
                        defer.append(dfr)
                        nsteps.append(ns)
                    print(f"| {d:g} ms | {'async' if mode else 'blocking'} | "
                          f"{1000 * statistics.median(ttfts):.1f} | {1000 * pct(ttfts, 99):.1f} | "
                          f"{1000 * pct(steps, 50):.2f} / {1000 * pct(steps, 99):.2f} | "
                          f"{statistics.median(defer):g} | {statistics.median(nsteps):g} |",
                          flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
