"""kvtrie.Client and its PutStream: the Python face of the C++ ``kvtrie::Client`` (the
extension module _kvtrie). Re-exported by :mod:`kvtrie`; import them from there."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _kvtrie
from ._errors import Error, InvalidArgumentError, NotFoundError, StatusCode
from ._types import Encoding, GetMode, ModelSpec, PathLike, PutResult, TlsConfig, TokenIds

__all__ = ["Client", "PutStream"]


def _read_pem(field: str, path: Optional[PathLike]) -> str:
    if path is None or path == "":
        return ""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _invalid(f"tls.{field}: cannot read '{os.fspath(path)}': {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise _invalid(f"tls.{field}: '{os.fspath(path)}' holds no PEM block (-----BEGIN ...)")
    return data.decode("ascii", errors="replace")


def _tls_options(tls: Union[None, bool, "TlsConfig", Mapping[str, Any]]) -> dict:
    """The TLS keyword arguments of _kvtrie._Client for ``tls`` (see :class:`Client`)."""
    if tls is None or tls is False:
        return {}
    if tls is True:
        return {"tls": True}
    if isinstance(tls, Mapping):
        unknown = sorted(set(tls) - {"ca", "cert", "key", "server_name"})
        if unknown:
            raise _invalid(f"tls.{unknown[0]}: unknown key (expected ca, cert, key, server_name)")
        tls = TlsConfig(**tls)
    if not isinstance(tls, TlsConfig):
        raise _invalid(f"tls: expected None, True, a TlsConfig or a mapping, got "
                       f"{type(tls).__name__}")
    if (tls.cert is None or tls.cert == "") != (tls.key is None or tls.key == ""):
        raise _invalid("tls.key: needed with tls.cert" if tls.key in (None, "")
                       else "tls.cert: needed with tls.key")
    return {"tls": True, "tls_root_pem": _read_pem("ca", tls.ca),
            "tls_cert_pem": _read_pem("cert", tls.cert),
            "tls_key_pem": _read_pem("key", tls.key),
            "tls_server_name": tls.server_name or ""}


def _invalid(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(StatusCode.INVALID_ARGUMENT, message)


def _tokens(tokens: TokenIds, name: str = "tokens") -> np.ndarray:
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise _invalid(f"{name}: expected a 1-D sequence of token ids, got shape {a.shape}")
    if a.size == 0:
        return np.empty(0, np.uint32)
    if a.dtype == np.uint32:
        return np.ascontiguousarray(a)
    if a.dtype.kind not in "iu":
        raise _invalid(f"{name}: expected integer token ids, got dtype {a.dtype}")
    if int(a.min()) < 0 or int(a.max()) > 0xFFFFFFFF:
        raise _invalid(f"{name}: token ids must lie in [0, 2**32)")
    return a.astype(np.uint32)


def _surprisal(surprisal: Optional[Sequence[float]]) -> Optional[np.ndarray]:
    if surprisal is None:
        return None
    s = np.ascontiguousarray(surprisal, dtype=np.float32)
    if s.ndim != 1:
        raise _invalid(f"surprisal: expected one value per token (1-D), got shape {s.shape}")
    return s


_PROFILES = {None: 0, "fast": 1, "compact": 2}


def _profile(profile: Optional[str]) -> int:
    key = profile.lower() if isinstance(profile, str) else profile
    if key not in _PROFILES:
        raise _invalid(f"profile: {profile!r} is not one of 'fast', 'compact' (or None)")
    return _PROFILES[key]


def _encoding(encoding: Union[None, str, int, Encoding]) -> int:
    if encoding is None:
        return int(Encoding.DEFAULT)
    if isinstance(encoding, str):
        try:
            return int(Encoding[encoding.upper()])
        except KeyError:
            names = ", ".join(e.name.lower() for e in Encoding)
            raise _invalid(f"encoding: '{encoding}' is not one of {names}") from None
    return int(Encoding(encoding))


#: ``kv_dtype`` spellings (the put's argument) -> kvtrie.v1.DType values. vLLM's cache_dtype
#: spellings are accepted too ("fp8" is E4M3, as in vLLM).
KV_DTYPES = {"fp16": 1, "bf16": 2, "fp32": 3, "fp8_e4m3": 4, "fp8_e5m2": 5, "uint8": 6,
             "fp8": 4, "fp8_e4m3fn": 4, "float8_e4m3fn": 4, "float8_e5m2": 5}


def _kv_dtype(kv_dtype: Optional[str]) -> int:
    if kv_dtype is None:
        return 0
    if kv_dtype not in KV_DTYPES:
        raise _invalid(f"kv_dtype: {kv_dtype!r} is not one of {sorted(KV_DTYPES)}")
    return KV_DTYPES[kv_dtype]


def _kv_dtype_name(value: int) -> Optional[str]:
    """ModelSpec.kv_dtype of a DType value: the one-byte dtypes' names, else None."""
    return {4: "fp8_e4m3", 5: "fp8_e5m2", 6: "uint8"}.get(value)


