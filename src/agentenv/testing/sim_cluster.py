"""Simulated nodes in a thread of the caller (tests), the waits the tests of the
control plane over them share, and their two fixtures (``sim_fixtures``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx

from .cluster import Cluster
from .sim_nodes import SimNodes
from .sim_records import Behaviour

T = TypeVar("T")


class InThread:
    """Simulated nodes served by an event loop in a thread of their own; ``call`` runs a
    coroutine there (the nodes' records are the loop's alone)."""

    def __init__(self, sim: SimNodes) -> None:
        self.sim = sim
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-nodes",
                                        daemon=True)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self._thread.start()
        self.call(self.sim.start())

    def states(self) -> dict[str, dict[str, str]]:
        """Every node's sandboxes and their states (read on the nodes' loop)."""
        async def read() -> dict[str, dict[str, str]]:
            return {n.node_id: {s.sandbox_id: s.state for s in n.sandboxes.values()}
                    for n in self.sim.nodes}
        return self.call(read())

    def set_heartbeating(self, node_id: str, on: bool) -> None:
        async def switch() -> None:
            self.sim.node(node_id).heartbeating = on
        self.call(switch())

    def beat(self, node_id: str) -> None:
        """One heartbeat of the node now (its answer's disowns applied)."""
        self.call(self.sim.beat(self.sim.node(node_id)))

    def stop(self) -> None:
        try:
            self.call(self.sim.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


@contextlib.contextmanager
def running(count: int, scheduler_url: str, api_key: str,
            behaviour: Behaviour | None = None) -> Iterator[InThread]:
    """``count`` simulated nodes in a thread, heartbeating to ``scheduler_url``."""
    runner = InThread(SimNodes(count, scheduler_url, api_key, behaviour))
    runner.start()
    try:
        yield runner
    finally:
        runner.stop()


def wait_for(check: Callable[[], bool], what: str, wait: float = 15) -> None:
    end = time.monotonic() + wait
    while not check():
        assert time.monotonic() < end, f"not within {wait}s: {what}"
        time.sleep(0.05)


def up_nodes(cluster: Cluster) -> set[str]:
    """The nodes a scheduler lists up (the first of the cluster's that answers)."""
    for port in cluster.scheduler_ports:
        try:
            with cluster.client(f"http://127.0.0.1:{port}") as c:
                r = c.get("/nodes", params={"state": "up"}, timeout=5)
        except httpx.HTTPError:
            continue  # killed: the next one
        if r.status_code == 200:
            return {n["node_id"] for n in r.json()}
    return set()


@contextlib.contextmanager
def heartbeating(cluster: Cluster, count: int, behaviour: Behaviour,
                 wait: float = 15) -> Iterator[InThread]:
    """``count`` simulated nodes heartbeating to every scheduler of ``cluster``, once
    each is listed up."""
    schedulers = ",".join(f"http://127.0.0.1:{p}" for p in cluster.scheduler_ports)
    with running(count, schedulers, cluster.api_key, behaviour) as nodes:
        wait_for(lambda: len(up_nodes(cluster)) == count, "every simulated node up", wait)
        yield nodes


def sim_fixtures(name: str, prefix: str, nodes: int, behaviour: Behaviour, *,
                 wait: float = 15, env: dict[str, str] | None = None,
                 **cluster: Any) -> tuple[Any, Any]:
    """A test module's two module-scoped fixtures over simulated nodes: ``cluster``, a
    real control plane (Redis, schedulers, gateways; ``cluster``: Cluster's arguments)
    with no node of its own, its services started with ``env`` in their environment
    (their config), and ``sim``, ``nodes`` simulated nodes of ``behaviour`` heartbeating
    to every scheduler of it, each listed up within ``wait`` s. ``prefix``: one letter,
    the cluster's names' own (with the process's ID)::

        cluster, sim = sim_fixtures("sim-quotas", "q", 10, Behaviour(capacity=4), gateways=2)
    """
    import pytest  # tests only: a benchmark importing this module does not need it

    @pytest.fixture(scope="module", name="cluster")
    def cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
        c = Cluster(tmp_path_factory.mktemp(name), f"{prefix}{os.getpid() % 256:02x}",
                    nodes=0, **cluster)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in (env or {}).items():
                mp.setenv(key, value)
            with c.serving() as serving:
                yield serving

    @pytest.fixture(scope="module", name="sim")
    def sim_fixture(cluster: Cluster) -> Iterator[InThread]:
        with heartbeating(cluster, nodes, behaviour, wait) as running_nodes:
            yield running_nodes

    return cluster_fixture, sim_fixture
