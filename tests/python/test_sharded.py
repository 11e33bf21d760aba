"""kvtrie.ShardedClient against three real kvtrie-server processes, on the real KV dumps of
tests/data: each prefix on its owner only (the same owner the C++ router picks), Gets
bit-identical, a killed shard a miss and never an error (issue 21)."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

import kvtrie
from conftest import TESTDATA, ServerProcess, read_dump

DUMPS = [TESTDATA / "sessions" / f"s{i}" for i in range(4)] + [
    TESTDATA / "neardup" / f"n{i}" for i in range(4)] + [
    TESTDATA / name for name in ("genesis_1-3", "GPL-3", "story_prompt")]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def windows():
    """The whole dumps, and 64-token windows of each at 32-token steps with distinct first
    blocks (real KV rows re-cut, so that there are enough prefixes to spread)."""
    out, seen = [], set()
    for folder in DUMPS:
        tokens, surprisal, k, v = read_dump(folder)
        n = len(tokens) // 16 * 16
        out.append((tokens[:n], k[:, :, :n], v[:, :, :n]))
        for o in range(16, len(tokens) - 64 + 1, 32):
            key = tuple(tokens[o:o + 16])
            if key not in seen:
                seen.add(key)
                out.append((tokens[o:o + 64], np.ascontiguousarray(k[:, :, o:o + 64]),
                            np.ascontiguousarray(v[:, :, o:o + 64])))
    return out


@pytest.fixture()
def shards(tmp_path):
    servers = [ServerProcess(tmp_path / f"kvtrie-{i}") for i in range(3)]
    yield servers
    for s in servers:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def shard_list(servers):
    return ",".join(f"kvtrie-{i}={s.target}" for i, s in enumerate(servers))


def test_each_prefix_on_its_owner_only_and_gets_bit_identical(shards):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py")
    direct = [kvtrie.Client(s.target, "stories260K", namespace="py") for s in shards]
    prefixes = windows()
    assert len(prefixes) > 40
    owners = {}
    for tokens, k, v in prefixes:
        r = c.put(tokens, k, v, encoding="lossless")
        assert r.stored_tokens == len(tokens)
    for tokens, k, v in prefixes:
        owner = c.owner(tokens)
        owners[owner] = owners.get(owner, 0) + 1
        for i, d in enumerate(direct):
            assert d.lookup(tokens) == (len(tokens) if owner == f"kvtrie-{i}" else 0)
        k2, v2, n = c.get(tokens)
        assert n == len(tokens)
        assert np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))
    assert sorted(owners) == ["kvtrie-0", "kvtrie-1", "kvtrie-2"]
    total = c.stats()
    assert total["shards_answered"] == 3
    assert total["nodes"] == sum(d.stats()["nodes"] for d in direct)


def test_a_killed_shard_is_a_miss_never_an_error(shards):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             timeout=5.0)
    prefixes = windows()
    for tokens, k, v in prefixes:
        c.put(tokens, k, v, encoding="lossless")
    shards[1].proc.kill()
    shards[1].proc.wait()
    lost = 0
    for tokens, k, v in prefixes:
        k2, v2, n = c.get(tokens)
        assert c.lookup(tokens) == n
        if c.owner(tokens) == "kvtrie-1":
            lost += 1
            assert n == 0
            assert c.put(tokens, k, v, encoding="lossless").stored_tokens == 0
        else:
            assert n == len(tokens) and np.array_equal(bits(k2), bits(k))
    assert lost > 0
    assert c.counters["puts_skipped"] == lost
    assert c.counters["shard_failures"] >= 1
    per = c.stats_all()
    assert isinstance(per["kvtrie-1"], kvtrie.Error) and isinstance(per["kvtrie-0"], dict)
    with pytest.raises(kvtrie.Error) as e:  # a delete must not pass for done
        c.delete(next(t for t, _, _ in prefixes if c.owner(t) == "kvtrie-1"))
    assert e.value.code == kvtrie.StatusCode.UNAVAILABLE


def test_membership_arguments_are_checked():
    with pytest.raises(kvtrie.InvalidArgumentError, match="shards"):
        kvtrie.ShardedClient("m")
    with pytest.raises(kvtrie.InvalidArgumentError, match="shards"):
        kvtrie.ShardedClient("m", shards="kvtrie-0")
    with pytest.raises(kvtrie.Error) as e:
        kvtrie.ShardedClient("m", shards_dns="no-such-host.invalid:1")
    assert e.value.code == kvtrie.StatusCode.UNAVAILABLE


def test_warm_up_asks_the_previous_owner_and_copies_to_the_new_one(shards, tmp_path):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             warmup_window=60.0, warmup_put={"encoding": "lossless"})
    prefixes = windows()
    for tokens, k, v in prefixes:
        c.put(tokens, k, v, encoding="lossless")
    before = [c.owner(t) for t, _, _ in prefixes]
    fourth = ServerProcess(tmp_path / "kvtrie-3")
    try:
        c.set_shards(shard_list(shards + [fourth]))
        new = kvtrie.Client(fourth.target, "stories260K", namespace="py")
        moved = 0
        for (tokens, k, v), was in zip(prefixes, before):
            assert c.lookup(tokens) == len(tokens)
            k2, v2, n = c.get(tokens)
            assert n == len(tokens) and np.array_equal(bits(k2), bits(k))
            if c.owner(tokens) != was:
                moved += 1
                assert new.lookup(tokens) == len(tokens)  # copied to the new owner
        assert moved > 0
        assert c.counters["warmup_copies"] == moved
        assert c.counters["warmup_hits"] == 2 * moved
    finally:
        fourth.proc.kill()
        fourth.proc.wait()


def test_pinned_prefixes_replicated_twice_survive_a_killed_shard(shards):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             timeout=5.0, pin_replicas=2, warmup_put={"encoding": "lossless"})
    with pytest.raises(kvtrie.InvalidArgumentError, match="pin_replicas"):
        kvtrie.ShardedClient("m", shards=shard_list(shards), pin_replicas=3)
    direct = [kvtrie.Client(s.target, "stories260K", namespace="py") for s in shards]
    prefixes = windows()
    for tokens, k, v in prefixes:
        c.put(tokens, k, v, encoding="lossless")
    pinned = prefixes[::2]
    for tokens, _, _ in pinned:
        c.pin(tokens)
        assert sum(d.lookup(tokens) == len(tokens) for d in direct) == 2  # owner and second
    assert c.counters["replica_copies"] == len(pinned) and c.counters["replica_failures"] == 0
    shards[0].proc.kill()
    shards[0].proc.wait()
    victims = 0
    for tokens, k, v in pinned:
        victims += c.owner(tokens) == "kvtrie-0"
        assert c.lookup(tokens) == len(tokens)
        k2, v2, n = c.get(tokens)
        assert n == len(tokens) and np.array_equal(bits(k2), bits(k))
        assert np.array_equal(bits(v2), bits(v))
    assert victims > 0 and c.counters["replica_hits"] >= 2 * victims


def test_delete_with_its_owner_down_still_deletes_the_replica(shards):
    # Delete removes the prefix's last block (and its subtree): with the owner known down it
    # still does so on the pinned replica, so a get falling back there never serves it.
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             timeout=5.0, pin_replicas=2, down_backoff=60.0)
    tokens, k, v = windows()[0]
    c.put(tokens, k, v, encoding="lossless")
    c.pin(tokens)
    assert c.counters["replica_copies"] == 1
    owner = int(c.owner(tokens).rsplit("-", 1)[1])
    shards[owner].proc.kill()
    shards[owner].proc.wait()
    c.lookup(tokens)  # the owner is lost: marked down
    assert c.counters["shard_failures"] >= 1
    with pytest.raises(kvtrie.Error) as e:
        c.delete(tokens)
    assert e.value.code == kvtrie.StatusCode.UNAVAILABLE
    for i, s in enumerate(shards):
        if i != owner:
            direct = kvtrie.Client(s.target, "stories260K", namespace="py")
            assert direct.lookup(tokens) < len(tokens)
    assert c.get(tokens)[2] < len(tokens) and c.lookup(tokens) < len(tokens)


@contextlib.contextmanager
def fourth_shard_joined(shards, tmp_path, **options):
    """A client (warm-up window 60 s, `options`) that put every window on the three shards, then
    a fourth shard joins: yields the client, the windows and each one's owner before it joined."""
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             warmup_window=60.0, **options)
    prefixes = windows()
    for tokens, k, v in prefixes:
        c.put(tokens, k, v, encoding="lossless")
    before = [c.owner(t) for t, _, _ in prefixes]
    fourth = ServerProcess(tmp_path / "kvtrie-3")
    try:
        c.set_shards(shard_list(shards + [fourth]))
        yield c, prefixes, before
    finally:
        fourth.proc.kill()
        fourth.proc.wait()