def _one_byte(name: Optional[str]) -> Optional[str]:
    return name if name in ("fp8_e4m3", "fp8_e5m2", "uint8") else None


def _mode(mode: Union[str, int, GetMode]) -> int:
    if isinstance(mode, str):
        try:
            return int(GetMode[mode.upper()])
        except KeyError:
            raise _invalid(f"mode: '{mode}' is not 'reconstructed' or 'residual'") from None
    return int(GetMode(mode))


def _array(a: Any) -> np.ndarray:
    # Zero-copy for a C-contiguous numpy array (or anything exposing one through __array__).
    return np.ascontiguousarray(a)


class _Closed:
    def __getattr__(self, name: str) -> Any:
        raise Error(StatusCode.FAILED_PRECONDITION, "client: closed")


class PutStream:
    """A Put sent layer by layer (from :meth:`Client.put_layers`); use it as a context manager.

    Call :meth:`write` for every layer (in any order, each exactly once, for every full block of
    the sequence from ``first_block`` on), then :meth:`commit`. Leaving the ``with`` block
    without a commit, or with an exception, cancels the Put: nothing is stored. Each write is
    sent at once (while the caller computes the next layer); the server stores the blocks only
    at the commit, all or nothing. Not for concurrent use from several threads.
    """

    def __init__(self, client: "Client", tokens: np.ndarray, num_layers: int,
                 surprisal: Optional[np.ndarray], options: Tuple[int, float, int, int, int, int],
                 kv_dtype: int = 0):
        self._client = client
        self._kv_dtype = int(kv_dtype)
        self._tokens = tokens
        self._num_layers = int(num_layers)
        self._surprisal = surprisal
        self._options = options
        self._stream: Optional[Any] = None  # _kvtrie._PutStream, opened at the first write
        self._done = False

    def write(self, layer: int, k: np.ndarray, v: np.ndarray, *, token_offset: int = 0) -> None:
        """Sends K and V of layer ``layer``.

        Args:
            layer: the (first) layer these arrays hold.
            k, v: ``[kv_heads, tokens, head_dim]`` for one layer, or
                ``[n, kv_heads, tokens, head_dim]`` for layers ``layer .. layer+n-1``.
            token_offset: the first token the arrays hold (a multiple of block_tokens); the
                full blocks inside ``[token_offset, token_offset + tokens)`` are sent.

        Raises:
            InvalidArgumentError: the arrays do not fit the stream (the field is named).
            Error: the server ended the stream (its status and message).
        """
        if self._done:
            raise Error(StatusCode.FAILED_PRECONDITION, "put: the stream was committed or cancelled")
        k, v = _array(k), _array(v)
        if k.ndim == 3:
            k = k[np.newaxis]
        if v.ndim == 3:
            v = v[np.newaxis]
        if self._stream is None:
            if k.ndim != 4:
                raise _invalid(f"k.shape: expected [kv_heads, tokens, head_dim] or "
                               f"[layers, kv_heads, tokens, head_dim], got {k.shape}")
            self._stream = self._client._c.open_put(
                self._tokens, self._surprisal, self._num_layers, k.shape[1], k.shape[3], k.dtype,
                *self._options, kv_dtype=self._kv_dtype)
            self._client._learn(ModelSpec(self._num_layers, k.shape[1], k.shape[3], k.dtype,
                                          _kv_dtype_name(self._kv_dtype)))
        self._stream.write(int(layer), int(token_offset), k, v)

    def commit(self) -> PutResult:
        """Stores the blocks sent; returns the server's :class:`PutResult`."""
        if self._stream is None:
            raise Error(StatusCode.FAILED_PRECONDITION, "put: nothing was written")
        if self._done:
            raise Error(StatusCode.FAILED_PRECONDITION, "put: the stream was committed or cancelled")
        self._done = True
        return PutResult._from_json(self._stream.commit())

    def cancel(self) -> None:
        """Ends the Put without storing anything (idempotent)."""
        self._done = True
        if self._stream is not None:
            self._stream.cancel()

    def __enter__(self) -> "PutStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.cancel()


