#!/usr/bin/python3
"""Checks that kvtrie-worker runs the exported GGUF exactly as PyTorch runs model.py.

Runs `kvtrie-worker dump` on a text, then model.py (float32, the GGUF's F16 weights) on the same
token ids, and compares the per-token surprisal (bits) and the K (after RoPE) and V the worker
dumped (fp16). Exits non-zero when the surprisal differs by more than --tol bits anywhere.

  /usr/bin/python3 tools/train/verify_worker.py --model tests/data/kvllama3M/kvllama3M.gguf \
      --worker build/client/worker/kvtrie-worker --text_file tests/data/kvllama3M/heldout_0.txt
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_gguf import model_from_gguf  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--worker", default="build/client/worker/kvtrie-worker")
    ap.add_argument("--text_file", required=True)
    ap.add_argument("--max_tokens", type=int, default=1024)
    ap.add_argument("--max_chars", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-3, help="bits")
    ap.add_argument("--write_reference", default="",
                    help="write PyTorch's per-token surprisal (bits, one a line; BOS 0) here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([args.worker, "dump", f"--model={args.model}",
                              f"--text_file={args.text_file}", f"--out={tmp}",
                              f"--max_tokens={args.max_tokens}", f"--max_chars={args.max_chars}"],
                             capture_output=True, text=True, check=True).stdout
        print(out.strip())
        man = json.load(open(os.path.join(tmp, "manifest.json")))
        k_w = np.load(os.path.join(tmp, "k.npy")).astype(np.float32)
        v_w = np.load(os.path.join(tmp, "v.npy")).astype(np.float32)
    ids = man["token_ids"]
    s_w = np.array([x or 0.0 for x in man["surprisal_bits"]], dtype=np.float64)
    model, _ = model_from_gguf(args.model)
    with torch.no_grad():
        logits, _, kvs = model(torch.tensor([ids]), return_kv=True)
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    s_t = np.zeros(len(ids))
    for i in range(1, len(ids)):
        s_t[i] = -logp[i - 1, ids[i]].item() / math.log(2)
    k_t = np.stack([kv[0][0].permute(1, 0, 2).numpy() for kv in kvs])  # [L, KVH, T, hd]
    v_t = np.stack([kv[1][0].permute(1, 0, 2).numpy() for kv in kvs])
    diff = np.abs(s_w[1:] - s_t[1:])
    k_rel = np.abs(k_w - k_t).max() / np.abs(k_t).max()
    v_rel = np.abs(v_w - v_t).max() / np.abs(v_t).max()
    print(f"{len(ids)} tokens; mean surprisal worker {s_w[1:].mean():.6f} bits, "
          f"PyTorch {s_t[1:].mean():.6f} bits; max |difference| {diff.max():.2e} bits, "
          f"mean {diff.mean():.2e}; K max rel. diff {k_rel:.2e}, V {v_rel:.2e} (fp16 dump)")
    if args.write_reference:
        with open(args.write_reference, "w") as f:
            f.write("".join(f"{x:.6f}\n" for x in s_t))
    ok = diff.max() <= args.tol and k_rel < 2e-3 and v_rel < 2e-3
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
