"""kvtrie.ShardedClient with one of two real kvtrie-server processes SIGSTOPped (hung, not dead:
its socket stays open), on the real KV dumps of tests/data (issue 30, row 5). The first call
routed to it costs ~2 x shard_probe_deadline, not the call's 60 s timeout, and later calls, past
their backoff, nothing; the connector's config reaches the same checks."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

import kvtrie
from conftest import TESTDATA, ServerProcess, read_dump

DUMPS = [TESTDATA / name for name in ("sessions/s0", "genesis_1-3", "GPL-3", "story_prompt",
                                      "neardup/n1")]
# The checks' deadline here: 1 s, not the default 0.25 s, so that a live shard on a loaded machine
# answers its checks. What a call routed to the stopped shard may cost: ~2 x that, with a margin;
# the call timeout (60 s) is six times more.
PROBE = 1.0
BOUND = 10.0


@pytest.fixture()
def two_shards(tmp_path):
    servers = [ServerProcess(tmp_path / f"kvtrie-{i}") for i in range(2)]
    yield servers
    for s in servers:
        if s.proc.poll() is None:
            os.kill(s.proc.pid, signal.SIGCONT)
            s.proc.kill()
            s.proc.wait()


def sigstop(pid):
    """SIGSTOPs `pid` and waits until every thread of it is stopped (kill returns before)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"{pid} did not stop")


def shard_list(servers):
    return ",".join(f"kvtrie-{i}={s.target}" for i, s in enumerate(servers))


def put_all_and_stop_one(c, servers):
    """Stores every dump; SIGSTOPs a shard that owns some; returns its name and the dumps."""
    dumps = []
    for folder in DUMPS:
        tokens, _, k, v = read_dump(folder)
        n = len(tokens) // 16 * 16
        assert c.put(tokens[:n], k[:, :, :n].copy(), v[:, :, :n].copy(),
                     encoding="lossless").stored_tokens == n
        dumps.append(tokens[:n])
    owners = {c.owner(t) for t in dumps}
    assert owners == {"kvtrie-0", "kvtrie-1"}
    sigstop(servers[1].proc.pid)
    return "kvtrie-1", dumps


def test_a_stopped_shard_costs_the_probe_deadline_not_the_timeout(two_shards):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(two_shards), namespace="hung",
                             timeout=60.0, down_backoff=0.2, shard_probe_deadline=PROBE)
    victim, dumps = put_all_and_stop_one(c, two_shards)
    on_victim = [t for t in dumps if c.owner(t) == victim]
    t0 = time.monotonic()
    assert c.lookup(on_victim[0]) == 0
    first = time.monotonic() - t0
    assert first < BOUND
    assert c.counters["probe_failures"] >= 1 and c.counters["calls_cancelled"] >= 1
    # Past several backoffs: misses at once, the prober keeps the shard down.
    slowest, end = 0.0, time.monotonic() + 2.0
    while time.monotonic() < end:
        for t in dumps:
            t0 = time.monotonic()
            _, _, n = c.get(t)
            slowest = max(slowest, time.monotonic() - t0)
            assert (n == 0) == (c.owner(t) == victim)
        time.sleep(0.05)
    assert slowest < BOUND
    print(f"[ hung ] python: first call to the stopped shard {first:.3f} s, later calls "
          f"at most {slowest:.3f} s (timeout 60 s)")
    # Continued: a check answers and its prefixes hit again.
    os.kill(two_shards[1].proc.pid, signal.SIGCONT)
    end = time.monotonic() + BOUND
    while c.lookup(on_victim[0]) == 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert c.lookup(on_victim[0]) == len(on_victim[0])
    c.close()


def test_calls_in_flight_when_it_stops_are_cancelled(two_shards):
    c = kvtrie.ShardedClient("stories260K", shards=shard_list(two_shards), namespace="hung",
                             timeout=60.0, shard_probe_deadline=PROBE)
    dumps = []
    for folder in DUMPS:
        tokens, _, k, v = read_dump(folder)
        n = len(tokens) // 16 * 16
        c.put(tokens[:n], k[:, :, :n].copy(), v[:, :, :n].copy(), encoding="lossless")
        dumps.append(tokens[:n])
    stop, slowest, errors = threading.Event(), [0.0], []

    def reader(i):
        while not stop.is_set():
            t = dumps[i % len(dumps)]
            i += 1
            t0 = time.monotonic()
            try:
                c.get(t)
            except kvtrie.Error as e:  # never: a lost shard is a miss
                errors.append(e)
            slowest[0] = max(slowest[0], time.monotonic() - t0)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    sigstop(two_shards[1].proc.pid)
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=70)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert slowest[0] < BOUND
    c.close()


def test_the_connector_config_reaches_the_checks(two_shards):
    from kvtrie._connector_io import _make_client  # noqa: PLC0415
    c = _make_client({"model_id": "stories260K", "shards": shard_list(two_shards),
                     "namespace": "hung", "shard_probe_deadline": PROBE,
                     "shard_probe_interval": 0.2}, 16)
    assert c._probe_deadline == PROBE and c._probe_interval == 0.2
    victim, dumps = put_all_and_stop_one(c, two_shards)
    t0 = time.monotonic()
    assert c.lookup([t for t in dumps if c.owner(t) == victim][0]) == 0
    assert time.monotonic() - t0 < BOUND
    c.close()


def test_probe_arguments_are_checked():
    with pytest.raises(kvtrie.Error, match="shard_probe_deadline"):
        kvtrie.ShardedClient("m", shards="a=127.0.0.1:1", shard_probe_deadline=-1)
    with pytest.raises(kvtrie.Error, match="shard_probe_interval"):
        kvtrie.ShardedClient("m", shards="a=127.0.0.1:1", shard_probe_interval=0)
