"""kvtrie.ShardedClient — N kvtrie servers (shards) used as one cache, from Python.

A thin wrapper over the C++ ``kvtrie::ShardedClient`` (client/sharded_client.h, bound as
``_kvtrie._ShardedClient``): the routing, the failure and backoff policy, the codes that mean a
lost shard, the health checks, the warm-up and the replicas are the C++ client's, the same as the
CLI's and every C++ caller's. Each call for a prefix goes to its owner: the shard whose *name*
wins the rendezvous hash of (namespace, model_id, the first ``route_tokens`` token ids), so a
prefix, its extensions and near-duplicates sharing the first block live on one shard.

A lost shard is a miss, never an error: when the owner is down, past its deadline or refusing
(:data:`LOST_SHARD_CODES`: UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED,
CANCELLED, UNKNOWN, INTERNAL, DATA_LOSS), ``lookup`` answers 0, ``get`` an empty result, ``put``
(and a ``put_layers`` stream) stores nothing (a :class:`PutResult` with 0 stored tokens) and
counts it in ``counters["puts_skipped"]``. The shard is then skipped for a jittered backoff, drawn
from ``[d/2, d]`` with ``d = min(down_backoff * 2**(n-1), down_max_backoff)`` after ``n``
failures in a row (``down_max_backoff`` by default 30 x ``down_backoff``, the CLI's rule), and
until a background health check of it (grpc.health.v1.Health/Check)
answers. A shard that stops answering without closing its connection (SIGSTOP, a hung host) is
found by those checks, which have a deadline of their own (``shard_probe_deadline``, 0.25 s): a
call that has waited that long has its shard checked, and when the check misses, the call (and
every other in flight there) is cancelled and answers a miss — ~2 x 0.25 s instead of the call's
``timeout`` (60 s). The caller's own errors (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, ...)
raise :class:`kvtrie.Error` as the plain :class:`Client`'s do; ``delete`` and ``pin`` always
raise (the caller must know they did not happen).

Where this module's former pure-Python policy differed from the C++ one, the C++ one holds
(issue 31): the backoff's cap is the C++ ``down_max_backoff`` (its default, 30 x
``down_backoff``, is the CLI's rule, kept in one place: ``DefaultDownMaxBackoff``); any answer of a shard (not only of a read or put) ends its run of failures; a membership is never
empty (an empty list is INVALID_ARGUMENT, a DNS answer with no shards keeps the last set);
``stats`` adds the shards up with the C++ ``MergeStats`` (bits_per_component and the mean
errors recomputed, histograms summed); a miss's arrays take their shape from the model spec this
client saw last (else ``(0, 0, 0, 0)``), without asking a shard; ``close`` ends the client.

Example::

    c = kvtrie.ShardedClient("stories260K",
                             shards="kvtrie-0=10.0.0.5:50051,kvtrie-1=10.0.0.6:50051")
    # or shards_dns="_grpc._tcp.kvtrie-headless.default.svc.cluster.local"
    c.put(tokens, k, v)
    k2, v2, n = c.get(tokens)       # n == 0 when the owner is down: recompute
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from . import _kvtrie
from ._client import Client, _encoding, _profile, _tls_options, _tokens
from ._errors import StatusCode, from_status
from ._types import ModelSpec, TlsConfig, TokenIds

__all__ = ["ShardedClient", "LOST_SHARD_CODES"]

#: The status codes of a lost shard (a miss), not of the call: the C++ client's LostShardCode.
LOST_SHARD_CODES = frozenset(c for c in StatusCode if _kvtrie._lost_shard_code(int(c)))

_WARMUP_PUT_KEYS = ("encoding", "profile", "target_rel_rms", "bits", "encode_on_client",
                    "learned_lossless")


def _warmup_put(put: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """_ShardedClient's warmup_* arguments of ``warmup_put`` (None: lossless, fast profile)."""
    put = {"encoding": "lossless", "profile": "fast"} if put is None else dict(put)
    unknown = sorted(set(put) - set(_WARMUP_PUT_KEYS))
    if unknown:
        raise from_status(StatusCode.INVALID_ARGUMENT,
                          f"warmup_put.{unknown[0]}: not one of {', '.join(_WARMUP_PUT_KEYS)}")
    return {"warmup_encoding": _encoding(put.get("encoding")),
            "warmup_profile": _profile(put.get("profile")),
            "warmup_target_rel_rms": float(put.get("target_rel_rms", 0.0)),
            "warmup_bits": int(put.get("bits", 0)),
            "warmup_encode_on_client": bool(put.get("encode_on_client", True)),
            "warmup_learned_lossless": bool(put.get("learned_lossless", False))}