def test_delete_in_the_warm_up_window_reaches_the_previous_owner(shards, tmp_path):
    with fourth_shard_joined(shards, tmp_path) as (c, prefixes, before):
        moved = 0
        for (tokens, _, _), was in zip(prefixes, before):
            if c.owner(tokens) == was:
                continue
            moved += 1
            with pytest.raises(kvtrie.Error):  # the new owner's NOT_FOUND
                c.delete(tokens)
            prev = kvtrie.Client(shards[int(was.rsplit("-", 1)[1])].target, "stories260K",
                                 namespace="py")
            assert prev.lookup(tokens) < len(tokens)
            assert c.get(tokens)[2] < len(tokens)  # not copied back from the previous owner
        assert moved > 0


def test_replica_of_a_residual_prefix_is_the_owners_reconstruction(tmp_path):
    servers = [ServerProcess(tmp_path / f"kvtrie-{i}", ["--default_encoding=residual"])
               for i in range(3)]
    try:
        c = kvtrie.ShardedClient("stories260K", shards=shard_list(servers), namespace="py",
                                 pin_replicas=2)  # warmup_put: its bit-exact default
        tokens, k, v = windows()[0]
        c.put(tokens, k, v, encoding="residual", target_rel_rms=0.1)
        c.pin(tokens)
        assert c.counters["replica_copies"] == 1
        owner = int(c.owner(tokens).rsplit("-", 1)[1])
        direct = [kvtrie.Client(s.target, "stories260K", namespace="py") for s in servers]
        k_o, v_o, n = direct[owner].get(tokens)
        assert n == len(tokens) and not np.array_equal(bits(k_o), bits(k))  # lossy there
        replicas = 0
        for i, d in enumerate(direct):
            if i == owner:
                continue
            k_r, v_r, m = d.get(tokens)
            if m:
                replicas += 1
                assert m == n and np.array_equal(bits(k_r), bits(k_o))
                assert np.array_equal(bits(v_r), bits(v_o))
        assert replicas == 1
    finally:
        for s in servers:
            s.proc.kill()
            s.proc.wait()


