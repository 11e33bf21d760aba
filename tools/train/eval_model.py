#!/usr/bin/python3
"""Held-out bits/token of the trained model against unigram and bigram models (issue 29).

The unigram and the bigram (interpolated Kneser-Ney, discount 0.75) are fitted on the train split
(DATA/train.bin). All three are scored on the same held-out tokens: every held-out document cut
into windows of --context tokens (the first window starts with the document's BOS), every token
but a window's first scored. Held-out documents whose name (extensions stripped) also names a
train document are skipped: the kernel and Python documentation ship one text as reST and HTML,
and the split is by path, so such a pair may straddle it.

With --stories260K and --worker, the worker also runs stories260K and this model on the first
--chars characters of every --stories_docs-th held-out document: bits per UTF-8 byte, since the
two tokenizers differ. Writes the table to --report (Markdown) and prints it.

  /usr/bin/python3 tools/train/eval_model.py --model tests/data/kvllama3M/kvllama3M.gguf \
      --data /work/train-run/data --stories260K tests/data/stories260K/stories260K.gguf \
      --worker build/client/worker/kvtrie-worker --report /tmp/eval.md
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_gguf import model_from_gguf, read_gguf  # noqa: E402

V = 4096


def doc_key(path):
    base = os.path.basename(path)
    return re.sub(r"(\.(gz|txt|rst|html?|md|[0-9][a-z]*))+$", "", base).lower()


def kept_heldout_docs(data, max_tokens):
    train_keys = set()
    with open(os.path.join(data, "train.jsonl")) as f:
        for line in f:
            m = re.search(r'"path": "([^"]*)"', line)
            train_keys.add(doc_key(m.group(1)))
    docs = [json.loads(line) for line in open(os.path.join(data, "heldout_docs.jsonl"))]
    texts = {}
    with open(os.path.join(data, "heldout.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            texts[rec["path"]] = rec["text"]
    kept, skipped, total = [], 0, 0
    for d in docs:
        if doc_key(d["path"]) in train_keys:
            skipped += 1
            continue
        if total >= max_tokens:
            break
        d["text"] = texts[d["path"]]
        kept.append(d)
        total += d["len"]
    return kept, skipped


def ngram_models(train):
    """Unigram (add-one) and interpolated Kneser-Ney bigram log2-probability functions."""
    t = np.asarray(train, dtype=np.int64)
    uni = np.bincount(t, minlength=V).astype(np.float64)
    p_uni = (uni + 1) / (uni.sum() + V)
    pairs = t[:-1] * V + t[1:]
    big = np.bincount(pairs, minlength=V * V).reshape(V, V).astype(np.float64)
    d = 0.75
    c_v = big.sum(1)
    n1_v = (big > 0).sum(1)
    cont = (big > 0).sum(0).astype(np.float64)
    p_cont = (cont + 1e-3) / (cont + 1e-3).sum()

    def log2_uni(prev, nxt):
        return np.log2(p_uni[nxt])

    def log2_big(prev, nxt):
        c = big[prev, nxt]
        cv = c_v[prev]
        safe = np.maximum(cv, 1)
        p = np.where(cv > 0, np.maximum(c - d, 0) / safe + d * n1_v[prev] / safe * p_cont[nxt],
                     p_cont[nxt])
        return np.log2(p)

    return log2_uni, log2_big


def windows(heldout, docs, context):
    for d in docs:
        toks = np.asarray(heldout[d["start"]:d["start"] + d["len"]], dtype=np.int64)
        for s in range(0, len(toks) - 1, context):
            w = toks[s:s + context]
            if len(w) >= 2:
                yield w


def _worker_dump(worker, model, path, chars, out):
    subprocess.run([worker, "dump", f"--model={model}", f"--text_file={path}", f"--out={out}",
                    "--max_tokens=0", f"--max_chars={chars}"], check=True, capture_output=True)
    man = json.load(open(os.path.join(out, "manifest.json")))
    return man["token_ids"], sum(x or 0.0 for x in man["surprisal_bits"])


def worker_bits_per_byte(worker, models, docs, chars, every):
    """Bits per UTF-8 byte of each model over the same texts; a text that does not fit every
    model's context whole is skipped."""
    contexts = [read_gguf(m)[0]["llama.context_length"] for m in models]
    bits = [0.0] * len(models)
    nbytes = n = 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.txt")
        for i, d in enumerate(docs):
            if i % every:
                continue
            text = d["text"][:chars]
            with open(path, "w") as f:
                f.write(text)
            got = [_worker_dump(worker, m, path, chars, os.path.join(tmp, "d"))
                   for m in models]
            if any(len(ids) >= c for (ids, _), c in zip(got, contexts)):
                continue
            for j, (_, b) in enumerate(got):
                bits[j] += b
            nbytes += len(text.encode())
            n += 1
    return [b / nbytes for b in bits], n, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF exported by export_gguf.py")
    ap.add_argument("--data", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max_tokens", type=int, default=200_000, help="held-out tokens scored")
    ap.add_argument("--stories260K", default="")
    ap.add_argument("--worker", default="build/client/worker/kvtrie-worker")
    ap.add_argument("--chars", type=int, default=1000)
    ap.add_argument("--stories_docs", type=int, default=4, help="every n-th kept document")
    ap.add_argument("--report", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)

    train = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    heldout = np.memmap(os.path.join(args.data, "heldout.bin"), dtype=np.uint16, mode="r")
    docs, skipped = kept_heldout_docs(args.data, args.max_tokens)
    log2_uni, log2_big = ngram_models(train)
    model, _ = model_from_gguf(args.model)
    sums = {"model": [], "unigram": [], "bigram": []}
    n_windows = 0
    with torch.no_grad():
        for w in windows(heldout, docs, args.context):
            n_windows += 1
            logits, _ = model(torch.from_numpy(w[None, :-1]))
            lp = torch.log_softmax(logits[0].double(), -1)
            sums["model"].append(-(lp[torch.arange(len(w) - 1), torch.from_numpy(w[1:])]
                                   / math.log(2)).numpy())
            sums["unigram"].append(-log2_uni(w[:-1], w[1:]))
            sums["bigram"].append(-log2_big(w[:-1], w[1:]))
    res = {k: np.concatenate(v) for k, v in sums.items()}
    n = len(res["model"])
    per_doc_gap = []
    rows = []
    for k in ("model", "bigram", "unigram"):
        m = res[k].mean()
        se = res[k].std() / math.sqrt(n)
        rows.append((k, m, se))
    gap = res["bigram"] - res["model"]
    gap_mean, gap_se = gap.mean(), gap.std() / math.sqrt(n)
    lines = [f"Held-out: {len(docs)} documents ({skipped} skipped: their name is also in the "
             f"train split), {n_windows} windows of <= {args.context} tokens, {n:,} scored tokens; "
             f"train split {len(train):,} tokens.", "",
             "| model | held-out bits/token | s.e. (per token) |", "|---|---|---|"]
    for k, m, se in rows:
        name = {"model": os.path.basename(args.model), "bigram": "bigram (Kneser-Ney, train split)",
                "unigram": "unigram (train split)"}[k]
        lines.append(f"| {name} | {m:.3f} | {se:.3f} |")
    lines += ["", f"Model vs bigram: {gap_mean:.3f} ± {gap_se:.3f} bits/token better "
              f"(gate: >= 1 bit/token: {'MET' if gap_mean >= 1 else 'NOT MET'})."]
    if args.stories260K:
        (ours, st), n_ours, b_ours = worker_bits_per_byte(
            args.worker, [args.model, args.stories260K], docs, args.chars, args.stories_docs)
        lines += ["", f"Same text through kvtrie-worker (the first {args.chars} characters of every "
                  f"{args.stories_docs}th kept held-out document, {n_ours} documents, "
                  f"{int(b_ours):,} bytes; bits per UTF-8 byte since the tokenizers differ):", "",
                  "| model | bits/byte |", "|---|---|",
                  f"| {os.path.basename(args.model)} | {ours:.3f} |",
                  f"| stories260K | {st:.3f} |"]
    out = "\n".join(lines) + "\n"
    print(out)
    if args.report:
        with open(args.report, "w") as f:
            f.write(out)
        with open(os.path.splitext(args.report)[0] + ".json", "w") as f:
            json.dump({"docs": len(docs), "skipped": skipped, "tokens": n, "windows": n_windows,
                       "rows": rows, "gap": [gap_mean, gap_se]}, f, indent=1)


if __name__ == "__main__":
    main()
