"""The simplest engine loop that drives a KV connector in vLLM's (v1) call order, over numpy fp16
caches (a thin caller; engine.py is the one that schedules like vLLM).

One request at a time: the scheduler asks the connector how many prompt tokens it can load
(get_num_new_matched_tokens), allocates paged blocks (update_state_after_alloc), builds the step's
connector metadata (build_connector_meta); the worker binds it, starts the loads (start_load_kv),
runs the model's forward pass, which waits for each layer's load (wait_for_layer_load) and saves
each layer after writing it (save_kv_layer), then waits for the saves (wait_for_save) and asks
for load errors (get_block_ids_with_load_errors): on errors it recomputes from the first failed
block, as vLLM does. The scheduler and worker connectors are separate objects (as in vLLM's
processes) and the metadata is pickled between them.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from llama_numpy import LlamaModel, make_caches


@dataclass
class Request:
    request_id: str
    prompt_token_ids: List[int]
    num_computed_tokens: int = 0
    block_ids: List[int] = field(default_factory=list)


class KVCacheBlocks:
    def __init__(self, block_ids: List[int]):
        self._ids = list(block_ids)

    def get_block_ids(self):
        return (self._ids,)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    num_scheduled_tokens: Dict[str, int]


@dataclass
class RunResult:
    logits: np.ndarray  # [prompt tokens, vocab]: row i = logits after token i (NaN if not computed)
    loaded_tokens: int  # tokens the connector was asked to load
    recomputed_from: Optional[int]  # first token recomputed after a load error, or None
    decode_logits: List[np.ndarray]  # greedy decode steps after the prompt


class Engine:
    def __init__(self, model: LlamaModel, scheduler_connector=None, worker_connector=None,
                 num_blocks: int = 128, block_size: int = 16, seed: int = 0):
        self.model = model
        self.sched = scheduler_connector
        self.worker = worker_connector
        self.block_size = block_size
        self.kv_caches = make_caches(model, num_blocks, block_size)
        self.names = list(self.kv_caches)
        self.free = list(np.random.RandomState(seed).permutation(num_blocks))  # scattered pages
        if self.worker is not None:
            self.worker.register_kv_caches(self.kv_caches)
        self.hook_between_schedule_and_load = None  # test hook: e.g. evict after the lookup

    def _step(self, req: Request, tokens: List[int], start: int, meta) -> np.ndarray:
        w = self.worker
        if w is not None:
            w.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
            w.start_load_kv(None)
        caches = [self.kv_caches[n] for n in self.names]
        logits = self.model.forward(
            tokens, start, caches, req.block_ids, self.block_size,
            before_layer=(lambda l: w.wait_for_layer_load(self.names[l])) if w else None,
            after_layer=(lambda l: w.save_kv_layer(self.names[l], self.kv_caches[self.names[l]],
                                                   None)) if w else None)
        if w is not None:
            w.wait_for_save()
        return logits

    def run(self, request_id: str, prompt: List[int], decode_steps: int = 4) -> RunResult:
        req = Request(request_id, [int(t) for t in prompt])
        n = len(req.prompt_token_ids)
        # Scheduler: external match, allocation, metadata.
        ext = 0
        if self.sched is not None:
            ext, is_async = self.sched.get_num_new_matched_tokens(req, req.num_computed_tokens)
            while ext is None:  # vLLM: not schedulable yet (an asynchronous lookup), ask again
                time.sleep(0.001)
                ext, is_async = self.sched.get_num_new_matched_tokens(req,
                                                                      req.num_computed_tokens)
            assert not is_async
        need = (n + decode_steps + self.block_size - 1) // self.block_size
        req.block_ids = [int(self.free.pop()) for _ in range(need)]
        if self.sched is not None:
            self.sched.update_state_after_alloc(req, KVCacheBlocks(req.block_ids), ext)
        req.num_computed_tokens = ext
        meta = self._schedule(req, n - ext)
        if self.hook_between_schedule_and_load:
            self.hook_between_schedule_and_load()
        logits = np.full((n, self.model.vocab_size), np.nan, np.float32)
        logits[ext:] = self._step(req, req.prompt_token_ids[ext:], ext, meta)
        recomputed_from = None
        failed = self.worker.get_block_ids_with_load_errors() if self.worker else set()
        if self.worker is not None:
            self.worker.clear_connector_metadata()
        if failed:  # recompute from the first block that did not load
            first = min(req.block_ids.index(b) for b in failed) * self.block_size
            recomputed_from = first
            req.num_computed_tokens = first
            meta = self._schedule(req, n - first)
            logits[:] = np.nan
            logits[first:] = self._step(req, req.prompt_token_ids[first:], first, meta)
            assert not self.worker.get_block_ids_with_load_errors()
            self.worker.clear_connector_metadata()
        req.num_computed_tokens = n
        # Greedy decode: the connector is called each step but has nothing to do.
        tokens = list(req.prompt_token_ids)
        decode, last = [], logits[-1]
        for _ in range(decode_steps):
            tokens.append(int(np.argmax(last)))
            meta = self._schedule(req, 1)
            last = self._step(req, tokens[-1:], len(tokens) - 1, meta)[0]
            if self.worker is not None:
                self.worker.clear_connector_metadata()
            req.num_computed_tokens += 1
            decode.append(last)
        if self.sched is not None:
            keep, _ = self.sched.request_finished(req, req.block_ids)
            while keep:  # the save commits after the step: keep the blocks until it is done
                done, _ = self.worker.get_finished({req.request_id})
                keep = not (done and req.request_id in done)
                time.sleep(0.001)
        self.free.extend(req.block_ids)
        return RunResult(logits, ext, recomputed_from, decode)

    def _schedule(self, req: Request, num_tokens: int):
        if self.sched is None:
            return None
        return self.sched.build_connector_meta(
            SchedulerOutput([], {req.request_id: num_tokens}))
