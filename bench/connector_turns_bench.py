"""Multi-turn conversations through KvtrieConnector (issue 32, row 10): the hit rate of later
turns with and without generated-token saves (``save_generated``).

--conversations conversations run side by side through the vLLM-shaped test engine
(tests/python/engine.py) with the real stories260K model, fp16 pages, against a kvtrie-server on
loopback. Turn 1's prompt is a 256-token slice of one of tests/data's four sessions (offset by
the conversation, so conversations share no more than a session's text); each turn generates
--generated tokens; turn k+1's prompt is turn k's prompt, its answer and --user new tokens
(random). The engine has no local prefix cache (the turn came back after its pages were reused,
or to another replica), so every hit is kvtrie's. Hit rate: tokens loaded from kvtrie over
prompt tokens, summed over turns 2.. (turn 1 has nothing stored); "computed" is the prompt
tokens those turns computed.

Run (from the repository root, after deploy/build.sh kvtrie-server kvtrie_python):
    PYTHONPATH=build/client/python /usr/bin/python3 bench/connector_turns_bench.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))

import numpy as np  # noqa: E402

from conftest import MODEL, TESTDATA, ServerProcess, read_dump  # noqa: E402
from engine import Engine, Request  # noqa: E402
from kvtrie.connector import KVConnectorRole, KvtrieConnector  # noqa: E402
from llama_numpy import LlamaModel  # noqa: E402


def run(model, target, namespace, save_generated, args):
    cfg = {"target": target, "model_id": "stories260K", "namespace": namespace,
           "encoding": "lossless", "save_generated": save_generated,
           "kv_load_failure_policy": "recompute"}
    sched = KvtrieConnector(role=KVConnectorRole.SCHEDULER, config=cfg)
    worker = KvtrieConnector(role=KVConnectorRole.WORKER, config=cfg)
    sessions = [read_dump(TESTDATA / "sessions" / f"s{i}")[0].tolist() for i in range(4)]
    rng = np.random.RandomState(1)
    prompts = [sessions[c % 4][c // 4 * 16:c // 4 * 16 + 256] for c in range(args.conversations)]
    prompt_tokens = loaded = 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        e = Engine(model, sched, [worker], num_blocks=64 * args.conversations,
                   max_tokens_per_step=4096, prefix_cache=False)
        out = e.run([Request(f"c{c}t{turn}", p, max_tokens=args.generated)
                     for c, p in enumerate(prompts)])
        if turn > 0:
            for r in out.values():
                prompt_tokens += len(r.prompt_token_ids)
                loaded += sum(r.external_tokens)
        prompts = [p + out[f"c{c}t{turn}"].output_token_ids +
                   rng.randint(1, model.vocab_size, args.user).tolist()
                   for c, p in enumerate(prompts)]
    wall = time.perf_counter() - t0
    sched.shutdown()
    worker.shutdown()
    return loaded, prompt_tokens, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--generated", type=int, default=48)
    ap.add_argument("--user", type=int, default=24)
    args = ap.parse_args()
    model = LlamaModel(str(MODEL))
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(Path(tmp) / "data")
        try:
            print("| generated-token saves | hit rate, turns 2.. | loaded | computed | wall (s) |")
            print("|---|---:|---:|---:|---:|")
            for save_generated in (False, True):
                loaded, total, wall = run(model, srv.target, f"turns-{save_generated}",
                                          save_generated, args)
                print(f"| {'on' if save_generated else 'off'} | {100 * loaded / total:.1f} % | "
                      f"{loaded} | {total - loaded} | {wall:.1f} |", flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
