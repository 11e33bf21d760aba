"""kvtrie.Client against a real kvtrie-server process, on the real KV dumps of tests/data."""

from __future__ import annotations

import pydoc
import threading
import time

import numpy as np
import pytest

import kvtrie
from conftest import TESTDATA, ServerProcess, read_dump

SESSIONS = [TESTDATA / "sessions" / f"s{i}" for i in range(4)]
SHARED_PREFIX_BLOCKS = 369 // 16  # the four sessions share a 369-token preamble


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def test_four_real_sessions_put_from_python_read_back_bit_identical(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="sessions")
    for i, folder in enumerate(SESSIONS):
        tokens, surprisal, k, v = read_dump(folder)
        r = c.put(tokens, k, v, surprisal=surprisal, encoding="lossless")
        assert r.stored_tokens == 512 and r.tail_tokens_ignored == 0
        if i == 0:
            assert (r.blocks_stored, r.blocks_deduplicated) == (32, 0)
        else:  # the shared preamble is stored once
            assert (r.blocks_stored, r.blocks_deduplicated) == (32 - SHARED_PREFIX_BLOCKS,
                                                                SHARED_PREFIX_BLOCKS)
        assert all(b.encoding == "lossless" for b in r.blocks if b.disposition == "stored")
    for folder in SESSIONS:
        tokens, _, k, v = read_dump(folder)
        assert c.lookup(tokens) == 512
        for mode in ("reconstructed", "residual"):
            k2, v2, n = c.get(tokens, mode=mode)
            assert n == 512 and k2.dtype == np.float16 and k2.shape == k.shape
            assert np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))
    stats = c.stats()
    assert stats["nodes"] == 32 + 3 * (32 - SHARED_PREFIX_BLOCKS)
    assert c.spec == kvtrie.ModelSpec(5, 4, 8, np.dtype(np.float16))


def test_get_returns_arrays_that_own_the_clients_buffer_without_a_copy(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="zerocopy")
    tokens, _, k, v = read_dump(SESSIONS[0])
    c.put(tokens, k, v)
    k2, v2, n = c.get(tokens[:100])  # 96 tokens: 6 full blocks
    assert n == 96 and k2.shape == (5, 4, 96, 8)
    assert not k2.flags.owndata and k2.base is not None  # a view of the C++ result
    assert k2.flags.c_contiguous and k2.flags.writeable
    assert np.array_equal(bits(k2), bits(k[:, :, :96]))
    # A non-contiguous input (a transposed copy made contiguous by the client) stores the same.
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not kt.flags.c_contiguous
    r = kvtrie.Client(server.target, "stories260K", namespace="zerocopy2").put(tokens, kt, v)
    assert r.blocks_stored == 32


def encoded_nodes(target: str, namespace: str) -> int:
    """Stored nodes of `namespace` whose blocks a client encoded (the server's Stats)."""
    stats = kvtrie.Client(target, "stories260K", namespace=namespace).stats()
    return int(stats.get("client_reported_error_nodes", 0))


def test_puts_are_encoded_here_unless_asked_dense(server):
    tokens, surprisal, k, v = read_dump(TESTDATA / "GPL-3")
    c = kvtrie.Client(server.target, "stories260K", namespace="py-encoded", codec_threads=2)
    r = c.put(tokens, k, v, surprisal=surprisal, encoding="lossless")  # the default: encoded here
    assert r.blocks_stored == 32 and encoded_nodes(server.target, "py-encoded") == 32
    k2, v2, n = c.get(tokens)
    assert n == 512 and np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))
    stored = r.bytes_stored
    # Dense: per call, per client, or because the client cannot code it (the compact profile).
    thin = kvtrie.Client(server.target, "stories260K", namespace="py-encoded",
                         encode_on_client=False)
    for put in (lambda: c.put(tokens, k, v, encoding="lossless", encode_on_client=False),
                lambda: thin.put(tokens, k, v, encoding="lossless"),
                lambda: c.put(tokens, k, v, encoding="lossless", profile="compact")):
        c.delete(tokens[:16])
        assert put().blocks_stored == 32
        assert encoded_nodes(server.target, "py-encoded") == 0
    c.delete(tokens[:16])
    # Encoded or dense, the fast profile stores the same bytes.
    assert c.put(tokens, k, v, encoding="lossless", encode_on_client=False).bytes_stored == stored
    c.delete(tokens[:16])
    r = c.put(tokens, k, v, encoding="residual", target_rel_rms=0.05)
    assert encoded_nodes(server.target, "py-encoded") == 32
    assert all(b.rel_rms_error_k <= 0.05 * 1.0001 for b in r.blocks)
    with pytest.raises(kvtrie.InvalidArgumentError, match="profile"):
        c.put(tokens, k, v, profile="tiny")


