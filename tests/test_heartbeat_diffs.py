"""Heartbeats that send only what changed (``cluster/beats.py``), applied by the
registry against a real redis-server: a diff lands on the beat it is against or not at
all (the node is asked for a full beat), so the registry never drifts from what its
node lists: not after a lost answer, a node restart with beats of the old process still
in flight, or two schedulers handling beats of one node at once. Kill tombstones and
room freed through the gateway hold on diffs; every field a node sends is bounded."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx

from agentenv.cluster.beats import (
    MAX_HEARTBEAT_BYTES,
    MAX_ITEM_BYTES,
    Beats,
    Sent,
    read_beat,
    send_beat,
)
from agentenv.cluster.common import Failover
from agentenv.cluster.node_registry import Applied, NodeStatus, Registry, SandboxEntry
from agentenv.cluster.sandbox_index import split
from agentenv.cluster.scheduler import create_scheduler_app


class Node:
    """A node's sandboxes and its heartbeats' state, as ``node/heartbeat.py`` keeps them."""

    def __init__(self, node_id: str = "n1", count: int = 0) -> None:
        self.node_id = node_id
        self.beats = Beats()
        self.sandboxes = {f"s{i}": self.entry(f"s{i}") for i in range(count)}

    @staticmethod
    def entry(sid: str, state: str = "running", **meta: str) -> SandboxEntry:
        return SandboxEntry(sid, state, item={"sandboxID": sid, "state": state,
                                              "startedAt": "2026-12-04T10:00:00Z",
                                              "metadata": {"job": "j", **meta}})

    def status(self) -> NodeStatus:
        load = sum(1 for s in self.sandboxes.values() if s.state == "running")
        return NodeStatus(node_id=self.node_id, url=f"http://{self.node_id}", capacity=400,
                          load=load, free_memory_mb=4096, runtime_kind="gvisor",
                          runtime_version="1", sandboxes=list(self.sandboxes.values()))

    def body(self) -> tuple[dict[str, Any], Sent]:
        return self.beats.body(self.status())


async def deliver(registry: Registry, body: dict[str, Any]) -> Applied:
    """One beat's body through the wire format (JSON, ``read_beat``) to ``registry``."""
    status, beat = read_beat(json.loads(json.dumps(body)))
    return await registry.heartbeat(status, 5000, beat)


async def beat(registry: Registry, node: Node) -> Applied:
    body, sent = node.body()
    applied = await deliver(registry, body)
    node.beats.answered(sent, {"disown": applied.disown, "full": applied.full})
    for sid in applied.disown:
        node.sandboxes.pop(sid, None)
    return applied


async def listed(registry: Registry, node_id: str) -> dict[str, str]:
    """The sandboxes the registry has on the node and their states: its records, each
    in the listings' index (what a listing reads) and among the node's fingerprints."""
    keys = await registry.redis.keys(registry._k("sbx", "*"))
    records = {k.rsplit(":", 1)[-1]: await registry.redis.hgetall(k) for k in keys}
    out = {sid: r["state"] for sid, r in records.items() if r.get("node") == node_id}
    members = await registry.redis.zrange(registry.index.all, 0, -1)
    assert {split(m)[1] for m in members} == set(records), "index and records differ"
    prints = await registry.redis.hkeys(registry._k("node-fp", node_id))
    assert set(prints) >= set(out), "the node's fingerprints miss a sandbox it owns"
    return out


def states(node: Node) -> dict[str, str]:
    return {sid: s.state for sid, s in node.sandboxes.items()}


def commands(registry: Registry) -> Any:
    async def read() -> int:
        return int((await registry.redis.info("stats"))["total_commands_processed"])
    return read


def run(redis_url: str, scenario: Any, prefix: str = "hbd:") -> None:
    """``scenario(registry)`` on a loop of its own; Redis flushed after it."""
    async def main() -> None:
        registry = Registry(redis_url, prefix=prefix)
        try:
            await scenario(registry)
        finally:
            await registry.redis.flushdb()
            await registry.close()
    asyncio.run(main())