class Client:
    """A connection to a kvtrie server for one model (``model_id``) in one namespace.

    Args:
        target: ``HOST:PORT`` of the server (``"127.0.0.1:50051"``).
        model_id: the model whose KV this client stores (``"stories260K"``); the rest of the
            model spec comes from the arrays of the first :meth:`put`.
        token: a bearer token, sent as ``authorization: Bearer <token>`` on every call (for
            servers run with ``--tokens_file``; a missing or unknown one is UNAUTHENTICATED).
        tls: None or False: plaintext. True: TLS, the server's certificate checked against the
            system's roots. A :class:`TlsConfig` (or a mapping with its keys, ``{"ca": path,
            "cert": path, "key": path, "server_name": name}``): TLS with that CA, and the
            client certificate for mutual TLS. The PEM files are read here; an unreadable one,
            or a cert without its key, raises INVALID_ARGUMENT naming ``tls.ca`` / ``tls.cert`` /
            ``tls.key``. A TLS client talking to a plaintext server (or the reverse), or one
            whose CA does not sign the server's certificate, gets UNAVAILABLE on its calls.
        timeout: deadline of each call (each attempt of it), in seconds.
        namespace: the namespace of every call (nothing is shared across namespaces).
        block_tokens: tokens per block for Puts (the first Put of a model fixes it).
        retry_attempts: attempts of one call, the first included (1 = never retry). A Put (and
            a :class:`PutStream`, which keeps a copy of what it sent, up to 256 MiB) that ends
            ABORTED — the server stored nothing because the prefix kept changing under
            concurrent Puts — or UNAVAILABLE is sent again, whole; lookup, stats and inspect are
            sent again after UNAVAILABLE, get after UNAVAILABLE or ABORTED (a centroid or learned
            state a RESIDUAL block names was deleted after the listing); delete and pin never
            are. The caller sees the error only when every attempt failed.
        retry_initial_backoff, retry_max_backoff: the wait before the n-th retry is drawn from
            ``[d/2, d]``, ``d = min(retry_max_backoff, retry_initial_backoff * 2**(n-1))``
            seconds.
        codec_threads: threads that encode a put and decode a RESIDUAL get (the caller's
            included); 0 = the machine's cores, 1 = the calling thread only.
        encode_on_client: the default of :meth:`put`'s ``encode_on_client`` (True: puts are
            encoded here; False: sent dense, the server encodes them — thin clients).
        predictor_refresh: seconds an encoding residual put uses the latest learned predictor
            state version it found before asking the server again (0 = before every put). A
            version the server has freed is noticed at once: the put is encoded again against
            the latest, and the caller sees no error.

    Thread-safe: one Client may be used from many threads at once (the GIL is released during
    every call). Creating it does not contact the server; a call to a server that is down raises
    :class:`Error` with ``StatusCode.UNAVAILABLE``.
    """

    def __init__(self, target: str, model_id: str, token: Optional[str] = None,
                 tls: Union[None, bool, TlsConfig, Mapping[str, Any]] = None,
                 timeout: float = 60.0, *, namespace: str = "", block_tokens: int = 16,
                 retry_attempts: int = 5, retry_initial_backoff: float = 0.1,
                 retry_max_backoff: float = 2.0, codec_threads: int = 0,
                 encode_on_client: bool = True, predictor_refresh: float = 10.0) -> None:
        tls_options = _tls_options(tls)
        self.target = target
        self.model_id = model_id
        self.namespace = namespace
        self.block_tokens = int(block_tokens)
        self._spec: Optional[ModelSpec] = None
        self.tls = bool(tls_options)
        self.encode_on_client = bool(encode_on_client)
        self._c = _kvtrie._Client(target, model_id, namespace, token or "", float(timeout),
                                  retry_attempts=int(retry_attempts),
                                  retry_initial_backoff=float(retry_initial_backoff),
                                  retry_max_backoff=float(retry_max_backoff),
                                  codec_threads=int(codec_threads),
                                  predictor_refresh=float(predictor_refresh), **tls_options)

    def __repr__(self) -> str:
        return (f"kvtrie.Client(target={self.target!r}, model_id={self.model_id!r}, "
                f"namespace={self.namespace!r}, tls={self.tls})")

    @property
    def spec(self) -> Optional[ModelSpec]:
        """The model spec seen last (from a Put's arrays or a Get's header), or None."""
        return self._spec

    def _learn(self, spec: ModelSpec) -> None:
        self._spec = spec

    def lookup(self, tokens: TokenIds) -> int:
        """Tokens of the longest stored block-aligned prefix of ``tokens`` (0 on a miss).

        Cheap: no payload moves.
        """
        return int(self._c.lookup(_tokens(tokens)))

    def put(self, tokens: TokenIds, k: np.ndarray, v: np.ndarray,
            surprisal: Optional[Sequence[float]] = None,
            encoding: Union[None, str, Encoding] = None, target_rel_rms: float = 0.0, *,
            bits: int = 0, first_block: int = 0, layers_per_message: int = 0,
            encode_on_client: Optional[bool] = None, profile: Optional[str] = None,
            learned_lossless: bool = False, kv_dtype: Optional[str] = None) -> PutResult:
        """Stores the KV of ``tokens``; blocks already stored are acknowledged as deduplicated.

        Args:
            tokens: the token ids (``len(tokens) == k.shape[2]``).
            k, v: ``[layers, kv_heads, tokens, head_dim]``, the same shape and dtype (float16,
                float32, or uint16 = bfloat16). Read in place when C-contiguous.
            surprisal: ``-log2 p(token_i | tokens_<i)`` in bits, one per token (0 for BOS), or
                None.
            encoding: ``"raw"``, ``"lossless"``, ``"residual"``, ``"int8"``, ``"kivi2"``,
                ``"turboquant"`` (or :class:`Encoding`); None = the server's default.
            target_rel_rms: RESIDUAL: the relative RMS error target of every (layer, K/V) plane
                of a block; 0 = the server's default.
            bits: TURBOQUANT bits per component (0 = 3).
            first_block: blocks before it are not sent (a :meth:`lookup` said they are stored).
            layers_per_message: layers per gRPC message (0 = a whole block per message; > 0
                sends the blocks dense).
            encode_on_client: None = the client's setting (True unless constructed with
                False). True: the blocks are encoded here and sent encoded whenever this client
                can code the request — raw, lossless, residual with ``target_rel_rms > 0``, of
                the fast profile, and the server's default encoding once a first put has shown
                which it is; anything else is sent dense. False: dense KV, the server encodes.
            profile: ``"fast"`` (None means fast) or ``"compact"`` (~15 % fewer bits, ~10x slower;
                only the server encodes it, so such puts travel dense).
            learned_lossless: lossless of the fast profile: also code each block against the
                namespace's latest learned state, kept when smaller (bit-exact; ~1.56x smaller
                than fp16 on held-out text instead of 1.12x, 2.0x for bf16; but it encodes at
                ~0.1-0.3 GB/s per core instead of ~2: ``bench/lossless.md``).
            kv_dtype: what one-byte ``uint8`` arrays hold: ``"fp8_e4m3"`` (vLLM's ``fp8`` /
                ``fp8_e4m3``), ``"fp8_e5m2"`` or ``"uint8"`` (None: the arrays' dtype decides;
                a uint8 array without it is INVALID_ARGUMENT). Such blocks are stored bit-exact:
                ``encoding`` None stores them lossless, a lossy one is INVALID_ARGUMENT
                (``model.dtype: fp8_e4m3 blocks can be stored RAW or LOSSLESS only ...``).

        Returns:
            :class:`PutResult` (stored and deduplicated blocks, bytes, achieved errors).

        Raises:
            InvalidArgumentError: shapes, dtypes or the token count do not agree, or the spec
                differs from the one stored for this model (the message names the field).
            Error: any other failure (UNAVAILABLE, RESOURCE_EXHAUSTED, ...).
        """
        t = _tokens(tokens)
        k, v = _array(k), _array(v)
        encode = self.encode_on_client if encode_on_client is None else bool(encode_on_client)
        result = PutResult._from_json(self._c.put(
            t, k, v, _surprisal(surprisal), _encoding(encoding), float(target_rel_rms), int(bits),
            self.block_tokens, int(first_block), int(layers_per_message),
            encode_on_client=encode, profile=_profile(profile),
            learned_lossless=bool(learned_lossless), kv_dtype=_kv_dtype(kv_dtype)))
        self._learn(ModelSpec(k.shape[0], k.shape[1], k.shape[3], k.dtype,
                              _kv_dtype_name(_kv_dtype(kv_dtype))))
        return result

    def put_layers(self, tokens: TokenIds, num_layers: int,
                   surprisal: Optional[Sequence[float]] = None,
                   encoding: Union[None, str, Encoding] = None, target_rel_rms: float = 0.0, *,
                   bits: int = 0, first_block: int = 0,
                   layers_per_message: int = 0, kv_dtype: Optional[str] = None) -> PutStream:
        """Opens a Put to be sent layer by layer as a worker computes it.

        Arguments as for :meth:`put`; ``num_layers`` is the model's layer count. The layers are
        sent dense, as they come (the server encodes them: encoding needs whole blocks; gather
        the layers and call :meth:`put` to encode here, as the connector does). The returned
        :class:`PutStream` takes each layer's ``[kv_heads, tokens, head_dim]`` K and V with
        :meth:`PutStream.write` and stores everything at :meth:`PutStream.commit`::

            with client.put_layers(tokens, num_layers=5) as s:
                for layer in range(5):
                    s.write(layer, k[layer], v[layer])   # sent now, while the next is computed
                result = s.commit()
        """
        return PutStream(self, _tokens(tokens), num_layers, _surprisal(surprisal),
                         (_encoding(encoding), float(target_rel_rms), int(bits), self.block_tokens,
                          int(first_block), int(layers_per_message)), _kv_dtype(kv_dtype))

    def get(self, tokens: TokenIds, mode: Union[str, GetMode] = "reconstructed",
            max_blocks: int = 0, layers: Optional[Tuple[int, int]] = None
            ) -> Tuple[np.ndarray, np.ndarray, int]:
        """KV of the longest stored prefix of ``tokens``.

        Args:
            tokens: the token ids to match.
            mode: ``"reconstructed"`` (the server decodes) or ``"residual"`` (the stored
                encoding travels and this client decodes it, in C++, GIL released).
            max_blocks: at most this many blocks (0 = all matched).
            layers: ``(begin, end)``: only layers ``[begin, end)`` of each block travel (the
                server sends no other; ``"reconstructed"`` mode only), e.g. to load a model
                layer group by layer group. The arrays' first axis is then ``end - begin``.
                None (default): all layers.

        Returns:
            ``(k, v, matched_tokens)``: k and v ``[layers, kv_heads, matched_tokens, head_dim]``
            in the stored dtype (uint16 for bfloat16), owning their memory (no copy). On a miss
            ``matched_tokens`` is 0 and the arrays have 0 tokens (shape ``(0, 0, 0, 0)`` if the
            model is not stored at all).

        Raises:
            Error: DATA_LOSS for a stored block that failed its checksum, UNAVAILABLE,
                INVALID_ARGUMENT naming ``layer_begin`` (a range in ``"residual"`` mode, an empty
                range) or ``layer_end`` (past the model's layers), ...
        """
        lb, le = (0, 0) if layers is None else (int(layers[0]), int(layers[1]))
        if layers is not None and (lb < 0 or le <= lb):
            raise _invalid(f"layer_begin: layers {tuple(layers)} is not a range "
                           "(begin, end > begin)")
        for name, x in (("layer_begin", lb), ("layer_end", le)):
            if x > 0xFFFFFFFF:  # the wire's uint32
                raise _invalid(f"{name}: {x} is past any model's layers")
        k, v, n, spec = self._c.get(_tokens(tokens), _mode(mode), int(max_blocks), lb, le)
        if spec is not None:
            if layers is None:  # a range's spec holds only its layers
                self._learn(ModelSpec(*spec[:4], _one_byte(spec[4])))
            return k, v, int(n)
        if layers is not None:
            return k, v, 0
        s = self._spec or self._stored_spec()
        if s is None:
            return k, v, 0
        empty = np.empty((s.num_layers, s.num_kv_heads, 0, s.head_dim), s.dtype)
        return empty, empty.copy(), 0

    def _stored_spec(self) -> Optional[ModelSpec]:
        try:
            m = self._c.inspect(0).get("model", {})
        except NotFoundError:
            return None
        dtypes = {"DTYPE_FP16": (np.float16, "fp16"), "DTYPE_FP32": (np.float32, "fp32"),
                  "DTYPE_BF16": (np.uint16, "bf16"), "DTYPE_FP8_E4M3": (np.uint8, "fp8_e4m3"),
                  "DTYPE_FP8_E5M2": (np.uint8, "fp8_e5m2"), "DTYPE_UINT8": (np.uint8, "uint8")}
        if m.get("dtype") not in dtypes:
            return None
        np_dtype, name = dtypes[m["dtype"]]
        spec = ModelSpec(int(m["num_layers"]), int(m["num_kv_heads"]), int(m["head_dim"]),
                         np.dtype(np_dtype), _one_byte(name))
        self._learn(spec)
        return spec

    def stats(self, namespace: Optional[str] = None) -> dict:
        """Server statistics (kvtrie.v1.StatsResponse as a dict, the .proto's field names).

        ``namespace=None`` means this client's namespace; ``""`` with a client in the default
        namespace gives the whole server.
        """
        return self._c.stats(self.namespace if namespace is None else namespace)

    def inspect(self, node_id: int = 0) -> dict:
        """One node of this model's trie (0 = the root) and its children, as a dict
        (kvtrie.v1.InspectResponse: ``model``, ``node``, ``children``)."""
        return self._c.inspect(int(node_id))

    def delete(self, tokens: TokenIds, erase: bool = False) -> dict:
        """Deletes the stored prefix ``tokens``' last block and its subtree.

        Returns ``{"nodes_deleted": n, "bytes_freed": b, "bytes_rewritten": r, ...}``
        (kvtrie.v1.DeleteResponse; zero fields left out): bit-exact near-duplicates coded
        against the prefix are re-encoded first (``centroids_reelected``), so the store changes
        by ``b - r`` bytes; a centroid with lossy members stays, unnamed, until its last member
        goes (``centroids_retained``, ``nodes_retained``). ``erase=True`` (DeleteRequest.erase):
        nothing of the deleted blocks stays on the server's disk; no centroid is retained, its
        members are re-coded bit-exact (``erase_bytes_rewritten``) and the server compacts its
        database (``erased``). Raises NotFoundError if not stored.
        """
        return self._c.delete(_tokens(tokens), bool(erase))

    def pin(
        self, tokens: TokenIds, ttl_seconds: int = 0, unpin: bool = False, extend_only: bool = False
    ) -> int:
        """Keeps the stored prefix ``tokens`` from eviction for ``ttl_seconds`` (0 = until
        unpinned), or removes the pin (``unpin=True``). ``extend_only=True`` is a lease: it never
        shortens the node's pin (one until unpinned, or a longer one, stays). Returns the pinned
        node's id. Raises NotFoundError if the prefix is not stored."""
        return int(self._c.pin(_tokens(tokens), int(ttl_seconds), bool(unpin), bool(extend_only)))

    def close(self) -> None:
        """Drops the connection (calls in flight on other threads finish first); later calls
        raise :class:`Error` FAILED_PRECONDITION."""
        self._c = _Closed()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