def test_an_empty_membership_is_refused_and_the_last_one_kept(shards):
    # The C++ client's rule (one policy): a membership is never empty; an empty list is
    # INVALID_ARGUMENT naming `shards` (a DNS answer with no shards keeps the last set too).
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             pin_replicas=2, warmup_window=60.0)
    tokens, k, v = windows()[0]
    assert c.put(tokens, k, v, encoding="lossless").stored_tokens == len(tokens)
    owner = c.owner(tokens)
    with pytest.raises(kvtrie.InvalidArgumentError, match="shards"):
        c.set_shards("")
    assert [n for n, _ in c.shards] == ["kvtrie-0", "kvtrie-1", "kvtrie-2"]
    assert c.owner(tokens) == owner
    assert c.lookup(tokens) == len(tokens) and c.get(tokens)[2] == len(tokens)


def test_warm_up_of_a_layer_range_never_stores_the_range_as_the_model(shards, tmp_path):
    """A Get of layers [1, 3) that the previous owner answers copies nothing partial to the new
    owner: a later whole Get there returns every layer bit-exact (or misses), never 2 layers."""
    with fourth_shard_joined(shards, tmp_path,
                             warmup_put={"encoding": "lossless"}) as (c, prefixes, before):
        moved = 0
        for (tokens, k, v), was in zip(prefixes, before):
            if c.owner(tokens) == was:
                continue
            moved += 1
            k2, v2, n = c.get(tokens, layers=(1, 3))
            assert n == len(tokens) and k2.shape[0] == 2
            assert np.array_equal(bits(k2), bits(k[1:3])) and np.array_equal(bits(v2), bits(v[1:3]))
            k3, v3, n3 = c.get(tokens)
            assert n3 == len(tokens)
            assert k3.shape == k.shape, f"{k3.shape} served for a {k.shape} prefix"
            assert np.array_equal(bits(k3), bits(k)) and np.array_equal(bits(v3), bits(v))
        assert moved > 0


# --- One policy (issue 31): the failure state Python reports is the C++ ShardedClient's. ---

def test_lost_shard_codes_are_the_cpp_clients():
    from kvtrie import _kvtrie
    for code in kvtrie.StatusCode:
        assert (code in kvtrie.LOST_SHARD_CODES) == _kvtrie._lost_shard_code(int(code)), code
    S = kvtrie.StatusCode
    assert kvtrie.LOST_SHARD_CODES == {S.UNAVAILABLE, S.DEADLINE_EXCEEDED, S.RESOURCE_EXHAUSTED,
                                       S.ABORTED, S.CANCELLED, S.UNKNOWN, S.INTERNAL, S.DATA_LOSS}


def wait_until_up(c, name, bound=60.0):
    """Polls until calls to `name` are no longer skipped (its backoff ended)."""
    end = time.monotonic() + bound
    while c.shard_state(name)["down"]:
        assert time.monotonic() < end, c.shard_state(name)
        time.sleep(0.05)


