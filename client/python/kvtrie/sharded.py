"""kvtrie.ShardedClient — N kvtrie servers (shards) used as one cache, from Python.

Each call for a prefix goes to its owner: the shard whose *name* wins the rendezvous hash of
(namespace, model_id, the first ``route_tokens`` token ids) — the C++ router's own function
(client/shard_router.h), so Python, C++ and CLI clients agree. A prefix, its extensions and
near-duplicates sharing the first block live on one shard.

A lost shard is a miss, never an error: when the owner is down, past its deadline or refusing
(UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, CANCELLED, UNKNOWN, INTERNAL,
DATA_LOSS), ``lookup`` answers 0, ``get`` an empty result, ``put`` stores nothing (a
:class:`PutResult` with 0 stored tokens) and counts it in ``counters["puts_skipped"]``. The shard
is then skipped for a jittered backoff (``down_backoff`` seconds doubling per failure in a row,
at most 30x) and until a background health check of it (grpc.health.v1.Health/Check) answers.
A shard that stops answering without closing its connection (SIGSTOP, a hung host) is found by
those checks, which have a deadline of their own (``shard_probe_deadline``, 0.25 s): a call that
has waited that long has its shard checked, and when the check misses, the call (and every other
in flight there) is cancelled and answers a miss — ~2 x 0.25 s instead of the call's ``timeout``
(60 s). The caller's own errors (INVALID_ARGUMENT,
NOT_FOUND, PERMISSION_DENIED, ...) raise :class:`kvtrie.Error` as the plain :class:`Client`'s do;
``delete`` and ``pin`` always raise (the caller must know they did not happen).

Example::

    c = kvtrie.ShardedClient("stories260K",
                             shards="kvtrie-0=10.0.0.5:50051,kvtrie-1=10.0.0.6:50051")
    # or shards_dns="_grpc._tcp.kvtrie-headless.default.svc.cluster.local"
    c.put(tokens, k, v)
    k2, v2, n = c.get(tokens)       # n == 0 when the owner is down: recompute
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ._errors import Error, StatusCode, from_status
from . import _kvtrie

__all__ = ["ShardedClient", "LOST_SHARD_CODES"]

LOST_SHARD_CODES = frozenset({
    StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED, StatusCode.RESOURCE_EXHAUSTED,
    StatusCode.ABORTED, StatusCode.CANCELLED, StatusCode.UNKNOWN, StatusCode.INTERNAL,
    StatusCode.DATA_LOSS,
})


class ShardedClient:
    """One :class:`kvtrie.Client` per shard, every call routed to the prefix's owner.

    Args:
        model_id: as :class:`kvtrie.Client`'s.
        shards: ``"name=host:port,..."`` — the shards by stable name (e.g. a StatefulSet's
            ``kvtrie-0``); or
        shards_dns: a DNS name giving them: an SRV name (``_grpc._tcp.kvtrie-headless.NS.svc.
            cluster.local``: each target's first label is the name) or ``host:port`` (A records,
            named by their reverse name). Re-resolved every ``refresh_interval`` seconds, and
            after a shard failure (at most once a second).
        route_tokens: tokens of a prefix that pick its owner (16: the first block; the same in
            every client of the shards).
        down_backoff: seconds a failed shard is skipped (doubling per failure in a row).
        warmup_window: seconds after the shard names change during which a lookup or get that
            misses on (or loses) a prefix's new owner asks its previous owner once; a get
            answered there is also put to the new owner (``warmup_put`` are its put keyword
            arguments; None, the default, is bit-exact: ``{"encoding": "lossless", "profile":
            "fast"}``, so a copy of a lossy prefix is not rounded again). 0 (the default): off.
        shard_probe_deadline: seconds: the deadline of a shard's health check, and how long a
            call waits before its shard is checked (the CLI's ``--shard_probe_deadline_ms``;
            0: no checks, a failed shard is skipped for its backoff only).
        shard_probe_interval: seconds between two checks of a down shard (0.5).
        pin_replicas: 2: a pinned prefix is also copied to (``warmup_put`` are the copy's put
            arguments) and pinned on its second shard in rendezvous order, ``delete`` and unpin
            reach both, and a lookup or get whose owner is lost or misses asks that shard once,
            so a pinned prefix survives one lost shard (the C++ client's ``pin_replicas``, CLI
            ``--pin_replicas``). 1 (the default): off.
        **client_kwargs: every shard's :class:`kvtrie.Client` arguments (``namespace``,
            ``timeout``, ``token``, ``tls``, ``retry_attempts``, ...; default
            ``retry_attempts=1``: a lost shard is a miss at once).

    Raises:
        Error: INVALID_ARGUMENT naming ``shards`` (neither or both given, a bad list);
            UNAVAILABLE when ``shards_dns`` does not resolve now.

    Thread-safe.
    """

    def __init__(self, model_id: str, *, shards: Optional[str] = None,
                 shards_dns: Optional[str] = None, route_tokens: int = 16,
                 refresh_interval: float = 30.0, down_backoff: float = 1.0,
                 warmup_window: float = 0.0, warmup_put: Optional[Dict[str, Any]] = None,
                 pin_replicas: int = 1, shard_probe_deadline: float = 0.25,
                 shard_probe_interval: float = 0.5, **client_kwargs: Any) -> None:
        if bool(shards) == bool(shards_dns):
            raise from_status(StatusCode.INVALID_ARGUMENT,
                              "shards, shards_dns: give exactly one of them")
        if int(route_tokens) < 1:
            raise from_status(StatusCode.INVALID_ARGUMENT, "route_tokens: must be >= 1")
        if int(pin_replicas) not in (1, 2):
            raise from_status(StatusCode.INVALID_ARGUMENT,
                              f"pin_replicas: {pin_replicas} (must be 1 or 2)")
        if float(shard_probe_deadline) < 0:
            raise from_status(StatusCode.INVALID_ARGUMENT, "shard_probe_deadline: must be >= 0")
        if float(shard_probe_interval) <= 0:
            raise from_status(StatusCode.INVALID_ARGUMENT, "shard_probe_interval: must be > 0")
        self.pin_replicas = int(pin_replicas)
        self.model_id = model_id
        self.namespace = client_kwargs.get("namespace", "")
        self.route_tokens = int(route_tokens)
        self._dns = shards_dns
        self._refresh_interval = float(refresh_interval)
        self._down_backoff = float(down_backoff)
        self._warmup_window = float(warmup_window)
        self._warmup_put = (dict(warmup_put) if warmup_put is not None else
                            {"encoding": "lossless", "profile": "fast"})
        self._previous: List[Tuple[str, str]] = []  # the shards before the last change of names
        self._changed_at = float("-inf")
        client_kwargs.setdefault("retry_attempts", 1)
        self._client_kwargs = client_kwargs
        self._lock = threading.Lock()  # guards everything below
        self._shards: List[Tuple[str, str]] = (
            _kvtrie._parse_shards(shards) if shards else sorted(_kvtrie._resolve_shards(shards_dns)))
        self._next_refresh = time.monotonic() + self._refresh_interval
        self._clients: Dict[str, Tuple[str, Any]] = {}  # name -> (target, kvtrie.Client)
        self._down_until: Dict[str, float] = {}
        self._failures: Dict[str, int] = {}
        self.counters = {"lost_calls": 0, "puts_skipped": 0, "shard_failures": 0,
                         "warmup_hits": 0, "warmup_copies": 0, "replica_copies": 0,
                         "replica_hits": 0, "replica_failures": 0, "probes": 0,
                         "probe_failures": 0, "calls_cancelled": 0}
        # The health checks (the C++ client's client/shard_health.h): shards down until a check
        # answers, and when each may be checked next.
        self._probe_deadline = float(shard_probe_deadline)
        self._probe_interval = float(shard_probe_interval)
        self._health_down: set = set()
        self._next_probe: Dict[str, float] = {}
        self._stop = threading.Event()
        if self._probe_deadline > 0:
            threading.Thread(target=_run_prober, args=(weakref.ref(self), self._stop),
                             name="kvtrie-shard-prober", daemon=True).start()

    def close(self) -> None:
        """Stops the background health checks (also done when the client is collected)."""
        self._stop.set()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent when __init__ raised
        if stop is not None:
            stop.set()

    def _probe_once(self) -> None:
        """One pass of the prober: checks the shards due (down ones every probe interval, up
        ones whose oldest call in flight waited the probe deadline) and cancels the calls of a
        shard whose check missed."""
        now = time.monotonic()
        with self._lock:
            due = [(name, client) for name, (_, client) in self._clients.items()
                   if now >= self._next_probe.get(name, 0.0) and
                   (name in self._health_down or
                    client._c.oldest_call_age() >= self._probe_deadline)]
        for name, client in due:
            try:
                client._c.check_health(self._probe_deadline)
                ok = True
            except Exception:  # noqa: BLE001 - any failure of the check is a failed check
                ok = False
            cancelled = 0 if ok else client._c.cancel_calls()
            with self._lock:
                self.counters["probes"] += 1
                self.counters["probe_failures"] += 0 if ok else 1
                self.counters["calls_cancelled"] += cancelled
                if self._clients.get(name, (None, None))[1] is not client:
                    continue  # replaced meanwhile
                if ok:
                    self._health_down.discard(name)
                else:
                    self._health_down.add(name)
                self._next_probe[name] = time.monotonic() + (
                    self._probe_deadline if ok else self._probe_interval)

    # --- membership ------------------------------------------------------------------------
    def _maybe_refresh(self) -> None:
        if self._dns is None:
            return
        with self._lock:
            if time.monotonic() < self._next_refresh:
                return
            self._next_refresh = time.monotonic() + self._refresh_interval
        try:
            shards = sorted(_kvtrie._resolve_shards(self._dns))
        except Error:
            return  # keep the last set
        self._replace(shards)

    def _replace(self, shards: List[Tuple[str, str]]) -> None:
        with self._lock:
            if [n for n, _ in shards] != [n for n, _ in self._shards]:
                self._previous, self._changed_at = self._shards, time.monotonic()
            self._shards = shards

    @property
    def shards(self) -> List[Tuple[str, str]]:
        """The current ``(name, target)`` shards, sorted by name."""
        self._maybe_refresh()
        with self._lock:
            return list(self._shards)

    def set_shards(self, shards: str) -> None:
        """Replaces an explicit membership (``"name=host:port,..."``)."""
        self._replace(_kvtrie._parse_shards(shards))

    def owner(self, tokens: Any) -> str:
        """The name of the shard that owns the prefix ``tokens``."""
        return self._owner(np.ascontiguousarray(tokens, dtype=np.uint32))[0]

    def _owner(self, tokens: np.ndarray,
               shards: Optional[List[Tuple[str, str]]] = None) -> Tuple[str, str]:
        """The owner in ``shards`` (None: the current membership). Raises UNAVAILABLE when the
        membership is empty."""
        shards = self.shards if shards is None else shards
        if not shards:
            raise Error(StatusCode.UNAVAILABLE, "no shards: the membership is empty")
        i = _kvtrie._shard_owner([n for n, _ in shards], self.namespace, self.model_id, tokens,
                                 self.route_tokens)
        return shards[i]

    def _owner_or_none(self, tokens: np.ndarray) -> Optional[str]:
        """The owner's name, or None when the membership is empty."""
        try:
            return self._owner(tokens)[0]
        except Error:
            return None

    def _second(self, tokens: np.ndarray) -> Optional[Tuple[str, str]]:
        """The prefix's second shard in rendezvous order (pin_replicas 2), else None."""
        if self.pin_replicas < 2:
            return None
        shards = self.shards
        if len(shards) < 2:
            return None
        owner = self._owner(tokens, shards)  # the same membership as the second's
        rest = [s for s in shards if s != owner]
        return rest[_kvtrie._shard_owner([n for n, _ in rest], self.namespace, self.model_id,
                                         tokens, self.route_tokens)]

    def _replica(self, tokens: np.ndarray, fn, hit):
        """fn(second shard's client) when pin_replicas is 2 and hit(result); else None."""
        second = self._second(tokens)
        client = self._acquire(second) if second else None
        if client is None:
            return None
        try:
            result = fn(client)
        except Error as e:
            self._lost(second[0], e, "admin")
            return None
        if not hit(result):
            return None
        with self._lock:
            self.counters["replica_hits"] += 1
        return result

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def _previous_owner(self, tokens: np.ndarray, owner: str) -> Optional[Tuple[str, str]]:
        with self._lock:
            if (not self._previous or
                    time.monotonic() - self._changed_at > self._warmup_window):
                return None
            previous, current = list(self._previous), dict(self._shards)
        i = _kvtrie._shard_owner([n for n, _ in previous], self.namespace, self.model_id, tokens,
                                 self.route_tokens)
        name = previous[i][0]
        return None if name == owner else (name, current.get(name, previous[i][1]))

    def _warm_up(self, tokens: np.ndarray, owner: str, fn):
        """fn(previous owner's client) when a warm-up applies and it answers; else None."""
        if self._warmup_window <= 0:
            return None
        prev = self._previous_owner(tokens, owner)
        client = self._acquire(prev) if prev else None
        if client is None:
            return None
        try:
            result = fn(client)
        except Error as e:
            self._lost(prev[0], e, "admin")
            return None
        return result

    # --- one shard's client and its health -------------------------------------------------
    def _acquire(self, shard: Tuple[str, str]):
        from . import Client  # the package's, imported late (this module is imported by it)
        name, target = shard
        with self._lock:
            entry = self._clients.get(name)
            if entry is None or entry[0] != target:
                entry = (target, Client(target, self.model_id, **self._client_kwargs))
                self._clients[name] = entry
                self._down_until.pop(name, None)
                self._failures.pop(name, None)
                self._health_down.discard(name)
                self._next_probe.pop(name, None)
            if time.monotonic() < self._down_until.get(name, 0.0) or name in self._health_down:
                return None
            return entry[1]

    def _lost(self, name: str, e: Error, kind: str) -> bool:
        """Records a failed call; True when it is the shard's (then a read or put is a miss)."""
        if e.code not in LOST_SHARD_CODES:
            return False
        with self._lock:
            self.counters["shard_failures"] += 1
            if kind != "admin":
                self.counters["lost_calls"] += 1
            if kind == "put":
                self.counters["puts_skipped"] += 1
            n = min(self._failures.get(name, 0) + 1, 20)
            self._failures[name] = n
            d = min(self._down_backoff * 2 ** (n - 1), self._down_backoff * 30)
            self._down_until[name] = time.monotonic() + d * random.uniform(0.5, 1.0)
            if self._probe_deadline > 0 and name not in self._health_down:
                self._health_down.add(name)  # skipped past its backoff too, until a check answers
                self._next_probe[name] = time.monotonic() + self._probe_interval
            if self._dns is not None:
                self._next_refresh = min(self._next_refresh, time.monotonic() + 1.0)
        return True

    def _ok(self, name: str) -> None:
        with self._lock:
            self._failures.pop(name, None)

    def _miss(self, kind: str) -> None:
        with self._lock:
            self.counters["lost_calls"] += 1
            if kind == "put":
                self.counters["puts_skipped"] += 1

    def _call(self, tokens: Any, kind: str, fn, miss):
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        try:
            name, target = self._owner(tokens)
        except Error:
            if kind == "admin":
                raise
            self._miss(kind)  # no shards: a miss
            return miss()
        client = self._acquire((name, target))
        if client is None:
            if kind == "admin":
                raise Error(StatusCode.UNAVAILABLE, f"shard {name} is down; nothing done")
            self._miss(kind)
            return miss()
        try:
            result = fn(client, tokens)
        except Error as e:
            if self._lost(name, e, kind) and kind != "admin":
                return miss()
            raise
        self._ok(name)
        return result

    # --- the calls -------------------------------------------------------------------------
    def lookup(self, tokens: Any) -> int:
        """As :meth:`kvtrie.Client.lookup`, on the owner; 0 when it is lost (or, with a
        warm-up, the previous owner's answer)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        n = self._call(tokens, "read", lambda c, t: c.lookup(t), lambda: 0)
        if n == 0:
            owner = self._owner_or_none(tokens)
            w = owner and self._warm_up(tokens, owner, lambda c: c.lookup(tokens))
            if w:
                with self._lock:
                    self.counters["warmup_hits"] += 1
                return w
            r = self._replica(tokens, lambda c: c.lookup(tokens), lambda m: m > 0)
            if r:
                return r
        return n

    def put(self, tokens: Any, k: np.ndarray, v: np.ndarray, *args: Any, **kwargs: Any):
        """As :meth:`kvtrie.Client.put`, on the owner; when it is lost nothing is stored and the
        result has ``stored_tokens == 0`` (counted in ``counters["puts_skipped"]``)."""
        from . import PutResult
        return self._call(tokens, "put", lambda c, t: c.put(t, k, v, *args, **kwargs),
                          lambda: PutResult(0, 0, 0, 0, ()))

    def put_layers(self, tokens: Any, num_layers: int, *args: Any,
                   **kwargs: Any) -> "_ShardedPutStream":
        """As :meth:`kvtrie.Client.put_layers`, on the owner. When the owner is lost (down when
        opened, or failing a write or the commit with a lost shard's status) the rest of the
        stream is discarded and :meth:`commit` returns a result with 0 stored tokens (counted in
        ``counters["puts_skipped"]``)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        try:
            name, target = self._owner(tokens)
        except Error:  # no shards: nothing stored
            self._miss("put")
            return _ShardedPutStream(self, "", None)
        client = self._acquire((name, target))
        stream = None if client is None else client.put_layers(tokens, num_layers, *args,
                                                                **kwargs)
        if stream is None:
            self._miss("put")
        return _ShardedPutStream(self, name, stream)

    def get(self, tokens: Any, *args: Any, **kwargs: Any) -> Tuple[np.ndarray, np.ndarray, int]:
        """As :meth:`kvtrie.Client.get`, on the owner; ``(empty, empty, 0)`` when it is lost."""
        def miss():
            empty = np.empty((0, 0, 0, 0), np.float16)
            return empty, empty.copy(), 0
        tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
        k, v, n = self._call(tokens, "read", lambda c, t: c.get(t, *args, **kwargs), miss)
        if n == 0:
            owner = self._owner_or_none(tokens)
            w = owner and self._warm_up(tokens, owner, lambda c: c.get(tokens, *args, **kwargs))
            if w and w[2] > 0:
                k, v, n = w
                with self._lock:
                    self.counters["warmup_hits"] += 1
                target = dict(self.shards).get(owner)
                # Not a layer range (get's fourth argument): its arrays hold some layers only,
                # and put as the model they would register it on the new owner with that many.
                whole = kwargs.get("layers", args[2] if len(args) > 2 else None) is None
                new = self._acquire((owner, target)) if target and whole else None
                try:
                    if new is not None:
                        new.put(tokens[:n], k, v, **self._warmup_put)
                        with self._lock:
                            self.counters["warmup_copies"] += 1
                except Error as e:
                    self._lost(owner, e, "admin")
        if n == 0:
            r = self._replica(tokens, lambda c: c.get(tokens, *args, **kwargs),
                              lambda g: g[2] > 0)
            if r:
                k, v, n = r
        return k, v, n

    def delete(self, tokens: Any, erase: bool = False) -> dict:
        """As :meth:`kvtrie.Client.delete`, on the owner (raises when it is lost); with
        ``pin_replicas=2`` also on the second shard and, inside the warm-up window, on the
        previous owner (a copy must not outlive its delete), even when the owner is lost;
        ``erase`` goes to each of them."""
        t = np.ascontiguousarray(tokens, dtype=np.uint32)
        error: Optional[Error] = None
        try:
            result = self._call(t, "admin", lambda c, t: c.delete(t, erase), None)
        except Error as e:
            error = e
        owner = self._owner_or_none(t) if self._warmup_window > 0 else None
        if owner is not None:
            self._warm_up(t, owner, lambda c: c.delete(t, erase))
        second = self._second(t)
        if second is not None:
            client = self._acquire(second)
            try:
                if client is None:
                    raise Error(StatusCode.UNAVAILABLE, f"shard {second[0]} is down")
                client.delete(t, erase)
            except Error as e:
                self._lost(second[0], e, "admin")
                self._count("replica_failures")
        if error is not None:
            raise error
        return result

    def pin(
        self, tokens: Any, ttl_seconds: int = 0, unpin: bool = False, extend_only: bool = False
    ) -> int:
        """As :meth:`kvtrie.Client.pin`, on the owner (raises when it is lost); with
        ``pin_replicas=2`` the prefix is then copied to its second shard and pinned there (a
        failed copy is counted in ``counters["replica_failures"]``, not raised)."""
        result = self._call(
            tokens, "admin", lambda c, t: c.pin(t, ttl_seconds, unpin, extend_only), None
        )
        t = np.ascontiguousarray(tokens, dtype=np.uint32)
        second = self._second(t)
        if second is None:
            return result
        owner, replica = self._acquire(self._owner(t)), self._acquire(second)
        try:
            if owner is None or replica is None:
                raise Error(StatusCode.UNAVAILABLE, "a shard is down")
            if not unpin:
                k, v, n = owner.get(t)
                if n == 0:
                    raise Error(StatusCode.NOT_FOUND, "the owner no longer stores it")
                replica.put(t[:n], k, v, **self._warmup_put)
            replica.pin(t, ttl_seconds, unpin, extend_only)
            if not unpin:
                self._count("replica_copies")
        except Error as e:
            self._lost(second[0], e, "admin")
            self._count("replica_failures")
        return result

    def stats_all(self, namespace: Optional[str] = None) -> Dict[str, Any]:
        """Every shard's :meth:`kvtrie.Client.stats` by name; a lost shard's entry is the
        :class:`kvtrie.Error` it raised (it is then skipped for its backoff)."""
        out: Dict[str, Any] = {}
        for shard in self.shards:
            client = self._acquire(shard)
            if client is None:
                out[shard[0]] = Error(StatusCode.UNAVAILABLE, f"shard {shard[0]} is down")
                continue
            try:
                out[shard[0]] = client.stats(namespace)
                self._ok(shard[0])
            except Error as e:
                self._lost(shard[0], e, "admin")
                out[shard[0]] = e
        return out

    def stats(self, namespace: Optional[str] = None) -> dict:
        """The counters of every shard that answered, summed (``max_*`` the largest), with
        ``shards_answered`` and ``shards_total``. Ratios are recomputed from the sums."""
        per = self.stats_all(namespace)
        answered = [s for s in per.values() if isinstance(s, dict)]
        total: Dict[str, Any] = {}
        for s in answered:
            for key, value in s.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if key.startswith("max_"):
                    total[key] = max(total.get(key, 0), value)
                else:
                    total[key] = total.get(key, 0) + value
        stored = total.get("bytes_stored", 0)
        total["compression_ratio"] = total.get("bytes_logical", 0) / stored if stored else 0.0
        total.pop("bits_per_component", None)
        total.pop("mean_rel_rms_error_k", None)
        total.pop("mean_rel_rms_error_v", None)
        total["shards_answered"] = len(answered)
        total["shards_total"] = len(per)
        return total

    def __repr__(self) -> str:
        return (f"kvtrie.ShardedClient(model_id={self.model_id!r}, "
                f"shards={[n for n, _ in self.shards]!r})")


def _run_prober(ref: "weakref.ref[ShardedClient]", stop: threading.Event) -> None:
    """The background health checks of a ShardedClient, until it is closed or collected."""
    while True:
        client = ref()
        if client is None:
            return
        tick = min(max(client._probe_deadline / 4, 0.005), 0.1)
        try:
            client._probe_once()
        except Exception:  # noqa: BLE001 - the prober must outlive any one pass
            pass
        del client
        if stop.wait(tick):
            return


class _ShardedPutStream:
    """The :class:`kvtrie.PutStream` of a prefix's owner, or a discarding one when it is lost."""

    def __init__(self, sharded: ShardedClient, name: str, stream: Any) -> None:
        self._sharded = sharded
        self._name = name
        self._stream = stream  # None: the owner is lost, writes are dropped
        self._done = False

    def _lost(self, e: Error) -> None:
        if not self._sharded._lost(self._name, e, "put"):
            raise e
        if self._stream is not None:
            try:
                self._stream.cancel()
            except Error:
                pass
        self._stream = None

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, *, token_offset: int = 0) -> None:
        if self._stream is None:
            return
        try:
            self._stream.write(layer, k, v, token_offset=token_offset)
        except Error as e:
            self._lost(e)

    def commit(self) -> Any:
        from . import PutResult
        self._done = True
        if self._stream is not None:
            try:
                result = self._stream.commit()
                self._sharded._ok(self._name)
                return result
            except Error as e:
                self._lost(e)
        return PutResult(0, 0, 0, 0, ())

    def cancel(self) -> None:
        self._done = True
        if self._stream is not None:
            self._stream.cancel()

    def __enter__(self) -> "_ShardedPutStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.cancel()
