#!/usr/bin/python3
"""Trains the head_dim-64 Llama-geometry model (issue 29). One script, two recipes.

  --recipe=cpu  4 layers, d_model 256, 4 query heads over 1 KV head (head_dim 64), SwiGLU FFN 512,
                vocab 4096, context 1024, tied output (~3.2M parameters); sized for this 2-core
                machine: most tokens at sequence length 128, then 256, 512 and a final phase at
                1024 so every position of the context is trained.
  --recipe=gpu  6 layers, d_model 512, 8 query heads over 2 KV heads (head_dim 64), FFN 1024
                (~15.4M parameters, F16 GGUF <= 32 MB); CUDA with bf16 autocast when present.
                UNTESTED: no GPU was available where this was written.

The learning rate warms up and then follows a cosine whose progress is the larger of
elapsed-time / --time_budget and tokens / --max_tokens, so a run stopped by its time budget ends
annealed. Checkpoints (OUT/ckpt.pt, atomically replaced) every --ckpt_every seconds; a run
restarted with the same OUT resumes. Logs tokens/s, train loss and a small held-out loss.

  nice -n 19 nohup /usr/bin/python3 tools/train/train.py --recipe=cpu \
      --data /work/train-run/data --out /work/train-run/cpu --time_budget 5400 > log 2>&1 &
"""

import argparse
import dataclasses
import json
import math
import os
import time

import numpy as np
import torch

from model import Config, Llama, num_params

RECIPES = {
    "cpu": dict(cfg=Config(dim=256, n_layers=4, n_heads=4, n_kv_heads=1, hidden_dim=512),
                tokens_per_step=4096, lr=3e-3, min_lr_frac=0.05, warmup_steps=30,
                # (progress at which the phase starts, sequence length)
                phases=[(0.0, 128), (0.75, 256), (0.87, 512), (0.94, 1024)],
                # One thread: on this shared 2-core machine 2 threads gave 966 tokens per
                # CPU-second and 1 thread 1,401 (OpenBLAS, 32 x 128 tokens a step).
                threads=1, device="cpu"),
    "gpu": dict(cfg=Config(dim=512, n_layers=6, n_heads=8, n_kv_heads=2, hidden_dim=1024),
                tokens_per_step=65536, lr=2e-3, min_lr_frac=0.05, warmup_steps=100,
                phases=[(0.0, 256), (0.6, 512), (0.8, 1024)], threads=16, device="cuda"),
}


