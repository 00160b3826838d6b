"""The cluster registry against a real redis-server: a burst of requests larger than
its connection pool waits for connections instead of failing (a gateway answering a
burst of 200 creates asks Redis ~200 times at once)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
from typing import Any

from agentenv.cluster.node_registry import (
    REDIS_MAX_CONNECTIONS,
    NodeStatus,
    Registry,
    SandboxEntry,
)
from agentenv.cluster.placement import PlacementRequest, place
from agentenv.cluster.placer import MIN_FRESH_S, Placer, Ranked


def test_a_burst_beyond_the_pool_waits_for_connections(redis_url: str) -> None:
    count = 3 * REDIS_MAX_CONNECTIONS + 50

    async def burst() -> list[dict[str, str] | None]:
        registry = Registry(redis_url)
        try:
            await asyncio.gather(*(registry.set_sandbox(f"s{i}", "node-1", "running")
                                   for i in range(count)))
            return await asyncio.gather(*(registry.sandbox(f"s{i}") for i in range(count)))
        finally:
            await registry.close()

    got = asyncio.run(burst())
    assert all(e is not None and e["node"] == "node-1" for e in got), got[:3]


def _status(node_id: str, *sandboxes: SandboxEntry, load: int = 0) -> NodeStatus:
    return NodeStatus(node_id=node_id, url=f"http://{node_id}", capacity=8, load=load,
                      free_memory_mb=4096, runtime_kind="gvisor", runtime_version="1",
                      sandboxes=list(sandboxes))


def test_heartbeats_own_sandboxes_and_nodes_are_read_whole(redis_url: str) -> None:
    """A heartbeat records what its node lists, forgets what it no longer lists, and
    tells it to drop what another live node took over; every node is read with its
    liveness and the gateway's counts of room taken and freed since its heartbeat."""

    async def scenario() -> None:
        registry = Registry(redis_url, prefix="hb-test:")
        try:
            many = [SandboxEntry(f"a{i}", "running", item={"sandboxID": f"a{i}"})
                    for i in range(300)]
            beat = _status("n1", *many, load=300)
            assert (await registry.heartbeat(beat, 5000))[:2] == ([], True)
            assert (await registry.heartbeat(beat, 5000))[:2] == ([], False)
            assert (await registry.sandbox("a7"))["node"] == "n1"
            # a5 was taken over by n2 (n1 was lost, now back): n1 is told to drop it.
            await registry.heartbeat(_status("n2"), 5000)
            await registry.set_sandbox("a5", "n2", "running", "snap", True)
            back = [SandboxEntry("a5", "paused", "snap", True), *many[6:]]
            assert (await registry.heartbeat(_status("n1", *back), 5000))[:2] == (["a5"], False)
            assert (await registry.sandbox("a5"))["node"] == "n2"
            # What n1 no longer lists is gone, what it lists is its own.
            assert [await registry.sandbox(f"a{i}") for i in (0, 1, 2, 3, 4)] == [None] * 5
            assert (await registry.sandbox("a299"))["node"] == "n1"
            # A takeover by a node that is down does not count: n1 keeps it.
            await registry.redis.delete(registry._k("alive", "n2"))
            await registry.heartbeat(_status("n1", *back), 5000)
            assert (await registry.sandbox("a5"))["node"] == "n1"

            await registry.reserve("n1", 5000)
            await registry.reserve("n1", 5000)
            assert await registry.release("n1", await registry.beat("n1"), 5000)
            nodes = {n.node_id: n for n in await registry.nodes()}
            assert (nodes["n1"].state, nodes["n1"].reserved, nodes["n1"].released) == \
                ("up", 2, 1)
            assert nodes["n2"].state == "down" and nodes["n1"].sandboxes == []
            assert nodes["n1"].to_dict() == (await registry.node("n1")).to_dict()
            # A new heartbeat is read at once, here and by another scheduler.
            other = Registry(redis_url, prefix="hb-test:")
            try:
                for load in (3, 5):
                    await registry.heartbeat(_status("n1", load=load), 5000)
                    for reader in (registry, other):
                        n1 = next(n for n in await reader.nodes() if n.node_id == "n1")
                        assert (n1.load, n1.reserved, n1.released) == (load, 0, 0)
            finally:
                await other.close()
        finally:
            await registry.redis.flushdb()
            await registry.close()

    asyncio.run(scenario())


