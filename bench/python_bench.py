#!/usr/bin/env python3
"""bench/python_bench.py — Put/Get throughput of the Python client (kvtrie.Client) against the
C++ client (kvtrie::Client, bench/client_bench) on the same server, in the same run (issue 14).

A 2,048-token prefix of a Llama-3.2-1B-shaped model by default (16 layers, 8 KV heads,
head_dim 64, fp16: 32 KiB of K+V per token, 64 MiB per prefix), filled with real stories260K
K/V values (tests/data/genesis_1-3, tiled over layers, heads, tokens and channels: real value
statistics, not a real model's structure; a throughput benchmark, not a compression claim).
Per encoding, repeats interleave the two clients (the order alternates); each repeat Puts into a
fresh namespace, Gets the prefix back (RAW and LOSSLESS: RECONSTRUCTED; RESIDUAL: mode RESIDUAL,
decoded by the client), checks it, and Deletes it. Throughput = dense K+V bytes / wall seconds;
medians over the repeats. Target: Python >= 80 % of C++. Also the client process's CPU time per
operation (its threads and gRPC's; the server is another process), which shows the client's own
cost and is less sensitive to a loaded machine than wall time.

    deploy/build.sh kvtrie-server client_bench kvtrie_python
    PYTHONPATH=build/client/python /usr/bin/python3 bench/python_bench.py [--reps=5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--build_dir", default=str(REPO / "build"))
    ap.add_argument("--target", default="", help="a running server (default: start one)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--encodings", default="raw,lossless,residual")
    args = ap.parse_args()
    build = Path(args.build_dir)
    sys.path.insert(0, str(build / "client" / "python"))
    import kvtrie  # noqa: E402 - the build tree's package unless installed

    # The prefix: real values, tiled into the benchmark's shape.
    src = REPO / "tests" / "data" / "genesis_1-3"
    sk, sv = np.load(src / "k.npy"), np.load(src / "v.npy")
    L, H, T, D = args.layers, args.kv_heads, args.tokens, args.head_dim
    il = np.arange(L) % sk.shape[0]
    ih = np.arange(H) % sk.shape[1]
    it = np.arange(T) % sk.shape[2]
    idd = np.arange(D) % sk.shape[3]
    k = np.ascontiguousarray(sk[np.ix_(il, ih, it, idd)])
    v = np.ascontiguousarray(sv[np.ix_(il, ih, it, idd)])
    tokens = (np.arange(T, dtype=np.uint32) * 7919) % 32000 + 3
    nbytes = k.nbytes + v.nbytes

    tmp = Path(tempfile.mkdtemp(prefix="python_bench_"))
    dump = tmp / "dump"
    dump.mkdir()
    np.save(dump / "k.npy", k)
    np.save(dump / "v.npy", v)
    (dump / "manifest.json").write_text(json.dumps({
        "token_ids": tokens.tolist(), "surprisal_bits": [0.0] * T, "layers": L, "kv_heads": H,
        "head_dim": D, "model_file": "bench.gguf"}))

    server = None
    target = args.target
    if not target:
        port_file = tmp / "port"
        server = subprocess.Popen(
            [str(build / "server" / "kvtrie-server"), "--listen=127.0.0.1:0",
             f"--data_dir={tmp / 'data'}", f"--port_file={port_file}"],
            stdout=open(tmp / "server.log", "wb"), stderr=subprocess.STDOUT)
        while not port_file.exists():
            if server.poll() is not None:
                print((tmp / "server.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text().strip()}"

    def cpu() -> float:  # CPU seconds of this process (the caller's thread and gRPC's)
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def python_rep(enc: str, mode: str, rep: int):
        c = kvtrie.Client(target, "bench", namespace=f"bench-py-{enc}-{rep}", timeout=600)
        c0, t0 = cpu(), time.perf_counter()
        r = c.put(tokens, k, v, encoding=enc)
        put_s, put_cpu = time.perf_counter() - t0, cpu() - c0
        assert r.stored_tokens == T, r
        c0, t0 = cpu(), time.perf_counter()
        k2, v2, n = c.get(tokens, mode=mode)
        get_s, get_cpu = time.perf_counter() - t0, cpu() - c0
        assert n == T and (enc == "residual" or np.array_equal(k2.view(np.uint16), k.view(np.uint16)))
        del k2, v2
        c.delete(tokens[:16])
        return put_s, get_s, put_cpu, get_cpu

    def cpp_rep(enc: str, mode: str, rep: int):
        out = subprocess.run(
            [str(build / "bench" / "client_bench"), f"--target={target}", f"--dump={dump}",
             f"--encoding={enc}", f"--mode={mode}", f"--ns=bench-cpp-{enc}", "--reps=1",
             f"--first_rep={rep}"], check=True, capture_output=True, text=True).stdout
        f = dict(kv.split("=") for kv in out.split())
        return float(f["put_s"]), float(f["get_s"]), float(f["put_cpu"]), float(f["get_cpu"])

    rows = []
    try:
        for enc in args.encodings.split(","):
            mode = "residual" if enc == "residual" else "reconstructed"
            py, cpp = [], []
            for rep in range(args.reps):
                order = (python_rep, cpp_rep) if rep % 2 == 0 else (cpp_rep, python_rep)
                for fn in order:
                    (py if fn is python_rep else cpp).append(fn(enc, mode, rep))
            for i, op in enumerate(("put", "get")):
                py_s = statistics.median(x[i] for x in py)
                cpp_s = statistics.median(x[i] for x in cpp)
                label = f"Put {enc.upper()}" if op == "put" else (
                    f"Get {mode.upper()} of {enc.upper()} blocks")
                py_cpu = statistics.median(x[i + 2] for x in py)
                cpp_cpu = statistics.median(x[i + 2] for x in cpp)
                rows.append((label, nbytes / cpp_s / 1e9, nbytes / py_s / 1e9, cpp_s / py_s,
                             [round(x[i], 3) for x in cpp], [round(x[i], 3) for x in py],
                             cpp_cpu * 1e3, py_cpu * 1e3))
    finally:
        if server is not None:
            server.terminate()
            server.wait()

    print(f"Python vs C++ client, {T}-token prefix, [{L}, {H}, {T}, {D}] fp16 K and V = "
          f"{nbytes / 2**20:.0f} MiB per prefix, {args.reps} repeats (medians), server "
          f"{'at ' + args.target if args.target else 'started here'}")
    print()
    print("| operation | C++ client GB/s | Python client GB/s | Python / C++ | client CPU ms "
          "C++ / Python | C++ s (each) | Python s (each) |")
    print("|---|---|---|---|---|---|---|")
    for label, cg, pg, ratio, cs, ps, cc, pc in rows:
        print(f"| {label} | {cg:.3f} | {pg:.3f} | {100 * ratio:.0f} % | {cc:.0f} / {pc:.0f} | "
              f"{cs} | {ps} |")
    worst = min(r[3] for r in rows)
    print()
    print(f"worst Python / C++: {100 * worst:.0f} % (target >= 80 %): "
          f"{'met' if worst >= 0.8 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
