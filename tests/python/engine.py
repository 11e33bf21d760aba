"""A test engine that schedules, allocates pages and calls a KV connector the way vLLM (v1) does.

Where it matters for a connector's data path it behaves as vLLM's scheduler and model runner:

* Several requests a step under a token budget (``max_tokens_per_step``): running requests
  first (a decode is one token, a prefill its next chunk of at most ``max_chunk`` tokens), then
  waiting ones (FCFS). Chunked
  prefill: pages are allocated per chunk, and a running request's new pages reach the connector
  only in ``scheduled_cached_reqs.new_block_ids`` (vLLM's CachedRequestData).
* A local prefix cache: a chained hash of each full page's tokens and the request's extra keys
  (LoRA adapter, multimodal hashes, cache_salt, as vLLM's kv_cache_utils) -> page. A request
  reuses another's pages and asks the connector only beyond that hit (``num_computed_tokens`` of
  ``get_num_new_matched_tokens``); freed pages keep their hash until they are reallocated.
* Preemption: when pages run out, the last running request is preempted (its pages freed, its
  computed tokens forgotten) and later resumed with new pages: ``update_state_after_alloc`` with
  all its pages again, and ``scheduled_cached_reqs.resumed_req_ids`` (its new_block_ids replace).
* Load errors under ``kv_load_failure_policy="recompute"``: a request with a failed block
  computes again from that block; its step's output is discarded. Under ``"fail"`` (vLLM's
  default) the request ends with an error (``failed``).
* ``full_cudagraph``: the per-layer hooks (``wait_for_layer_load``, ``save_kv_layer``) are not
  called, as a full CUDA graph replays attention; ``skip_save_layers``: layers whose attention
  does not call ``save_kv_layer`` (custom attention).
* Asynchronous saves: ``request_finished`` returning True keeps the pages until every rank's
  ``get_finished`` reported the request. Asynchronous loads: when ``get_num_new_matched_tokens``
  returns True the request gets pages for the loaded tokens and waits (vLLM's
  WAITING_FOR_REMOTE_KVS) until every rank's ``get_finished`` reports it loaded, then is
  scheduled from its loaded tokens (from its first failed page, if any).
* Asynchronous lookups (vllm/v1/core/sched/scheduler.py): ``add_request`` calls the
  connector's ``on_new_request``; when ``get_num_new_matched_tokens`` answers ``None`` the
  request is skipped for this step (nothing allocated, the next waiting request is tried) and put
  back at the queue's head, as Scheduler.schedule's ``if ext_tokens is None`` branch.
* ``skip_reading_prefix_cache`` (``prompt_logprobs``; vllm/sampling_params.py,
  vllm/v1/request.py): no local prefix-cache hit (kv_cache_manager.get_computed_blocks); the
  connector is still asked, with 0 local tokens.
* KV cache events of the connector (vllm/v1/worker/kv_connector_model_runner_mixin.py: each
  worker's ``get_kv_connector_kv_cache_events()`` after ``get_finished``, in forward and
  no-forward steps; vllm/distributed/kv_transfer/kv_connector/utils.py, KVOutputAggregator:
  the first worker's object, the others' ``add_events`` + ``increment_workers(1)``;
  vllm/v1/core/sched/scheduler.py, update_from_output: ``update_connector_output``, then
  ``take_events()`` published): ``kv_events`` is what the publisher got, in order.
* FP8 KV caches (``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``, vLLM's ``--kv-cache-dtype``):
  vLLM keeps them as uint8 pages (vllm/v1/worker/gpu_model_runner.py allocates the KV cache in
  the spec's dtype, uint8 for ``fp8*`` per vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE);
  each new K/V is rounded to the nearest FP8 value (scale 1) when written and attention reads
  the decoded values, so an FP8 run's logits differ from an fp16 run's and wrong bytes show.
* Hybrid models: ``sliding_layers`` with ``sliding_window`` tokens. With a connector that is
  ``SupportsHMA`` (it has ``request_finished_all_groups``), two KV cache groups as vLLM's hybrid
  allocator makes them (vllm/v1/core/kv_cache_utils.py, get_kv_cache_configs: one group per
  spec type; vllm/v1/kv_cache_interface.py: FullAttentionSpec, SlidingWindowSpec): group 0
  the full-attention layers, group 1 the sliding-window ones, each with its own block table
  from one page pool whose page 0 is the null block (vllm/v1/core/block_pool.py). A group-1
  page whose tokens all slid out of the window is freed and replaced by the null block
  (vllm/v1/core/single_type_kv_cache_manager.py, SlidingWindowManager.remove_skipped_blocks,
  called before each allocation, external tokens included); the SchedulerOutput's block ids,
  ``KVCacheBlocks.get_block_ids()`` and ``request_finished_all_groups`` carry every group
  (vllm/v1/core/sched/scheduler.py, Scheduler._connector_finished). A load error reported
  with two groups raises, as vLLM's Scheduler._update_requests_with_invalid_blocks does
  (``(req_block_ids,) = get_block_ids(req_id)``). Without ``SupportsHMA`` vLLM turns the
  hybrid allocator off (one group; the sliding-window layers keep every page). The local
  prefix cache is off in hybrid mode (vLLM's hybrid coordinator's hit rules are not modelled).
  The sliding-window layers attend to the last ``sliding_window`` positions either way.
* Torch tensors in vLLM's layouts (``flash_attn`` [2, blocks, block_size, heads, head_dim],
  ``flash_infer`` [blocks, 2, block_size, heads, head_dim], ``flash_infer_hnd`` [blocks, 2,
  heads, block_size, head_dim], ``mla`` [blocks, block_size, latent] with the latent = K and V of
  all heads), fp16 or bf16, ``tp`` ranks each holding its share of the KV heads: every rank
  has its own caches and worker connector, and attention runs per rank on its heads.

The model (llama_numpy.LlamaModel, stories260K) computes from the paged caches in float64, so a
token's logits do not depend on the batch or the chunk, and wrong KV shows as wrong logits.
"""

