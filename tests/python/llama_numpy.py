"""A numpy Llama forward pass over a paged KV cache, for the connector test's engine loop.

The model is a Llama-architecture GGUF with F32/F16 tensors (stories260K). It follows the same
conventions as the C++ reference worker (client/worker/llama_model.h, llama2.c's run.c): RMSNorm,
grouped-query attention, RoPE on adjacent pairs (x[2i], x[2i+1]) of each head, SwiGLU, tied or
separate classifier. K/V are rounded to float16 when written to the cache (an fp16 engine) and
attention reads them back from the cache. Arithmetic is float64 (logits returned as float32), so a
token's results do not depend on how many tokens share its batch (float32 BLAS kernels differ
with the batch size): a prefix loaded from kvtrie and a cold run give bit-identical logits.

Paged cache: one array per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` float16
(K then V; vLLM's FlashAttention layout); a request's token t lives in block ``block_ids[t //
block_size]`` at offset ``t % block_size``.

The GGUF reader follows the GGUF spec (ggml docs/gguf.md), versions 2 and 3.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import numpy as np

# GGUF metadata value types -> struct format (scalars).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}


def read_gguf(path: str):
    """(metadata dict, tensors dict name -> float64 array shaped [out, in] (ne reversed))."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        s = data[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return s

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(_SCALARS[t])

    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (only 2 and 3)")
    n_tensors, n_kv = take("<Q"), take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        ne = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, ne, take("<I"), take("<Q")))
    align = int(meta.get("general.alignment", 32))
    base = (pos + align - 1) // align * align
    tensors = {}
    for name, ne, ggml_type, offset in infos:
        count = int(np.prod(ne))
        if ggml_type == 0:
            a = np.frombuffer(data, np.float32, count, base + offset)
        elif ggml_type == 1:
            a = np.frombuffer(data, np.float16, count, base + offset).astype(np.float32)
        else:
            raise NotImplementedError(f"{name}: ggml type {ggml_type} (only F32 and F16)")
        tensors[name] = a.reshape(list(reversed(ne))).astype(np.float64)
    return meta, tensors


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w1: np.ndarray
    w2: np.ndarray
    w3: np.ndarray