class ShardedClient(Client):
    """A :class:`kvtrie.Client` over N shards: every call goes to the prefix's owner.

    ``lookup``, ``put``, ``put_layers``, ``get``, ``delete`` and ``pin`` take
    :class:`kvtrie.Client`'s arguments; ``stats``, ``stats_all`` and ``inspect`` answer for every
    shard.

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
        down_backoff: seconds a failed shard is skipped at first (doubling per failure in a row).
        down_max_backoff: the most seconds it is skipped (None: 30 x ``down_backoff``, as the
            CLI's ``--shard_down_backoff_ms``; a smaller value also caps ``down_backoff``).
        warmup_window: seconds after the shard names change during which a lookup or get that
            misses on (or loses) a prefix's new owner asks its previous owner once; a get
            answered there is also put to the new owner (``warmup_put`` are its put keyword
            arguments, of ``encoding``, ``profile``, ``target_rel_rms``, ``bits``,
            ``encode_on_client``, ``learned_lossless``; None, the default, is bit-exact:
            ``{"encoding": "lossless", "profile": "fast"}``, so a copy of a lossy prefix is not
            rounded again). 0 (the default): off.
        shard_probe_deadline: seconds: the deadline of a shard's health check, and how long a
            call waits before its shard is checked (the CLI's ``--shard_probe_deadline_ms``;
            0: no checks, a failed shard is skipped for its backoff only).
        shard_probe_interval: seconds between two checks of a down shard (0.5).
        pin_replicas: 2: a pinned prefix is also copied to (``warmup_put`` are the copy's put
            arguments) and pinned on its second shard in rendezvous order, ``delete`` and unpin
            reach both, and a lookup or get whose owner is lost or misses asks that shard once,
            so a pinned prefix survives one lost shard (CLI ``--pin_replicas``). 1 (default): off.
        token, tls, timeout, namespace, block_tokens, retry_attempts, retry_initial_backoff,
            retry_max_backoff, codec_threads, encode_on_client, predictor_refresh: every shard's
            connection, as :class:`kvtrie.Client`'s (``retry_attempts`` defaults to 1 here: a
            lost shard is a miss at once).

    Raises:
        Error: INVALID_ARGUMENT naming the argument (``shards``: neither or both given, a bad
            list); UNAVAILABLE when ``shards_dns`` does not resolve now.

    Thread-safe.
    """

    def __init__(self, model_id: str, *, shards: Optional[str] = None,
                 shards_dns: Optional[str] = None, route_tokens: int = 16,
                 refresh_interval: float = 30.0, down_backoff: float = 1.0,
                 down_max_backoff: Optional[float] = None, warmup_window: float = 0.0,
                 warmup_put: Optional[Dict[str, Any]] = None, pin_replicas: int = 1,
                 shard_probe_deadline: float = 0.25, shard_probe_interval: float = 0.5,
                 token: Optional[str] = None,
                 tls: Union[None, bool, TlsConfig, Mapping[str, Any]] = None,
                 timeout: float = 60.0, namespace: str = "", block_tokens: int = 16,
                 retry_attempts: int = 1, retry_initial_backoff: float = 0.1,
                 retry_max_backoff: float = 2.0, codec_threads: int = 0,
                 encode_on_client: bool = True, predictor_refresh: float = 10.0) -> None:
        self.model_id = model_id
        self.namespace = namespace
        self.block_tokens = int(block_tokens)
        self.encode_on_client = bool(encode_on_client)
        self._spec: Optional[ModelSpec] = None
        tls_options = _tls_options(tls)
        self.tls = bool(tls_options)
        self._c = _kvtrie._ShardedClient(
            model_id, namespace, token or "", float(timeout), shards=shards or "",
            shards_dns=shards_dns or "", route_tokens=int(route_tokens),
            refresh_interval=float(refresh_interval), down_backoff=float(down_backoff),
            down_max_backoff=-1.0 if down_max_backoff is None else float(down_max_backoff),
            warmup_window=float(warmup_window),
            block_tokens=self.block_tokens, pin_replicas=int(pin_replicas),
            shard_probe_deadline=float(shard_probe_deadline),
            shard_probe_interval=float(shard_probe_interval),
            retry_attempts=int(retry_attempts), retry_initial_backoff=float(retry_initial_backoff),
            retry_max_backoff=float(retry_max_backoff), codec_threads=int(codec_threads),
            predictor_refresh=float(predictor_refresh), **_warmup_put(warmup_put), **tls_options)
        options = self._c.options()
        self.route_tokens: int = options["route_tokens"]
        self.pin_replicas: int = options["pin_replicas"]
        self._probe_deadline: float = options["shard_probe_deadline"]
        self._probe_interval: float = options["shard_probe_interval"]

    def __repr__(self) -> str:
        return (f"kvtrie.ShardedClient(model_id={self.model_id!r}, "
                f"shards={[n for n, _ in self.shards]!r})")

    def _stored_spec(self) -> Optional[ModelSpec]:
        return None  # a miss's shape: the spec seen last, without asking a shard

    # --- membership --------------------------------------------------------------------------
    @property
    def shards(self) -> List[Tuple[str, str]]:
        """The current ``(name, target)`` shards, sorted by name."""
        return [tuple(s) for s in self._c.shards()]

    def set_shards(self, shards: str) -> None:
        """Replaces an explicit membership (``"name=host:port,..."``; INVALID_ARGUMENT naming
        ``shards`` for a bad or empty list, the membership then unchanged)."""
        self._c.set_shards(shards)

    def owner(self, tokens: TokenIds) -> str:
        """The name of the shard that owns the prefix ``tokens``."""
        return self._c.owner(_tokens(tokens))

    # --- the failure policy's state (the C++ client's) ---------------------------------------
    @property
    def counters(self) -> Dict[str, int]:
        """``lost_calls``, ``puts_skipped``, ``shard_failures``, ``warmup_hits``,
        ``warmup_copies``, ``replica_copies``, ``replica_hits``, ``replica_failures``,
        ``probes``, ``probe_failures``, ``calls_cancelled`` (a snapshot)."""
        return self._c.counters()

    def shard_state(self, name: str) -> Dict[str, Any]:
        """Shard ``name`` as the calls see it: ``failures_in_a_row``, ``down_for`` (seconds of
        backoff left), ``health_down`` (skipped until a check answers) and ``down`` (calls to it
        are misses now)."""
        return self._c.state(name)

    # --- calls that differ from Client's ------------------------------------------------------
    def pin(self, tokens: TokenIds, ttl_seconds: int = 0, unpin: bool = False,
            extend_only: bool = False, *, replicate: bool = True) -> int:
        """As :meth:`kvtrie.Client.pin`, on the owner (raises when it is lost); with
        ``pin_replicas=2`` and ``replicate`` the prefix is then copied to its second shard and
        pinned there (a failed copy is counted in ``counters["replica_failures"]``, not raised).
        ``replicate=False``: the owner only (a lease renewed per request)."""
        return int(self._c.pin(_tokens(tokens), int(ttl_seconds), bool(unpin), bool(extend_only),
                               owner_only=not replicate))

    def inspect(self, node_id: int = 0) -> Dict[str, Any]:
        """Every shard's :meth:`kvtrie.Client.inspect` by name (node ids are each shard's own;
        0 is every shard's root); a lost shard's entry is the :class:`kvtrie.Error` it raised."""
        return self._c.inspect(int(node_id))

    def stats_all(self, namespace: Optional[str] = None) -> Dict[str, Any]:
        """Every shard's :meth:`kvtrie.Client.stats` by name; a lost shard's entry is the
        :class:`kvtrie.Error` it raised (it is then skipped for its backoff)."""
        return self._c.stats_all(self.namespace if namespace is None else namespace)

    def stats(self, namespace: Optional[str] = None) -> dict:
        """The stats of every shard that answered added up (the C++ ``MergeStats``: counters
        summed, ``max_*`` the largest, ratios and mean errors recomputed, histograms summed),
        with ``shards_answered`` and ``shards_total``."""
        return self._c.stats(self.namespace if namespace is None else namespace)

    def close(self) -> None:
        """Ends the client: its health checks stop and later calls raise FAILED_PRECONDITION
        (also done, without the error, when it is collected)."""
        super().close()