def test_put_layers_streams_layer_by_layer_and_stores_only_at_commit(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="layers")
    tokens, surprisal, k, v = read_dump(SESSIONS[1])
    with c.put_layers(tokens, num_layers=5, surprisal=surprisal, encoding="lossless") as s:
        for layer in (4, 0, 3, 1):  # any order
            s.write(layer, k[layer], v[layer])
    assert c.lookup(tokens) == 0  # left without a commit: cancelled, nothing stored
    with c.put_layers(tokens, num_layers=5, encoding="lossless") as s:
        s.write(0, k[0:2], v[0:2])  # a layer range
        for layer in (4, 2, 3):
            s.write(layer, k[layer], v[layer])
        assert c.lookup(tokens) == 0  # not visible before the commit
        r = s.commit()
    assert r.blocks_stored == 32 and c.lookup(tokens) == 512
    k2, v2, n = c.get(tokens)
    assert np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))
    # A span that starts at a block: only its blocks (from first_block on) are sent.
    c2 = kvtrie.Client(server.target, "stories260K", namespace="layers2")
    c2.put(tokens[:160], k[:, :, :160], v[:, :, :160])
    with c2.put_layers(tokens, num_layers=5, first_block=10) as s:
        for layer in range(5):
            s.write(layer, k[layer, :, 160:], v[layer, :, 160:], token_offset=160)
        r = s.commit()
    assert (r.blocks_stored, r.blocks_deduplicated) == (22, 10)
    assert np.array_equal(bits(c2.get(tokens)[0]), bits(k))


def test_mismatches_raise_invalid_argument_naming_the_field(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="errors")
    tokens, _, k, v = read_dump(SESSIONS[2])
    c.put(tokens[:32], k[:, :, :32], v[:, :, :32])  # fixes the spec: 5 x 4 x 8, fp16

    def field_of(call):
        with pytest.raises(kvtrie.InvalidArgumentError) as e:
            call()
        assert e.value.code == kvtrie.StatusCode.INVALID_ARGUMENT
        assert isinstance(e.value, ValueError)
        return e.value.field, e.value.message

    f, m = field_of(lambda: c.put(tokens, k, v[:, :, :511]))
    assert f == "v.shape" and "(5, 4, 511, 8)" in m and "tokens" in m
    f, m = field_of(lambda: c.put(tokens, k, v.astype(np.float32)))
    assert f == "v.dtype" and "float32" in m and "float16" in m
    f, m = field_of(lambda: c.put(tokens[:500], k, v))
    assert f == "tokens" and "500" in m and "512" in m
    f, _ = field_of(lambda: c.put(tokens, k.astype(np.float64), v.astype(np.float64)))
    assert f == "k.dtype"
    f, _ = field_of(lambda: c.put(tokens, k[0], v[0]))
    assert f == "k.shape"
    f, _ = field_of(lambda: c.put(tokens, k, v, surprisal=[1.0, 2.0]))
    assert f == "surprisal"
    f, _ = field_of(lambda: c.put([-1] * 512, k, v))
    assert f == "tokens"
    f, _ = field_of(lambda: c.put(tokens, k, v, encoding="zip"))
    assert f == "encoding"
    # The server's own checks against the stored model spec, carried with its message.
    wide = np.zeros((5, 4, 32, 16), np.float16)
    f, m = field_of(lambda: c.put(tokens[:32], wide, wide))
    assert f == "model.head_dim" and "8" in m and "16" in m
    f, m = field_of(lambda: c.put(tokens[:32], k[:, :, :32].astype(np.float32),
                                  v[:, :, :32].astype(np.float32)))
    assert f == "model.dtype"
    f, _ = field_of(lambda: c.put(tokens[:32], k[:4, :, :32], v[:4, :, :32]))
    assert f == "model.num_layers"
    # A layer-wise Put that misses a layer fails at the commit with the server's message.
    with c.put_layers(tokens[:32], num_layers=5) as s:
        for layer in range(4):
            s.write(layer, k[layer, :, :32], v[layer, :, :32])
        f, m = field_of(s.commit)
    assert f == "kv" and "missing layers" in m
    with c.put_layers(tokens[:32], num_layers=5) as s:
        f, _ = field_of(lambda: s.write(5, k[0, :, :32], v[0, :, :32]))
    assert f == "layer_begin"
    assert c.lookup(tokens) == 32  # nothing above was stored


