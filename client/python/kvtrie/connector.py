"""KvtrieConnector: kvtrie behind the method names and call order of vLLM's KVConnectorBase_V1.

An inference engine with a paged KV cache calls it exactly as vLLM (v1) calls a KV connector:

Scheduler side (one instance, ``role=KVConnectorRole.SCHEDULER``), per step:
    ``on_new_request(request)`` when it is queued starts its Lookup on a lookup thread;
    ``get_num_new_matched_tokens(request, num_computed_tokens)`` -> ``(tokens to load, False)``
    (the Lookup's answer: the longest stored prefix beyond the engine's local prefix-cache hit
    ``num_computed_tokens``; never the whole prompt, the last token is computed), or ``(None,
    False)`` while the Lookup is in flight: vLLM skips the request for the step and asks again
    (the scheduler's loop never waits on the network; ``async_lookup: false`` does); ``(0,
    False)`` for a request with ``skip_reading_prefix_cache`` (``prompt_logprobs``, pooling);
    ``update_state_after_alloc(request, blocks, num_external_tokens)`` once blocks are allocated
    (again, with all its new blocks, when a preempted request resumes);
    ``build_connector_meta(scheduler_output)`` -> :class:`KvtrieConnectorMetadata` (what to load
    into which blocks, what to save), handed to the workers; the page lists follow the
    SchedulerOutput (new requests' ``block_ids``, running ones' ``new_block_ids`` per chunk,
    replaced for ``resumed_req_ids``); ``request_finished(request, block_ids)`` -> ``(True,
    None)`` when a save of the request was scheduled (its commit runs after the step: the engine
    keeps the blocks until :meth:`get_finished` reports it), else ``(False, None)``.

Worker side (``role=KVConnectorRole.WORKER``), per forward pass:
    ``register_kv_caches({layer_name: cache})`` once (the layout detected per layer, see
    below); ``bind_connector_metadata(meta)``; ``start_load_kv(forward_context)`` starts the
    loads on a loader thread and returns: per request one Get per layer group
    (``load_layer_groups``, :meth:`kvtrie.Client.get` ``layers=``), in layer order;
    ``wait_for_layer_load(layer_name)`` inside each attention layer waits for that layer only
    (the thread scatters each group's KV of tokens ``[L, L + loaded)`` into the paged cache as
    soon as it arrived, so layer 0 computes while later groups are still on the wire);
    ``save_kv_layer(layer_name, kv_layer, attn_metadata)`` after each layer wrote its KV hands
    the layer to a saver thread, which gathers it from the
    paged cache (and, with ``encode_on_client`` off, sends it at once on a layer-wise Put stream,
    :meth:`kvtrie.Client.put_layers`), overlapping with the next layers' compute;
    ``wait_for_save()`` waits until the step's saves are gathered (the pages may then be reused)
    and hands their commits (encode on the worker, Put) to a commit thread, after the step;
    ``get_finished(finished_req_ids)`` -> ``(saved, None)`` reports finished requests whose
    commits are done; ``get_block_ids_with_load_errors()`` returns the block ids whose KV could
    not be loaded (the prefix was evicted or deleted after the lookup, or the server is
    unreachable): with vLLM's ``kv_load_failure_policy="recompute"`` the engine recomputes from
    the first of them; with the default ``"fail"`` vLLM fails the request. A request whose load
    failed in a step is not saved in that step (its new KV was computed over missing context);
    the recompute step saves it. ``get_kv_connector_stats()`` returns the counters since the
    last call. Loads run within their step, layer by layer; with ``async_load`` on they run in
    the background instead (``get_num_new_matched_tokens`` returns True, the request waits for
    :meth:`get_finished` to report it loaded, as vLLM's WAITING_FOR_REMOTE_KVS).

Keys: kvtrie keys are token ids. What else vLLM puts in a block hash (kv_cache_utils' extra
keys: the LoRA adapter's name and id, multimodal hashes (``mm_features[i].identifier`` or
``mm_hashes``), ``cache_salt``) is folded into the request's ``model_id`` as ``#`` + 16 hex
digits of a SHA-256 of them (:func:`request_identity`): the model_id, not the namespace, because
the namespace is the tenant and authorization boundary (tokens are granted per namespace), while
an adapter is another model and a salt or image makes the same token ids mean other KV; such a
request gets its own trie and predictor state. Multimodal hashes key the whole prompt (vLLM keys
only the blocks from the image on), so text before an image is not shared across images: fewer
hits, never wrong ones. A request with no token ids (``prompt_token_ids=None``, prompt
embeddings) is a miss and is not saved. Tensor / pipeline parallel ranks hold different heads /
layers, so each rank stores and loads under ``model_id@tp{rank}of{size}`` (``@pp{rank}of{size}``)
when the size is above 1 (``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size`` in the config, else
from vLLM's ``parallel_config``); the scheduler looks up rank 0's.

Paged cache layouts (:class:`KvLayout`, detected from each layer's shape and, when given, the
engine's ``num_blocks`` and ``block_size``, which the ``[num_blocks, 2, ...]`` layouts need
(vLLM's ``cache_config`` gives it); ``kv_layout`` forces one; an unknown or ambiguous shape is a
ValueError naming it): FlashAttention ``[2, num_blocks, block_size, kv_heads,
head_dim]``, FlashInfer / Triton ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (NHD) and
``[num_blocks, 2, kv_heads, block_size, head_dim]`` (HND), MLA ``[num_blocks, block_size,
latent]`` (stored as one head of ``latent / 2``: K = the first half, V = the second). Torch
tensors (fp16, bf16, fp32; bfloat16 travels as its uint16 bit patterns, reinterpreted, never
converted) or numpy arrays. Token ``t`` of a request lives at ``block_ids[t // block_size]``,
offset ``t % block_size``; the engine's block size need not equal kvtrie's ``block_tokens``.

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
compute, and the server encodes. Either way a save of fewer new blocks than a quarter of the
stored blocks before them (a decode step's block after a long prefix) goes the second way: an
encoded Put copies arrays as wide as the whole prefix. ``predictor_refresh`` (10 s): see
:class:`kvtrie.Client`.
``async_load`` (false): loads run in the background across steps, reported by ``get_finished``.
``kv_events`` (vLLM's ``enable_kv_cache_events``; false standalone): KV cache events for
routers, ``medium="KVTRIE"``: see :meth:`get_kv_connector_kv_cache_events` and
:meth:`take_events`.
``save_generated`` (true): decode steps save the blocks their generated tokens complete (a
conversation's next turn loads them); false: only the prompt's blocks (saves are incremental
either way: each step saves the blocks it completed, see :meth:`build_connector_meta`).
``async_lookup`` (true): Lookups run on ``lookup_threads`` (4) threads, never in the scheduler's
loop (see ``get_num_new_matched_tokens``). ``min_load_tokens`` (0): a hit shorter than that
(beyond the local one) is not loaded: the engine computes it. ``lease_seconds`` (30): a lookup
that hits pins the prefix for that long (the server's Pin with a TTL; never unpinned: the Pin
of a node replaces its expiry, so an unpin would also end another request's lease), so it is
not evicted before the load; 0 = no leases (a Delete still removes a leased prefix).
``kv_load_failure_policy`` (vLLM's, from ``kv_transfer_config``; ``"fail"`` by default there):
under ``"fail"`` the connector warns at startup, and logs an error naming each request a failed
load fails. ``kv_role`` (vLLM's): ``kv_producer`` only saves, ``kv_consumer`` only loads.
Decode / prefill context parallelism (``decode_context_parallel_size`` > 1) is refused at
startup, naming the setting. FP8 caches (``cache_dtype`` ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``,
uint8 pages; ``kv_dtype`` in the config standalone) are stored bit-exact as kvtrie's FP8 dtypes
(``encoding`` lossless or raw; a lossy one, ``fp8_inc`` / ``fp8_ds_mla`` and
``calculate_kv_scales`` are refused at startup: :func:`kv_dtype_of`). Hybrid models: see
:class:`KvtrieConnector` and :func:`kv_cache_groups`.
``layerwise`` (true): loads and saves overlap the layers through ``wait_for_layer_load`` /
``save_kv_layer``, so vLLM captures piecewise CUDA graphs (:meth:`requires_piecewise_for_cudagraph`);
``false`` allows full graphs: :meth:`start_load_kv` waits for the step's loads. Either way a layer
whose ``save_kv_layer`` did not come is gathered in :meth:`wait_for_save`.

Fingerprint (under vLLM): the model_id is ``model_id~`` + 12 hex digits of a SHA-256 of what
makes KV differ under one model name (:func:`kv_fingerprint`: model, revision, dtype,
quantization, rope scaling / theta, KV cache dtype, block sizes, ``fingerprint_extra``);
``fingerprint: false`` leaves it out. :meth:`reset_cache` (vLLM's prefix-cache reset) bumps a
cache epoch, folded into later requests' model_ids as ``.e{epoch}`` (``cache_epoch``: the first).
``load_layer_groups`` (1): a load is that many Gets of consecutive layers (at most one per layer;
``"residual"`` get_mode always 1: its blocks travel whole), so layer 0 computes while later groups
stream. The server reads and decodes whole blocks for every group (a range saves wire bytes, not
server CPU), so more than 1 pays that many decodes for the overlap: worth it across a network,
not to a loopback sidecar, where decoding dominates; hence 1 by default.
``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``: see Keys. ``block_size``, ``num_blocks``,
``kv_layout``: see the layouts.

More than one server: ``shards`` (``"kvtrie-0=host:port,kvtrie-1=host:port,..."``) or
``shards_dns`` (an SRV name of the headless Service, or ``host:port`` for A records) instead of
``target`` makes the connector use a :class:`kvtrie.ShardedClient`: every lookup, get and save
of a prompt goes to its owner shard (rendezvous hash of the first ``route_tokens`` = 16 tokens),
and a lost shard is a miss (lookup 0, the engine computes; a save skipped), never an error.
``retry_attempts`` then defaults to 1; ``shard_down_backoff`` (1 s: a failed shard is skipped
that long, doubling), ``shards_refresh_seconds`` (30) and ``shard_warmup_seconds`` (0) are the
CLI's ``--shard_down_backoff_ms``, ``--shards_refresh_seconds`` and ``--shard_warmup_seconds``;
``shard_probe_deadline`` (0.25 s) and ``shard_probe_interval`` (0.5 s) are the CLI's
``--shard_probe_deadline_ms`` and ``--shard_probe_interval_ms`` (a hung shard is found by a
health check with that deadline and its calls cancelled: a miss, not the call's timeout);
``pin_replicas`` (1): 2 makes a miss on a prompt's owner ask its second shard, where prefixes
pinned with ``--pin_replicas=2`` (system prompts) are copied.

With vLLM installed the class derives from its KVConnectorBase_V1; without it (as here) it
stands alone. Tested with tests/python/engine.py (an engine that schedules like vLLM: chunked
prefill, local prefix hits, preemption, torch layouts, bf16, two TP ranks;
tests/python/test_connector_engine.py) and simple_engine.py (test_connector.py), not against
vLLM.
"""