def test_a_heartbeat_sent_before_a_kill_does_not_bring_the_sandbox_back(redis_url: str
                                                                        ) -> None:
    """The gateway kills a sandbox and forgets it; its node's heartbeat, sent just
    before the kill and read just after, still lists it. A listing must not show a
    sandbox its user has just killed (it did, until the node's next heartbeat)."""

    async def scenario() -> None:
        registry = Registry(redis_url, prefix="kill-race:")
        try:
            item = {"sandboxID": "k1", "templateID": "base", "state": "running",
                    "startedAt": "2026-12-04T10:00:00Z"}
            await registry.heartbeat(_status("n1"), 5000)
            await registry.set_sandbox("k1", "n1", "running", item=item)
            stale = _status("n1", SandboxEntry("k1", "running", item=item), load=1)
            await registry.forget_sandbox("k1")  # the kill through the gateway
            await registry.heartbeat(stale, 5000)  # sent before it, read after it
            assert await registry.sandbox("k1") is None
            assert await registry.redis.zrange(registry.index.all, 0, -1) == []
            # The node's next heartbeat no longer lists it, and nothing is left behind.
            await registry.heartbeat(_status("n1"), 5000)
            assert await registry.sandbox("k1") is None
            assert await registry.redis.hgetall(registry._k("node-fp", "n1")) == {}
        finally:
            await registry.redis.flushdb()
            await registry.close()

    asyncio.run(scenario())


def test_room_freed_through_the_gateway_outlives_a_heartbeat_taken_before_it(
        redis_url: str) -> None:
    """A pause or kill through the gateway frees its slot at once; a heartbeat the node
    took before the pause finished (it still counts the sandbox) does not take that room
    back, one that no longer counts it settles it, and a resume takes the slot again."""

    async def scenario() -> None:
        registry = Registry(redis_url, prefix="room-test:")
        try:
            full = [SandboxEntry("p1", "running"), SandboxEntry("p2", "running")]
            await registry.heartbeat(dataclasses.replace(_status("n1", *full, load=2),
                                                         capacity=2), 5000)
            assert await registry.reserve_room("n1", 5000) is None  # full
            await registry.free("n1", "p1", 5000)  # p1 paused through the gateway
            await registry.free("n1", "p1", 5000)  # said twice: counted once
            # The heartbeat the node took while p1 was pausing: still running, load 2.
            await registry.heartbeat(dataclasses.replace(_status("n1", *full, load=2),
                                                         capacity=2), 5000)
            assert (await registry.node("n1")).released == 1
            assert await registry.reserve_room("n1", 5000) is not None  # p1's slot
            assert await registry.reserve_room("n1", 5000) is None
            # The next heartbeat shows it paused (and the placement running): settled.
            after = [SandboxEntry("p1", "paused"), SandboxEntry("p2", "running"),
                     SandboxEntry("new", "running")]
            await registry.heartbeat(dataclasses.replace(_status("n1", *after, load=2),
                                                         capacity=2), 5000)
            assert (await registry.node("n1")).released == 0
            assert await registry.reserve_room("n1", 5000) is None
            # A kill frees p2, and its resume before any heartbeat takes that room back
            # (a sandbox killed cannot resume: the same count for a pause then resume).
            await registry.free("n1", "p2", 5000)
            assert [(n.released, n.reserved) for n in await registry.nodes()] == [(1, 0)]
            await registry.take("n1", "p2", 5000)
            assert [(n.released, n.reserved) for n in await registry.nodes()] == [(0, 0)]
            # A resume of p1, whose pause a heartbeat has seen: a slot taken until the next.
            await registry.take("n1", "p1", 5000)
            assert [(n.released, n.reserved) for n in await registry.nodes()] == [(0, 1)]
        finally:
            await registry.redis.flushdb()
            await registry.close()

    asyncio.run(scenario())


