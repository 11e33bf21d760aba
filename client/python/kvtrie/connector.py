"""KvtrieConnector: kvtrie behind the method names and call order of vLLM's KVConnectorBase_V1.

An inference engine with a paged KV cache calls it exactly as vLLM (v1) calls a KV connector:

Scheduler side (one instance, ``role=KVConnectorRole.SCHEDULER``), per step:
    ``get_num_new_matched_tokens(request, num_computed_tokens)`` -> ``(tokens to load, False)``
    (a Lookup: the longest stored prefix; never the whole prompt, the last token is computed);
    ``update_state_after_alloc(request, blocks, num_external_tokens)`` once blocks are allocated;
    ``build_connector_meta(scheduler_output)`` -> :class:`KvtrieConnectorMetadata` (what to load
    into which blocks, what to save), handed to the workers; ``request_finished(request,
    block_ids)`` -> ``(False, None)`` (saves finish inside the step, blocks may be freed).

Worker side (``role=KVConnectorRole.WORKER``), per forward pass:
    ``register_kv_caches({layer_name: cache})`` once; ``bind_connector_metadata(meta)``;
    ``start_load_kv(forward_context)`` starts one Get per request on a loader thread and returns;
    ``wait_for_layer_load(layer_name)`` inside each attention layer waits for that layer only
    (the thread scatters the fetched KV into the paged cache layer by layer, so the first layers
    compute while later ones are still being written); ``save_kv_layer(layer_name, kv_layer,
    attn_metadata)`` after each layer wrote its KV hands the layer to a saver thread, which
    gathers it from the paged cache (and, with ``encode_on_client`` off, sends it at once on a
    layer-wise Put stream, :meth:`kvtrie.Client.put_layers`), overlapping with the next layers'
    compute; ``wait_for_save()`` commits the Puts (by default encoding them on the worker first); ``get_block_ids_with_load_errors()`` returns the block
    ids whose KV could not be loaded (the prefix was evicted or deleted after the lookup, or the
    server is unreachable) — the engine recomputes from the first of them, as vLLM does.
    A request whose load failed in a step is not saved in that step (its new KV was computed
    over missing context); the recompute step saves it.

Paged cache layout: each layer's array is ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (K then V; vLLM's FlashAttention layout), numpy (or anything numpy can index; torch
tensors on the CPU through ``.numpy()`` views). Token ``t`` of a request lives at
``block_ids[t // block_size]``, offset ``t % block_size``; the engine's block size need not equal
kvtrie's ``block_tokens``.

Configuration (a dict; under vLLM, ``kv_connector_extra_config``): ``target`` (HOST:PORT),
``model_id`` (default: vLLM's model name), ``namespace``, ``token``, ``tls`` (``true`` or
``{"ca": path, "cert": path, "key": path}``, as :class:`kvtrie.Client`), ``timeout``, ``encoding``
(``"lossless"``, ``"residual"``, ...), ``target_rel_rms``, ``get_mode`` (``"reconstructed"`` or
``"residual"``: decode on the worker), ``block_tokens`` (16), ``retry_attempts`` (5),
``retry_initial_backoff`` (0.1 s), ``retry_max_backoff`` (2 s): a save whose Put ends ABORTED
(concurrent Puts kept changing its prefix; nothing was stored) or UNAVAILABLE is sent again, whole,
by the client's put stream, so the worker does not see it (see :class:`kvtrie.Client`);
``codec_threads`` (0 = the cores) encode saves and decode a ``"residual"`` get;
``encode_on_client`` (true): a save is encoded on the worker (raw, lossless, residual with a
``target_rel_rms``, of the fast profile) and sent encoded, so the server only checks and stores
the bytes: the layers of a request are gathered during the forward pass and put whole at
:meth:`wait_for_save` (encoding needs whole blocks). ``false`` (thin workers): each layer is sent
dense as it is saved (:meth:`kvtrie.Client.put_layers`), overlapping with the next layers'
compute, and the server encodes. ``predictor_refresh`` (10 s): see :class:`kvtrie.Client`.

More than one server: ``shards`` (``"kvtrie-0=host:port,kvtrie-1=host:port,..."``) or
``shards_dns`` (an SRV name of the headless Service, or ``host:port`` for A records) instead of
``target`` makes the connector use a :class:`kvtrie.ShardedClient`: every lookup, get and save
of a prompt goes to its owner shard (rendezvous hash of the first ``route_tokens`` = 16 tokens),
and a lost shard is a miss (lookup 0, the engine computes; a save skipped), never an error.
``retry_attempts`` then defaults to 1; ``shard_down_backoff`` (1 s: a failed shard is skipped
that long, doubling), ``shards_refresh_seconds`` (30) and ``shard_warmup_seconds`` (0) are the
CLI's ``--shard_down_backoff_ms``, ``--shards_refresh_seconds`` and ``--shard_warmup_seconds``;
``pin_replicas`` (1): 2 makes a miss on a prompt's owner ask its second shard, where prefixes
pinned with ``--pin_replicas=2`` (system prompts) are copied.

With vLLM installed the class derives from its KVConnectorBase_V1; without it (as here) it
stands alone. Tested with the engine loop in tests/python/test_connector.py, not against vLLM.
"""