from __future__ import annotations

import concurrent.futures
import enum
import hashlib
import importlib.util
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from . import Error, ShardedClient, StatusCode

from ._connector_io import _bool, _EncodedSave, _make_client
from ._kv_events import AllBlocksCleared, KvtrieKVEvents, removed_event, stored_event
from ._layouts import KvLayout, canonical, check_dtype, detect_layout, read, write

log = logging.getLogger("kvtrie.connector")

# Under vLLM: be a real KVConnectorBase_V1 (tests/python/test_vllm_conformance.py imports a fake
# vllm package with the pinned signatures). Only vLLM being absent falls back to standing alone:
# a vLLM that is installed but does not import (a dependency of its own missing, a CUDA error, a
# version without the v1 connector API) raises here, not later as a class vLLM's loader rejects.
if importlib.util.find_spec("vllm") is not None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1 as _Base, KVConnectorMetadata as _MetaBase, KVConnectorRole)
    try:  # vLLM with the hybrid memory allocator's connector interface
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
            SupportsHMA as _HMA)
    except ImportError:  # an older vLLM: one KV cache group only
        _HMA = object
else:  # vLLM is not installed (as in this repository's engine tests)
    _Base = object
    _MetaBase = object
    _HMA = object

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Where a connector instance runs (values as vLLM's)."""

        SCHEDULER = 0
        WORKER = 1


__all__ = ["KvtrieConnector", "KvtrieConnectorMetadata", "KvtrieConnectorStats", "RequestMeta",
           "KVConnectorRole", "KvLayout", "detect_layout"]


@dataclass
class RequestMeta:
    """One request's work in one step (picklable: vLLM ships it to the workers)."""

    req_id: str
    token_ids: List[int]  #: the prompt, and the generated tokens a save covers
    block_ids: List[int]  #: the request's engine blocks, in token order (all of them, this step)
    load_begin: int = 0  #: load tokens [load_begin, load_end): the engine's local hit ends at
    load_end: int = 0  #: load_begin (0 = no load)
    save_tokens: int = 0  #: save the full kvtrie blocks of tokens [0, save_tokens) (0 = no save)
    stored_blocks: int = 0  #: kvtrie blocks stored (the lookup's, earlier steps' saves): not sent
    identity: str = ""  #: the request's key beyond its tokens, folded into the model_id
    async_load: bool = False  #: load in the background, reported by get_finished (not computed)
    #: hybrid models (more than one KV cache group): every group's blocks, in group order
    #: (block_ids is group 0's); empty with one group
    group_block_ids: List[List[int]] = field(default_factory=list)
    #: per group, the first token whose page is still the request's this step: a sliding-window
    #: group's pages before it may have been freed (vLLM does not tell the connector)
    group_valid_from: List[int] = field(default_factory=list)

    @property
    def load_tokens(self) -> int:  # tokens to load (0 = none)
        return max(0, self.load_end - self.load_begin)


@dataclass
class KvtrieConnectorMetadata(_MetaBase):  # type: ignore[misc, valid-type]
    """What the workers do this step: the requests that load or save."""

    requests: List[RequestMeta] = field(default_factory=list)


@dataclass
class KvtrieConnectorStats:
    """The worker's counters since the last :meth:`KvtrieConnector.get_kv_connector_stats`
    (vLLM's KVConnectorStats shape: ``data``, ``reset``, ``aggregate``, ``reduce``,
    ``is_empty``)."""

    data: Dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: "KvtrieConnectorStats") -> "KvtrieConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, int]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Tracked:  # scheduler side: a request between its first alloc and request_finished
    request: Any
    identity: str
    block_ids: List[int] = field(default_factory=list)
    load_begin: int = 0  # pending load [load_begin, load_end), consumed by build_connector_meta
    load_end: int = 0
    stored_blocks: int = 0  # kvtrie blocks the lookup found stored
    saved_blocks: int = 0  # kvtrie blocks stored or saved by an earlier step (not sent again)
    last_end: int = 0  # tokens computed by the end of its last scheduled step
    async_load: bool = False  # the pending load is asynchronous
    groups: List[List[int]] = field(default_factory=list)  # every group's blocks (hybrid only)


def _block_ids(blocks: Any) -> List[int]:
    # vLLM's KVCacheBlocks.get_block_ids() -> tuple of lists (one per KV cache group); the
    # SchedulerOutput's block_ids are such a tuple too (or None: no new blocks).
    if blocks is None:
        return []
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    if isinstance(ids, tuple):
        ids = ids[0] if ids else []
    return [int(b) for b in ids]


def _group_block_ids(blocks: Any) -> List[List[int]]:
    """Every KV cache group's block ids (vLLM's tuple of lists, one per group)."""
    if blocks is None:
        return []
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    if not isinstance(ids, tuple):
        ids = (ids,)
    return [[int(b) for b in g] for g in ids]


def _prompt(request: Any) -> Optional[List[int]]:
    """The prompt's token ids, or None when the request has none kvtrie can key on (prompt
    embeddings instead of tokens: a miss, never saved)."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    return [int(t) for t in ids]


def _all_tokens(request: Any, prompt: List[int]) -> List[int]:
    """The prompt and the tokens generated so far (vLLM's ``Request.all_token_ids``)."""
    ids = getattr(request, "all_token_ids", None)
    if ids is None:
        out = getattr(request, "output_token_ids", None) or []
        return prompt + [int(t) for t in out]
    return [int(t) for t in ids]


def _num_tokens(request: Any, num_prompt: int) -> int:
    """``len(request.all_token_ids)`` without copying them (vLLM's is a ConstantList)."""
    ids = getattr(request, "all_token_ids", None)
    if ids is not None:
        return len(ids)
    return num_prompt + len(getattr(request, "output_token_ids", None) or [])


def _skips_reading(request: Any) -> bool:
    """vLLM's ``request.skip_reading_prefix_cache`` (set for ``prompt_logprobs`` and pooling
    requests that need every prompt position computed): such a request loads nothing; it is
    still saved (its KV is computed as any other's)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def request_identity(request: Any) -> str:
    """What, besides its token ids, vLLM puts in a request's block hashes (kv_cache_utils'
    extra keys): the LoRA adapter, the multimodal inputs' hashes and ``cache_salt``. ``""``
    for a plain request, else ``"#"`` + 16 hex digits of a SHA-256 of them."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
        lid = getattr(lora, "lora_int_id", None)
        if lid is None:
            lid = getattr(lora, "adapter_id", None)
        parts.append(f"lora={name}:{lid}")
    mm = []
    for f in getattr(request, "mm_features", None) or []:
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(f, "mm_position", None)
        mm.append(f"{ident}@{getattr(pos, 'offset', '')}")
    mm += [str(h) for h in getattr(request, "mm_hashes", None) or []]
    if mm:
        parts.append("mm=" + ",".join(mm))
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    if not parts:
        return ""
    return "#" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# A save encoded on the worker when at most this many stored blocks precede each new one (its
