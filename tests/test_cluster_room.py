"""On a one-node cluster whose heartbeats are slow (10 s), with two schedulers and
Redis as a primary, a replica and Sentinel:

- the gateway's own count of the room it frees and takes between heartbeats: kills,
  pauses and failed creates through the gateway are room at once, not at the node's
  next heartbeat;
- a scheduler killed with -9 during a burst of creates fails none of them: the
  gateway places them itself, and the node heartbeats to the other;
- the Redis primary killed with -9 during a burst fails none either: Sentinel
  promotes the replica, and Redis commands are retried through the failover.

Its own namespaces and addresses: link 10.36/16, sandbox pool 10.37/16.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing.cluster import Cluster

CAPACITY = 2


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("slow-cluster"), f"r{os.getpid() % 256:02x}", nodes=1,
                link_net=36, pool_nets=(37,), max_sandboxes=CAPACITY, heartbeat_ms=10_000,
                node_ttl_ms=30_000, gateway_queue_s=1.0, schedulers=2, sentinel=True)
    with c.serving() as serving:
        yield serving


def refused(c: Cluster) -> float:
    """The gateway's count of placements it refused (no node had room)."""
    r = httpx.get(c.gateway_url + "/metrics", timeout=10, trust_env=False,
                  headers={"Authorization": f"Bearer {c.api_key}"})
    for line in r.text.splitlines():
        if line.startswith('aenv_placements_total{result="refused"}'):
            return float(line.split()[-1])
    return 0.0


def burst(n: int) -> list[Sandbox | Exception]:
    def one() -> Sandbox | Exception:
        try:
            return Sandbox.create(template="base", timeout=60)
        except Exception as exc:  # what the user sees, kept for the assertion
            return exc
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: one(), range(n)))


def burst_through(kill: subprocess.Popen) -> None:
    """A burst with ``kill`` (a control-plane process) killed -9 while it is under
    way: every create of it succeeds."""
    with ThreadPoolExecutor(1) as pool:
        during = pool.submit(burst, CAPACITY)
        time.sleep(0.1)
        kill.kill()
        kill.wait()
        first = during.result()
    check_and_kill(first)


def check_and_kill(sandboxes: list, command: str = "") -> None:
    """Every create succeeded (and the first runs ``echo command``); all killed after."""
    try:
        assert all(isinstance(s, Sandbox) for s in sandboxes), sandboxes
        if command:
            assert sandboxes[0].commands.run(f"echo {command}").stdout == f"{command}\n"
    finally:
        for sbx in sandboxes:
            if isinstance(sbx, Sandbox):
                sbx.kill()


def test_room_freed_between_heartbeats_is_room_at_once(slow: Cluster) -> None:
    """Fill the node, kill (or pause) what is on it, and a burst right after is placed
    at once, with no refusal, long before the node's next heartbeat says it has room."""
    for round_ in ("kill", "pause"):
        first = burst(CAPACITY)
        assert all(isinstance(s, Sandbox) for s in first), first
        before = refused(slow)
        for sbx in first:
            assert isinstance(sbx, Sandbox)
            sbx.kill() if round_ == "kill" else sbx.pause()
        again = burst(CAPACITY)
        try:
            assert all(isinstance(s, Sandbox) for s in again), (round_, again)
            assert refused(slow) == before, f"placements refused after the {round_}s"
            # The node is really full now: one more waits out the gateway's queue time.
            with slow.client() as api:
                full = api.post("/sandboxes", json={"templateID": "base"})
            assert full.status_code == 429, full.text
        finally:
            for sbx in [*first, *again]:
                if isinstance(sbx, Sandbox):
                    sbx.kill()
    with slow.client() as api:
        assert api.get("/v2/sandboxes", params={"state": "running,paused"}).json() == []


def beats(c: Cluster) -> int:
    out = subprocess.run(["redis-cli", "-p", str(c.redis_primary()), "get", "aenv:beat:node-1"],
                         capture_output=True, text=True).stdout.strip()
    return int(out or 0)


def test_a_scheduler_killed_during_a_burst_fails_no_create(slow: Cluster) -> None:
    before = beats(slow)
    assert slow.scheduler is not None
    burst_through(slow.scheduler)
    check_and_kill(burst(CAPACITY), "placed")  # placed through the other scheduler
    # The node's heartbeats reach the other scheduler (the node stays up).
    end = time.monotonic() + 3 * slow.heartbeat_ms / 1000
    while beats(slow) <= before and time.monotonic() < end:
        time.sleep(0.2)
    assert beats(slow) > before
    with slow.client(f"http://127.0.0.1:{slow.scheduler_ports[1]}") as sched:
        assert sched.get("/nodes/node-1").json()["state"] == "up"


def redis_cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                          text=True).stdout


def test_a_redis_failover_during_creates_fails_none(slow: Cluster) -> None:
    end = time.monotonic() + 30  # the replica is in sync, and Sentinel knows it
    while not ("master_link_status:up" in redis_cli(slow.replica_port, "info", "replication")
               and str(slow.replica_port) in redis_cli(slow.sentinel_port, "sentinel",
                                                       "replicas", "aenv")):
        assert time.monotonic() < end, "the replica did not sync"
        time.sleep(0.2)
    assert slow.redis_primary() == slow.redis_port
    assert slow.redis is not None
    burst_through(slow.redis)
    end = time.monotonic() + 30
    while slow.redis_primary() != slow.replica_port:
        assert time.monotonic() < end, "Sentinel did not promote the replica"
        time.sleep(0.2)
    check_and_kill(burst(CAPACITY), "served")
    with slow.client() as api:
        assert api.get("/v2/sandboxes").json() == []
