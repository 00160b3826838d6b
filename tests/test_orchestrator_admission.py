"""The sandbox manager's admission control and runs, over fakes (unit_nodes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.orchestrator import BadRequest, CreateRequest, SandboxState
from agentenv.orchestrator.admission import TooManyRequests
from unit_nodes import Node, started


@pytest.fixture
async def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    async with started(tmp_path, monkeypatch, capacity=3, slots=4) as n:
        yield n


async def test_a_create_beyond_capacity_waits_for_room_and_holds_nothing(node: Node) -> None:
    mgr = node.manager
    first, *_ = [await mgr.create(CreateRequest("base")) for _ in range(3)]
    waiting = asyncio.create_task(mgr.create(CreateRequest("base")))
    await asyncio.sleep(0.1)
    assert not waiting.done() and mgr.admission.waiting == 1
    assert len(mgr.list()) == 3 and len(node.slots.holding) == 3  # a waiter holds nothing
    await mgr.kill(first.sandbox_id)
    record = await waiting
    assert record.state is SandboxState.RUNNING
    assert record.queued_at < record.started_at <= record.booted_at <= record.ready_at
    # A waiter that gives up (its client hung up) leaves the queue and takes no room.
    gone = asyncio.create_task(mgr.create(CreateRequest("base")))
    await asyncio.sleep(0.1)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert mgr.admission.waiting == 0 and len(mgr.list()) == 3


async def test_waiters_are_served_round_robin_across_keys(node: Node) -> None:
    mgr = node.manager
    held = [await mgr.create(CreateRequest("base", owner="a")) for _ in range(3)]
    order: list[str] = []

    async def create(owner: str) -> None:
        await mgr.create(CreateRequest("base", owner=owner))
        order.append(owner)

    tasks = []
    for owner in ("a", "a", "a", "b"):
        tasks.append(asyncio.create_task(create(owner)))
        await asyncio.sleep(0.02)
    for record in held[:2]:
        await mgr.kill(record.sandbox_id)
        await asyncio.sleep(0.1)
    assert order == ["a", "b"]  # b's one create does not wait behind a's burst
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_per_key_quota_holds_one_key_not_the_others(node: Node) -> None:
    mgr = node.manager
    node.config.key_quotas = {"small": {"max_sandboxes": 1}}
    await mgr.create(CreateRequest("base", owner="small"))
    with pytest.raises(TooManyRequests, match="quota of 1 concurrent"):
        await mgr.create(CreateRequest("base", owner="small"))
    assert (await mgr.create(CreateRequest("base", owner="other"))).state is \
        SandboxState.RUNNING


async def test_a_run_ends_with_its_sandboxes_and_survives_a_restart(node: Node) -> None:
    mgr = node.manager
    with pytest.raises(BadRequest, match="unknown or has ended"):
        await mgr.create(CreateRequest("base", run_id="run_nope"))
    assert mgr.list() == []
    run = mgr.create_run("trainer-1", 5, "kill")
    other = await mgr.create(CreateRequest("base"))
    members = [await mgr.create(CreateRequest("base", run_id=run.run_id)) for _ in range(2)]
    assert {r.sandbox_id for r in mgr.run_members(run.run_id)} == {r.sandbox_id for r in members}
    mgr = await node.restart()  # the run and its lease are kept
    (kept,) = mgr.runbook.list()
    assert kept.run_id == run.run_id and kept.lease_s == 5
    kept.expires_at = 0  # its lease lapsed (while the node was down, say)
    mgr.runs.tend()
    for _ in range(50):
        if not mgr.runbook.list() and len(mgr.list()) == 1:
            break
        await asyncio.sleep(0.05)
    assert [r.sandbox_id for r in mgr.list()] == [other.sandbox_id]
    assert mgr.runbook.list() == []
    with pytest.raises(BadRequest):
        await mgr.create(CreateRequest("base", run_id=run.run_id))
    for bad in (("", 5, "kill"), ("x" * 65, 5, "kill"), ("a b", 5, "kill"),
                ("ok", 4, "kill"), ("ok", 86401, "kill"), ("ok", True, "kill"),
                ("ok", 5, "explode")):
        with pytest.raises(BadRequest):
            mgr.create_run(*bad)


async def test_a_creates_per_second_quota_paces_a_key(node: Node) -> None:
    mgr = node.manager
    mgr.admission.timeout_s = 5
    node.config.key_quotas = {"paced": {"creates_per_s": 2}}
    for _ in range(3):
        record = await mgr.create(CreateRequest("base", owner="paced"))
        await mgr.kill(record.sandbox_id)
    # Two go at once (the bucket holds two); the third waits for a token, woken by time.
    assert mgr.admission.stats()["waited"] == 1