def test_server_errors_carry_the_grpc_code(server, tmp_path):
    c = kvtrie.Client(server.target, "stories260K", namespace="codes")
    with pytest.raises(kvtrie.NotFoundError) as e:
        c.pin([1, 2, 3] * 16)
    assert e.value.code == kvtrie.StatusCode.NOT_FOUND
    down = kvtrie.Client("127.0.0.1:1", "stories260K", timeout=5)
    with pytest.raises(kvtrie.Error) as e:
        down.lookup([1, 2, 3])
    assert e.value.code == kvtrie.StatusCode.UNAVAILABLE


def test_residual_mode_decodes_client_side_and_meets_the_target(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="residual")
    tokens, surprisal, k, v = read_dump(TESTDATA / "genesis_1-3")
    target = 0.05
    r = c.put(tokens, k, v, surprisal=surprisal, encoding="residual", target_rel_rms=target)
    assert r.blocks_stored == 32
    assert all(b.encoding == "residual" for b in r.blocks)
    assert r.bytes_stored < r.bytes_logical / 2  # it compresses (real data)
    k_res, v_res, n = c.get(tokens, mode="residual")  # the stored encoding, decoded here
    k_rec, v_rec, _ = c.get(tokens, mode="reconstructed")  # decoded by the server
    assert n == 512
    # The client's decode equals the server's, bit for bit.
    assert np.array_equal(bits(k_res), bits(k_rec)) and np.array_equal(bits(v_res), bits(v_rec))
    assert not np.array_equal(bits(k_res), bits(k))  # lossy
    # Every (block, layer, K/V) plane meets the target, measured here on the decoded values.
    worst = 0.0
    for b in range(32):
        sl = slice(16 * b, 16 * (b + 1))
        for orig, dec in ((k, k_res), (v, v_res)):
            x = orig[:, :, sl].astype(np.float64)
            y = dec[:, :, sl].astype(np.float64)
            err = np.sqrt(((x - y) ** 2).sum(axis=(1, 2, 3)) / (x ** 2).sum(axis=(1, 2, 3)))
            worst = max(worst, float(err.max()))
    assert 0 < worst <= target * 1.001, worst


def test_codec_threads_decode_a_residual_get_alike_and_a_negative_count_is_refused(server):
    tokens, surprisal, k, v = read_dump(TESTDATA / "genesis_1-3")
    one = kvtrie.Client(server.target, "stories260K", namespace="codec_threads",
                        codec_threads=1)
    one.put(tokens, k, v, surprisal=surprisal, encoding="residual", target_rel_rms=0.05)
    k1, v1, n1 = one.get(tokens, mode="residual")  # on the calling thread
    cores = kvtrie.Client(server.target, "stories260K", namespace="codec_threads")  # 0: cores
    k0, v0, n0 = cores.get(tokens, mode="residual")
    assert n0 == n1 == 512
    assert np.array_equal(bits(k0), bits(k1)) and np.array_equal(bits(v0), bits(v1))
    with pytest.raises(kvtrie.Error) as e:
        kvtrie.Client(server.target, "stories260K", codec_threads=-1)
    assert e.value.code == kvtrie.StatusCode.INVALID_ARGUMENT and "codec_threads" in str(e.value)