def test_a_diff_carries_and_writes_only_what_changed(redis_url: str) -> None:
    async def scenario(registry: Registry) -> None:
        node = Node(count=300)
        first, _ = node.body()
        assert first["full"] and len(first["sandboxes"]) == 300
        node.beats = Beats()
        assert await beat(registry, node) == Applied([], True, False)
        assert await listed(registry, "n1") == states(node)
        # Nothing changed: a beat of a few hundred bytes, a dozen Redis commands.
        count = commands(registry)
        body, sent = node.body()
        size = len(json.dumps(body))
        assert not body["full"] and body["sandboxes"] == [] and body["removed"] == []
        before = await count()
        applied = await deliver(registry, body)
        node.beats.answered(sent, applied._asdict())
        assert applied == Applied([], False, False)
        idle = await count() - before - 1
        assert size < 1000 and idle <= 16, (size, idle)
        # One paused, one gone, one new: those three, and the registry follows.
        node.sandboxes["s1"] = node.entry("s1", "paused")
        del node.sandboxes["s2"]
        node.sandboxes["t1"] = node.entry("t1")
        body, sent = node.body()
        assert sorted(s["sandbox_id"] for s in body["sandboxes"]) == ["s1", "t1"]
        assert body["removed"] == ["s2"]
        applied = await deliver(registry, body)
        node.beats.answered(sent, applied._asdict())
        assert not applied.full
        assert await listed(registry, "n1") == states(node)
        assert await registry.sandbox("s2") is None
        # Every FULL_CHECK_EVERY-th beat is whole again (asked for by the registry).
        fulls = 0
        for _ in range(40):
            body, sent = node.body()
            fulls += body["full"]
            applied = await deliver(registry, body)
            node.beats.answered(sent, applied._asdict())
        assert fulls == 2 and await listed(registry, "n1") == states(node)

    run(redis_url, scenario)


def test_a_lost_answer_costs_a_full_beat_not_a_divergence(redis_url: str) -> None:
    """A beat the registry applied but whose answer the node never got (a timeout, a
    scheduler that died after writing): the next diff, against the beat before it, is
    refused, and the full beat that follows puts the registry where the node is."""

    async def scenario(registry: Registry) -> None:
        node = Node(count=20)
        await beat(registry, node)
        node.sandboxes["a"] = node.entry("a")  # made, then gone before the next beat
        body, _ = node.body()
        assert not (await deliver(registry, body)).full  # applied; the answer is lost
        assert "a" in await listed(registry, "n1")
        del node.sandboxes["a"]
        node.sandboxes["s3"] = node.entry("s3", "paused")
        # Against the beat before the lost one, it would leave "a" listed: refused.
        assert await beat(registry, node) == Applied([], False, True, refused=True)
        assert "a" in await listed(registry, "n1")  # nothing of it was written
        body, sent = node.body()
        assert body["full"]
        applied = await deliver(registry, body)
        node.beats.answered(sent, applied._asdict())
        assert await listed(registry, "n1") == states(node)
        node.sandboxes["s4"] = node.entry("s4", "paused")
        assert not (await beat(registry, node)).full
        assert await listed(registry, "n1") == states(node)

    run(redis_url, scenario)


def test_beats_of_a_node_process_that_restarted_are_refused(redis_url: str) -> None:
    """Beats of the node's previous process still in flight when the new one's first
    beat lands (a slow scheduler, a retry) are refused, full or diff."""

    async def scenario(registry: Registry) -> None:
        old = Node(count=5)
        await beat(registry, old)
        old.sandboxes["s0"] = old.entry("s0", "paused")
        late_diff, _ = old.body()
        late_full, _ = Beats().body(old.status())  # a first beat, delayed
        new = Node(count=2)  # restarted: s0 and s1 only
        assert new.beats.session > late_full["session"] > old.beats.session
        await beat(registry, new)
        for late in (late_diff, late_full):
            assert await deliver(registry, late) == Applied([], False, True, refused=True)
        assert await listed(registry, "n1") == states(new)
        assert not (await beat(registry, new)).full

    run(redis_url, scenario)