# Put copies the whole prefix's arrays), else sent layer-wise, dense (see _save_layer_to).
_MAX_UNSENT_PER_NEW_BLOCK = 4
_MAX_IDENTITIES = 64  # clients kept for adapters / salts / images (one per model_id)


def _attr(obj: Any, *path: str) -> Any:
    for name in path:
        obj = getattr(obj, name, None) if obj is not None else None
    return obj


def kv_fingerprint(vllm_config: Any, block_tokens: int,
                   extra: Optional[str] = None) -> Tuple[str, Dict[str, Any]]:
    """``(12 hex digits, fields)``: what makes two deployments' KV differ under one model name
    (vLLM's ``model_config``: model, revision, dtype, quantization, the HF config's rope
    scaling / theta / parameters; ``cache_config``: KV cache dtype and block size; kvtrie's
    ``block_tokens``; ``fingerprint_extra``, e.g. a hash of fine-tuned weights)."""
    mc, cc = _attr(vllm_config, "model_config"), _attr(vllm_config, "cache_config")
    hf = _attr(mc, "hf_config")
    fields = {
        "model": _attr(mc, "model"), "revision": _attr(mc, "revision"),
        "dtype": _attr(mc, "dtype"), "quantization": _attr(mc, "quantization"),
        "rope_scaling": _attr(hf, "rope_scaling"), "rope_theta": _attr(hf, "rope_theta"),
        "rope_parameters": _attr(hf, "rope_parameters"),
        "kv_cache_dtype": _attr(cc, "cache_dtype") or "auto",
        "block_size": _attr(cc, "block_size"), "block_tokens": int(block_tokens),
        "extra": extra}
    canon = json.dumps(fields, sort_keys=True, default=str)  # nested dicts sorted too
    return hashlib.sha256(canon.encode()).hexdigest()[:12], fields


def _parallel_suffix(cfg: Dict[str, Any], vllm_config: Any, scheduler: bool) -> str:
    """``@tp{rank}of{size}`` (and ``@pp{rank}of{size}``) when the model is split: each rank
    holds its own heads (layers), so it stores and loads under its own model_id. The scheduler
    asks rank 0's model_id (every rank saves the same prompts; a rank that misses reports a
    load error and the engine recomputes)."""
    par = getattr(vllm_config, "parallel_config", None) if vllm_config is not None else None
    tp = int(cfg.get("tp_size", getattr(par, "tensor_parallel_size", 1) or 1))
    pp = int(cfg.get("pp_size", getattr(par, "pipeline_parallel_size", 1) or 1))
    for name, n in (("tp_size", tp), ("pp_size", pp)):
        if n < 1:
            raise ValueError(f"{name}: {n} is not >= 1")
    rank = int(getattr(par, "rank", 0) or 0) if par is not None else 0
    tp_rank, pp_rank = rank % tp, rank // tp % pp
    if par is not None and not scheduler and (tp > 1 or pp > 1):  # pragma: no cover - vLLM
        try:  # the worker's own ranks, as vLLM's parallel_state has them
            from vllm.distributed import parallel_state as ps  # type: ignore
            tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pp_group().rank_in_group
        except Exception as e:  # noqa: BLE001 - fall back to parallel_config.rank
            log.info("vLLM's parallel_state unavailable (%s): ranks from parallel_config.rank", e)
    tp_rank = int(cfg.get("tp_rank", tp_rank))
    pp_rank = int(cfg.get("pp_rank", pp_rank))
    if scheduler:
        tp_rank = pp_rank = 0
    for name, r, n in (("tp_rank", tp_rank, tp), ("pp_rank", pp_rank, pp)):
        if not 0 <= r < n:
            raise ValueError(f"{name}: {r} is not in [0, {n})")
    return (f"@tp{tp_rank}of{tp}" if tp > 1 else "") + (f"@pp{pp_rank}of{pp}" if pp > 1 else "")


def _lease(client: Any, tokens: List[int], ttl_seconds: int) -> None:
    """Pins ``tokens`` for ``ttl_seconds`` where they are stored: on a ShardedClient the owner
    only (its ``pin`` with ``pin_replicas=2`` would also copy the prefix to a second shard)."""
    if isinstance(client, ShardedClient):
        client.pin(tokens, ttl_seconds=ttl_seconds, extend_only=True, replicate=False)
    else:
        client.pin(tokens, ttl_seconds=ttl_seconds, extend_only=True)


#: vLLM's BlockPool.null_block (vllm/v1/core/block_pool.py, BlockPool.__init__: the first block,
#: taken off the free list and never allocated): a sliding-window group's table holds it for
#: the blocks that slid out of the window (SlidingWindowManager.remove_skipped_blocks).
_NULL_BLOCK = 0
#: KV cache spec classes (vllm/v1/kv_cache_interface.py) whose layers hold K and V per token in
#: pages, as kvtrie stores them. Sliding-window pages out of the window are freed (the null
#: block); a chunked-local layer's too.
_ATTENTION_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec",
                    "SinkFullAttentionSpec")


@dataclass(frozen=True)
class KvCacheGroup:
    """One of vLLM's KV cache groups (KVCacheConfig.kv_cache_groups[i]) as the connector uses
    it: its layers, its spec's class name and block size."""

    layer_names: Tuple[str, ...]
    kind: str
    block_size: Optional[int]
    sliding_window: Optional[int] = None  #: SlidingWindowSpec's window, in tokens


def kv_cache_groups(kv_cache_config: Any) -> List[KvCacheGroup]:
    """The KV cache groups of vLLM's ``kv_cache_config`` (empty without one), checked: every
    group must hold attention layers (:data:`_ATTENTION_SPECS`, or a subclass of vLLM's
    ``AttentionSpec``) of one block size. Mamba (and other state) groups, a group whose layers
    have different specs (``UniformTypeKVCacheSpecs``: extra caches beside attention, e.g.
    DeepSeek V3.2's indexer keys) and mixed block sizes are refused with a ValueError naming the
    group (issue 32 row 5)."""
    groups = list(_attr(kv_cache_config, "kv_cache_groups") or [])
    out: List[KvCacheGroup] = []
    for i, g in enumerate(groups):
        spec = _attr(g, "kv_cache_spec")
        kind = type(spec).__name__
        mro = {c.__name__ for c in type(spec).__mro__}
        if "MambaSpec" in mro or "Mamba" in kind:
            raise ValueError(
                f"kv_cache_groups[{i}]: {kind}: a Mamba (state space) layer group; the kvtrie "
                "connector stores attention KV per token and cannot load a Mamba state, so "
                "hybrid Mamba models are not supported (run without the connector)")
        if "UniformTypeKVCacheSpecs" in mro:
            raise ValueError(
                f"kv_cache_groups[{i}]: {kind}: layers with different cache specs in one group "
                "(an extra cache beside attention, e.g. an indexer's keys); the kvtrie connector "
                "stores only per-token K and V of attention layers")
        if "ChunkedLocalAttentionSpec" in mro:
            raise ValueError(
                f"kv_cache_groups[{i}]: {kind}: chunked local attention frees pages by chunk; "
                "the kvtrie connector handles full and sliding-window attention groups")
        if kind not in _ATTENTION_SPECS and "AttentionSpec" not in mro:
            raise ValueError(
                f"kv_cache_groups[{i}]: {kind}: not an attention KV cache; the kvtrie "
                f"connector stores the K and V pages of {', '.join(_ATTENTION_SPECS)} layers")
        bs = _attr(spec, "block_size")
        sw = _attr(spec, "sliding_window") if "SlidingWindowSpec" in mro else None
        out.append(KvCacheGroup(tuple(str(n) for n in (_attr(g, "layer_names") or ())), kind,
                                int(bs) if bs is not None else None,
                                int(sw) if sw else None))
    sizes = {g.block_size for g in out if g.block_size is not None}
    if len(sizes) > 1:
        raise ValueError(
            "kv_cache_groups: block sizes " + ", ".join(
                f"[{i}] {g.kind} {g.block_size}" for i, g in enumerate(out)) +
            " differ; the kvtrie connector addresses every layer's token t at block t // "
            "block_size, so all groups need one block size")
    return out


def kv_dtype_of(vllm_config: Any, cfg: Dict[str, Any]) -> Optional[str]:
    """The one-byte KV dtype the connector stores (``"fp8_e4m3"`` / ``"fp8_e5m2"``), or None
    for fp16 / bf16 / fp32 caches (stored as their tensors say). ``kv_dtype`` in the config,
    else vLLM's ``cache_config.cache_dtype``: ``fp8`` and ``fp8_e4m3`` are E4M3, ``fp8_e5m2``
    E5M2 (vLLM keeps both as uint8 pages). Other FP8 modes (``fp8_inc``, ``fp8_ds_mla``: other
    page formats) and FP8 with scales computed at run time (``calculate_kv_scales``: the same
    bytes would mean other values in another engine) are refused, naming the setting."""
    name = cfg.get("kv_dtype")
    field_name = "kv_dtype"
    if name is None:
        name = str(_attr(vllm_config, "cache_config", "cache_dtype") or "auto")
        field_name = "cache_dtype"
    name = str(name)
    if name in ("auto", "float16", "half", "bfloat16", "float", "float32", "fp16", "bf16",
                "fp32"):
        return None
    out = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
           "uint8": "uint8"}.get(name)
    if out is None:
        raise ValueError(f"{field_name}: {name!r}: the kvtrie connector stores fp16, bf16, fp32 "
                         "and fp8 / fp8_e4m3 / fp8_e5m2 KV caches (bit-exact), not this format")
    if out.startswith("fp8") and _attr(vllm_config, "cache_config", "calculate_kv_scales"):
        raise ValueError("calculate_kv_scales: True: FP8 KV scales computed at run time make "
                         "the same stored bytes mean other values in another engine; use the "
                         "checkpoint's scales (the default) with the kvtrie connector")
    return out