from __future__ import annotations

import collections
import hashlib
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

import numpy as np
import torch


@dataclass
class LoRARequest:  # the fields of vLLM's LoRARequest a connector may key on
    lora_name: str
    lora_int_id: int


@dataclass
class MultiModalFeature:  # vLLM's MultiModalFeatureSpec: its hash is `identifier`
    identifier: str


@dataclass
class Request:
    request_id: str
    prompt_token_ids: Optional[List[int]]
    max_tokens: int = 4
    lora_request: Optional[LoRARequest] = None
    mm_features: List[MultiModalFeature] = field(default_factory=list)
    cache_salt: Optional[str] = None
    prompt_embeds: Any = None
    # vLLM's SamplingParams.__post_init__ (vllm/sampling_params.py): skip_reading_prefix_cache
    # left None becomes `prompt_logprobs is not None` (a hit would leave prompt positions without
    # logprobs); pooling requests set it too (PoolingParams). vllm/v1/request.py copies it onto
    # the Request (get_skip_reading_prefix_cache).
    prompt_logprobs: Optional[int] = None
    skip_reading_prefix_cache: Optional[bool] = None
    # Engine state.
    num_computed_tokens: int = 0
    output_token_ids: List[int] = field(default_factory=list)
    block_ids: List[int] = field(default_factory=list)
    sw_block_ids: List[int] = field(default_factory=list)  # hybrid: the sliding-window group's
    preempted: bool = False
    loaded_async: int = -1  # tokens an asynchronous load brought (-1: none pending)
    num_preemptions: int = 0
    local_hit_tokens: List[int] = field(default_factory=list)  # per admission
    external_tokens: List[int] = field(default_factory=list)  # per admission
    logits: Dict[int, np.ndarray] = field(default_factory=dict)  # position -> row
    first_token_time: Optional[float] = None
    finished: bool = False
    failed: bool = False  # finished with an error (kv_load_failure_policy="fail")

    def __post_init__(self):
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None

    @property
    def all_token_ids(self) -> List[int]:
        return list(self.prompt_token_ids) + self.output_token_ids


class KVCacheBlocks:
    def __init__(self, block_ids: List[int], *groups: List[int]):
        self._ids = list(block_ids)
        self._groups = [list(g) for g in groups]  # groups 1.. (hybrid)

    def get_block_ids(self):
        return (self._ids, *self._groups)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: Optional[List[int]]
    block_ids: tuple
    num_computed_tokens: int
    lora_request: Any = None
    mm_features: list = field(default_factory=list)


@dataclass
class CachedRequestData:
    req_ids: List[str] = field(default_factory=list)
    resumed_req_ids: Set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)  # tuple of lists, or None
    num_computed_tokens: List[int] = field(default_factory=list)


@dataclass
class KVConnectorOutput:  # the field of vLLM's KVConnectorOutput a connector's events travel in
    kv_cache_events: Any = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: List[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]
    finished_req_ids: Set[str]


# ---------------- FP8 (OCP E4M3 "fn" and E5M2), as vLLM's uint8 pages hold them ----------------


