#!/usr/bin/python3
"""Exports a tools/train checkpoint to GGUF (version 3) that kvtrie-worker loads unchanged.

Matrices are F16, norm weights F32; the SentencePiece vocabulary goes into tokenizer.ggml.*
(pieces, scores, token types) the way client/worker/tokenizer.cc reads it. No output.weight:
the worker ties the output to token_embd.weight when it is absent, as the model was trained.
The worker applies RoPE to adjacent pairs, as model.py does, so Q and K are written unpermuted.

  /usr/bin/python3 tools/train/export_gguf.py --ckpt /work/train-run/cpu/ckpt.pt \
      --tokenizer /work/train-run/data/tok.model --out kvllama3M.gguf --name kvllama3M
"""

import argparse
import struct

import numpy as np
import sentencepiece as spm
import torch

GGUF_UINT32, GGUF_FLOAT32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY, GGUF_INT32 = 4, 6, 7, 8, 9, 5
GGML_F32, GGML_F16 = 0, 1
ALIGN = 32


def _str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv(key, vtype, value):
    out = _str(key) + struct.pack("<I", vtype)
    if vtype == GGUF_UINT32:
        out += struct.pack("<I", value)
    elif vtype == GGUF_INT32:
        out += struct.pack("<i", value)
    elif vtype == GGUF_FLOAT32:
        out += struct.pack("<f", value)
    elif vtype == GGUF_STRING:
        out += _str(value)
    else:
        raise ValueError(vtype)
    return out


def _kv_array(key, etype, values):
    out = _str(key) + struct.pack("<II", GGUF_ARRAY, etype) + struct.pack("<Q", len(values))
    if etype == GGUF_STRING:
        out += b"".join(_str(v) for v in values)
    elif etype == GGUF_FLOAT32:
        out += np.asarray(values, dtype="<f4").tobytes()
    elif etype == GGUF_INT32:
        out += np.asarray(values, dtype="<i4").tobytes()
    return out


def gguf_tensors(state, cfg):
    """(name, numpy array) in the worker's names; torch [out, in] is GGUF ne = {in, out}."""
    yield "token_embd.weight", state["tok_embeddings.weight"]
    yield "output_norm.weight", state["norm.weight"]
    names = {"attn_norm.weight": "attn_norm.weight", "wq.weight": "attn_q.weight",
             "wk.weight": "attn_k.weight", "wv.weight": "attn_v.weight",
             "wo.weight": "attn_output.weight", "ffn_norm.weight": "ffn_norm.weight",
             "w1.weight": "ffn_gate.weight", "w2.weight": "ffn_down.weight",
             "w3.weight": "ffn_up.weight"}
    for layer in range(cfg["n_layers"]):
        for src, dst in names.items():
            yield f"blk.{layer}.{dst}", state[f"layers.{layer}.{src}"]


def export(ckpt_path, tok_path, out_path, name):
    ck = torch.load(ckpt_path, map_location="cpu")
    cfg = ck["config"]
    state = {k: v.float().numpy() for k, v in ck["model"].items()}
    sp = spm.SentencePieceProcessor(model_file=tok_path)
    n = sp.get_piece_size()
    assert n == cfg["vocab_size"], (n, cfg["vocab_size"])
    pieces = [sp.id_to_piece(i) for i in range(n)]
    scores = [sp.get_score(i) for i in range(n)]
    # llama.cpp token types: 1 normal, 2 unknown, 3 control, 6 byte.
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    assert pieces[3] == "<0x00>" and pieces[258] == "<0xFF>", "byte pieces must be ids 3..258"

    kvs = [
        _kv("general.architecture", GGUF_STRING, "llama"),
        _kv("general.name", GGUF_STRING, name),
        _kv("general.alignment", GGUF_UINT32, ALIGN),
        _kv("llama.context_length", GGUF_UINT32, cfg["context_length"]),
        _kv("llama.embedding_length", GGUF_UINT32, cfg["dim"]),
        _kv("llama.feed_forward_length", GGUF_UINT32, cfg["hidden_dim"]),
        _kv("llama.block_count", GGUF_UINT32, cfg["n_layers"]),
        _kv("llama.attention.head_count", GGUF_UINT32, cfg["n_heads"]),
        _kv("llama.attention.head_count_kv", GGUF_UINT32, cfg["n_kv_heads"]),
        _kv("llama.rope.dimension_count", GGUF_UINT32, cfg["dim"] // cfg["n_heads"]),
        _kv("llama.rope.freq_base", GGUF_FLOAT32, cfg["rope_theta"]),
        _kv("llama.attention.layer_norm_rms_epsilon", GGUF_FLOAT32, cfg["rms_norm_eps"]),
        _kv("tokenizer.ggml.model", GGUF_STRING, "llama"),
        _kv_array("tokenizer.ggml.tokens", GGUF_STRING, pieces),
        _kv_array("tokenizer.ggml.scores", GGUF_FLOAT32, scores),
        _kv_array("tokenizer.ggml.token_type", GGUF_INT32, types),
        _kv("tokenizer.ggml.bos_token_id", GGUF_UINT32, sp.bos_id()),
        _kv("tokenizer.ggml.eos_token_id", GGUF_UINT32, sp.eos_id()),
        _kv("tokenizer.ggml.unknown_token_id", GGUF_UINT32, sp.unk_id()),
    ]
    infos, blobs, offset = [], [], 0
    for tname, arr in gguf_tensors(state, cfg):
        data = (arr.astype("<f2") if arr.ndim == 2 else arr.astype("<f4")).tobytes()
        info = _str(tname) + struct.pack("<I", arr.ndim)
        info += b"".join(struct.pack("<Q", d) for d in reversed(arr.shape))
        info += struct.pack("<IQ", GGML_F16 if arr.ndim == 2 else GGML_F32, offset)
        infos.append(info)
        pad = (-len(data)) % ALIGN
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    header = b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs)
    header += b"".join(infos)
    header += b"\0" * ((-len(header)) % ALIGN)
    with open(out_path, "wb") as f:
        f.write(header)
        for b in blobs:
            f.write(b)
    return len(header) + offset