def test_two_schedulers_with_beats_of_one_node_never_interleave(redis_url: str) -> None:
    """One beat sent to two schedulers at once (a retry): one applies it, the other
    asks for a full beat. A slow scheduler whose beat was claimed before a later beat
    of the node writes nothing after it: the registry is where the node is now."""

    class Slow(Registry):
        """A scheduler that stalls between a beat's claim and its writes."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.claimed, self.gate = asyncio.Event(), asyncio.Event()
            fenced = self.heartbeats._fenced

            async def stalled(*args: Any, **kwargs: Any) -> bool:
                self.claimed.set()
                await self.gate.wait()
                return await fenced(*args, **kwargs)

            self.heartbeats._fenced = stalled  # type: ignore[method-assign]

    async def scenario(registry: Registry) -> None:
        other = Registry(redis_url, prefix="hbd:")
        slow = Slow(redis_url, prefix="hbd:")
        try:
            node = Node(count=10)
            await beat(registry, node)
            node.sandboxes["s1"] = node.entry("s1", "paused")
            body, sent = node.body()
            answers = await asyncio.gather(deliver(registry, body), deliver(other, body))
            assert sorted(a.refused for a in answers) == [False, True], answers
            node.beats.answered(sent, answers[0]._asdict())
            if answers[0].full:
                await beat(registry, node)

            node.sandboxes["x"] = node.entry("x")
            body, _ = node.body()
            stuck = asyncio.create_task(deliver(slow, body))  # claimed, not yet written
            await slow.claimed.wait()
            del node.sandboxes["x"]  # the node moved on: x ended, s5 paused
            node.sandboxes["s5"] = node.entry("s5", "paused")
            assert (await beat(registry, node)).refused  # against the beat before
            assert not (await beat(registry, node)).full  # full, applied
            slow.gate.set()
            assert (await stuck).refused  # its claim was taken over: nothing written
            assert await listed(registry, "n1") == states(node)
        finally:
            await other.close()
            await slow.close()

    run(redis_url, scenario)


def test_a_beat_handled_late_does_not_drop_a_sandbox_a_later_one_listed(redis_url: str
                                                                         ) -> None:
    """A beat that timed out on a slow scheduler, handled there only after the node's
    next beat (which lists a sandbox just made) was applied elsewhere: refused. Applied,
    it would drop the new sandbox from the listings until the node's next beat (whole
    beats did: a listing right after a burst of creates missed one)."""

    async def scenario(registry: Registry) -> None:
        node = Node(count=3)
        await beat(registry, node)
        await beat(registry, node)
        late, _ = node.body()  # sent, timed out: no answer
        node.sandboxes["new"] = node.entry("new")
        await registry.set_sandbox("new", "n1", "running", item=node.sandboxes["new"].item)
        assert not (await beat(registry, node)).refused
        assert await deliver(registry, late) == Applied([], False, True, refused=True)
        assert await listed(registry, "n1") == states(node)
        # A late whole beat of the node process before (restarted since): the same.
        late, _ = Beats().body(dataclasses.replace(node.status(), sandboxes=[]))
        node.beats = Beats()
        await beat(registry, node)
        assert (await deliver(registry, late)).refused
        assert await listed(registry, "n1") == states(node)

    run(redis_url, scenario)


def test_a_diff_does_not_bring_back_a_sandbox_killed_through_the_gateway(redis_url: str
                                                                          ) -> None:
    async def scenario(registry: Registry) -> None:
        node = Node(count=3)
        await beat(registry, node)
        await registry.forget_sandbox("s1")  # the kill through the gateway
        node.sandboxes["s1"] = node.entry("s1", "running", step="2")  # taken before it
        assert not (await beat(registry, node)).full
        assert "s1" not in await listed(registry, "n1")
        del node.sandboxes["s1"]
        await beat(registry, node)
        assert await listed(registry, "n1") == states(node)
        assert await registry.redis.hkeys(registry._k("node-fp", "n1")) != []
        assert "s1" not in await registry.redis.hkeys(registry._k("node-fp", "n1"))

    run(redis_url, scenario)


def test_room_freed_through_the_gateway_on_diffs(redis_url: str) -> None:
    """A diff that does not mention a freed sandbox leaves it as the beat it is against
    had it: still running there, so still freed room (settling it there would count
    its slot twice: freed, and free in a load that still counts it). A diff that shows
    it paused or gone settles it; one freed that no beat listed settles at once."""

    async def scenario(registry: Registry) -> None:
        node = Node(count=3)
        await beat(registry, node)
        for sid in ("s0", "s1", "never-listed"):
            await registry.free("n1", sid, 5000)  # paused or killed through the gateway
        node.sandboxes["s2"] = node.entry("s2", "paused")  # s0, s1 still running here
        assert not (await beat(registry, node)).full
        n1 = await registry.node("n1")
        assert n1 is not None and (n1.load, n1.released) == (2, 2)
        node.sandboxes["s0"] = node.entry("s0", "paused")
        del node.sandboxes["s1"]
        await beat(registry, node)
        n1 = await registry.node("n1")
        assert n1 is not None and (n1.load, n1.released) == (0, 0)
        assert await registry.redis.smembers(registry._k("freed", "n1")) == set()

    run(redis_url, scenario)


def test_heartbeats_through_the_scheduler_are_bounded(redis_url: str) -> None:
    """What a node sends is bounded: a 400 or 413 that says what, nothing recorded of
    it, and the node's next beat is served. A refused diff is followed by a full beat
    at once; an older node's full beat with no session is applied as it always was."""

    async def scenario(registry: Registry) -> None:
        app = create_scheduler_app(redis_url, "k" * 32)  # the registry's default prefix
        transport = httpx.ASGITransport(app=app)
        node = Node(count=2)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://sched",
                                         headers={"X-API-Key": "k" * 32}) as http:
                async def post(body: Any) -> httpx.Response:
                    return await http.post("/nodes/heartbeat", json=body)

                good, _ = Beats().body(node.status())
                bad: list[tuple[dict[str, Any], int, str]] = [
                    ({**good, "node_id": "../x"}, 400, "node_id"),
                    ({**good, "node_id": "n" * 200}, 400, "node_id"),
                    ({**good, "capacity": "8"}, 400, "capacity"),
                    ({**good, "load": -1}, 400, "load"),
                    ({**good, "url": "u" * 5000}, 400, "url"),
                    ({**good, "templates": ["t"] * 100_001}, 400, "templates"),
                    ({**good, "sandboxes": [{"sandbox_id": "a/b", "state": "running"}]},
                     400, "sandbox ID"),
                    ({**good, "sandboxes": [{"sandbox_id": "a", "state": "r" * 300}]},
                     400, "state"),
                    ({**good, "sandboxes": [{"sandbox_id": "a", "state": "running",
                                             "item": {"x": "y" * MAX_ITEM_BYTES}}]},
                     413, "item"),
                    ({**good, "session": "yesterday"}, 400, "session"),
                    ({**good, "full": False, "base": good["seq"]}, 400, "base"),
                    ({**good, "full": False, "base": 1, "seq": 2,
                      "removed": ["x" * 65]}, 400, "removed"),
                ]
                for body, code, says in bad:
                    r = await post(body)
                    assert (r.status_code, says in r.json()["message"]) == (code, True), \
                        (says, r.status_code, r.text[:300])
                for raw in (b"{", b"[" * 100_000):  # not JSON; nested past the parser
                    r = await http.post("/nodes/heartbeat", content=raw)
                    assert r.status_code == 400 and "invalid heartbeat" in r.text, r.text
                r = await http.post("/nodes/heartbeat", content=b" " * (MAX_HEARTBEAT_BYTES + 1),
                                    headers={"content-type": "application/json"})
                assert r.status_code == 413 and "exceeds" in r.json()["message"]
                assert await registry.redis.smembers(registry._k("nodes")) == set()
                assert await registry.redis.keys(registry._k("sbx", "*")) == []
                # The node's own beats are served, the first whole, the next a diff.
                for _ in range(2):
                    body, sent = node.body()
                    r = await post(body)
                    assert r.status_code == 200, r.text
                    node.beats.answered(sent, r.json())
                    assert r.json() == {"disown": [], "full": False, "applied": True}
                assert not body["full"]
                assert await listed(registry, "n1") == states(node)
                # The registry lost track of the node (forgotten): a node's diff is
                # refused and its full beat follows at once, in the same heartbeat.
                await registry.forget_node("n1")
                node.sandboxes["late"] = node.entry("late")
                answer = await send_beat(http, Failover("http://sched"), node.beats,
                                         node.status())
                assert answer["applied"] is True
                assert await listed(registry, "n1") == states(node)
                # An older node: its whole status, no session.
                older = dataclasses.replace(node.status(), node_id="old",
                                            sandboxes=[Node.entry("o1")])
                r = await post(older.to_dict())
                assert r.status_code == 200
                assert r.json() == {"disown": [], "full": False, "applied": True}
                assert set(await registry.redis.smembers(registry._k("nodes"))) == \
                    {"n1", "old"}
                assert await listed(registry, "old") == {"o1": "running"}
        finally:
            await app.state.registry.close()

    run(redis_url, scenario, prefix="aenv:")