def _fp8_values(kind: str) -> np.ndarray:
    """The float64 value of each of the 256 codes (NaN for NaN codes, +-inf for E5M2's)."""
    out = np.empty(256, np.float64)
    for c in range(256):
        sign = -1.0 if c & 0x80 else 1.0
        if kind == "fp8_e4m3":
            e, m = (c >> 3) & 0xF, c & 7
            if e == 0xF and m == 7:
                v = np.nan
            elif e == 0:
                v = m / 8.0 * 2.0 ** -6
            else:
                v = (1 + m / 8.0) * 2.0 ** (e - 7)
        else:  # fp8_e5m2
            e, m = (c >> 2) & 0x1F, c & 3
            if e == 0x1F:
                v = np.inf if m == 0 else np.nan
            elif e == 0:
                v = m / 4.0 * 2.0 ** -14
            else:
                v = (1 + m / 4.0) * 2.0 ** (e - 15)
        out[c] = sign * v
    return out


FP8_VALUES = {k: _fp8_values(k) for k in ("fp8_e4m3", "fp8_e5m2")}


def fp8_encode(x: np.ndarray, kind: str) -> np.ndarray:
    """The nearest finite FP8 code of each value (saturating), as uint8."""
    vals = FP8_VALUES[kind][:128]  # the non-negative codes, increasing with the code
    codes = np.nonzero(np.isfinite(vals))[0]
    pos = vals[codes]
    a = np.minimum(np.abs(x), pos[-1])
    i = np.clip(np.searchsorted(pos, a), 1, len(pos) - 1)
    nearer = np.where(a - pos[i - 1] <= pos[i] - a, i - 1, i)
    return (codes[nearer] | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


# ---------------- KV cache groups, as vllm/v1/kv_cache_interface.py names the specs ----------


@dataclass
class KVCacheSpec:
    block_size: int


class AttentionSpec(KVCacheSpec):
    pass


class FullAttentionSpec(AttentionSpec):
    pass


@dataclass
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 0


class MambaSpec(KVCacheSpec):
    pass


@dataclass
class KVCacheGroupSpec:  # vLLM's KVCacheGroupSpec: the group's layers and their spec
    layer_names: List[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:  # the part of vLLM's KVCacheConfig a connector reads
    kv_cache_groups: List[KVCacheGroupSpec]


def layer_names(num_layers: int) -> List[str]:
    return [f"model.layers.{l}.self_attn.attn" for l in range(num_layers)]


def kv_cache_config(num_layers: int, block_size: int = 16, sliding_layers=(),
                    sliding_window: int = 0, hybrid: bool = True) -> KVCacheConfig:
    """What vLLM hands a connector (and the engine uses): with sliding-window layers and the
    hybrid allocator on, a full-attention group and a sliding-window group; else one group."""
    names = layer_names(num_layers)
    sw = set(sliding_layers)
    if not sw or not hybrid:
        return KVCacheConfig([KVCacheGroupSpec(names, FullAttentionSpec(block_size))])
    return KVCacheConfig([
        KVCacheGroupSpec([n for i, n in enumerate(names) if i not in sw],
                         FullAttentionSpec(block_size)),
        KVCacheGroupSpec([n for i, n in enumerate(names) if i in sw],
                         SlidingWindowSpec(block_size, sliding_window))])


def make_cache(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    if layout == "flash_attn":
        return torch.zeros(2, num_blocks, block_size, heads, head_dim, dtype=dtype)
    if layout == "flash_infer":
        return torch.zeros(num_blocks, 2, block_size, heads, head_dim, dtype=dtype)
    if layout == "flash_infer_hnd":
        return torch.zeros(num_blocks, 2, heads, block_size, head_dim, dtype=dtype)
    if layout == "mla":
        return torch.zeros(num_blocks, block_size, 2 * heads * head_dim, dtype=dtype)
    raise ValueError(f"layout: {layout!r}")


def kv_pages(cache: torch.Tensor, layout: str, heads: int, head_dim: int):
    """(K, V) views [num_blocks, block_size, heads, head_dim] of a layer's cache."""
    if layout == "flash_attn":
        return cache[0], cache[1]
    if layout == "flash_infer":
        return cache[:, 0], cache[:, 1]
    if layout == "flash_infer_hnd":
        return cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
    c = cache.view(cache.shape[0], cache.shape[1], 2, heads, head_dim)  # mla
    return c[:, :, 0], c[:, :, 1]


def _extra_keys(req: Request) -> tuple:
    lora = (req.lora_request.lora_name, req.lora_request.lora_int_id) if req.lora_request else None
    return (lora, tuple(f.identifier for f in req.mm_features), req.cache_salt)


class Engine:
    def __init__(self, model, sched=None, workers=(), *, tp: int = 1,
                 dtype: torch.dtype = torch.float16, layout: str = "flash_attn",
                 num_blocks: int = 96, block_size: int = 16, max_tokens_per_step: int = 1024,
                 max_chunk: Optional[int] = None, prefix_cache: bool = True, seed: int = 0,
                 kv_load_failure_policy: str = "recompute", full_cudagraph: bool = False,
                 skip_save_layers=(), kv_cache_dtype: Optional[str] = None,
                 sliding_layers=(), sliding_window: int = 0,
                 disable_hybrid_kv_cache_manager: bool = False):
        self.model, self.sched, self.workers = model, sched, list(workers)
        self.fp8 = kv_cache_dtype  # None, "fp8_e4m3" or "fp8_e5m2": uint8 pages
        if self.fp8 is not None:
            assert self.fp8 in FP8_VALUES
            dtype = torch.uint8
        self.sw_layers, self.window = set(sliding_layers), int(sliding_window)
        assert not self.sw_layers or self.window > 0
        # The hybrid allocator stays on only for a SupportsHMA connector (else vLLM turns it off
        # and every layer is in one full-attention group).
        self.hybrid = (bool(self.sw_layers) and sched is not None and hasattr(
            sched, "request_finished_all_groups") and not disable_hybrid_kv_cache_manager)
        if self.hybrid:
            prefix_cache = False  # (the hybrid coordinator's local hits are not modelled)
        # vLLM's KVTransferConfig.kv_load_failure_policy; the scheduler recomputes only under
        # "recompute" (Scheduler.__init__: recompute_kv_load_failures), else a request with a
        # block that failed to load is finished with an error (FINISHED_ERROR).
        assert kv_load_failure_policy in ("recompute", "fail")
        self.policy = kv_load_failure_policy
        # The per-layer hooks run inside attention (vllm/attention/layer.py:
        # wait_for_kv_layer_from_connector, maybe_save_kv_layer_to_connector); a full CUDA
        # graph replays attention without them, custom attention may not call them. The model
        # runner calls start_load_kv before and wait_for_save after the forward pass either way
        # (vllm/v1/worker/kv_connector_model_runner_mixin.py).
        self.full_cudagraph, self.skip_save_layers = full_cudagraph, set(skip_save_layers)
        assert not self.workers or len(self.workers) == tp
        assert model.num_kv_heads % tp == 0 and model.num_heads % tp == 0
        self.tp, self.layout, self.dtype = tp, layout, dtype
        self.block_size, self.budget, self.prefix_cache = block_size, max_tokens_per_step, prefix_cache
        self.max_chunk = max_chunk or max_tokens_per_step  # vLLM's long_prefill_token_threshold
        self.kv_heads = model.num_kv_heads // tp  # per rank
        self.names = [f"model.layers.{l}.self_attn.attn" for l in range(model.num_layers)]
        self.caches = [{n: make_cache(layout, num_blocks, block_size, self.kv_heads,
                                      model.head_dim, dtype) for n in self.names}
                       for _ in range(tp)]
        for w, caches in zip(self.workers, self.caches):
            w.register_kv_caches(caches)
        # Pages: free ones in LRU order (scattered at first), reference counts, prefix cache.
        # Hybrid: page 0 is vLLM's null block, never allocated (BlockPool.null_block).
        order = np.random.RandomState(seed).permutation(num_blocks)
        self.free: "collections.OrderedDict[int, None]" = collections.OrderedDict(
            (int(p), None) for p in order if not (self.hybrid and p == 0))
        self.refs: Dict[int, int] = {}
        self.page_hash: Dict[int, int] = {}
        self.cached: Dict[int, int] = {}  # hash -> page
        self.waiting: "collections.deque[Request]" = collections.deque()
        self.running: List[Request] = []
        self.held: Dict[str, Request] = {}  # finished, pages kept until get_finished
        self.remote: Dict[str, Request] = {}  # waiting for an asynchronous load (vLLM's
        self.received: Dict[str, int] = {}  # WAITING_FOR_REMOTE_KVS): ranks that reported it
        self.failed_pages: Set[int] = set()  # load errors not yet matched to a request
        self.reported: Dict[str, int] = {}  # req -> ranks that reported it finished saving
        self.finished_ids: Set[str] = set()  # finished since the last step (to get_finished)
        self.requests: Dict[str, Request] = {}
        self.steps = 0
        self.preemptions = 0
        self.hook_before_execute: Optional[Callable[[SchedulerOutput], None]] = None
        self.step_times: List[float] = []
        self.lookup_deferrals = 0  # waiting requests skipped because the connector said None
        self.kv_events: List[Any] = []  # the connector's KV cache events, as published

    # ---------------- pages ----------------

    def _alloc(self, n: int) -> Optional[List[int]]:
        if len(self.free) < n:
            return None
        pages = []
        for _ in range(n):
            p, _ = self.free.popitem(last=False)
            h = self.page_hash.pop(p, None)
            if h is not None and self.cached.get(h) == p:
                del self.cached[h]
            self.refs[p] = 1
            pages.append(p)
        return pages

    def _alloc_groups(self, n: int):
        """n pages for group 0 and, hybrid, n for the sliding-window group (one pool)."""
        pages = self._alloc(n * (2 if self.hybrid else 1))
        if pages is None:
            return None, None
        return pages[:n], pages[n:]

    def _remove_skipped(self, req: Request, computed: int) -> None:
        """vLLM's SlidingWindowManager.remove_skipped_blocks(total_computed_tokens): the
        sliding-window pages whose tokens are all before ``computed - window + 1`` are freed
        and become the null block (the connector is not told; its tables keep the old ids)."""
        if not self.hybrid:
            return
        skipped = max(0, computed - self.window + 1) // self.block_size
        for i in range(min(skipped, len(req.sw_block_ids))):
            if req.sw_block_ids[i] != 0:
                self._release([req.sw_block_ids[i]])
                req.sw_block_ids[i] = 0

    def _release(self, pages: List[int]) -> None:
        for p in pages:
            if self.hybrid and p == 0:  # the null block
                continue
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free[p] = None

    def _page_hashes(self, req: Request, n_pages: int) -> List[int]:
        out, h, toks = [], 0, req.all_token_ids
        extra = _extra_keys(req)
        for i in range(n_pages):
            h = int.from_bytes(hashlib.sha256(pickle.dumps(
                (h, tuple(toks[i * self.block_size:(i + 1) * self.block_size]), extra))).digest()[:8],
                "little")
            out.append(h)
        return out

    def _local_hit(self, req: Request) -> List[int]:
        # vLLM 003df29 vllm/v1/core/kv_cache_manager.py, get_computed_blocks: no local hit when
        # `not prefix_cache_lookup_enabled(request)` (caching off or
        # request.skip_reading_prefix_cache). The scheduler still asks the connector (with 0).
        if not self.prefix_cache or req.skip_reading_prefix_cache:
            return []
        pages = []
        for h in self._page_hashes(req, (len(req.prompt_token_ids) - 1) // self.block_size):
            p = self.cached.get(h)
            if p is None:
                break
            pages.append(p)
        for p in pages:
            if self.refs.get(p, 0) == 0:
                del self.free[p]
            self.refs[p] = self.refs.get(p, 0) + 1
        return pages

    def _register(self, req: Request) -> None:
        full = min(req.num_computed_tokens, len(req.all_token_ids)) // self.block_size
        for p, h in zip(req.block_ids[:full], self._page_hashes(req, full)):
            if p not in self.page_hash and h not in self.cached:
                self.page_hash[p], self.cached[h] = h, p

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req.block_ids + req.sw_block_ids)
        req.block_ids, req.sw_block_ids, req.num_computed_tokens = [], [], 0
        req.preempted = True
        req.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    # ---------------- scheduling ----------------

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)
        # vLLM's Scheduler.add_request tells the connector at once (connector.on_new_request).
        if self.sched is not None and hasattr(self.sched, "on_new_request"):
            self.sched.on_new_request(req)

    def _pages_for(self, req: Request, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - len(req.block_ids))

    def _schedule(self) -> SchedulerOutput:
        budget = self.budget
        so = SchedulerOutput([], CachedRequestData(), {}, self.finished_ids)
        self.finished_ids = set()
        for req in list(self.running):
            if budget == 0 or req not in self.running:
                continue
            n = min(len(req.all_token_ids) - req.num_computed_tokens, budget, self.max_chunk)
            new = sw_new = None
            self._remove_skipped(req, req.num_computed_tokens)
            while new is None:
                new, sw_new = self._alloc_groups(
                    self._pages_for(req, req.num_computed_tokens + n))
                if new is None:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
            if new is None:
                continue
            req.block_ids += new
            req.sw_block_ids += sw_new
            so.scheduled_cached_reqs.req_ids.append(req.request_id)
            so.scheduled_cached_reqs.new_block_ids.append(
                ((new, sw_new) if self.hybrid else (new,)) if new else None)
            so.scheduled_cached_reqs.num_computed_tokens.append(req.num_computed_tokens)
            so.num_scheduled_tokens[req.request_id] = n
            budget -= n
        skipped: List[Request] = []  # vLLM's skipped_waiting_requests
        while self.waiting and budget > 0:
            req = self.waiting[0]
            loaded = req.loaded_async >= 0
            if loaded:  # its asynchronous load is done: schedule it
                computed, req.loaded_async = req.loaded_async, -1
                hit, local, ext = list(req.block_ids), 0, 0
            else:
                hit = self._local_hit(req)
                local = len(hit) * self.block_size
                ext, is_async = 0, False
                if self.sched is not None:
                    ext, is_async = self.sched.get_num_new_matched_tokens(req, local)
                    if ext is None:
                        # vLLM (vllm/v1/core/sched/scheduler.py, Scheduler.schedule, the
                        # waiting loop: `if ext_tokens is None:`): the connector cannot tell
                        # yet; the request is skipped this step (nothing allocated) and put
                        # back at the queue's head after the loop; the next one is tried.
                        self._release(hit)
                        skipped.append(self.waiting.popleft())
                        self.lookup_deferrals += 1
                        continue
                computed = local + ext
                if is_async:  # pages for the loaded tokens only; not scheduled until loaded
                    req.block_ids = hit
                    new = self._alloc(self._pages_for(req, computed))
                    if new is None:
                        req.block_ids = []
                        self._release(hit)
                        break
                    self.waiting.popleft()
                    req.block_ids = hit + new
                    self.sched.update_state_after_alloc(req, KVCacheBlocks(req.block_ids), ext)
                    req.local_hit_tokens.append(local)
                    req.external_tokens.append(ext)
                    req.loaded_async = computed  # until get_finished reports it
                    self.remote[req.request_id] = req
                    continue
            n = min(len(req.all_token_ids) - computed, budget, self.max_chunk)
            req.block_ids = hit
            new, sw_new = self._alloc_groups(self._pages_for(req, computed + n))
            if new is None:
                if loaded:  # the pages its load filled stay the request's
                    req.loaded_async = computed
                else:
                    self._release(hit)
                    req.block_ids = []
                break
            self.waiting.popleft()
            req.block_ids = hit + new
            if self.hybrid:  # (no local hits in hybrid mode: hit is empty)
                req.sw_block_ids = list(sw_new)
                self._remove_skipped(req, computed)  # the external hit's slid-out pages: null
            if self.sched is not None:  # vLLM: all the request's blocks, before it counts them
                self.sched.update_state_after_alloc(req, KVCacheBlocks(
                    req.block_ids, *([req.sw_block_ids] if self.hybrid else [])), ext)
            req.num_computed_tokens = computed
            if not loaded:
                req.local_hit_tokens.append(local)
                req.external_tokens.append(ext)
            if req.preempted:
                c = so.scheduled_cached_reqs
                c.req_ids.append(req.request_id)
                c.resumed_req_ids.add(req.request_id)
                c.new_block_ids.append((list(req.block_ids),
                                        *([list(req.sw_block_ids)] if self.hybrid else [])))
                c.num_computed_tokens.append(computed)
                req.preempted = False
            else:
                so.scheduled_new_reqs.append(NewRequestData(
                    req.request_id, req.prompt_token_ids,
                    (list(req.block_ids), *([list(req.sw_block_ids)] if self.hybrid else [])),
                    computed,
                    req.lora_request, req.mm_features))
            self.running.append(req)
            so.num_scheduled_tokens[req.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))  # vLLM: waiting.prepend_requests(skipped)
        return so

    # ---------------- one step ----------------

    def step(self) -> None:
        t0 = time.perf_counter()
        so = self._schedule()
        meta = self.sched.build_connector_meta(so) if self.sched is not None else None
        if self.hook_before_execute:
            self.hook_before_execute(so)
        batch = [(self.requests[r], n) for r, n in so.num_scheduled_tokens.items()]
        for w in self.workers:  # the metadata travels pickled, as to vLLM's workers
            w.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
            w.start_load_kv(None)
        logits = self._forward(batch)
        errors: Set[int] = set()
        events = []
        for w in self.workers:
            w.wait_for_save()
            done, received = w.get_finished(so.finished_req_ids)
            errors |= w.get_block_ids_with_load_errors()
            if errors and self.hybrid:
                # vLLM's Scheduler._update_requests_with_invalid_blocks:
                # `(req_block_ids,) = self.kv_cache_manager.get_block_ids(req_id)` with two groups
                raise ValueError("too many values to unpack (expected 1): load errors reported "
                                 "with more than one KV cache group")
            events.append(self._worker_events(w))
            for r in done or ():
                self.reported[r] = self.reported.get(r, 0) + 1
            for r in received or ():
                self.received[r] = self.received.get(r, 0) + 1
            w.clear_connector_metadata()
        self._publish(events)
        self._release_reported()
        self.failed_pages |= errors
        for r in [r for r, n in self.received.items() if n == len(self.workers)]:
            del self.received[r]  # loaded: back to the queue's head, from its first failed page
            req = self.remote.pop(r)
            bad = [i for i, p in enumerate(req.block_ids) if p in self.failed_pages]
            self.failed_pages -= set(req.block_ids)
            if bad and self.policy == "fail":
                self._fail(req)
                continue
            if bad:
                req.loaded_async = min(req.loaded_async, bad[0] * self.block_size)
            self.waiting.appendleft(req)
        now = time.perf_counter()
        for (req, n), rows in zip(batch, logits):
            bad = [i for i, p in enumerate(req.block_ids) if p in errors]
            if bad and self.policy == "fail":
                self._fail(req)
                continue
            if bad:  # kv_load_failure_policy="recompute": again from the first failed block
                req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * self.block_size)
                continue
            start = req.num_computed_tokens
            for i in range(n):
                req.logits[start + i] = rows[i]
            req.num_computed_tokens += n
            self._register(req)
            if req.num_computed_tokens == len(req.all_token_ids):  # sample the next token
                if req.first_token_time is None:
                    req.first_token_time = now
                req.output_token_ids.append(int(np.argmax(rows[-1])))
                if len(req.output_token_ids) >= req.max_tokens:
                    self._finish(req)
        self.steps += 1
        self.step_times.append(time.perf_counter() - t0)

    @staticmethod
    def _worker_events(w) -> Any:
        f = getattr(w, "get_kv_connector_kv_cache_events", None)
        return f() if f is not None else None

    def _publish(self, worker_events: List[Any]) -> None:
        """vLLM's KVOutputAggregator combines the workers' events, the scheduler's connector
        takes them (update_connector_output) and hands them to the publisher (take_events)."""
        combined = None
        for ev in worker_events:
            if combined is None:
                combined = ev
            elif ev:
                combined.add_events(ev.get_all_events())
                combined.increment_workers(1)
        if self.sched is None or not hasattr(self.sched, "take_events"):
            return
        self.sched.update_connector_output(KVConnectorOutput(combined or None))
        self.kv_events.extend(self.sched.take_events())

    def _fail(self, req: Request) -> None:
        """kv_load_failure_policy="fail": the request ends with an error, its output dropped."""
        req.failed = True
        if req in self.running:
            self._finish(req)
            return
        self.running.append(req)  # (an asynchronous load's request: never ran)
        self._finish(req)

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        req.finished = True
        keep = False
        if self.sched is not None and self.hybrid:  # Scheduler._connector_finished
            self._remove_skipped(req, len(req.all_token_ids))
            keep, _ = self.sched.request_finished_all_groups(
                req, (list(req.block_ids), list(req.sw_block_ids)))
        elif self.sched is not None:
            keep, _ = self.sched.request_finished(req, req.block_ids)
        self.finished_ids.add(req.request_id)
        if keep:
            self.held[req.request_id] = req
        else:
            self._release(req.block_ids + req.sw_block_ids)

    def _release_reported(self) -> None:
        for r in [r for r, n in self.reported.items() if n == len(self.workers)]:
            del self.reported[r]
            req = self.held.pop(r)
            self._release(req.block_ids + req.sw_block_ids)

    def run(self, requests=(), max_steps: int = 10000) -> Dict[str, Request]:
        """Adds ``requests`` and steps until every request finished and its pages came back."""
        for r in requests:
            self.add_request(r)
        while self.waiting or self.running or self.remote:
            assert max_steps > 0, "the engine made no progress"
            max_steps -= 1
            self.step()
            if not self.running and (self.remote or self.waiting):
                time.sleep(0.001)  # only asynchronous loads or lookups in flight
        while self.held:  # saves still committing: ask the workers until they report
            events = []
            for w in self.workers:  # vLLM's no-forward steps (kv_connector_no_forward)
                done, _ = w.get_finished(self.finished_ids)
                for r in done or ():
                    self.reported[r] = self.reported.get(r, 0) + 1
                events.append(self._worker_events(w))
            self._publish(events)
            self.finished_ids = set()
            self._release_reported()
            time.sleep(0.001)
        return self.requests

    # ---------------- the model, per rank on its heads ----------------

    def _forward(self, batch) -> List[np.ndarray]:
        m, bs = self.model, self.block_size
        hq, hk = m.num_heads // self.tp, self.kv_heads  # per rank
        rep = m.num_heads // m.num_kv_heads
        xs, plans = [], []
        for req, n in batch:
            start = req.num_computed_tokens
            toks = req.all_token_ids[start:start + n]
            pos = np.arange(start, start + n)
            all_pos = torch.arange(start + n)
            mask = all_pos.numpy()[None, :] > pos[:, None]
            plan = {}
            for sw in (False, True):  # the full-attention layers' pages and mask, the window's
                ids = req.sw_block_ids if sw and self.hybrid else req.block_ids
                blocks = torch.as_tensor(ids, dtype=torch.int64)
                m_ = mask | (all_pos.numpy()[None, :] <= pos[:, None] - self.window) if sw else mask
                plan[sw] = (pos, blocks[pos // bs], torch.as_tensor(pos % bs),
                            blocks[all_pos // bs], all_pos % bs, m_)
            plans.append(plan)
            xs.append(m.embd[np.asarray(toks, dtype=np.int64)].astype(np.float64))
        for l, L in enumerate(m.layers):
            name = self.names[l]
            for w in self.workers if not self.full_cudagraph else ():
                w.wait_for_layer_load(name)
            sw = l in self.sw_layers
            qs = []
            for x, plan in zip(xs, plans):
                pos, nb, no, _, _, _ = plan[sw]
                xb = m._rmsnorm(x, L.attn_norm)
                T = len(pos)
                q = m._rope((xb @ L.wq.T).reshape(T, m.num_heads, m.head_dim), pos)
                k = m._rope((xb @ L.wk.T).reshape(T, m.num_kv_heads, m.head_dim), pos)
                v = (xb @ L.wv.T).reshape(T, m.num_kv_heads, m.head_dim)
                qs.append(q)
                for r in range(self.tp):
                    K, V = kv_pages(self.caches[r][name], self.layout, hk, m.head_dim)
                    kr, vr = k[:, r * hk:(r + 1) * hk].copy(), v[:, r * hk:(r + 1) * hk].copy()
                    if self.fp8 is not None:  # vLLM's FP8 cache write: the nearest FP8 bytes
                        K[nb, no] = torch.from_numpy(fp8_encode(kr, self.fp8))
                        V[nb, no] = torch.from_numpy(fp8_encode(vr, self.fp8))
                    else:
                        K[nb, no] = torch.from_numpy(kr).to(self.dtype)
                        V[nb, no] = torch.from_numpy(vr).to(self.dtype)
            for r, w in enumerate(self.workers):
                if not self.full_cudagraph and l not in self.skip_save_layers:
                    w.save_kv_layer(name, self.caches[r][name], None)
            for i, (q, plan) in enumerate(zip(qs, plans)):
                pos, _, _, ab, ao, mask = plan[sw]
                T = len(pos)
                att = np.empty((T, m.num_heads, m.head_dim), np.float64)
                for r in range(self.tp):
                    K, V = kv_pages(self.caches[r][name], self.layout, hk, m.head_dim)
                    if self.fp8 is not None:  # attention reads the FP8 values
                        Ks = FP8_VALUES[self.fp8][K[ab, ao].numpy()]
                        Vs = FP8_VALUES[self.fp8][V[ab, ao].numpy()]
                    else:
                        Ks = K[ab, ao].double().numpy()
                        Vs = V[ab, ao].double().numpy()
                    if sw:  # slid-out (null or reused) pages are masked: never read as values
                        Ks, Vs = np.where(mask.all(0)[:, None, None], 0.0, Ks), np.where(
                            mask.all(0)[:, None, None], 0.0, Vs)
                    for h in range(r * hq, (r + 1) * hq):
                        kh = h // rep - r * hk
                        s = (q[:, h, :] @ Ks[:, kh, :].T) / np.sqrt(m.head_dim)
                        s[mask] = -np.inf
                        s -= s.max(axis=-1, keepdims=True)
                        p = np.exp(s)
                        p /= p.sum(axis=-1, keepdims=True)
                        att[:, h, :] = p @ Vs[:, kh, :]
                x = xs[i] + att.reshape(T, m.dim) @ L.wo.T
                xb = m._rmsnorm(x, L.ffn_norm)
                h1, h3 = xb @ L.w1.T, xb @ L.w3.T
                xs[i] = x + ((h1 / (1.0 + np.exp(-h1))) * h3) @ L.w2.T
        return [(m._rmsnorm(x, m.out_norm) @ m.out.T).astype(np.float32) for x in xs]
