"""Erasing Deletes from Python (issue 30): ``Client.delete(tokens, erase=True)`` and
``ShardedClient.delete(tokens, erase=True)`` against a real server, on the near-duplicate dumps
tests/data/neardup/n0 and n1 stored lossy (n0's branch after their divergence is the centroid of
n1's lossy blocks): nothing is retained, the answer says what it cost, n1 reads back as before.
Without erase the centroids stay retained (the default)."""

from __future__ import annotations

import numpy as np

import kvtrie
from conftest import TESTDATA, read_dump

N0, N1 = TESTDATA / "neardup" / "n0", TESTDATA / "neardup" / "n1"


def _put_pair(c):
    """Stores n0 and n1 lossy; returns (n0's branch from the divergence block, n1's tokens)."""
    t0, s0, k0, v0 = read_dump(N0)
    t1, s1, k1, v1 = read_dump(N1)
    c.put(t0, k0, v0, s0, encoding="residual", profile="compact")
    c.put(t1, k1, v1, s1, encoding="residual", profile="compact")
    same = int(np.argmax(t0 != t1))
    return t0[: (same // 16 + 1) * 16], t1


def _expect_erased(c, delete):
    branch, t1 = _put_pair(c)
    k_before, v_before, n = c.get(t1)
    assert n == len(t1)
    d = delete(branch)
    assert d["erased"] is True
    assert int(d.get("centroids_retained", 0)) == 0
    assert int(d["centroids_reelected"]) > 20 and int(d["erase_bytes_rewritten"]) > 0
    assert int(c.stats().get("retained_nodes", 0)) == 0
    k, v, n = c.get(t1)
    assert n == len(t1) and np.array_equal(k, k_before) and np.array_equal(v, v_before)


def test_client_delete_with_erase_retains_nothing(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="py-erase")
    _expect_erased(c, lambda t: c.delete(t, erase=True))


def test_sharded_client_delete_with_erase_retains_nothing(server):
    c = kvtrie.ShardedClient("stories260K", shards=f"kvtrie-0={server.target}",
                             namespace="py-erase-sharded")
    _expect_erased(kvtrie.Client(server.target, "stories260K", namespace="py-erase-sharded"),
                   lambda t: c.delete(t, erase=True))


def test_delete_without_erase_retains_lossy_centroids(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="py-retain")
    branch, _ = _put_pair(c)
    d = c.delete(branch)
    assert not d.get("erased", False) and int(d["centroids_retained"]) > 20
    assert int(c.stats()["retained_nodes"]) > 0
