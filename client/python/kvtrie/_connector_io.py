"""KvtrieConnector's clients and saves (kvtrie.connector): the client of a configuration, a
boolean config value, and a save encoded on the worker."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from . import Client, Error, ShardedClient, StatusCode


def _make_client(cfg: Dict[str, Any], block_tokens: int) -> Any:
    """A :class:`kvtrie.Client` on ``target``, or with ``shards`` / ``shards_dns`` a
    :class:`kvtrie.ShardedClient` (every call to the prompt's owner; a lost shard is a miss)."""
    sharded = bool(cfg.get("shards") or cfg.get("shards_dns"))
    kwargs: Dict[str, Any] = dict(
        token=cfg.get("token"), tls=cfg.get("tls"), timeout=float(cfg.get("timeout", 60)),
        namespace=cfg.get("namespace", ""), block_tokens=block_tokens,
        # Over shards a lost shard is a miss at once (the engine recomputes), not retried.
        retry_attempts=int(cfg.get("retry_attempts", 1 if sharded else 5)),
        retry_initial_backoff=float(cfg.get("retry_initial_backoff", 0.1)),
        retry_max_backoff=float(cfg.get("retry_max_backoff", 2.0)),
        codec_threads=int(cfg.get("codec_threads", 0)),
        predictor_refresh=float(cfg.get("predictor_refresh", 10.0)))
    if not sharded:
        return Client(cfg.get("target", "127.0.0.1:50051"), cfg["model_id"], **kwargs)
    return ShardedClient(cfg["model_id"], shards=cfg.get("shards") or None,
                         shards_dns=cfg.get("shards_dns") or None,
                         route_tokens=int(cfg.get("route_tokens", 16)),
                         refresh_interval=float(cfg.get("shards_refresh_seconds", 30.0)),
                         down_backoff=float(cfg.get("shard_down_backoff", 1.0)),
                         shard_probe_deadline=float(cfg.get("shard_probe_deadline", 0.25)),
                         shard_probe_interval=float(cfg.get("shard_probe_interval", 0.5)),
                         warmup_window=float(cfg.get("shard_warmup_seconds", 0.0)),
                         pin_replicas=int(cfg.get("pin_replicas", 1)), **kwargs)


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{key}: {value!r} is not a boolean")


class _EncodedSave:
    """A save encoded on the worker: the layers written during the forward pass are gathered
    here and put whole at commit (``kvtrie.Client.put``, which encodes on ``codec_threads``).
    The same write/commit/cancel calls as a :class:`kvtrie.PutStream`."""

    def __init__(self, client: Any, tokens: Sequence[int], num_layers: int, first_block: int,
                 block_tokens: int, encoding: Any, target_rel_rms: float,
                 kv_dtype: Optional[str] = None) -> None:
        self._client = client
        self._kv_dtype = kv_dtype  # what one-byte (FP8) arrays hold, kvtrie.Client.put's
        self._tokens = list(tokens)
        self._layers = num_layers
        self._first_block = first_block
        self._begin = min(first_block * block_tokens, len(self._tokens))  # first token sent
        self._encoding = encoding
        self._target_rel_rms = target_rel_rms
        self._k: Optional[np.ndarray] = None
        self._v: Optional[np.ndarray] = None
        self._written = np.zeros((num_layers, len(self._tokens)), bool)  # [layer, token] written

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, *, token_offset: int = 0) -> None:
        if self._k is None:  # [layers, kv_heads, tokens, head_dim]; blocks before first: unsent
            shape = (self._layers, k.shape[0], len(self._tokens), k.shape[2])
            self._k, self._v = np.zeros(shape, k.dtype), np.zeros(shape, v.dtype)
        n = k.shape[1]
        self._k[layer, :, token_offset:token_offset + n] = k
        self._v[layer, :, token_offset:token_offset + n] = v
        self._written[layer, token_offset:token_offset + n] = True

    def commit(self) -> Any:
        """Puts the gathered layers. Raises FAILED_PRECONDITION (nothing stored) when any layer
        lacks a token of the range sent: the zeros there must never be stored as KV."""
        if self._k is None:
            raise Error(StatusCode.FAILED_PRECONDITION, "put: no layer was written")
        missing = [i for i in range(self._layers) if not self._written[i, self._begin:].all()]
        if missing:
            self.cancel()
            raise Error(StatusCode.FAILED_PRECONDITION,
                        f"put: layers {missing} not written for tokens [{self._begin}, "
                        f"{len(self._tokens)}); nothing stored")
        k, v, self._k, self._v = self._k, self._v, None, None
        return self._client.put(self._tokens, k, v, encoding=self._encoding,
                                target_rel_rms=self._target_rel_rms,
                                first_block=self._first_block, encode_on_client=True,
                                **({"kv_dtype": self._kv_dtype} if self._kv_dtype else {}))

    def cancel(self) -> None:
        self._k = self._v = None
