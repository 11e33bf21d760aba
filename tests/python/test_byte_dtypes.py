"""FP8 and uint8 KV caches (issue 32 row 3) through kvtrie.Client and a real kvtrie-server: the
real stories260K KV of tests/data rounded to FP8 E4M3 / E5M2 (as vLLM's --kv-cache-dtype fp8
pages hold it) and plain uint8, stored bit-exact (raw and lossless, encoded on the client or by
the server) and read back byte for byte; lossy encodings refused naming the field; a uint8
array without ``kv_dtype`` refused as ambiguous."""

from __future__ import annotations

import numpy as np
import pytest

import kvtrie
from conftest import TESTDATA, ServerProcess, read_dump

SESSION = TESTDATA / "sessions" / "s0"


def fp8_values(kind: str) -> np.ndarray:
    """The value of each non-negative code 0..127 (NaN / inf where the format has them)."""
    c = np.arange(128)
    if kind == "fp8_e4m3":
        e, m = c >> 3, c & 7
        v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
        return np.where((e == 15) & (m == 7), np.nan, v)
    e, m = c >> 2, c & 3
    v = np.where(e == 0, m / 4.0 * 2.0 ** -14, (1 + m / 4.0) * 2.0 ** (e - 15.0))
    return np.where(e == 31, np.inf, v)


def to_fp8(x: np.ndarray, kind: str) -> np.ndarray:
    """Nearest finite FP8 code of each value (saturating), as uint8."""
    vals = fp8_values(kind)
    codes = np.nonzero(np.isfinite(vals))[0]
    pos = vals[codes]
    a = np.minimum(np.abs(x.astype(np.float64)), pos[-1])
    i = np.clip(np.searchsorted(pos, a), 1, len(pos) - 1)
    nearer = np.where(a - pos[i - 1] <= pos[i] - a, i - 1, i)
    return (codes[nearer] | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


@pytest.fixture(scope="module")
def kv():
    tokens, _, k, v = read_dump(SESSION)
    return tokens, k, v


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "uint8"])
@pytest.mark.parametrize("encoding,encode_on_client",
                         [("lossless", True), ("lossless", False), ("raw", True), (None, False)])
def test_one_byte_caches_round_trip_bit_exact(server, kv, kv_dtype, encoding, encode_on_client):
    tokens, k, v = kv
    if kv_dtype == "uint8":
        kb, vb = k.view(np.uint8)[..., ::2].copy(), v.view(np.uint8)[..., ::2].copy()
    else:
        kb, vb = to_fp8(k, kv_dtype), to_fp8(v, kv_dtype)
    ns = f"{kv_dtype}-{encoding}-{encode_on_client}"
    c = kvtrie.Client(server.target, "stories260K", namespace=ns)
    r = c.put(tokens, kb, vb, encoding=encoding, encode_on_client=encode_on_client,
              kv_dtype=kv_dtype)
    assert r.stored_tokens == len(tokens) // 16 * 16
    want = "raw" if encoding == "raw" else "lossless"  # an unnamed encoding: lossless
    assert {b.encoding for b in r.blocks if b.disposition == "stored"} == {want}
    if encoding != "raw" and kv_dtype != "uint8":  # (the uint8 case: fp16 low bytes, noise)
        assert r.bytes_stored < r.bytes_logical  # zstd of FP8 KV's bytes
    assert c.spec.kv_dtype == kv_dtype
    k2, v2, n = c.get(tokens)
    assert n == r.stored_tokens and k2.dtype == np.uint8
    assert np.array_equal(k2, kb[:, :, :n]) and np.array_equal(v2, vb[:, :, :n])
    assert c.spec.kv_dtype == kv_dtype and c.spec.dtype == np.uint8
    model = kvtrie.Client(server.target, "stories260K", namespace=ns).inspect(0)["model"]
    assert model["dtype"] == "DTYPE_" + kv_dtype.upper()
    # Layer by layer (PutStream), after the first blocks: the same bytes.
    c2 = kvtrie.Client(server.target, "stories260K", namespace=ns + "-layers")
    with c2.put_layers(tokens, num_layers=k.shape[0], kv_dtype=kv_dtype) as s:
        for layer in range(k.shape[0]):
            s.write(layer, kb[layer], vb[layer])
        assert s.commit().stored_tokens == r.stored_tokens
    k3, v3, _ = c2.get(tokens)
    assert np.array_equal(k3, kb[:, :, :n]) and np.array_equal(v3, vb[:, :, :n])


