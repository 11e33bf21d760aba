"""The Llama-architecture decoder exactly as client/worker/llama_model.cc runs it (issue 29).

RMSNorm (weight * x / sqrt(mean(x^2) + eps)), RoPE on adjacent pairs (x[2j], x[2j+1]) rotated by
pos * theta^(-2j / head_dim), grouped-query attention (query head h reads KV head
h / (heads / kv_heads)), SwiGLU FFN w2(silu(w1 x) * w3 x), output tied to the token embedding.
No biases. The weights map one to one onto the GGUF tensors the worker loads (export_gguf.py).
"""

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class Config:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 1
    hidden_dim: int = 512
    vocab_size: int = 4096
    context_length: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self):
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(cfg, length, device=None):
    """cos and sin [length, head_dim / 2], computed in float32 as llama_model.cc does."""
    hd = cfg.head_dim
    idx = torch.arange(0, hd, 2, dtype=torch.float32, device=device)
    freq = 1.0 / torch.pow(torch.tensor(cfg.rope_theta, dtype=torch.float32), idx / hd)
    ang = torch.arange(length, dtype=torch.float32, device=device)[:, None] * freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x, cos, sin):
    """x [B, T, H, hd]; rotates adjacent pairs (x[2j], x[2j+1])."""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.dim, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wq = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.w1 = nn.Linear(d, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, d, bias=False)
        self.w3 = nn.Linear(d, cfg.hidden_dim, bias=False)

    def forward(self, x, cos, sin, mask, return_kv=False):
        cfg = self.cfg
        B, T, _ = x.shape
        hd = cfg.head_dim
        h = self.attn_norm(x)
        q = apply_rope(self.wq(h).view(B, T, cfg.n_heads, hd), cos, sin)
        k = apply_rope(self.wk(h).view(B, T, cfg.n_kv_heads, hd), cos, sin)
        v = self.wv(h).view(B, T, cfg.n_kv_heads, hd)
        kv = (k, v) if return_kv else None
        rep = cfg.n_heads // cfg.n_kv_heads
        q = q.transpose(1, 2)  # [B, H, T, hd]
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, cfg.n_heads * hd)
        x = x + self.wo(y)
        h = self.ffn_norm(x)
        x = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return x, kv


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        cos, sin = rope_tables(cfg, cfg.context_length)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        mask = torch.triu(torch.ones(cfg.context_length, cfg.context_length, dtype=torch.bool), 1)
        self.register_buffer("mask", mask, persistent=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("wo.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, return_kv=False):
        T = idx.shape[1]
        x = self.tok_embeddings(idx)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        kvs = []
        for layer in self.layers:
            x, kv = layer(x, cos, sin, self.mask, return_kv)
            kvs.append(kv)
        logits = self.norm(x) @ self.tok_embeddings.weight.t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        if return_kv:
            return logits, loss, kvs
        return logits, loss


def num_params(model):
    return sum(p.numel() for p in model.parameters())
