"""The value types of the kvtrie package: TLS settings, encodings and Get modes, model specs, Put
results, and the bfloat16 conversions. Re-exported by :mod:`kvtrie`; import them from there."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["TokenIds", "PathLike", "TlsConfig", "Encoding", "GetMode", "ModelSpec", "BlockResult",
           "PutResult", "bf16_to_float32", "float32_to_bf16"]

TokenIds = Union[Sequence[int], np.ndarray]
PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings of a :class:`Client`: PEM files, read when the Client is created.

    Attributes:
        ca: the CA certificate(s) the server's certificate must chain to; None = the system's
            roots (as ``tls=True``).
        cert, key: the client's certificate chain and private key, for servers that require
            mutual TLS (``--tls_client_ca --tls_require_client_cert``); both or neither.
        server_name: the name checked in the server's certificate instead of the target's host
            (e.g. ``"kvtrie.internal"`` when connecting by IP address).

    A plain mapping with the same keys works too: ``tls={"ca": "ca.pem"}``.
    """

    ca: Optional[PathLike] = None
    cert: Optional[PathLike] = None
    key: Optional[PathLike] = None
    server_name: Optional[str] = None


class Encoding(enum.IntEnum):
    """How the server stores blocks (kvtrie.v1.Encoding)."""

    DEFAULT = 0  #: the server's --default_encoding
    RAW = 1  #: the tensor bytes as given
    LOSSLESS = 2  #: bit-exact (byte planes + entropy coding)
    RESIDUAL = 3  #: predictive residual coding to a relative-RMS error target (lossy)
    INT8 = 4  #: baseline: int8 per token
    KIVI2 = 5  #: baseline: KIVI-style 2-bit
    TURBOQUANT = 6  #: baseline: random rotation + Lloyd-Max scalar quantizer


class GetMode(enum.IntEnum):
    """How Get returns blocks (kvtrie.v1.GetMode)."""

    RECONSTRUCTED = 1  #: the server decodes; dense tensors on the wire
    RESIDUAL = 2  #: the stored encoding on the wire; this client decodes it (in C++)


@dataclass(frozen=True)
class ModelSpec:
    """What a KV cache is valid for, as learned from a Put's arrays or a Get's header."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: np.dtype  #: float16, float32, uint16 (= bfloat16 bit patterns), or uint8
    #: what uint8 arrays hold: "fp8_e4m3", "fp8_e5m2" or "uint8"; None for float16, float32
    #: and bfloat16 (the numpy dtype tells them apart)
    kv_dtype: Optional[str] = None


@dataclass(frozen=True)
class BlockResult:
    """What a Put did with one block."""

    block_index: int
    disposition: str  #: "stored", "deduplicated" or "residual_of_centroid"
    node_id: int
    encoding: str  #: "raw", "lossless", "residual", ... ("unspecified" when deduplicated)
    bytes_logical: int  #: dense bytes of the block in the model's dtype
    bytes_stored: int  #: encoded bytes written (0 when deduplicated)
    bits_per_component: float
    rel_rms_error_k: float  #: achieved ||K - K'|| / ||K|| (0 when bit-exact)
    rel_rms_error_v: float
    max_abs_error: float


@dataclass(frozen=True)
class PutResult:
    """The server's answer to a Put (kvtrie.v1.PutResponse)."""

    stored_tokens: int  #: block-aligned tokens of this sequence now in the trie
    tail_tokens_ignored: int  #: trailing tokens that did not fill a block (not stored)
    blocks_stored: int
    blocks_deduplicated: int
    blocks: Tuple[BlockResult, ...]  #: in block_index order (blocks that were sent)

    @property
    def bytes_logical(self) -> int:
        """Dense bytes of the blocks sent."""
        return sum(b.bytes_logical for b in self.blocks)

    @property
    def bytes_stored(self) -> int:
        """Encoded bytes written by this Put."""
        return sum(b.bytes_stored for b in self.blocks)

    @staticmethod
    def _from_json(j: Mapping[str, Any]) -> "PutResult":
        def strip(name: str, prefix: str) -> str:
            return name[len(prefix):].lower() if name.startswith(prefix) else name.lower()

        blocks = tuple(
            BlockResult(
                block_index=int(b["block_index"]),
                disposition=strip(b["disposition"], "BLOCK_"),
                node_id=int(b["node_id"]),
                encoding=strip(b["encoding"], "ENCODING_"),
                bytes_logical=int(b["bytes_logical"]),
                bytes_stored=int(b["bytes_stored"]),
                bits_per_component=float(b["bits_per_component"]),
                rel_rms_error_k=float(b["rel_rms_error_k"]),
                rel_rms_error_v=float(b["rel_rms_error_v"]),
                max_abs_error=float(b["max_abs_error"]),
            )
            for b in j.get("blocks", [])
        )
        return PutResult(
            stored_tokens=int(j["stored_tokens"]),
            tail_tokens_ignored=int(j["tail_tokens_ignored"]),
            blocks_stored=int(j["blocks_stored"]),
            blocks_deduplicated=int(j["blocks_deduplicated"]),
            blocks=blocks,
        )


def bf16_to_float32(a: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns held as uint16 (exact)."""
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(a: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)
