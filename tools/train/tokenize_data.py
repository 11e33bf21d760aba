#!/usr/bin/python3
"""Trains the SentencePiece tokenizer (BPE, vocab 4096, byte fallback) and encodes the text.

The vocabulary is laid out the way client/worker/tokenizer.cc reads it (llama2.c's layout):
0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3..258 the byte pieces <0x00>..<0xFF>, then the merged
pieces with their BPE scores; "\u2581" stands for a space and a space is prefixed to the text.
No normalization (identity), spaces kept as they are, digits split.

Writes DATA/tok.model, DATA/train.bin and DATA/heldout.bin (uint16 token ids; every document
starts with BOS) and DATA/heldout_docs.jsonl ({"path", "start", "len"} per held-out document).

  /usr/bin/python3 tools/train/tokenize_data.py --data /work/train-run/data
"""

import argparse
import json
import os
import random

import numpy as np
import sentencepiece as spm


def train_tokenizer(data, vocab_size, sample_lines, seed):
    rng = random.Random(seed)
    lines = []
    with open(os.path.join(data, "train.jsonl")) as f:
        for rec in f:
            for line in json.loads(rec)["text"].split("\n"):
                if line.strip():
                    lines.append(line)
    rng.shuffle(lines)
    sample = os.path.join(data, "tokenizer_sample.txt")
    with open(sample, "w") as f:
        for line in lines[:sample_lines]:
            f.write(line + "\n")
    spm.SentencePieceTrainer.train(
        input=sample, model_prefix=os.path.join(data, "tok"), model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        max_sentence_length=8192, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=2, input_sentence_size=sample_lines, shuffle_input_sentence=False)
    os.remove(sample)


def encode(data, split, sp):
    docs = []
    ids = []
    with open(os.path.join(data, f"{split}.jsonl")) as f:
        recs = [json.loads(r) for r in f]
    encoded = sp.encode([r["text"] for r in recs])
    for rec, toks in zip(recs, encoded):
        docs.append({"path": rec["path"], "start": len(ids), "len": len(toks) + 1})
        ids.append(1)
        ids.extend(toks)
    np.array(ids, dtype=np.uint16).tofile(os.path.join(data, f"{split}.bin"))
    if split == "heldout":
        with open(os.path.join(data, "heldout_docs.jsonl"), "w") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")
    return len(ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--vocab_size", type=int, default=4096)
    ap.add_argument("--sample_lines", type=int, default=600_000)
    ap.add_argument("--seed", type=int, default=29)
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.data, "tok.model")):
        train_tokenizer(args.data, args.vocab_size, args.sample_lines, args.seed)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "tok.model"))
    for split in ("heldout", "train"):
        n = encode(args.data, split, sp)
        print(f"{split}: {n:,} tokens", flush=True)


if __name__ == "__main__":
    main()
