"""KV cache events for routers (issue 32): what KvtrieConnector announces to vLLM's KV event
publisher (``--kv-events-config``), so a KV-aware router (vLLM's, llm-d's, Dynamo's) knows which
prefixes kvtrie holds for this engine: ``BlockStored`` once a save is committed, ``BlockRemoved``
when a load finds blocks gone (evicted or deleted after the lookup), ``AllBlocksCleared`` after
``reset_cache``, all with ``medium="KVTRIE"``.

Under vLLM the event classes are vLLM's own (``vllm.distributed.kv_events``) and
:class:`KvtrieKVEvents` derives from its ``KVConnectorKVEvents``; without vLLM (or a vLLM
without them) stand-ins with the same fields and value semantics (equal events hash alike:
vLLM's ``KVEventAggregator`` counts them across workers)."""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

MEDIUM = "KVTRIE"

try:  # vLLM's own classes, so its publisher and aggregator take them as they are
    from vllm.distributed.kv_events import (  # type: ignore
        AllBlocksCleared, BlockRemoved, BlockStored, KVConnectorKVEvents as _EventsBase)
except ImportError:  # no vLLM, or one before connector KV events
    _EventsBase = object

    @dataclass(eq=True)
    class BlockStored:  # type: ignore[no-redef]  # the fields of vLLM's
        block_hashes: List[int]
        parent_block_hash: Optional[int]
        token_ids: List[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str] = None

        def __hash__(self) -> int:
            return hash((tuple(self.block_hashes), self.parent_block_hash,
                         tuple(self.token_ids), self.block_size, self.lora_id, self.medium,
                         self.lora_name))

    @dataclass(eq=True)
    class BlockRemoved:  # type: ignore[no-redef]
        block_hashes: List[int]
        medium: Optional[str]

        def __hash__(self) -> int:
            return hash((tuple(self.block_hashes), self.medium))

    @dataclass(eq=True, frozen=True)
    class AllBlocksCleared:  # type: ignore[no-redef]
        pass


def block_hashes(key: str, tokens: Sequence[int], block_tokens: int, end_block: int) -> List[int]:
    """The chained hashes of the first ``end_block`` kvtrie blocks of ``tokens`` under ``key``
    (the model_id and the request's identity, never the rank): hash i covers blocks 0..i, as
    vLLM's block hashes; 63-bit ints (vLLM's ExternalBlockHash is bytes or int)."""
    out: List[int] = []
    h = hashlib.sha256(key.encode()).digest()
    for i in range(end_block):
        block = tokens[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.sha256(h + b"".join(int(t).to_bytes(4, "little", signed=True)
                                        for t in block)).digest()
        out.append(int.from_bytes(h[:8], "little") >> 1)
    return out


def stored_event(key: str, tokens: Sequence[int], block_tokens: int, first_block: int,
                 end_block: int) -> Any:
    """``BlockStored`` of blocks ``[first_block, end_block)`` of ``tokens``."""
    hashes = block_hashes(key, tokens, block_tokens, end_block)
    fields = dict(block_hashes=hashes[first_block:],
                  parent_block_hash=hashes[first_block - 1] if first_block > 0 else None,
                  token_ids=[int(t) for t in tokens[first_block * block_tokens:
                                                    end_block * block_tokens]],
                  block_size=block_tokens, lora_id=None, medium=MEDIUM, lora_name=None)
    try:
        return BlockStored(**fields)
    except TypeError:  # a vLLM before lora_name
        del fields["lora_name"]
        return BlockStored(**fields)


def removed_event(key: str, tokens: Sequence[int], block_tokens: int, first_block: int,
                  end_block: int) -> Any:
    """``BlockRemoved`` of blocks ``[first_block, end_block)`` of ``tokens``."""
    hashes = block_hashes(key, tokens, block_tokens, end_block)
    return BlockRemoved(block_hashes=hashes[first_block:], medium=MEDIUM)


class KvtrieKVEvents(_EventsBase):  # type: ignore[misc, valid-type]
    """vLLM's ``KVConnectorKVEvents`` of KvtrieConnector: one worker's events of a step; vLLM's
    KVOutputAggregator adds the other workers' (``add_events``, ``increment_workers``) and the
    scheduler's connector keeps, in :meth:`aggregate`, the events every worker that reported
    sent (as vLLM's KVEventAggregator: a count per distinct event)."""

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers: {num_workers} is not >= 1")
        self._counts: "collections.Counter[Any]" = collections.Counter()
        self._workers = num_workers

    def add_events(self, events: List[Any]) -> None:
        if not isinstance(events, list):
            raise TypeError("events: not a list of KV cache events")
        self._counts.update(events)

    def aggregate(self) -> "KvtrieKVEvents":
        common = [e for e, n in self._counts.items() if n >= self._workers]
        self._counts = collections.Counter(common)
        self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"count: {count} is not >= 1")
        self._workers += count

    def get_all_events(self) -> List[Any]:
        return list(self._counts.elements())

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._counts.clear()
        self._workers = 1

    def merge(self, other: Any) -> "KvtrieKVEvents":
        self.add_events(other.get_all_events())
        return self

    def __repr__(self) -> str:
        return f"<KvtrieKVEvents workers={self._workers} events={len(self._counts)}>"