def test_residual_get_of_blocks_coded_against_a_learned_state(tmp_path):
    """With --learn_predictors the server codes new blocks against a learned predictor state; the
    Python client's RESIDUAL Get goes through the C++ client, which fetches that state
    (GetPredictor, cached) and decodes bit-identically to the server."""
    s = ServerProcess(tmp_path / "data", ["--learn_predictors", "--predictor_refit_tokens=512"])
    try:
        c = kvtrie.Client(s.target, "stories260K", namespace="learned")
        tokens, surprisal, k, v = read_dump(TESTDATA / "GPL-3")
        # Dense: the server learns from dense Puts (a thin client's).
        c.put(tokens, k, v, surprisal=surprisal, encoding="residual", target_rel_rms=0.05,
              encode_on_client=False)
        for _ in range(400):  # learned from in the background
            if c.stats().get("predictor_fits", 0) >= 1:
                break
            time.sleep(0.05)
        assert c.stats().get("predictor_fits", 0) == 1
        tokens, surprisal, k, v = read_dump(TESTDATA / "genesis_1-3")
        # Encoded here against version 1 (fetched with GetPredictor).
        c.put(tokens, k, v, surprisal=surprisal, encoding="residual", target_rel_rms=0.05)
        assert c.stats().get("blocks_on_learned", 0) > 0
        assert int(c.stats().get("client_reported_error_nodes", 0)) == 32
        k_res, v_res, n = c.get(tokens, mode="residual")
        k_rec, v_rec, _ = c.get(tokens, mode="reconstructed")
        assert n == 512
        assert np.array_equal(bits(k_res), bits(k_rec)) and np.array_equal(bits(v_res), bits(v_rec))
        versions = c.inspect()["predictors"]
        assert versions[0]["version"] == 1 and versions[0]["dependents"] > 0
    finally:
        s.stop()


def test_float32_and_bfloat16_round_trip_bit_identical(server):
    tokens, _, k, v = read_dump(SESSIONS[3])
    k32, v32 = k.astype(np.float32) * 1.5, v.astype(np.float32)  # plumbing: exact in fp32
    c = kvtrie.Client(server.target, "fp32-model", namespace="dtypes")
    assert c.put(tokens, k32, v32, encoding="lossless").blocks_stored == 32
    k2, v2, n = c.get(tokens)
    assert k2.dtype == np.float32 and np.array_equal(k2, k32) and np.array_equal(v2, v32)
    kb, vb = kvtrie.float32_to_bf16(k32), kvtrie.float32_to_bf16(v32)
    assert kb.dtype == np.uint16
    assert np.allclose(kvtrie.bf16_to_float32(kb), k32, rtol=1 / 128)
    c = kvtrie.Client(server.target, "bf16-model", namespace="dtypes")
    assert c.put(tokens, kb, vb, encoding="lossless").blocks_stored == 32
    k3, v3, _ = c.get(tokens, mode="residual")
    assert k3.dtype == np.uint16 and np.array_equal(k3, kb) and np.array_equal(v3, vb)
    assert c.inspect()["model"]["dtype"] == "DTYPE_BF16"


