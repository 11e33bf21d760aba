"""The Python client and the connector send a Put that ended ABORTED again (issue 18), so a
worker never sees it: a real kvtrie-server behind kvtrie-test-proxy (tests/failing_put_proxy.h),
which fails the first Puts the way the server does under contention (read whole, nothing stored)
and forwards the rest."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import kvtrie
from conftest import BUILD, TESTDATA, read_dump
from kvtrie.connector import (KvtrieConnector, KvtrieConnectorMetadata, KVConnectorRole,
                              RequestMeta)

PROXY = BUILD / "tests" / "kvtrie-test-proxy"
S0 = TESTDATA / "sessions" / "s0"


class Proxy:
    """kvtrie-test-proxy --target=SERVER --put_failures=N, on a loopback port 0."""

    def __init__(self, tmp: Path, target: str, put_failures: int, put_code: str = "ABORTED"):
        if not PROXY.exists():
            pytest.fail(f"{PROXY} is missing: build it (deploy/build.sh kvtrie-test-proxy)")
        port_file = tmp / f"proxy{time.monotonic_ns()}.port"
        self.proc = subprocess.Popen([str(PROXY), f"--target={target}",
                                      f"--put_failures={put_failures}",
                                      f"--put_code={put_code}", f"--port_file={port_file}"])
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("kvtrie-test-proxy did not start")
            time.sleep(0.02)
        self.target = f"127.0.0.1:{int(port_file.read_text())}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def proxy(server, tmp_path):
    made = []

    def make(put_failures: int, put_code: str = "ABORTED") -> Proxy:
        made.append(Proxy(tmp_path, server.target, put_failures, put_code))
        return made[-1]

    yield make
    for p in made:
        p.close()


def expect_stored(server, namespace: str) -> None:
    tokens, _, k, v = read_dump(S0)
    k2, v2, n = kvtrie.Client(server.target, "stories260K", namespace=namespace).get(tokens)
    assert n == 512
    assert np.array_equal(k2.view(np.uint16), k.view(np.uint16))
    assert np.array_equal(v2.view(np.uint16), v.view(np.uint16))


def test_an_aborted_put_is_sent_again_and_the_caller_sees_only_its_success(server, proxy):
    p = proxy(2)
    tokens, surprisal, k, v = read_dump(S0)
    c = kvtrie.Client(p.target, "stories260K", namespace="retry_put")  # the default policy
    r = c.put(tokens, k, v, surprisal=surprisal, encoding="lossless")
    assert (r.blocks_stored, r.blocks_deduplicated) == (32, 0)
    expect_stored(server, "retry_put")


def test_an_aborted_put_layers_stream_sends_every_layer_again(server, proxy):
    p = proxy(2)
    tokens, _, k, v = read_dump(S0)
    c = kvtrie.Client(p.target, "stories260K", namespace="retry_layers")
    with c.put_layers(tokens, num_layers=5, encoding="lossless") as s:
        for layer in range(5):
            s.write(layer, k[layer], v[layer])
        r = s.commit()
    assert r.blocks_stored == 32
    expect_stored(server, "retry_layers")


def test_an_unavailable_put_is_sent_again(server, proxy):
    p = proxy(1, "UNAVAILABLE")
    tokens, _, k, v = read_dump(S0)
    r = kvtrie.Client(p.target, "stories260K", namespace="retry_unavailable").put(tokens, k, v)
    assert r.blocks_stored == 32
    expect_stored(server, "retry_unavailable")


def test_retry_attempts_bound_the_attempts(server, proxy):
    p = proxy(3)
    tokens, _, k, v = read_dump(S0)
    c = kvtrie.Client(p.target, "stories260K", namespace="retry_bound", retry_attempts=3,
                      retry_initial_backoff=0.001)
    with pytest.raises(kvtrie.Error) as e:
        c.put(tokens, k, v)
    assert e.value.code == kvtrie.StatusCode.ABORTED
    assert c.put(tokens, k, v).blocks_stored == 32  # the proxy's 4th Put goes through
    with pytest.raises(kvtrie.InvalidArgumentError) as bad:
        kvtrie.Client(p.target, "stories260K", retry_attempts=0)
    assert bad.value.field == "retry_attempts"


def test_the_connectors_save_is_sent_again_and_the_worker_sees_no_error(server, proxy):
    p = proxy(2)
    tokens, _, k, v = read_dump(S0)
    # A paged cache per layer, [2, blocks, block_size, kv_heads, head_dim], holding the dump's
    # 512 tokens in engine blocks 0..31 of 16 tokens.
    caches = {}
    for layer in range(5):
        c = np.zeros((2, 40, 16, 4, 8), dtype=np.float16)
        c[0, :32] = k[layer].transpose(1, 0, 2).reshape(32, 16, 4, 8)
        c[1, :32] = v[layer].transpose(1, 0, 2).reshape(32, 16, 4, 8)
        caches[f"layers.{layer}.attn"] = c
    worker = KvtrieConnector(role=KVConnectorRole.WORKER,
                             config={"target": p.target, "model_id": "stories260K",
                                     "namespace": "retry_connector"})
    worker.register_kv_caches(caches)
    worker.bind_connector_metadata(KvtrieConnectorMetadata(requests=[RequestMeta(
        "r0", [int(t) for t in tokens], list(range(32)), save_tokens=512)]))
    worker.start_load_kv(None)
    for name, cache in caches.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, cache, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    deadline = time.monotonic() + 30  # the commit runs after the step: wait for get_finished
    while worker.get_finished({"r0"})[0] != {"r0"} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.stats["save_errors"] == 0 and worker.stats["saved_blocks"] == 32
    expect_stored(server, "retry_connector")