class LlamaModel:
    def __init__(self, path: str):
        meta, t = read_gguf(path)
        self.dim = int(meta["llama.embedding_length"])
        self.num_layers = int(meta["llama.block_count"])
        self.num_heads = int(meta["llama.attention.head_count"])
        self.num_kv_heads = int(meta.get("llama.attention.head_count_kv", self.num_heads))
        self.eps = float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5))
        self.theta = float(meta.get("llama.rope.freq_base", 10000.0))
        self.head_dim = self.dim // self.num_heads
        self.embd = t["token_embd.weight"]
        self.vocab_size = self.embd.shape[0]
        self.out_norm = t["output_norm.weight"]
        self.out = t.get("output.weight", self.embd)
        self.layers = [
            Layer(t[f"blk.{i}.attn_norm.weight"], t[f"blk.{i}.attn_q.weight"],
                  t[f"blk.{i}.attn_k.weight"], t[f"blk.{i}.attn_v.weight"],
                  t[f"blk.{i}.attn_output.weight"], t[f"blk.{i}.ffn_norm.weight"],
                  t[f"blk.{i}.ffn_gate.weight"], t[f"blk.{i}.ffn_down.weight"],
                  t[f"blk.{i}.ffn_up.weight"])
            for i in range(self.num_layers)
        ]
        i = np.arange(0, self.head_dim, 2, dtype=np.float64)
        self.inv_freq = 1.0 / np.power(self.theta, i / self.head_dim)

    @classmethod
    def random(cls, dim: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 4,
               vocab: int = 1024, seed: int = 0) -> "LlamaModel":
        """A Llama-shaped model with random weights: for timing longer contexts than
        stories260K's 512 tokens, never for a compression or accuracy claim."""
        rng = np.random.RandomState(seed)
        m = cls.__new__(cls)
        m.dim, m.num_layers, m.num_heads, m.num_kv_heads = dim, layers, heads, kv_heads
        m.eps, m.theta, m.head_dim = 1e-5, 10000.0, dim // heads
        kv, hidden = kv_heads * m.head_dim, 4 * dim

        def w(*shape):
            return rng.standard_normal(shape) / np.sqrt(shape[-1])
        m.embd = w(vocab, dim)
        m.vocab_size, m.out_norm, m.out = vocab, np.ones(dim), m.embd
        m.layers = [Layer(np.ones(dim), w(dim, dim), w(kv, dim), w(kv, dim), w(dim, dim),
                          np.ones(dim), w(hidden, dim), w(dim, hidden), w(hidden, dim))
                    for _ in range(layers)]
        i = np.arange(0, m.head_dim, 2, dtype=np.float64)
        m.inv_freq = 1.0 / np.power(m.theta, i / m.head_dim)
        return m

    def _rmsnorm(self, x, w):
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(ms + self.eps)) * w

    def _rope(self, x, positions):
        # x [T, heads, head_dim]; rotate adjacent pairs by pos * inv_freq.
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def forward(self, tokens: Sequence[int], start: int, kv_caches: Sequence[np.ndarray],
                block_ids: Sequence[int], block_size: int,
                before_layer: Optional[Callable[[int], None]] = None,
                after_layer: Optional[Callable[[int], None]] = None) -> np.ndarray:
        """Runs ``tokens`` at positions start, start+1, ...; their K/V go into the paged cache
        (layer l's array ``kv_caches[l]``), attention reads positions [0, start + len(tokens)).
        ``before_layer(l)`` runs before layer l reads the cache (the connector's
        wait_for_layer_load), ``after_layer(l)`` after it wrote its K/V (save_kv_layer).
        Returns the logits of every token, [len(tokens), vocab] float32."""
        T = len(tokens)
        S = start + T
        pos = np.arange(start, S)
        blocks = np.asarray(block_ids, dtype=np.int64)
        new_b, new_o = blocks[pos // block_size], pos % block_size
        all_pos = np.arange(S)
        all_b, all_o = blocks[all_pos // block_size], all_pos % block_size
        rep = self.num_heads // self.num_kv_heads
        mask = all_pos[None, :] > pos[:, None]  # [T, S] future keys
        x = self.embd[np.asarray(tokens, dtype=np.int64)].astype(np.float64)
        for l, L in enumerate(self.layers):
            xb = self._rmsnorm(x, L.attn_norm)
            q = (xb @ L.wq.T).reshape(T, self.num_heads, self.head_dim)
            k = (xb @ L.wk.T).reshape(T, self.num_kv_heads, self.head_dim)
            v = (xb @ L.wv.T).reshape(T, self.num_kv_heads, self.head_dim)
            q, k = self._rope(q, pos), self._rope(k, pos)
            if before_layer:
                before_layer(l)
            cache = kv_caches[l]
            cache[0, new_b, new_o] = k.astype(np.float16)
            cache[1, new_b, new_o] = v.astype(np.float16)
            if after_layer:
                after_layer(l)
            K = cache[0, all_b, all_o].astype(np.float64)  # [S, kv_heads, head_dim]
            V = cache[1, all_b, all_o].astype(np.float64)
            att_out = np.empty((T, self.num_heads, self.head_dim), np.float64)
            scale = 1.0 / np.sqrt(self.head_dim)
            for h in range(self.num_heads):
                kh = h // rep
                scores = (q[:, h, :] @ K[:, kh, :].T) * scale  # [T, S]
                scores[mask] = -np.inf
                scores -= scores.max(axis=-1, keepdims=True)
                p = np.exp(scores)
                p /= p.sum(axis=-1, keepdims=True)
                att_out[:, h, :] = p @ V[:, kh, :]
            x = x + att_out.reshape(T, self.dim) @ L.wo.T
            xb = self._rmsnorm(x, L.ffn_norm)
            h1, h3 = xb @ L.w1.T, xb @ L.w3.T
            x = x + ((h1 / (1.0 + np.exp(-h1))) * h3) @ L.w2.T
        return (self._rmsnorm(x, self.out_norm) @ self.out.T).astype(np.float32)


def nll_bits(logits: np.ndarray, next_tokens: Sequence[int]) -> np.ndarray:
    """-log2 softmax(logits[i])[next_tokens[i]] per row, in float64."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -logp[np.arange(len(next_tokens)), np.asarray(next_tokens)] / np.log(2.0)


def make_caches(model: LlamaModel, num_blocks: int, block_size: int) -> Dict[str, np.ndarray]:
    """vLLM-style layer names -> paged caches [2, num_blocks, block_size, kv_heads, head_dim]."""
    return {
        f"model.layers.{l}.self_attn.attn":
            np.zeros((2, num_blocks, block_size, model.num_kv_heads, model.head_dim), np.float16)
        for l in range(model.num_layers)
    }