def read_gguf(path):
    """(metadata dict, {tensor name: float32 numpy array in torch's [out, in] order})."""
    data = open(path, "rb").read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal pos
        n = take("<Q")
        s = data[pos:pos + n].decode("utf-8")
        pos += n
        return s

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q",
              11: "<q", 12: "<d"}

    def value(t):
        if t == GGUF_STRING:
            return string()
        if t == GGUF_ARRAY:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(scalar[t])

    assert data[:4] == b"GGUF"
    pos = 4
    _, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        nd = take("<I")
        ne = [take("<Q") for _ in range(nd)]
        infos.append((name, ne, take("<I"), take("<Q")))
    align = meta.get("general.alignment", ALIGN)
    base = (pos + align - 1) // align * align
    tensors = {}
    for name, ne, t, off in infos:
        dt = "<f2" if t == GGML_F16 else "<f4"
        count = int(np.prod(ne))
        arr = np.frombuffer(data, dtype=dt, count=count, offset=base + off).astype(np.float32)
        tensors[name] = arr.reshape(list(reversed(ne)))
    return meta, tensors


def model_from_gguf(path):
    """A model.Llama holding the GGUF's (F16-rounded) weights, for checks against the worker."""
    from model import Config, Llama
    meta, t = read_gguf(path)
    cfg = Config(dim=meta["llama.embedding_length"], n_layers=meta["llama.block_count"],
                 n_heads=meta["llama.attention.head_count"],
                 n_kv_heads=meta["llama.attention.head_count_kv"],
                 hidden_dim=meta["llama.feed_forward_length"],
                 vocab_size=len(meta["tokenizer.ggml.tokens"]),
                 context_length=meta["llama.context_length"],
                 rope_theta=meta["llama.rope.freq_base"],
                 rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"])
    model = Llama(cfg)
    inv = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    for layer in range(cfg.n_layers):
        for src, dst in [("attn_norm.weight", "attn_norm.weight"), ("wq.weight", "attn_q.weight"),
                         ("wk.weight", "attn_k.weight"), ("wv.weight", "attn_v.weight"),
                         ("wo.weight", "attn_output.weight"), ("ffn_norm.weight", "ffn_norm.weight"),
                         ("w1.weight", "ffn_gate.weight"), ("w2.weight", "ffn_down.weight"),
                         ("w3.weight", "ffn_up.weight")]:
            inv[f"blk.{layer}.{dst}"] = f"layers.{layer}.{src}"
    state = {inv[k]: torch.from_numpy(v.copy()) for k, v in t.items()}
    model.load_state_dict(state)
    model.eval()
    return model, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="kvllama3M")
    args = ap.parse_args()
    size = export(args.ckpt, args.tokenizer, args.out, args.name)
    print(f"wrote {args.out}: {size:,} bytes")


if __name__ == "__main__":
    main()