def test_a_beat_taken_mid_create_does_not_hide_the_sandbox_the_gateway_recorded(
        redis_url: str) -> None:
    """A node's beat that lists a sandbox as still creating, handled after the gateway
    recorded the create's answer (running), leaves it running in the listings; the
    node's next beat says running too. (The cause of a listing missing one sandbox of a
    burst through two gateways: test_cluster_gateways.)"""
    async def scenario(registry: Registry) -> None:
        node = Node(count=2)
        await beat(registry, node)
        node.sandboxes["x"] = node.entry("x", "creating")
        body, sent = node.body()  # taken mid-create, delivered late
        item = {**node.entry("x").item, "state": "running"}
        await registry.set_sandbox("x", node.node_id, "running", item=item)
        applied = await deliver(registry, body)
        node.beats.answered(sent, {"disown": applied.disown, "full": applied.full})
        assert (await listed(registry, node.node_id))["x"] == "running"
        running = await registry.redis.zrange(registry.index.state("running"), 0, -1)
        assert "x" in {split(m)[1] for m in running}
        node.sandboxes["x"] = node.entry("x")
        await beat(registry, node)
        assert await listed(registry, node.node_id) == states(node)
    run(redis_url, scenario)


def state_index(registry: Registry, state: str) -> Any:
    """The sandbox IDs a listing by ``state`` reads from the index."""
    async def read() -> set[str]:
        members = await registry.redis.zrange(registry.index.state(state), 0, -1)
        return {split(m)[1] for m in members}
    return read()


