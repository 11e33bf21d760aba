"""The paged KV layouts vLLM's attention backends hand to a KV connector, and bit-exact copies
between them and kvtrie's arrays (bfloat16 as uint16 bit patterns, never converted)."""

from __future__ import annotations

import enum
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["KvLayout", "detect_layout", "canonical", "check_dtype", "write", "read"]


class KvLayout(enum.Enum):
    """The paged KV layouts vLLM's attention backends hand to a connector (one tensor a layer)."""

    FLASH_ATTN = "flash_attn"  #: [2, num_blocks, block_size, kv_heads, head_dim] (K then V)
    FLASH_INFER = "flash_infer"  #: [num_blocks, 2, block_size, kv_heads, head_dim] (NHD)
    FLASH_INFER_HND = "flash_infer_hnd"  #: [num_blocks, 2, kv_heads, block_size, head_dim]
    MLA = "mla"  #: [num_blocks, block_size, latent]: one latent vector a token


def detect_layout(shape: Sequence[int], num_blocks: Optional[int] = None,
                  block_size: Optional[int] = None) -> KvLayout:
    """The layout of a paged cache of ``shape``, checked against the engine's declared
    ``num_blocks`` and ``block_size`` where given (``None``: not checked). Raises ValueError
    naming the shape for a shape no layout fits or more than one fits (then set ``kv_layout``)."""
    shape = tuple(int(d) for d in shape)

    def fits(nb: int, bs: int) -> bool:
        return (num_blocks is None or nb == num_blocks) and (block_size is None or bs == block_size)

    found = []
    if len(shape) == 5:
        if shape[0] == 2 and fits(shape[1], shape[2]):
            found.append(KvLayout.FLASH_ATTN)
        if shape[1] == 2 and fits(shape[0], shape[2]):
            found.append(KvLayout.FLASH_INFER)
        # Without the declared block_size, NHD and HND of [blocks, 2, ...] cannot be told apart.
        if shape[1] == 2 and (block_size is None or shape[2] != block_size) and fits(
                shape[0], shape[3]):
            found.append(KvLayout.FLASH_INFER_HND)
    elif len(shape) == 3 and shape[2] % 2 == 0 and fits(shape[0], shape[1]):
        found.append(KvLayout.MLA)
    if len(found) != 1:
        raise ValueError(
            f"kv cache shape {list(shape)}: {'no' if not found else 'more than one'} known layout "
            f"fits (num_blocks={num_blocks}, block_size={block_size}; known: "
            "[2, blocks, block_size, heads, head_dim], [blocks, 2, block_size, heads, head_dim], "
            "[blocks, 2, heads, block_size, head_dim], [blocks, block_size, latent]); "
            "set kv_layout, num_blocks or block_size")
    return found[0]


def canonical(cache: Any, layout: KvLayout) -> Any:
    """A view of ``cache`` shaped [2, num_blocks, block_size, kv_heads, head_dim] sharing its
    memory (writes through). MLA's latent is split in halves: K = the first, V = the second."""
    is_np = isinstance(cache, np.ndarray)
    if layout is KvLayout.FLASH_ATTN:
        return cache
    if layout is KvLayout.FLASH_INFER:
        return cache.transpose(1, 0, 2, 3, 4) if is_np else cache.transpose(0, 1)
    if layout is KvLayout.FLASH_INFER_HND:
        return cache.transpose(1, 0, 3, 2, 4) if is_np else cache.permute(1, 0, 3, 2, 4)
    nb, bs, latent = cache.shape
    split = (nb, bs, 1, 2, latent // 2)
    return (cache.reshape(split).transpose(3, 0, 1, 2, 4) if is_np else
            cache.view(split).permute(3, 0, 1, 2, 4))


def check_dtype(k: np.ndarray, cache: Any) -> None:
    """ValueError unless KV of numpy dtype ``k.dtype`` (uint16 = bfloat16) fits ``cache``."""
    if isinstance(cache, np.ndarray):
        ok = k.dtype == cache.dtype
    else:
        import torch  # type: ignore
        want = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32,
                torch.uint8: np.uint8}
        for name in ("float8_e4m3fn", "float8_e5m2"):  # FP8 pages travel as their bytes
            if hasattr(torch, name):
                want[getattr(torch, name)] = np.uint8
        ok = want.get(cache.dtype) == k.dtype
    if not ok:
        raise ValueError(f"stored KV is {k.dtype} (uint16 = bfloat16), the cache {cache.dtype}")


def write(cache: Any, kv: int, blocks: np.ndarray, offsets: np.ndarray, data: np.ndarray) -> None:
    """cache[kv, blocks, offsets] = data, bit for bit (bfloat16 travels as uint16 patterns and
    is reinterpreted, never converted)."""
    if isinstance(cache, np.ndarray):
        cache[kv, blocks, offsets] = data
        return
    import torch  # type: ignore
    src = np.ascontiguousarray(data)
    if src.dtype == np.uint16:
        t = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(src)
    if src.dtype == np.uint8 and cache.dtype != torch.uint8:
        cache = cache.view(torch.uint8)  # FP8 pages: the bytes, never converted
    cache[kv, torch.from_numpy(blocks), torch.from_numpy(offsets)] = t.to(cache.device)


def read(cache: Any, kv: int, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """cache[kv, blocks, offsets] as numpy (bfloat16 as its uint16 bit patterns)."""
    if isinstance(cache, np.ndarray):
        return cache[kv, blocks, offsets]
    import torch  # type: ignore
    t = cache[kv, torch.from_numpy(blocks), torch.from_numpy(offsets)].cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.element_size() == 1 and t.dtype != torch.uint8:  # FP8 pages: their bytes
        return t.view(torch.uint8).numpy()
    return t.numpy()