def test_miss_stats_inspect_pin_delete(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="admin")
    tokens, _, k, v = read_dump(SESSIONS[0])
    empty_k, empty_v, n = c.get(tokens)
    assert n == 0 and empty_k.shape == (0, 0, 0, 0)  # the model is not stored yet
    c.put(tokens, k, v)
    other = tokens.copy()
    other[0] = 7
    k0, _, n = c.get(other)
    assert n == 0 and k0.shape == (5, 4, 0, 8)
    root = c.inspect()
    assert root["model"]["head_dim"] == 8 and root["node"]["num_children"] == 1
    child = root["children"][0]
    assert c.inspect(child["node_id"])["node"]["token_ids"] == tokens[:16].tolist()
    node = c.pin(tokens[:64], ttl_seconds=60)
    assert node > 0 and c.stats()["pinned_nodes"] >= 1
    # A lease (extend_only) never shortens a pin, and cannot unpin.
    assert c.pin(tokens[:64], ttl_seconds=1, extend_only=True) == node
    with pytest.raises(kvtrie.InvalidArgumentError, match="extend_only"):
        c.pin(tokens[:64], unpin=True, extend_only=True)
    assert c.pin(tokens[:64], unpin=True) == node
    d = c.delete(tokens[:256])
    assert d["nodes_deleted"] == 32 - 15 and d["bytes_freed"] > 0
    assert c.lookup(tokens) == 240
    with pytest.raises(kvtrie.NotFoundError):
        c.delete(tokens[:256])
    with c:
        pass
    with pytest.raises(kvtrie.Error) as e:
        c.lookup(tokens)
    assert e.value.code == kvtrie.StatusCode.FAILED_PRECONDITION


def test_eight_python_threads_share_one_client(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="threads")
    dumps = [read_dump(f) for f in SESSIONS]
    errors, done = [], []

    def work(i: int):
        try:
            tokens, _, k, v = dumps[i % 4]
            tokens = tokens.copy()
            tokens[1] = 300 + i  # a distinct sequence per thread (no shared blocks)
            for _ in range(3):
                r = c.put(tokens, k, v, encoding="lossless")
                assert r.stored_tokens == 512
                k2, v2, n = c.get(tokens)
                assert n == 512 and np.array_equal(bits(k2), bits(k))
                assert np.array_equal(bits(v2), bits(v))
                assert c.lookup(tokens) == 512
            done.append(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(done) == list(range(8))
    assert c.stats()["nodes"] == 8 * 32


def test_the_gil_is_released_during_a_call(server):
    # While one thread waits in a slow call (a Get of a prefix that is being put: many blocks),
    # another thread keeps running Python. Measured as progress, not time.
    c = kvtrie.Client(server.target, "stories260K", namespace="gil")
    tokens, _, k, v = read_dump(SESSIONS[0])
    big_k, big_v = np.tile(k, (1, 1, 16, 1)), np.tile(v, (1, 1, 16, 1))  # 8192 tokens
    big_t = np.arange(8192, dtype=np.uint32) % 500 + 3
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)

    t = threading.Thread(target=spin)
    t.start()
    before = len(ticks)
    c.put(big_t, big_k, big_v, encoding="residual")
    during = len(ticks) - before
    stop.set()
    t.join()
    assert during > 100  # the spinning thread ran while put() was in C++


def test_help_reads_well():
    text = pydoc.render_doc(kvtrie.Client, renderer=pydoc.plaintext)
    for phrase in ("put_layers", "Thread-safe", "matched_tokens", "InvalidArgumentError",
                   "[layers, kv_heads, tokens, head_dim]"):
        assert phrase in text, phrase
    assert "sequence layer by layer" in pydoc.render_doc(kvtrie.PutStream, renderer=pydoc.plaintext) \
        or "layer by layer" in pydoc.render_doc(kvtrie.PutStream, renderer=pydoc.plaintext)


def test_the_readme_example_runs(server, monkeypatch):
    readme = (TESTDATA.parent.parent / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) == 6
    monkeypatch.chdir(TESTDATA.parent.parent)
    scope = {}
    exec(code.replace("127.0.0.1:50051", server.target), scope)  # noqa: S102 - our README
    assert scope["r"].blocks_stored + scope["r"].blocks_deduplicated == 32 and scope["n"] == 512
    assert np.array_equal(scope["k"], np.load(TESTDATA / "sessions" / "s0" / "k.npy"))
    assert scope["c"].encode_on_client and not scope["thin"].encode_on_client