class BetweenReadAndWrite(Registry):
    """A scheduler whose heartbeat writes wait until ``between`` (the gateway's change)
    has run, once: what the beat read is then older than the record."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.between: Any = None
        fenced = self.heartbeats._fenced

        async def late(*args: Any, **kwargs: Any) -> int | None:
            if self.between is not None:
                change, self.between = self.between, None
                await change()
            return await fenced(*args, **kwargs)

        self.heartbeats._fenced = late  # type: ignore[method-assign]


def test_the_gateway_recording_a_create_between_a_beats_read_and_writes_wins(
        redis_url: str) -> None:
    """A beat that read the record before the gateway recorded the create's answer
    (running) and wrote after it leaves the record and the index as the gateway wrote
    them (the listings kept showing the sandbox: no state 'creating' written back), and
    asks for a full beat, which finds the node's record as it is."""
    async def scenario(registry: Registry) -> None:
        late = BetweenReadAndWrite(redis_url, prefix="hbd:")
        try:
            node = Node(count=2)
            await beat(late, node)
            node.sandboxes["x"] = node.entry("x", "creating")
            item = {**node.entry("x").item, "state": "running"}
            late.between = lambda: registry.set_sandbox("x", node.node_id, "running",
                                                        item=item)
            body, sent = node.body()
            applied = await deliver(late, body)
            node.beats.answered(sent, {"disown": applied.disown, "full": applied.full})
            assert applied.full and not applied.refused
            assert (await listed(late, node.node_id))["x"] == "running"
            assert "x" in await state_index(late, "running")
            assert "x" not in await state_index(late, "creating")
            node.sandboxes["x"] = node.entry("x")
            await beat(late, node)
            assert await listed(late, node.node_id) == states(node)
            assert await state_index(late, "creating") == set()
            assert await state_index(late, "running") == set(node.sandboxes)
        finally:
            await late.close()
    run(redis_url, scenario, prefix="hbd:")


