"""kvtrie — the Python client of a kvtrie server (a KV-cache store for LLM inference workers).

KV crosses this API as numpy arrays ``[layers, kv_heads, tokens, head_dim]`` (K after RoPE),
float16, float32, or bfloat16 as ``uint16`` bit patterns (numpy has no bfloat16; an ml_dtypes
``bfloat16`` array is accepted too). One-byte caches (vLLM's ``--kv-cache-dtype fp8`` pages,
uint8 tensors there) travel as ``uint8`` arrays with ``kv_dtype="fp8_e4m3"``, ``"fp8_e5m2"`` or
``"uint8"`` on the put (ml_dtypes float8 arrays name it themselves); they are stored bit-exact
(raw or lossless; a lossy encoding is INVALID_ARGUMENT). The model spec (layers, kv_heads,
head_dim, dtype) comes from
the arrays; the first Put of a (namespace, model_id) fixes it on the server. The client cuts the
sequence into blocks of ``block_tokens`` tokens (16); only full blocks are stored.

The work is done in C++ (``kvtrie::Client``, gRPC, the codec) with the GIL released: arrays are
read in place and returned without a copy, and one :class:`Client` may be used from many threads.
Puts are encoded by this client (raw, lossless, and residual with a ``target_rel_rms``, of the fast
profile, on ``codec_threads``) and sent encoded: the server checks and stores the bytes, so wire,
disk and server CPU scale with the compressed size. ``encode_on_client=False`` (per client or per
put) sends dense KV for the server to encode (thin clients).
A failed call raises :class:`Error` carrying the gRPC status code and the server's message, which
starts with the field at fault.

Example::

    import kvtrie
    c = kvtrie.Client("127.0.0.1:50051", "stories260K")
    r = c.put(tokens, k, v, encoding="lossless")   # k, v: [layers, kv_heads, tokens, head_dim]
                                                   # encoded here (fast profile), sent encoded
    k2, v2, n = c.get(tokens)                      # KV of the longest stored prefix (n tokens)
    assert (k2 == k[:, :, :n]).all()

The connector for vLLM-style engines is :mod:`kvtrie.connector`.
"""

from __future__ import annotations

from . import _kvtrie  # noqa: F401  (kvtrie._kvtrie: the extension module, as before)
from ._client import Client, PutStream
from ._errors import (STALE_PREDICTOR_VERSION, Error, InvalidArgumentError, NotFoundError,
                      StatusCode)
from ._types import (BlockResult, Encoding, GetMode, ModelSpec, PathLike, PutResult, TlsConfig,
                     TokenIds, bf16_to_float32, float32_to_bf16)

__all__ = [
    "Client",
    "TlsConfig",
    "PutStream",
    "PutResult",
    "BlockResult",
    "ModelSpec",
    "Encoding",
    "GetMode",
    "Error",
    "InvalidArgumentError",
    "NotFoundError",
    "StatusCode",
    "STALE_PREDICTOR_VERSION",
    "bf16_to_float32",
    "float32_to_bf16",
]

# N servers as one cache (kvtrie/sharded.py, over the C++ ShardedClient): a Client subclass.
from .sharded import LOST_SHARD_CODES, ShardedClient  # noqa: E402

__all__ += ["ShardedClient", "LOST_SHARD_CODES"]