from __future__ import annotations

import concurrent.futures
import enum
import importlib.util
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from . import Client, Error, ShardedClient, StatusCode

log = logging.getLogger("kvtrie.connector")

# Under vLLM: be a real KVConnectorBase_V1 (tests/python/test_vllm_conformance.py imports a fake
# vllm package with the pinned signatures). Only vLLM being absent falls back to standing alone:
# a vLLM that is installed but does not import (a dependency of its own missing, a CUDA error, a
# version without the v1 connector API) raises here, not later as a class vLLM's loader rejects.
if importlib.util.find_spec("vllm") is not None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1 as _Base, KVConnectorMetadata as _MetaBase, KVConnectorRole)
else:  # vLLM is not installed (as in this repository's engine tests)
    _Base = object
    _MetaBase = object

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Where a connector instance runs (values as vLLM's)."""

        SCHEDULER = 0
        WORKER = 1


__all__ = ["KvtrieConnector", "KvtrieConnectorMetadata", "RequestMeta", "KVConnectorRole"]


@dataclass
class RequestMeta:
    """One request's work in one step (picklable: vLLM ships it to the workers)."""

    req_id: str
    token_ids: List[int]  #: the prompt
    block_ids: List[int]  #: the request's engine blocks, in token order
    load_tokens: int = 0  #: load tokens [0, load_tokens) from kvtrie (0 = no load)
    save_tokens: int = 0  #: save the full kvtrie blocks of tokens [0, save_tokens) (0 = no save)
    stored_blocks: int = 0  #: kvtrie blocks the lookup found stored (not sent again)


@dataclass
class KvtrieConnectorMetadata(_MetaBase):  # type: ignore[misc, valid-type]
    """What the workers do this step: the requests that load or save."""

    requests: List[RequestMeta] = field(default_factory=list)


@dataclass
class _Tracked:  # scheduler side: a request between alloc and finish
    request: Any
    block_ids: List[int]
    load_tokens: int  # pending load, consumed by the next build_connector_meta
    stored_blocks: int


def _block_ids(blocks: Any) -> List[int]:
    # vLLM's KVCacheBlocks.get_block_ids() -> tuple of lists (one per KV cache group).
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    if isinstance(ids, tuple):
        ids = ids[0] if ids else []
    return [int(b) for b in ids]


def _prompt(request: Any) -> List[int]:
    return list(request.prompt_token_ids)


class KvtrieConnector(_Base):  # type: ignore[misc, valid-type]
    """kvtrie as a vLLM-style KV connector (see the module docstring for the call order)."""

    def __init__(self, vllm_config: Any = None, role: Any = None, kv_cache_config: Any = None, *,
                 config: Optional[Dict[str, Any]] = None, client: Any = None):
        if _Base is not object and vllm_config is not None:  # constructed by vLLM
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            except TypeError:  # vLLM before kv_cache_config was added
                super().__init__(vllm_config, role)
        cfg: Dict[str, Any] = dict(config or {})
        if vllm_config is not None:  # constructed by vLLM
            kt = getattr(vllm_config, "kv_transfer_config", None)
            cfg = {**dict(getattr(kt, "kv_connector_extra_config", None) or {}), **cfg}
            cfg.setdefault("model_id", str(vllm_config.model_config.model).replace("/", "_"))
        self._role_value = role if role is not None else KVConnectorRole.WORKER
        self._cfg = cfg
        self._block_tokens = int(cfg.get("block_tokens", 16))
        self._client = client or _make_client(cfg, self._block_tokens)
        self._encoding = cfg.get("encoding", "lossless")
        self._encode_on_client = _bool(cfg.get("encode_on_client", True), "encode_on_client")
        self._target_rel_rms = float(cfg.get("target_rel_rms", 0.0))
        self._get_mode = cfg.get("get_mode", "reconstructed")
        # Scheduler side.
        self._tracked: Dict[str, _Tracked] = {}
        # Worker side.
        self._meta: Optional[KvtrieConnectorMetadata] = None
        self._caches: Dict[str, Any] = {}
        self._layer_index: Dict[str, int] = {}
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "kvtrie-load")
        self._saver = concurrent.futures.ThreadPoolExecutor(1, "kvtrie-save")
        self._layer_loaded: List[threading.Event] = []
        self._load_future: Optional[concurrent.futures.Future] = None
        self._lock = threading.Lock()
        self._load_errors: Set[int] = set()  # guarded by _lock
        self._failed_loads: Set[str] = set()  # req ids whose load failed this step (_lock)
        self._loaded_ok: Dict[str, int] = {}  # req id -> tokens its last load delivered (_lock)
        self._saves: Dict[str, Any] = {}  # req id -> PutStream (saver thread only)
        self._save_failed: Set[str] = set()  # req ids with a failed layer save (saver thread)
        self._save_futures: List[concurrent.futures.Future] = []
        self.stats: Dict[str, int] = {"lookups": 0, "loaded_tokens": 0, "load_failed_tokens": 0,
                                      "saved_blocks": 0, "save_errors": 0}

    @property
    def role(self) -> Any:
        return self._role_value

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtrie holds (block-aligned, at most all
        but the last prompt token, which the engine computes for its logits). Side-effect free;
        ``(0, False)`` when the server cannot be reached."""
        prompt = _prompt(request)
        try:
            matched = self._client.lookup(prompt)
        except Error as e:
            log.warning("kvtrie lookup failed, computing instead: %s", e)
            return 0, False
        self.stats["lookups"] += 1
        matched = min(matched, len(prompt) - 1)
        return max(0, matched - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Remembers the request's blocks and the tokens to load into them."""
        req_id = str(request.request_id)
        ids = _block_ids(blocks)
        t = self._tracked.get(req_id)
        if t is None:
            load_end = int(request.num_computed_tokens) + int(num_external_tokens)
            self._tracked[req_id] = _Tracked(
                request, ids, load_end if num_external_tokens > 0 else 0,
                load_end // self._block_tokens if num_external_tokens > 0 else 0)
        else:  # a second allocation for the same request: more blocks
            t.block_ids = t.block_ids + [b for b in ids if b not in t.block_ids]
            if num_external_tokens > 0:
                t.load_tokens = int(request.num_computed_tokens) + int(num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvtrieConnectorMetadata:
        """This step's loads (from update_state_after_alloc) and saves: a request is saved in
        the step that computes the last token of its prompt's last full kvtrie block (so a
        chunked prefill saves once, at the end, and a recompute after a load error saves
        again). Resets the pending loads."""
        scheduled: Dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", {}))
        meta = KvtrieConnectorMetadata()
        for req_id, t in self._tracked.items():
            if req_id not in scheduled and t.load_tokens == 0:
                continue
            prompt = _prompt(t.request)
            full = len(prompt) // self._block_tokens * self._block_tokens
            computed = int(t.request.num_computed_tokens)
            end = computed + scheduled.get(req_id, 0)
            save = full if (full > t.stored_blocks * self._block_tokens and computed < full <= end) else 0
            if t.load_tokens or save:
                meta.requests.append(RequestMeta(req_id, prompt, list(t.block_ids),
                                                 t.load_tokens, save, t.stored_blocks))
            t.load_tokens = 0
        return meta

    def request_finished(self, request: Any,
                         block_ids: Sequence[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Forgets the request. Returns ``(False, None)``: nothing is sent after the step, so
        its blocks may be freed now."""
        self._tracked.pop(str(request.request_id), None)
        return False, None

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """The engine's paged caches by layer name, in model order (layer i = kvtrie layer i)."""
        self._caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self._caches)}
        self._names = list(self._caches)

    def bind_connector_metadata(self, connector_metadata: KvtrieConnectorMetadata) -> None:
        self._meta = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def has_connector_metadata(self) -> bool:
        return self._meta is not None

    def _get_connector_metadata(self) -> KvtrieConnectorMetadata:
        assert self._meta is not None, "bind_connector_metadata was not called"
        return self._meta

    def _slots(self, block_ids: Sequence[int], begin: int, end: int):
        cache = next(iter(self._caches.values()))
        bs = cache.shape[2]
        t = np.arange(begin, end)
        return np.asarray(block_ids, dtype=np.int64)[t // bs], t % bs

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts this step's loads on the loader thread and returns at once."""
        meta = self._get_connector_metadata()
        loads = [r for r in meta.requests if r.load_tokens > 0]
        self._layer_loaded = [threading.Event() for _ in self._names]
        with self._lock:
            self._failed_loads = set()
        if not loads:
            for e in self._layer_loaded:
                e.set()
            self._load_future = None
            return
        self._load_future = self._loader.submit(self._load, loads, self._layer_loaded)

    def _load(self, loads: List[RequestMeta], events: List[threading.Event]) -> None:
        fetched = []  # (request, k, v, tokens delivered)
        try:
            for r in loads:
                bt = self._block_tokens
                want = (r.load_tokens + bt - 1) // bt * bt
                try:
                    k, v, n = self._client.get(r.token_ids[:want], mode=self._get_mode)
                except Error as e:
                    log.warning("kvtrie load of %s failed, recomputing: %s", r.req_id, e)
                    k = v = None
                    n = 0
                n = min(n, r.load_tokens)
                fetched.append((r, k, v, n))
                self._account_load(r, n)
            for layer, name in enumerate(self._names):
                cache = self._caches[name]
                for r, k, v, n in fetched:
                    if n == 0:
                        continue
                    b, o = self._slots(r.block_ids, 0, n)
                    _write(cache, 0, b, o, k[layer, :, :n].transpose(1, 0, 2))
                    _write(cache, 1, b, o, v[layer, :, :n].transpose(1, 0, 2))
                events[layer].set()
        finally:
            for e in events:  # never leave a layer waiting, whatever happened
                e.set()

    def _account_load(self, r: RequestMeta, n: int) -> None:
        bs = next(iter(self._caches.values())).shape[2]
        with self._lock:
            self._loaded_ok[r.req_id] = n
            if n < r.load_tokens:
                first, last = n // bs, (r.load_tokens - 1) // bs
                self._load_errors.update(int(b) for b in r.block_ids[first:last + 1])
                self._failed_loads.add(r.req_id)
        self.stats["loaded_tokens"] += n
        self.stats["load_failed_tokens"] += r.load_tokens - n

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Blocks until this layer's KV of this step's loads is in the paged cache."""
        if self._layer_loaded:
            self._layer_loaded[self._layer_index[layer_name]].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Queues this layer of this step's saves; the saver thread gathers it from
        ``kv_layer`` and sends it while the engine computes the next layer."""
        meta = self._get_connector_metadata()
        layer = self._layer_index[layer_name]
        for r in meta.requests:
            if r.save_tokens > 0:
                self._save_futures.append(self._saver.submit(self._save_layer, r, layer, kv_layer))

    def _first_block(self, r: RequestMeta) -> int:
        with self._lock:
            ok = self._loaded_ok.get(r.req_id)
        stored = r.stored_blocks if ok is None else min(r.stored_blocks, ok // self._block_tokens)
        return stored

    def _save_layer(self, r: RequestMeta, layer: int, kv_layer: Any) -> None:
        with self._lock:
            if r.req_id in self._failed_loads:
                return  # computed over missing context this step: not saved
        if r.req_id in self._save_failed:
            return  # an earlier layer failed: the request is not committed
        try:
            self._save_layer_to(r, layer, kv_layer)
        except BaseException:
            self._save_failed.add(r.req_id)  # never commit a request with a layer missing
            raise

    def _save_layer_to(self, r: RequestMeta, layer: int, kv_layer: Any) -> None:
        s = self._saves.get(r.req_id)
        first = self._first_block(r)
        if s is None:
            if self._encode_on_client:
                s = _EncodedSave(self._client, r.token_ids[:r.save_tokens], len(self._names),
                                 first, self._block_tokens, self._encoding, self._target_rel_rms)
            else:
                s = self._client.put_layers(r.token_ids[:r.save_tokens], len(self._names),
                                            encoding=self._encoding,
                                            target_rel_rms=self._target_rel_rms,
                                            first_block=first)
            self._saves[r.req_id] = s
        begin = first * self._block_tokens
        b, o = self._slots(r.block_ids, begin, r.save_tokens)
        k = np.ascontiguousarray(_read(kv_layer, 0, b, o).transpose(1, 0, 2))
        v = np.ascontiguousarray(_read(kv_layer, 1, b, o).transpose(1, 0, 2))
        s.write(layer, k, v, token_offset=begin)

    def _commit_all(self) -> None:
        saves, self._saves = self._saves, {}
        save_failed, self._save_failed = self._save_failed, set()
        for req_id, s in saves.items():
            with self._lock:
                failed = req_id in self._failed_loads
            if failed or req_id in save_failed:  # a failed layer is counted in save_errors
                s.cancel()
                continue
            try:
                result = s.commit()
                self.stats["saved_blocks"] += result.blocks_stored
            except Error as e:
                self.stats["save_errors"] += 1
                log.warning("kvtrie save of %s failed (a future miss, nothing else): %s", req_id, e)

    def wait_for_save(self) -> None:
        """Blocks until this step's saves are committed. A failed save is logged and counted
        (``stats["save_errors"]``), never raised: it only costs a future cache miss."""
        if self._load_future is not None:
            self._load_future.result()  # the save decision needs the load outcome
        futures, self._save_futures = self._save_futures, []
        for f in futures:
            try:
                f.result()
            except Error as e:
                self.stats["save_errors"] += 1
                log.warning("kvtrie save failed: %s", e)
        self._saver.submit(self._commit_all).result()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Block ids whose KV could not be loaded since the last call (then cleared)."""
        if self._load_future is not None:
            self._load_future.result()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                   Optional[Set[str]]]:
        """No asynchronous transfers outlive a step: ``(None, None)``."""
        return None, None

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)


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
                 block_tokens: int, encoding: Any, target_rel_rms: float) -> None:
        self._client = client
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
                                first_block=self._first_block, encode_on_client=True)

    def cancel(self) -> None:
        self._k = self._v = None


def _write(cache: Any, kv: int, blocks: np.ndarray, offsets: np.ndarray, data: np.ndarray) -> None:
    if isinstance(cache, np.ndarray):
        cache[kv, blocks, offsets] = data
    else:  # pragma: no cover - torch under vLLM (untested here)
        import torch  # type: ignore
        cache[kv, torch.from_numpy(blocks), torch.from_numpy(offsets)] = (
            torch.from_numpy(np.ascontiguousarray(data)).to(cache.device, cache.dtype))


def _read(cache: Any, kv: int, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    if isinstance(cache, np.ndarray):
        return cache[kv, blocks, offsets]
    import torch  # type: ignore  # pragma: no cover - torch under vLLM (untested here)
    t = cache[kv, torch.from_numpy(blocks), torch.from_numpy(offsets)].cpu()  # pragma: no cover
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