def test_lossy_encodings_of_fp8_are_refused_naming_the_field(server, kv):
    tokens, k, v = kv
    kb, vb = to_fp8(k, "fp8_e4m3"), to_fp8(v, "fp8_e4m3")
    c = kvtrie.Client(server.target, "stories260K", namespace="fp8-lossy")
    # Sent dense: the server refuses it (the header's encoding against the model's dtype).
    for encoding in ("residual", "int8", "kivi2", "turboquant"):
        with pytest.raises(kvtrie.InvalidArgumentError,
                           match=r"model\.dtype: fp8_e4m3 blocks can be stored RAW or LOSSLESS "
                                 r"only; encoding\.encoding ENCODING_[A-Z0-9]+ is lossy"):
            c.put(tokens, kb, vb, encoding=encoding, target_rel_rms=0.05,
                  encode_on_client=False, kv_dtype="fp8_e4m3")
    # Encoded here: the codec refuses it before anything is sent.
    with pytest.raises(kvtrie.InvalidArgumentError,
                       match="dtype: fp8_e4m3 blocks can be stored RAW or LOSSLESS only"):
        c.put(tokens, kb, vb, encoding="residual", target_rel_rms=0.05, kv_dtype="fp8_e4m3")
    assert c.lookup(tokens) == 0  # nothing was stored


def test_a_uint8_array_needs_kv_dtype_and_the_model_keeps_its_dtype(server, kv):
    tokens, k, v = kv
    kb, vb = to_fp8(k, "fp8_e5m2"), to_fp8(v, "fp8_e5m2")
    c = kvtrie.Client(server.target, "stories260K", namespace="fp8-ambiguous")
    with pytest.raises(kvtrie.InvalidArgumentError, match=r"k\.dtype: uint8 is ambiguous"):
        c.put(tokens, kb, vb)
    with pytest.raises(kvtrie.InvalidArgumentError, match="kv_dtype: 'fp9'"):
        c.put(tokens, kb, vb, kv_dtype="fp9")
    with pytest.raises(kvtrie.InvalidArgumentError, match="does not hold kv_dtype fp8_e5m2"):
        c.put(tokens, k, v, kv_dtype="fp8_e5m2")  # float16 arrays
    c.put(tokens, kb, vb, kv_dtype="fp8_e5m2")
    # The same model_id in E4M3 is another model: refused naming model.dtype.
    with pytest.raises(kvtrie.InvalidArgumentError, match="model.dtype"):
        c.put(tokens, kb, vb, kv_dtype="fp8_e4m3", encode_on_client=False)


def test_a_lossy_server_default_stores_fp8_lossless(tmp_path, kv):
    tokens, k, v = kv
    kb, vb = to_fp8(k, "fp8_e4m3"), to_fp8(v, "fp8_e4m3")
    s = ServerProcess(tmp_path / "data", ["--default_encoding=residual"])
    try:
        for on_client in (False, True):
            c = kvtrie.Client(s.target, "stories260K", namespace=f"default-{on_client}")
            r = c.put(tokens, kb, vb, encode_on_client=on_client, kv_dtype="fp8_e4m3")
            assert {b.encoding for b in r.blocks if b.disposition == "stored"} == {"lossless"}
            k2, _, n = c.get(tokens)
            assert np.array_equal(k2, kb[:, :, :n])
        # fp16 puts of the same client still get the server's residual default.
        c16 = kvtrie.Client(s.target, "stories260K", namespace="default-fp16")
        r = c16.put(tokens, k, v, encode_on_client=False)
        assert {b.encoding for b in r.blocks if b.disposition == "stored"} == {"residual"}
    finally:
        s.stop()