def lr_at(step, progress, r):
    if step < r["warmup_steps"]:
        return r["lr"] * (step + 1) / r["warmup_steps"]
    p = min(1.0, progress)
    return r["lr"] * (r["min_lr_frac"] + (1 - r["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * p)))


def seq_len_at(progress, r):
    t = r["phases"][0][1]
    for start, length in r["phases"]:
        if progress >= start:
            t = length
    return t


def batch(data, bsz, t, rng, device):
    starts = rng.integers(0, len(data) - t - 1, size=bsz)
    x = np.stack([data[s:s + t + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x).to(device)
    return x[:, :-1], x[:, 1:]


@torch.no_grad()
def heldout_loss(model, held, t, n, device):
    """Mean loss (nats) over n fixed, evenly spaced held-out windows of t tokens."""
    model.eval()
    step = (len(held) - t - 1) // n
    xs = np.stack([held[i * step:i * step + t + 1] for i in range(n)]).astype(np.int64)
    xs = torch.from_numpy(xs).to(device)
    losses = []
    for i in range(0, n, 4):
        _, loss = model(xs[i:i + 4, :-1], xs[i:i + 4, 1:])
        losses.append(loss.item())
    model.train()
    return sum(losses) / len(losses)


def save(path, obj):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="cpu")
    ap.add_argument("--data", required=True, help="folder with train.bin, heldout.bin")
    ap.add_argument("--out", required=True)
    ap.add_argument("--time_budget", type=float, default=5400, help="seconds of training")
    ap.add_argument("--max_tokens", type=float, default=float("inf"))
    ap.add_argument("--ckpt_every", type=float, default=240, help="seconds")
    ap.add_argument("--eval_every", type=float, default=600, help="seconds")
    ap.add_argument("--tokens_per_step", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--lr", type=float, default=0, help="0: the recipe's")
    ap.add_argument("--hidden_dim", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--threads", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()

    r = dict(RECIPES[args.recipe])
    cfg = dataclasses.replace(r["cfg"])
    if args.hidden_dim:
        cfg.hidden_dim = args.hidden_dim
    if args.tokens_per_step:
        r["tokens_per_step"] = args.tokens_per_step
    if args.lr:
        r["lr"] = args.lr
    device = r["device"] if (r["device"] != "cuda" or torch.cuda.is_available()) else "cpu"
    torch.set_num_threads(args.threads or r["threads"])
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    train = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    held = np.memmap(os.path.join(args.data, "heldout.bin"), dtype=np.uint16, mode="r")
    model = Llama(cfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=r["lr"], betas=(0.9, 0.95), eps=1e-8)
    state = {"step": 0, "tokens": 0, "elapsed": 0.0, "log": []}
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        print(f"resumed at step {state['step']}, {state['tokens']:,} tokens", flush=True)
    rng = np.random.default_rng(args.seed + state["step"])
    print(f"recipe {args.recipe}: {dataclasses.asdict(cfg)}, {num_params(model):,} parameters, "
          f"{len(train):,} train tokens, device {device}", flush=True)
    use_bf16 = device == "cuda"

    def checkpoint():
        save(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                         "config": dataclasses.asdict(cfg), "recipe": args.recipe})

    t_start = time.time() - state["elapsed"]
    last_ckpt = last_eval = last_log = time.time()
    log_tokens, log_time = state["tokens"], time.time()
    while True:
        state["elapsed"] = time.time() - t_start
        progress = max(state["elapsed"] / args.time_budget, state["tokens"] / args.max_tokens)
        if progress >= 1.0:
            break
        t = seq_len_at(progress, r)
        bsz = max(1, r["tokens_per_step"] // t)
        lr = lr_at(state["step"], progress, r)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train, bsz, t, rng, device)
        if use_bf16:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
        else:
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += bsz * t
        now = time.time()
        if now - last_log >= 30:
            tps = (state["tokens"] - log_tokens) / (now - log_time)
            print(f"step {state['step']} tokens {state['tokens']:,} elapsed {state['elapsed']:.0f}s "
                  f"progress {progress:.3f} seq {t} lr {lr:.2e} loss {loss.item():.4f} "
                  f"({loss.item() / math.log(2):.3f} bits) tok/s {tps:.0f}", flush=True)
            log_tokens, log_time, last_log = state["tokens"], now, now
        if now - last_eval >= args.eval_every:
            hl = heldout_loss(model, held, 512, 16, device)
            state["log"].append({"step": state["step"], "tokens": state["tokens"],
                                 "elapsed": state["elapsed"], "heldout_bits": hl / math.log(2)})
            print(f"EVAL step {state['step']} tokens {state['tokens']:,} heldout "
                  f"{hl / math.log(2):.3f} bits/token (16 x 512)", flush=True)
            last_eval = time.time()
        if now - last_ckpt >= args.ckpt_every:
            checkpoint()
            last_ckpt = time.time()
    hl = heldout_loss(model, held, 1024, 16, device)
    state["log"].append({"step": state["step"], "tokens": state["tokens"],
                         "elapsed": state["elapsed"], "heldout_bits_1024": hl / math.log(2)})
    checkpoint()
    print(f"DONE step {state['step']} tokens {state['tokens']:,} elapsed {state['elapsed']:.0f}s "
          f"heldout {hl / math.log(2):.3f} bits/token (16 x 1024)", flush=True)
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump({"recipe": args.recipe, "config": dataclasses.asdict(cfg),
                   "params": num_params(model), "state": state}, f, indent=1)


if __name__ == "__main__":
    main()