def test_backoff_is_the_cpp_clients_capped_at_down_max_backoff(shards):
    # Probes off: the backoff alone keeps a shard down. The former Python policy had no
    # down_max_backoff and capped it at 30 x down_backoff (here [30, 60] s, then [2, 4] s); the C++
    # one (now Python's) caps it at down_max_backoff, also below down_backoff.
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             timeout=5.0, down_backoff=60.0, down_max_backoff=30.0,
                             shard_probe_deadline=0)
    tokens, k, v = windows()[0]
    assert c.put(tokens, k, v, encoding="lossless").stored_tokens == len(tokens)
    owner = c.owner(tokens)
    live = next(f"kvtrie-{i}" for i in range(3) if f"kvtrie-{i}" != owner)
    assert c.shard_state(owner) == {"failures_in_a_row": 0, "down_for": 0.0,
                                    "health_down": False, "down": False}
    victim = shards[int(owner.rsplit("-", 1)[1])]
    victim.proc.kill()
    victim.proc.wait()
    assert c.lookup(tokens) == 0
    state = c.shard_state(owner)
    assert state["failures_in_a_row"] == 1 and state["down"] and not state["health_down"]
    assert 14.0 < state["down_for"] <= 30.0, state  # min(60, 30) drawn from [15, 30]
    # Skipped without a call while down: misses counted, no new failure.
    for _ in range(5):
        assert c.lookup(tokens) == 0 and c.get(tokens)[2] == 0
    counters = c.counters
    assert counters["shard_failures"] == 1 and counters["lost_calls"] == 11
    assert c.shard_state(live)["failures_in_a_row"] == 0

    # Doubling per failure in a row up to down_max_backoff: 1, 2, then 2 again (not 4).
    c2 = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                              timeout=5.0, down_backoff=1.0, down_max_backoff=2.0,
                              shard_probe_deadline=0)
    for n, cap in ((1, 1.0), (2, 2.0), (3, 2.0)):
        wait_until_up(c2, owner)
        assert c2.lookup(tokens) == 0
        state = c2.shard_state(owner)
        assert state["failures_in_a_row"] == n and 0 < state["down_for"] <= cap, (n, state)
    assert c2.counters["shard_failures"] == 3
    # Without down_max_backoff: the CLI's cap, 30 x down_backoff (DefaultDownMaxBackoff).
    assert kvtrie.ShardedClient("m", shards="a=127.0.0.1:1", down_backoff=0.5,
                                shard_probe_deadline=0)._c.options()["down_max_backoff"] == 15.0


def test_put_layers_goes_to_the_owner_and_a_lost_owner_stores_nothing(shards):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             timeout=5.0, down_backoff=60.0)
    direct = {f"kvtrie-{i}": kvtrie.Client(s.target, "stories260K", namespace="py")
              for i, s in enumerate(shards)}
    prefixes = windows()
    tokens, k, v = prefixes[0]
    with c.put_layers(tokens, num_layers=k.shape[0]) as s:
        for layer in range(k.shape[0]):
            s.write(layer, k[layer], v[layer])
        assert s.commit().stored_tokens == len(tokens)
    owner = c.owner(tokens)
    assert {n: d.lookup(tokens) for n, d in direct.items()} == {
        n: (len(tokens) if n == owner else 0) for n in direct}
    victim = shards[int(owner.rsplit("-", 1)[1])]
    victim.proc.kill()
    victim.proc.wait()
    other, ko, vo = next(p for p in prefixes[1:] if c.owner(p[0]) == owner)
    with c.put_layers(other, num_layers=ko.shape[0]) as s:  # fails on its first write
        for layer in range(ko.shape[0]):
            s.write(layer, ko[layer], vo[layer])
        assert s.commit().stored_tokens == 0
    with c.put_layers(other, num_layers=ko.shape[0]) as s:  # the owner known down: dropped
        for layer in range(ko.shape[0]):
            s.write(layer, ko[layer], vo[layer])
        assert s.commit().stored_tokens == 0
    assert c.counters["puts_skipped"] == 2 and c.counters["shard_failures"] == 1


def test_a_lease_pins_the_owner_only(shards):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(shards), namespace="py",
                             pin_replicas=2)
    direct = [kvtrie.Client(s.target, "stories260K", namespace="py") for s in shards]
    tokens, k, v = windows()[0]
    c.put(tokens, k, v, encoding="lossless")
    c.pin(tokens, 60, extend_only=True, replicate=False)
    assert c.counters["replica_copies"] == 0
    assert sum(d.lookup(tokens) == len(tokens) for d in direct) == 1
    c.pin(tokens)
    assert c.counters["replica_copies"] == 1
    assert sum(d.lookup(tokens) == len(tokens) for d in direct) == 2