def _commands(registry: Registry) -> Any:
    async def read() -> int:
        return int((await registry.redis.info("stats"))["total_commands_processed"])
    return read


def test_a_placement_reads_redis_the_same_whatever_the_number_of_nodes(redis_url: str
                                                                       ) -> None:
    """Placements from the scheduler's view: their Redis commands do not grow with the
    nodes (before: four per node per placement), and a node's room is reserved
    atomically, so two schedulers whose views are stale never overfill it."""

    async def scenario() -> None:
        registry = Registry(redis_url, prefix="place-test:")
        other = Registry(redis_url, prefix="place-test:")
        try:
            per_size = []
            for size in (10, 200):
                for k in range(size):
                    await registry.heartbeat(_status(f"s{size}-{k}", load=0), 60_000)
                # One read of the nodes for the forty (a loaded machine would read them
                # again every 0.2 s: a count of its own, whatever the number of nodes).
                placer = Placer(registry, 60_000, refresh_s=60)
                count = _commands(registry)
                before = await count()
                for _ in range(40):
                    assert len(await placer.place(PlacementRequest())) == 1
                per_size.append((await count() - before - 1) / 40)
                for k in range(size):
                    await registry.forget_node(f"s{size}-{k}")
            # A reservation each (a script: 8 commands as Redis counts them) and the
            # read of the nodes (8): the same at 10 and at 200 nodes.
            assert per_size[1] <= per_size[0] + 0.5 and max(per_size) <= 9, per_size

            # One node with room for 3 (capacity 8, load 5), two schedulers that both
            # read it with room: 3 placements succeed between them, the rest are refused.
            await registry.heartbeat(_status("tight", load=5), 60_000)
            a, b = Placer(registry, 60_000, refresh_s=60), Placer(other, 60_000, refresh_s=60)
            assert await a._view(60) and await b._view(60)
            got = [await p.place(PlacementRequest()) for p in (a, b, a, b, a, b)]
            assert [len(g) for g in got] == [1, 1, 1, 0, 0, 0]
            nodes = {n.node_id: n for n in await registry.nodes()}
            assert nodes["tight"].effective_load == nodes["tight"].capacity
            # Room freed (a kill between heartbeats) is room again: a placement its view
            # refuses reads the nodes again once that view is MIN_FRESH_S old.
            assert await registry.release("tight", await registry.beat("tight"), 60_000)
            await asyncio.sleep(2 * MIN_FRESH_S)
            assert len(await b.place(PlacementRequest())) == 1
        finally:
            await registry.close()
            await other.close()

    asyncio.run(scenario())


def test_ranked_picks_are_places_picks() -> None:
    """The placer's heap (a pick in O(log nodes)) picks as ``placement.place``'s pass
    over every node does: kinds of request mixed over one view, loads shared, nodes
    excluded, full, of another runtime or short of memory."""
    rng = random.Random(31)
    for _ in range(200):
        count = rng.randint(1, 30)
        nodes = [NodeStatus(node_id=f"n{i}", url="", capacity=rng.randint(1, 6),
                            load=rng.randint(0, 6), reserved=rng.randint(0, 2),
                            free_memory_mb=rng.choice([100, 64_000, 64_000]),
                            runtime_kind=rng.choice(["gvisor", "other"]), runtime_version="v",
                            templates=rng.sample(["a", "b", "c"], rng.randint(0, 3)))
                 for i in range(count)]
        by_pass, by_heap = copy.deepcopy(nodes), copy.deepcopy(nodes)
        heaps: dict[tuple[str, str], Ranked] = {}
        for _ in range(15):
            req = PlacementRequest(template=rng.choice(["a", "b", ""]),
                                   runtime_kind=rng.choice(["", "gvisor"]),
                                   exclude=rng.sample([n.node_id for n in nodes],
                                                      rng.randint(0, min(3, count))))
            expected = [n.node_id for n in place(by_pass, req)]
            heap = heaps.setdefault((req.template, req.runtime_kind), Ranked(by_heap, req))
            got = heap.pick(req.exclude)
            assert ([got.node_id] if got else []) == expected