def test_a_beat_older_than_a_pause_through_the_gateway_does_not_resume_it_in_the_listing(
        redis_url: str) -> None:
    """The gateway records a pause between a beat's read (running) and its writes: the
    sandbox stays paused in the records and the index; the node's next beat agrees."""
    async def scenario(registry: Registry) -> None:
        late = BetweenReadAndWrite(redis_url, prefix="hbd:")
        try:
            node = Node(count=3)
            await beat(late, node)
            node.sandboxes["s1"] = node.entry("s1", "running", step="2")  # a change
            late.between = lambda: registry.set_sandbox("s1", node.node_id, "paused")
            applied = await beat(late, node)
            assert applied.full
            assert (await listed(late, node.node_id))["s1"] == "paused"
            assert "s1" in await state_index(late, "paused")
            assert "s1" not in await state_index(late, "running")
            node.sandboxes["s1"] = node.entry("s1", "paused", step="2")
            await beat(late, node)
            assert await listed(late, node.node_id) == states(node)
        finally:
            await late.close()
    run(redis_url, scenario, prefix="hbd:")


def test_a_beat_between_the_gateways_read_and_write_leaves_no_stale_index_entry(
        redis_url: str) -> None:
    """A heartbeat applied between the gateway's read of a record and its write (the
    gateway's write is then refused and made again from the new record): the index
    holds the sandbox under its one state, whichever wrote last."""
    async def scenario(registry: Registry) -> None:
        node = Node(count=1)
        await beat(registry, node)
        node.sandboxes["x"] = node.entry("x", "creating")
        guarded = registry._guarded
        calls = {"n": 0}

        async def beat_first(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                await beat(registry, node)  # writes x as creating after the gateway read
            return await guarded(*args, **kwargs)

        registry._guarded = beat_first  # type: ignore[method-assign]
        item = {**node.entry("x").item, "state": "running"}
        await registry.set_sandbox("x", node.node_id, "running", item=item)
        assert calls["n"] == 2  # refused once, then written over the beat's record
        assert (await listed(registry, node.node_id))["x"] == "running"
        assert await state_index(registry, "creating") == set()
        assert await state_index(registry, "running") == {"s0", "x"}
        await registry.forget_sandbox("x")
        assert "x" not in await listed(registry, node.node_id)
        assert await state_index(registry, "running") == {"s0"}
    run(redis_url, scenario)