def _refuse_context_parallel(vllm_config: Any) -> None:
    """Decode / prefill context parallelism split a request's tokens (not heads) across
    ranks: no rank holds a prompt's whole KV, which kvtrie stores per prompt. Refused."""
    par = _attr(vllm_config, "parallel_config")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        n = getattr(par, name, 1) if par is not None else 1
        if n is not None and int(n) > 1:
            raise ValueError(f"{name}: {n}: the kvtrie connector does not support context "
                             "parallelism (each rank holds only some tokens' KV); run without "
                             f"it (--{name.replace('_size', '-size').replace('_', '-')} 1)")


# vLLM's SupportsHMA beside its base when it has one (object twice is no class).
_BASES: Tuple[type, ...] = (_Base,) if _HMA is object else (_Base, _HMA)


class KvtrieConnector(*_BASES):  # type: ignore[misc, valid-type]
    """kvtrie as a vLLM-style KV connector (see the module docstring for the call order).

    Hybrid-aware (vLLM's ``SupportsHMA``): with the hybrid allocator's KV cache groups (full and
    sliding-window attention, one block size) vLLM calls :meth:`request_finished_all_groups`
    and hands every group's blocks; each layer is loaded into and saved from its group's pages
    (a sliding-window layer's pages that slid out of the window are vLLM's null block: not
    loaded into; a save that would need one is dropped). Mamba groups, extra non-attention
    caches and mixed block sizes are refused at startup (:func:`kv_cache_groups`)."""

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
            cache = getattr(vllm_config, "cache_config", None)
            if getattr(cache, "block_size", None):
                cfg.setdefault("block_size", int(cache.block_size))
            # num_blocks only when configured: a tensor sized otherwise (hybrid allocators)
            # must not stop the worker; block_size alone tells the layouts apart.
        self._role_value = role if role is not None else KVConnectorRole.WORKER
        scheduler = self._role_value == KVConnectorRole.SCHEDULER
        _refuse_context_parallel(vllm_config)
        # Hybrid models (issue 32 row 5): vLLM's KV cache groups; more than one only when the
        # hybrid allocator is on, which vLLM keeps on for a SupportsHMA connector such as this.
        self._groups = kv_cache_groups(kv_cache_config)
        self._hybrid = len(self._groups) > 1
        # FP8 caches (row 3): stored bit-exact as one-byte KV (kvtrie's DTYPE_FP8_*).
        self._kv_dtype = kv_dtype_of(vllm_config, cfg)
        self._block_tokens = int(cfg.get("block_tokens", 16))
        self._base_model = str(cfg.get("model_id", ""))
        if vllm_config is not None and _bool(cfg.get("fingerprint", True), "fingerprint"):
            fp, fields = kv_fingerprint(vllm_config, self._block_tokens,
                                        cfg.get("fingerprint_extra"))
            self._base_model += "~" + fp
            log.info("kvtrie model_id %s: the KV fingerprint %s of %s", self._base_model, fp,
                     fields)
        kt = _attr(vllm_config, "kv_transfer_config")
        self._kv_role = str(cfg.get("kv_role", getattr(kt, "kv_role", None) or "kv_both"))
        if self._kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"kv_role: {self._kv_role!r} is not kv_both, kv_producer or "
                             "kv_consumer")
        self._loads_kv = self._kv_role != "kv_producer"  # a producer only saves
        self._saves_kv = self._kv_role != "kv_consumer"  # a consumer only loads
        # vLLM's KVTransferConfig.kv_load_failure_policy ("fail" unless set): under "fail" a
        # promised load that fails fails the request (vLLM's scheduler, _handle_invalid_blocks).
        self._failure_policy = str(cfg.get(
            "kv_load_failure_policy", getattr(kt, "kv_load_failure_policy", None) or "fail"))
        self._lease_seconds = int(cfg.get("lease_seconds", 30))
        if self._lease_seconds < 0:
            raise ValueError(f"lease_seconds: {self._lease_seconds} is not >= 0")
        if vllm_config is not None and self._loads_kv and self._failure_policy == "fail":
            log.warning(
                "kvtrie: kv_load_failure_policy is 'fail': a request whose promised KV cannot "
                "be loaded (deleted after its lookup, a lease of %d s expired, the server "
                "unreachable) FAILS instead of being recomputed. Set "
                "--kv-transfer-config '{..., \"kv_load_failure_policy\": \"recompute\"}' "
                "unless failing is what you want.", self._lease_seconds)
        self._epoch = int(cfg.get("cache_epoch", 0))  # reset_cache bumps it (scheduler side)
        self._model_suffix = _parallel_suffix(cfg, vllm_config, scheduler)
        self._split = "@" in self._model_suffix  # more than one rank computes each step
        self._first_rank = all(p[2:].startswith("0of") for p in self._model_suffix.split("@")[1:])
        self._cfg = cfg
        self._num_blocks = int(cfg["num_blocks"]) if cfg.get("num_blocks") else None
        self._engine_block_size = int(cfg["block_size"]) if cfg.get("block_size") else None
        self._kv_layout = KvLayout(cfg["kv_layout"]) if cfg.get("kv_layout") else None
        self._client = client or _make_client(
            {**cfg, "model_id": self._base_model + self._model_suffix}, self._block_tokens)
        self._clients: Dict[str, Any] = {"": self._client}  # identity -> client (_lock)
        self._encoding = cfg.get("encoding", "lossless")
        if self._kv_dtype is not None and str(self._encoding) not in ("lossless", "raw"):
            raise ValueError(f"encoding: {self._encoding!r} is lossy; {self._kv_dtype} KV caches "
                             "are stored bit-exact: 'lossless' (the default) or 'raw'")
        self._encode_on_client = _bool(cfg.get("encode_on_client", True), "encode_on_client")
        self._target_rel_rms = float(cfg.get("target_rel_rms", 0.0))
        self._get_mode = cfg.get("get_mode", "reconstructed")
        self._async_load = _bool(cfg.get("async_load", False), "async_load")
        if self._hybrid and self._async_load:
            raise ValueError(
                f"async_load: true with {len(self._groups)} KV cache groups: vLLM's scheduler "
                "finishes an asynchronous load of one group only (Scheduler."
                "_update_waiting_for_remote_kv unpacks one group's block ids); leave it false")
        if self._hybrid and vllm_config is not None and self._loads_kv:
            log.warning(
                "kvtrie: %d KV cache groups (%s): a load that fails cannot be reported to vLLM "
                "(its scheduler's _update_requests_with_invalid_blocks takes one group), so it "
                "is logged and counted (unreported_load_failures) and the request computes "
                "over the missing KV; the lookup's lease (lease_seconds=%d) protects the "
                "prefix until the load.", len(self._groups),
                ", ".join(g.kind for g in self._groups), self._lease_seconds)
        self._save_generated = _bool(cfg.get("save_generated", True), "save_generated")
        # KV cache events for routers: on when vLLM publishes KV events (--kv-events-config
        # enable_kv_cache_events), else as configured. Only the first rank reports (ranks
        # commit at their own pace; vLLM's aggregator keeps only events every reporting worker
        # sent in the same step).
        self._kv_events = _bool(cfg.get("kv_events", bool(_attr(
            vllm_config, "kv_events_config", "enable_kv_cache_events"))), "kv_events")
        self._load_layer_groups = int(cfg.get("load_layer_groups", 1))
        if self._load_layer_groups < 1:
            raise ValueError(f"load_layer_groups: {self._load_layer_groups} is not >= 1")
        self._layerwise = _bool(cfg.get("layerwise", True), "layerwise")
        self._async_lookup = _bool(cfg.get("async_lookup", True), "async_lookup")
        self._min_load_tokens = int(cfg.get("min_load_tokens", 0))
        if self._min_load_tokens < 0:
            raise ValueError(f"min_load_tokens: {self._min_load_tokens} is not >= 0")
        lookup_threads = int(cfg.get("lookup_threads", 4))
        if lookup_threads < 1:
            raise ValueError(f"lookup_threads: {lookup_threads} is not >= 1")
        # Scheduler side.
        self._tracked: Dict[str, _Tracked] = {}
        self._matched: Dict[str, Tuple[int, int, int]] = {}  # req -> (local hit, ext, stored)
        self._saving: Set[str] = set()  # requests a save was scheduled for (request_finished)
        # Lookups in flight or answered, per request until it is admitted or finished (the
        # scheduler thread only; the futures run on _lookup_pool).
        self._lookups: Dict[str, concurrent.futures.Future] = {}
        self._lookup_pool = concurrent.futures.ThreadPoolExecutor(lookup_threads, "kvtrie-lookup")
        # Worker side.
        self._meta: Optional[KvtrieConnectorMetadata] = None
        self._caches: Dict[str, Any] = {}  # layer name -> canonical view (register_kv_caches)
        self._layer_index: Dict[str, int] = {}
        self._names: List[str] = []
        self._loader = concurrent.futures.ThreadPoolExecutor(1, "kvtrie-load")
        self._saver = concurrent.futures.ThreadPoolExecutor(1, "kvtrie-save")
        self._committer = concurrent.futures.ThreadPoolExecutor(1, "kvtrie-commit")
        self._layer_loaded: List[threading.Event] = []
        self._load_future: Optional[concurrent.futures.Future] = None
        self._lock = threading.Lock()
        self._load_errors: Set[int] = set()  # guarded by _lock
        self._failed_loads: Set[str] = set()  # req ids whose load failed this step (_lock)
        self._loaded_ok: Dict[str, int] = {}  # req id -> end of its last load's KV (_lock)
        self._saves: Dict[str, Any] = {}  # req id -> PutStream (saver thread only)
        self._save_failed: Set[str] = set()  # req ids with a failed layer save (saver thread)
        self._save_bytes: Dict[str, int] = {}  # req id -> dense bytes gathered (saver thread)
        self._save_futures: List[concurrent.futures.Future] = []
        self._saved_layers: Set[int] = set()  # layers save_kv_layer was called for this step
        self._commits: Dict[str, List[concurrent.futures.Future]] = {}  # req -> commits in flight
        self._finishing: Set[str] = set()  # finished requests with saves, not yet reported
        self._async_loader = concurrent.futures.ThreadPoolExecutor(1, "kvtrie-async-load")
        self._received: Set[str] = set()  # asynchronous loads done, not yet reported (_lock)
        self.stats: Dict[str, int] = {  # updated under _lock; see get_kv_connector_stats
            "lookups": 0, "lookup_hits": 0, "loaded_tokens": 0, "loaded_bytes": 0,
            "load_failed_tokens": 0, "load_failures": 0, "saved_blocks": 0, "saved_bytes": 0,
            "save_errors": 0, "leases": 0, "failed_requests": 0, "unreported_load_failures": 0}
        self._reported: Dict[str, int] = dict(self.stats)  # stats at the last get_kv_connector_stats
        self._events: List[Any] = []  # worker: KV events since the last report (_lock)
        self._sched_events: Optional[KvtrieKVEvents] = None  # scheduler: the workers' events
        self._cleared = False  # scheduler: reset_cache since the last take_events

    @property
    def role(self) -> Any:
        return self._role_value

    def _client_for(self, identity: str) -> Any:
        """The client of the model_id ``model_id + identity + rank suffix`` (created once)."""
        with self._lock:
            c = self._clients.pop(identity, None)
            if c is None:
                if len(self._clients) >= _MAX_IDENTITIES:  # drop the least recently used
                    del self._clients[next(k for k in self._clients if k)]
                model = self._base_model + identity + self._model_suffix
                c = _make_client({**self._cfg, "model_id": model}, self._block_tokens)
            self._clients[identity] = c  # most recently used last
            return c

    # ---------------- scheduler side ----------------

    def _identity(self, request: Any) -> str:
        """The request's key beyond its tokens (:func:`request_identity`) and, after
        :meth:`reset_cache`, the cache epoch: folded into the model_id of its lookups, loads
        and saves (it travels to the workers in the metadata)."""
        return request_identity(request) + (f".e{self._epoch}" if self._epoch else "")

    def _lookup(self, identity: str, prompt: List[int]) -> Tuple[int, float]:
        """``(stored prefix of prompt in tokens, when)``: 0 when the server cannot be reached.
        With ``lease_seconds`` a hit is leased: the prefix is pinned for that long (the server's
        Pin with a TTL) so it is not evicted before the worker loads it; a prefix gone before
        the pin is a miss (never promise what is not held)."""
        t = time.monotonic()
        client = self._client_for(identity)
        try:
            matched = int(client.lookup(prompt))
        except Error as e:
            log.warning("kvtrie lookup failed, computing instead: %s", e)
            return 0, t
        with self._lock:
            self.stats["lookups"] += 1
        bt = self._block_tokens
        if self._lease_seconds and matched >= bt and self._loads_kv:
            try:
                _lease(client, prompt[:matched // bt * bt], self._lease_seconds)
                with self._lock:
                    self.stats["leases"] += 1
            except Error as e:
                if e.code == StatusCode.NOT_FOUND:  # gone since the lookup: a miss
                    return 0, t
                if e.code in (StatusCode.PERMISSION_DENIED, StatusCode.UNAUTHENTICATED,
                              StatusCode.UNIMPLEMENTED):  # never allowed: said once
                    log.warning("kvtrie: leasing looked-up prefixes failed (%s): leases are "
                                "off; a prefix evicted before its load fails under policy "
                                "'fail'", e)
                    self._lease_seconds = 0
                else:  # this prefix unleased: its load may still fail (then said per request)
                    log.info("kvtrie: no lease on a looked-up prefix: %s", e)
        return matched, t

    def _start_lookup(self, request: Any) -> Optional[concurrent.futures.Future]:
        prompt = _prompt(request)
        if prompt is None or _skips_reading(request):
            return None
        req_id = str(request.request_id)
        f = self._lookups.get(req_id)
        if f is not None and f.done() and self._lease_seconds and (
                time.monotonic() - f.result()[1] > self._lease_seconds / 2):
            f = None  # answered long ago (waiting for pages): its lease may lapse, ask anew
        if f is None:
            f = self._lookups[req_id] = self._lookup_pool.submit(
                self._lookup, self._identity(request), prompt)
        return f

    def on_new_request(self, request: Any) -> None:
        """vLLM calls this when a request enters the waiting queue: its lookup starts now, on a
        lookup thread (``async_lookup``), so it is usually answered by the time the scheduler
        reaches the request."""
        if self._async_lookup and self._loads_kv:
            self._start_lookup(request)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` (the engine's local prefix-cache hit) that
        kvtrie holds under the request's identity (block-aligned, at most all but the last prompt
        token, which the engine computes for its logits; 0 below ``min_load_tokens``).
        ``(0, False)`` when the server cannot be reached, the request has no token ids
        (``prompt_token_ids=None``, prompt embeddings) or sets ``skip_reading_prefix_cache``
        (vLLM: ``prompt_logprobs``, pooling): a miss, never an error.

        With ``async_lookup`` (the default) this never waits on the network: the first call
        (or :meth:`on_new_request`) starts the Lookup on a lookup thread and returns ``(None,
        False)`` until it is answered; vLLM's scheduler then skips the request for this step and
        asks again in the next (Scheduler.schedule: ``if ext_tokens is None``). The answer is
        kept for the request until it is allocated (:meth:`update_state_after_alloc`), so the
        steps it waits for pages ask no more. ``async_lookup: false``: one blocking Lookup per
        call, in the scheduler's loop.

        The second value is True for a load with ``async_load`` on: the engine waits for the
        request's id in :meth:`get_finished`'s second set before it schedules it; off (the
        default) loads run within the step, layer by layer, overlapping the forward pass."""
        prompt = _prompt(request)
        if prompt is None or _skips_reading(request) or not self._loads_kv:
            return 0, False
        if self._async_lookup:
            f = self._start_lookup(request)
            assert f is not None
            if not f.done():
                return None, False
            matched = f.result()[0]
        else:
            matched = self._lookup(self._identity(request), prompt)[0]
        stored = matched // self._block_tokens
        matched = min(matched, len(prompt) - 1)
        ext = max(0, matched - int(num_computed_tokens))
        if ext < self._min_load_tokens:
            ext = 0
        if ext > 0:
            with self._lock:
                self.stats["lookup_hits"] += 1
        self._matched[str(request.request_id)] = (int(num_computed_tokens), ext, stored)
        return ext, self._async_load and ext > 0

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Remembers the request's blocks (vLLM passes all of them: the local hit's and the new
        ones) and the tokens to load into them: ``[L, L + num_external_tokens)`` where L is the
        local hit given to :meth:`get_num_new_matched_tokens`. Called again when a preempted
        request is resumed: its page list is replaced, not appended to; and after an
        asynchronous load, with ``num_external_tokens`` 0."""
        prompt = _prompt(request)
        if prompt is None:
            return
        req_id = str(request.request_id)
        matched = self._matched.pop(req_id, None)
        self._lookups.pop(req_id, None)  # admitted: a resumption after preemption asks anew
        t = self._tracked.get(req_id)
        if t is None:
            t = self._tracked[req_id] = _Tracked(request, self._identity(request))
        t.request = request
        t.block_ids = _block_ids(blocks)
        t.groups = _group_block_ids(blocks) if self._hybrid else []
        local = int(request.num_computed_tokens)
        if matched is not None:
            local, _, t.stored_blocks = matched
            t.saved_blocks = t.stored_blocks
        t.last_end = 0  # admitted (again): computing from its hits on
        ext = int(num_external_tokens)
        t.load_begin, t.load_end = (local, local + ext) if ext > 0 else (0, 0)
        t.async_load = self._async_load and ext > 0

    def build_connector_meta(self, scheduler_output: Any) -> KvtrieConnectorMetadata:
        """This step's loads (from update_state_after_alloc) and saves. The page lists follow
        the SchedulerOutput: a new request's ``block_ids``, a running one's
        ``scheduled_cached_reqs.new_block_ids`` appended (chunked prefill allocates per chunk),
        or replacing the list when it is in ``resumed_req_ids`` (``resumed_from_preemption`` in
        older vLLM). Saves are incremental: each step saves the kvtrie blocks its computed tokens
        completed (a chunk of a chunked prefill; with ``save_generated``, the default, decode
        steps too, the generated tokens included, so a conversation's next turn, whose prompt is
        this one's prompt and output, hits them), each a Put from the first block not stored or
        saved before (committed after the step, in order, on the commit thread). A step that goes
        back (a recompute after a load error) saves again from there. With more than one rank
        (TP / PP), a step that also loaded saves nothing: a load that failed on one rank makes
        the KV every rank computed in that step wrong, and no rank knows of the others' failures;
        its blocks are saved by the request's next step, if that step was not discarded (so a
        request that loads and finishes in one step is not saved). Resets the pending loads."""
        scheduled: Dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", {}))
        computed: Dict[str, int] = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or []:
            t = self._tracked.get(str(new.req_id))
            if t is not None:
                t.block_ids = _block_ids(new.block_ids)
                t.groups = _group_block_ids(new.block_ids) if self._hybrid else []
                computed[t.request.request_id] = int(new.num_computed_tokens)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", None) or ())
            flags = getattr(cached, "resumed_from_preemption", None) or []
            for i, req_id in enumerate(cached.req_ids):
                t = self._tracked.get(str(req_id))
                if t is None:
                    continue
                ids = _block_ids(cached.new_block_ids[i])
                groups = _group_block_ids(cached.new_block_ids[i]) if self._hybrid else []
                if req_id in resumed or (i < len(flags) and flags[i]):
                    t.block_ids = ids
                    t.groups = groups
                else:
                    t.block_ids = t.block_ids + ids
                    if groups:  # (None: no new blocks in any group)
                        t.groups = [old + new for old, new in zip(
                            t.groups or [[] for _ in groups], groups)]
                computed[str(req_id)] = int(cached.num_computed_tokens[i])
        meta = KvtrieConnectorMetadata()
        bt = self._block_tokens
        for req_id, t in self._tracked.items():
            if req_id not in scheduled and t.load_end == 0:
                continue
            n_prompt = len(t.request.prompt_token_ids)
            n_tokens = _num_tokens(t.request, n_prompt) if self._save_generated else n_prompt
            begin = computed.get(req_id, int(t.request.num_computed_tokens))
            end = begin + scheduled.get(req_id, 0)
            save = 0
            if req_id in scheduled:
                if begin < t.last_end:  # the engine went back (a load error): save again
                    t.saved_blocks = min(t.saved_blocks, begin // bt)
                t.last_end = end
                done = min(end, n_tokens) // bt  # kvtrie blocks whose KV exists after it
                if (self._saves_kv and done > t.saved_blocks
                        and not (t.load_end and self._split)):  # see the docstring
                    save = done * bt
            if t.load_end or save:  # the token ids only now (a decode step saves 1 in bt)
                tokens = _prompt(t.request)
                if save > len(tokens):
                    tokens = _all_tokens(t.request, tokens)[:save]
                meta.requests.append(RequestMeta(
                    req_id, tokens, list(t.block_ids), t.load_begin, t.load_end, save,
                    t.saved_blocks, t.identity, t.async_load, [list(g) for g in t.groups],
                    self._valid_from(begin) if t.groups else []))
            if save:
                self._saving.add(req_id)
                t.saved_blocks = save // bt
            t.load_begin = t.load_end = 0
        return meta

    def _valid_from(self, computed: int) -> List[int]:
        """Per group, the first token whose page a step starting at ``computed`` still holds:
        vLLM frees a sliding-window group's pages whose tokens are all before ``computed -
        window + 1`` (SlidingWindowManager.get_num_skipped_tokens / remove_skipped_blocks,
        called from allocate_slots with the tokens computed before the step)."""
        out = []
        for g in self._groups:
            bs = g.block_size or self._engine_block_size or 1
            skipped = max(0, computed - g.sliding_window + 1) if g.sliding_window else 0
            out.append(skipped // bs * bs)
        return out

    def request_finished(self, request: Any,
                         block_ids: Sequence[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Forgets the request. Returns ``(True, None)`` when a save of it was scheduled: the
        workers commit saves after the step, so the engine keeps its blocks until
        :meth:`get_finished` reports the request; else ``(False, None)``."""
        req_id = str(request.request_id)
        self._tracked.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._lookups.pop(req_id, None)
        saving = req_id in self._saving
        self._saving.discard(req_id)
        return saving, None

    def request_finished_all_groups(self, request: Any, block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM's ``SupportsHMA`` hook, called instead of :meth:`request_finished` once the
        request finished in every KV cache group (vllm/v1/core/sched/scheduler.py,
        Scheduler._connector_finished), with every group's blocks: the same answer (the
        workers keep every group's pages until :meth:`get_finished` reports the request)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """The engine's paged caches by layer name, in model order (layer i = kvtrie layer i),
        torch tensors (fp16, bf16, fp32) or numpy arrays in any :class:`KvLayout`, detected from
        the shape and the declared ``num_blocks`` / ``block_size`` (ValueError otherwise)."""
        self._layouts: Dict[str, KvLayout] = {}
        self._caches = {}
        group_of = {n: i for i, g in enumerate(self._groups) for n in g.layer_names}
        self._layer_group: List[int] = []
        for name, cache in kv_caches.items():
            dtype = str(getattr(cache, "dtype", ""))
            one_byte = any(d in dtype for d in ("int8", "float8"))  # vLLM's fp8 pages: uint8
            if one_byte and self._kv_dtype is None:
                raise ValueError(f"kv_caches[{name!r}]: dtype {dtype}: a one-byte (FP8) cache, "
                                 "but no FP8 KV dtype is configured (vLLM's --kv-cache-dtype "
                                 "fp8 / fp8_e4m3 / fp8_e5m2, or kv_dtype in the config)")
            if not one_byte and self._kv_dtype is not None:
                raise ValueError(f"kv_caches[{name!r}]: dtype {dtype}: kv_dtype is "
                                 f"{self._kv_dtype}, which vLLM keeps in uint8 pages")
            if "int8" in dtype and "uint8" not in dtype:
                raise ValueError(f"kv_caches[{name!r}]: dtype {dtype}: signed int8 pages are "
                                 "not vLLM's FP8 layout (uint8 or float8)")
            if self._groups:
                if name not in group_of:
                    raise ValueError(
                        f"kv_caches[{name!r}]: in no KV cache group "
                        f"({', '.join(g.kind for g in self._groups)}): an extra cache beside "
                        "the attention layers' K and V, which the kvtrie connector cannot store")
                self._layer_group.append(group_of[name])
            else:
                self._layer_group.append(0)
            layout = self._kv_layout or detect_layout(cache.shape, self._num_blocks,
                                                      self._engine_block_size)
            self._layouts[name] = layout
            self._caches[name] = canonical(cache, layout)
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

    def _page_size(self) -> int:
        return int(next(iter(self._caches.values())).shape[2])

    def _slots(self, block_ids: Sequence[int], begin: int, end: int):
        bs = self._page_size()
        t = np.arange(begin, end)
        return np.asarray(block_ids, dtype=np.int64)[t // bs], t % bs

    def _pages(self, r: RequestMeta, layer: int) -> List[int]:
        """The request's pages of ``layer``'s KV cache group (hybrid models), else its pages."""
        if r.group_block_ids:
            return r.group_block_ids[self._layer_group[layer]]
        return r.block_ids

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts this step's loads on the loader thread and returns at once (asynchronous
        loads on their own thread, for requests this step does not compute)."""
        meta = self._get_connector_metadata()
        for r in meta.requests:
            if r.load_tokens > 0 and r.async_load:
                self._async_loader.submit(self._load_async, r)
        loads = [r for r in meta.requests if r.load_tokens > 0 and not r.async_load]
        self._layer_loaded = [threading.Event() for _ in self._names]
        with self._lock:
            self._failed_loads = set()
        if not loads:
            for e in self._layer_loaded:
                e.set()
            self._load_future = None
            return
        self._load_future = self._loader.submit(self._load, loads, self._layer_loaded)
        if not self._layerwise:  # no wait_for_layer_load will come (full CUDA graphs)
            self._load_future.result()

    def _layer_groups(self) -> List[Tuple[int, int]]:
        """The layer ranges a load is fetched in, in layer order (``load_layer_groups``)."""
        n = len(self._names)
        g = 1 if self._get_mode == "residual" else max(1, min(self._load_layer_groups, n))
        bounds = [round(i * n / g) for i in range(g + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(g)]

    def _load(self, loads: List[RequestMeta], events: List[threading.Event]) -> None:
        # Per request: tokens delivered by every group so far (None: no group yet), and whether
        # the Gets went wrong. A later group may find fewer blocks (evicted meanwhile): the load
        # ends where the shortest group ended; the longer groups' extra tokens are written but
        # reported failed, so the engine recomputes (overwrites) them.
        got: Dict[int, Optional[int]] = {i: None for i in range(len(loads))}
        groups = self._layer_groups()
        whole = len(groups) == 1
        try:
            for lb, le in groups:
                fetched = []  # (request, k, v, end of the KV delivered) of this group
                for i, r in enumerate(loads):
                    bt = self._block_tokens
                    want = (r.load_end + bt - 1) // bt * bt
                    if got[i] is not None:
                        want = min(want, got[i])  # no more than the earlier groups delivered
                    k = v = None
                    n = 0
                    if want > r.load_begin:
                        try:
                            k, v, n = self._client_for(r.identity).get(
                                r.token_ids[:want], mode=self._get_mode,
                                **({} if whole else {"layers": (lb, le)}))
                            check_dtype(k, next(iter(self._caches.values())))
                        except (Error, ValueError) as e:
                            log.warning("kvtrie load of %s failed, recomputing: %s", r.req_id, e)
                            k = v = None
                            n = 0
                    got[i] = n if got[i] is None else min(got[i], n)  # block-aligned
                    fetched.append((r, k, v, max(r.load_begin, min(n, r.load_end))))
                for layer in range(lb, le):
                    cache = self._caches[self._names[layer]]
                    for r, k, v, n in fetched:
                        if n <= r.load_begin:
                            continue
                        b, o = self._slots(self._pages(r, layer), r.load_begin, n)
                        kl = 0 if whole else lb
                        kk = k[layer - kl, :, r.load_begin:n].transpose(1, 0, 2)
                        vv = v[layer - kl, :, r.load_begin:n].transpose(1, 0, 2)
                        if r.group_block_ids:  # a sliding window's slid-out pages: the null
                            live = b != _NULL_BLOCK  # block, never written (vLLM skips them)
                            b, o, kk, vv = b[live], o[live], kk[live], vv[live]
                        write(cache, 0, b, o, kk)
                        write(cache, 1, b, o, vv)
                    events[layer].set()
            for i, r in enumerate(loads):
                n = max(r.load_begin, min(got[i] or 0, r.load_end))
                self._account_load(r, n, self._token_bytes() * (n - r.load_begin))
        except BaseException:
            for i, r in enumerate(loads):  # whatever was written is reported failed
                self._account_load(r, r.load_begin, 0)
            raise
        finally:
            for e in events:  # never leave a layer waiting, whatever happened
                e.set()

    def _token_bytes(self) -> int:
        """Bytes of one token's K and V over all layers of the registered caches."""
        total = 0
        for c in self._caches.values():
            heads, dim = int(c.shape[3]), int(c.shape[4])
            total += 2 * heads * dim * int(getattr(c, "itemsize", 0) or c.element_size())
        return total

    def _load_async(self, r: RequestMeta) -> None:
        try:
            self._load([r], [threading.Event() for _ in self._names])
        finally:  # its failed blocks are recorded before the id is reported
            with self._lock:
                self._received.add(r.req_id)

    def _account_load(self, r: RequestMeta, n: int, nbytes: int) -> None:
        bs = self._page_size()
        with self._lock:
            self._loaded_ok[r.req_id] = n
            if n < r.load_end and r.group_block_ids:
                # Hybrid: vLLM's scheduler cannot take load errors of more than one group
                # (_update_requests_with_invalid_blocks unpacks one), so none is reported.
                self.stats["unreported_load_failures"] += 1
            elif n < r.load_end:
                first, last = n // bs, (r.load_end - 1) // bs
                self._load_errors.update(int(b) for b in r.block_ids[first:last + 1])
                self._failed_loads.add(r.req_id)
                self.stats["load_failures"] += 1
                if self._failure_policy == "fail":
                    self.stats["failed_requests"] += 1
                if self._kv_events and self._first_rank:  # the blocks are gone: routers learn it
                    bt = self._block_tokens
                    self._events.append(removed_event(self._base_model + r.identity, r.token_ids,
                                                      bt, n // bt, -(-r.load_end // bt)))
            self.stats["loaded_tokens"] += n - r.load_begin
            self.stats["loaded_bytes"] += nbytes
            self.stats["load_failed_tokens"] += r.load_end - n
        if n < r.load_end and r.group_block_ids:
            log.error("kvtrie: request %s: only %d of the %d promised tokens [%d, %d) could be "
                      "loaded; with %d KV cache groups vLLM cannot be told (its scheduler takes "
                      "load errors of one group), so this request computes over missing KV "
                      "from token %d", r.req_id, n - r.load_begin, r.load_end - r.load_begin,
                      r.load_begin, r.load_end, len(r.group_block_ids), n)
        elif n < r.load_end and self._failure_policy == "fail":
            log.error("kvtrie: request %s: only %d of the %d promised tokens [%d, %d) could be "
                      "loaded (evicted or deleted after the lookup, or the server unreachable); "
                      "kv_load_failure_policy is 'fail', so vLLM FAILS this request. With "
                      "'recompute' it would be recomputed from token %d.", r.req_id,
                      n - r.load_begin, r.load_end - r.load_begin, r.load_begin, r.load_end, n)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Blocks until this layer's KV of this step's loads is in the paged cache."""
        if self._layer_loaded:
            self._layer_loaded[self._layer_index[layer_name]].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Queues this layer of this step's saves; the saver thread gathers it from the paged
        cache (the layer registered under ``layer_name``; ``kv_layer`` is the same tensor) and,
        with ``encode_on_client`` off, sends it while the engine computes the next layer."""
        self._queue_layer_saves(self._layer_index[layer_name])

    def _queue_layer_saves(self, layer: int) -> None:
        self._saved_layers.add(layer)
        cache = self._caches[self._names[layer]]
        for r in self._get_connector_metadata().requests:
            if r.save_tokens > 0:
                self._save_futures.append(self._saver.submit(self._save_layer, r, layer, cache))

    def _first_block(self, r: RequestMeta) -> int:
        with self._lock:
            ok = self._loaded_ok.get(r.req_id)
        return r.stored_blocks if ok is None else min(r.stored_blocks, ok // self._block_tokens)

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
            client = self._client_for(r.identity)
            # A Put encoded here copies arrays as wide as the whole prefix (the unsent blocks
            # before `first` too; a copy is ~5x faster than encoding): for a block or two after
            # a long stored prefix (a decode step's block) far more than encoding them. Such a
            # save goes dense on a layer-wise Put instead (the server encodes the new blocks).
            new_blocks = r.save_tokens // self._block_tokens - first
            if self._encode_on_client and first <= _MAX_UNSENT_PER_NEW_BLOCK * new_blocks:
                s = _EncodedSave(client, r.token_ids[:r.save_tokens], len(self._names),
                                 first, self._block_tokens, self._encoding, self._target_rel_rms,
                                 self._kv_dtype)
            else:
                s = client.put_layers(r.token_ids[:r.save_tokens], len(self._names),
                                      encoding=self._encoding,
                                      target_rel_rms=self._target_rel_rms, first_block=first,
                                      kv_dtype=self._kv_dtype)
            self._saves[r.req_id] = s
        begin = first * self._block_tokens
        b, o = self._slots(self._pages(r, layer), begin, r.save_tokens)
        g = self._layer_group[layer]
        if r.group_valid_from and begin < r.group_valid_from[g]:
            raise ValueError(
                f"layer {layer} ({self._groups[g].kind}): the save [{begin}, {r.save_tokens}) "
                f"starts before token {r.group_valid_from[g]}, whose pages slid out of the "
                "window (vLLM freed them): not saved")
        if r.group_block_ids and (b == _NULL_BLOCK).any():
            raise ValueError(
                f"layer {layer} ({self._groups[self._layer_group[layer]].kind}): tokens "
                f"{int(begin + np.argmax(b == _NULL_BLOCK))}.. of the save [{begin}, "
                f"{r.save_tokens}) slid out of its window (vLLM freed their pages): not saved")
        k = np.ascontiguousarray(read(kv_layer, 0, b, o).transpose(1, 0, 2))
        v = np.ascontiguousarray(read(kv_layer, 1, b, o).transpose(1, 0, 2))
        s.write(layer, k, v, token_offset=begin)
        self._save_bytes[r.req_id] = self._save_bytes.get(r.req_id, 0) + k.nbytes + v.nbytes

    def _commit(self, req_id: str, s: Any, nbytes: int, event: Optional[Tuple] = None) -> None:
        try:
            result = s.commit()
            with self._lock:
                self.stats["saved_blocks"] += result.blocks_stored
                self.stats["saved_bytes"] += nbytes
                if event is not None:  # (key, tokens, first block, end block): now stored
                    self._events.append(stored_event(event[0], event[1], self._block_tokens,
                                                     event[2], event[3]))
        except Exception as e:  # noqa: BLE001 - any failure of a save is a future miss only
            with self._lock:
                self.stats["save_errors"] += 1
            log.warning("kvtrie save of %s failed (a future miss, nothing else): %r", req_id, e)

    def wait_for_save(self) -> None:
        """Blocks until this step's saves are gathered out of the paged cache (so its pages may
        be reused after the step), then commits them (encode, send, store) on the commit thread
        after the step: :meth:`get_finished` reports a finished request once its commits are
        done. A failed save is logged and counted (``stats["save_errors"]``), never raised: it
        only costs a future cache miss."""
        if self._load_future is not None:
            self._load_future.result()  # the save decision needs the load outcome
        if self._meta is not None:
            # Layers whose save_kv_layer did not come (full CUDA graphs replay attention
            # without the hook; custom attention may skip it): gathered now, after the forward
            # pass wrote them, so a save is never dropped for a missing layer.
            for layer in range(len(self._names)):
                if layer not in self._saved_layers:
                    self._queue_layer_saves(layer)
        self._saved_layers = set()
        futures, self._save_futures = self._save_futures, []
        for f in futures:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - never raised: the save is dropped, counted
                with self._lock:
                    self.stats["save_errors"] += 1
                log.warning("kvtrie save failed (a future miss, nothing else): %r", e)
        saves, self._saves = self._saves, {}
        save_failed, self._save_failed = self._save_failed, set()
        save_bytes, self._save_bytes = self._save_bytes, {}
        metas = {r.req_id: r for r in self._meta.requests} if self._meta is not None else {}
        for req_id, s in saves.items():
            with self._lock:
                failed = req_id in self._failed_loads
            if failed or req_id in save_failed:  # a failed layer is counted in save_errors
                s.cancel()
                continue
            event = None
            r = metas.get(req_id)
            if self._kv_events and self._first_rank and r is not None:
                event = (self._base_model + r.identity, r.token_ids[:r.save_tokens],
                         self._first_block(r), r.save_tokens // self._block_tokens)
            fut = self._committer.submit(self._commit, req_id, s, save_bytes.get(req_id, 0),
                                         event)
            with self._lock:
                # Its load's end no longer bounds the next saves (they begin where this ends).
                self._loaded_ok.pop(req_id, None)
                self._commits.setdefault(req_id, []).append(fut)
        meta = self._meta
        for r in meta.requests if meta is not None else []:
            if r.save_tokens > 0:
                with self._lock:
                    self._commits.setdefault(r.req_id, [])

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Block ids whose KV could not be loaded since the last call (then cleared): under
        vLLM's ``kv_load_failure_policy="recompute"`` the engine recomputes from the first of
        them; under the default ``"fail"`` vLLM fails those requests."""
        if self._load_future is not None:
            self._load_future.result()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]],
                                                                   Optional[Set[str]]]:
        """``(finished saving, finished loading)``: the requests of ``finished_req_ids`` (this
        call's or an earlier one's) a save was scheduled for, once all their commits are done
        (the engine then frees their blocks: :meth:`request_finished` returned True for exactly
        these); and the requests whose asynchronous load is done (its failed blocks are in
        :meth:`get_block_ids_with_load_errors` by then). ``None`` for an empty set."""
        done: Set[str] = set()
        with self._lock:
            received, self._received = self._received, set()
            self._finishing.update(r for r in finished_req_ids if r in self._commits)
            for r in finished_req_ids:
                if r not in self._commits:
                    self._loaded_ok.pop(r, None)
            for req_id in list(self._finishing):
                if all(f.done() for f in self._commits[req_id]):
                    done.add(req_id)
                    self._finishing.discard(req_id)
                    del self._commits[req_id]
                    self._loaded_ok.pop(req_id, None)
        return (done or None), (received or None)

    def get_kv_connector_stats(self) -> Optional[KvtrieConnectorStats]:
        """The counters since the last call, or None when all are 0: on the scheduler
        ``lookups`` and ``lookup_hits`` (an external hit beyond the local one); on a worker
        ``loaded_tokens`` / ``loaded_bytes`` (dense KV written into the paged cache),
        ``load_failed_tokens`` / ``load_failures`` (requests), ``saved_blocks`` (stored, not
        deduplicated), ``saved_bytes`` (dense KV gathered for committed saves), ``save_errors``;
        ``leases`` (scheduler), ``failed_requests`` (loads that failed under policy "fail").
        """
        with self._lock:
            now = dict(self.stats)
        delta = {k: now[k] - self._reported.get(k, 0) for k in now}
        self._reported = now
        stats = KvtrieConnectorStats(delta)
        return None if stats.is_empty() else stats

    def get_kv_connector_kv_cache_events(self) -> Optional[KvtrieKVEvents]:
        """Worker: the KV cache events since the last call (``kv_events``; the first rank
        only), or None: ``BlockStored`` (``medium="KVTRIE"``, kvtrie's ``block_tokens`` a block,
        chained hashes of the model_id with the request's identity and the tokens) for each
        committed save's new blocks, ``BlockRemoved`` for the promised blocks a load did not
        find. vLLM hands them to the scheduler's :meth:`update_connector_output`."""
        with self._lock:
            events, self._events = self._events, []
        if not events:
            return None
        out = KvtrieKVEvents(num_workers=1)
        out.add_events(events)
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler: keeps the workers' KV events of ``connector_output.kv_cache_events``
        (vLLM's KVConnectorOutput, the workers' events combined) until :meth:`take_events`."""
        events = getattr(connector_output, "kv_cache_events", None)
        if not events or not isinstance(events, KvtrieKVEvents):
            return
        if self._sched_events is None:
            self._sched_events = events
        else:
            self._sched_events.add_events(events.get_all_events())
            self._sched_events.increment_workers(events.get_number_of_workers())

    def take_events(self) -> Any:
        """Scheduler: the KV cache events since the last call, for vLLM's KV event publisher
        (``AllBlocksCleared`` first after :meth:`reset_cache`; then the events every reporting
        worker sent)."""
        if self._cleared:
            self._cleared = False
            yield AllBlocksCleared()
        if self._sched_events is not None:
            events, self._sched_events = self._sched_events, None
            yield from events.aggregate().get_all_events()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> Optional[KvtrieConnectorStats]:
        """The stats object of ``data`` (a :class:`KvtrieConnectorStats`'s ``data``, as vLLM
        ships it from the workers to be aggregated)."""
        return KvtrieConnectorStats(dict(data)) if data is not None else KvtrieConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        """vLLM's Prometheus counters of :meth:`get_kv_connector_stats` (``vllm:kvtrie_*``,
        e.g. ``vllm:kvtrie_lookup_hits``, ``vllm:kvtrie_loaded_bytes``; see
        :mod:`kvtrie._metrics`), a subclass of vLLM's ``KVConnectorPromMetrics``; None without
        vLLM (or a vLLM without that class)."""
        from ._metrics import build_prom_metrics
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> Optional[bool]:
        """vLLM's prefix-cache reset (``reset_prefix_cache``; weights updated in place, RL):
        on the scheduler, bumps the cache epoch folded into every later request's model_id,
        so nothing stored before is loaded again (it ages out of the server by eviction). The
        epoch starts at ``cache_epoch`` (0): a restarted engine is back there; set
        ``cache_epoch`` to keep a reset across restarts. True; None on a worker."""
        if self._role_value != KVConnectorRole.SCHEDULER:
            return None
        self._epoch += 1
        self._lookups.clear()  # answers of the old epoch
        self._cleared = self._kv_events  # routers forget what kvtrie held for this engine
        self._matched.clear()
        log.info("kvtrie cache reset: epoch %d (model_id %s%s)", self._epoch, self._base_model,
                 f"*.e{self._epoch}")
        return True

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """``layerwise`` (true by default): the per-layer hooks (``wait_for_layer_load``,
        ``save_kv_layer``) overlap loads and saves with the layers' compute, but run inside the
        attention layers, which a full CUDA graph replays without calling them, so vLLM must
        capture piecewise graphs (attention outside the graph). ``layerwise: false``: full
        graphs are allowed; :meth:`start_load_kv` then waits for the step's loads and
        :meth:`wait_for_save` gathers every layer."""
        return _bool((extra_config or {}).get("layerwise", True), "layerwise")

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvtrie is a best-effort cache; a request never waits for its KV to be
        delivered anywhere (a failed save is a future miss)."""
        return False

    def shutdown(self) -> None:
        self._lookup_pool.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        self._committer.shutdown(wait=True)
        self._async_loader.shutdown(wait=True)
