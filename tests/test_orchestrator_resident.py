"""The sandbox manager's two-tier (resident) pauses, over fakes (unit_nodes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentenv.orchestrator import (
    CreateRequest,
    SandboxManager,
    SandboxState,
)
from agentenv.orchestrator import specs as specs_module
from unit_nodes import Node, started


@pytest.fixture
async def resident_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                        ) -> AsyncIterator[Node]:
    async with started(tmp_path, monkeypatch, capacity=3, slots=3, resident=True) as n:
        yield n


async def _captured(mgr: SandboxManager, sandbox_id: str) -> None:
    entry = mgr.residents.get(sandbox_id) if mgr.residents is not None else None
    if entry is not None and entry.capture is not None:
        await entry.capture
    await asyncio.gather(*mgr.sandboxes.commits())


async def test_a_resident_pause_freezes_and_a_resume_thaws_in_place(resident_node: Node) -> None:
    node = resident_node
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid, slot = record.sandbox_id, record.slot_address
    await mgr.pause(sid)
    assert record.state is SandboxState.PAUSED
    assert node.runtime.sandboxes[sid].state == "paused" and record.slot_address == slot
    await _captured(mgr, sid)  # captured frozen, committed in the background
    assert node.runtime.sandboxes[sid].state == "paused"
    assert mgr.snapshots.get(record.snapshot_id).metadata["kind"] == "pause"
    await mgr.resume(sid)
    assert record.state is SandboxState.RUNNING and record.slot_address == slot
    assert ("restore", sid) not in node.runtime.calls  # a thaw, not a restore
    assert node.runtime.sandboxes[sid].state == "running"

    # Paused and resumed before its capture began: no capture, no snapshot left over.
    before = record.snapshot_id
    await mgr.pause(sid)
    await mgr.resume(sid)
    await asyncio.sleep(0)
    assert record.snapshot_id == before and not mgr.sandboxes.commits()
    assert [m.snapshot_id for m in mgr.snapshots.list()] == [before]


async def test_a_resume_within_the_capture_delay_is_a_thaw_and_eviction_hurries_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    monkeypatch.setattr(specs_module, "build_bundle", lambda _dir: bundle)
    # A delay far longer than the test: whatever is captured was hurried.
    node = Node(tmp_path, capacity=2, slots=2, resident=True, capture_delay_ms=60_000)
    mgr = node.manager
    await mgr.start()
    try:
        record = await mgr.create(CreateRequest("base"))
        sid = record.sandbox_id
        before = record.snapshot_id
        await mgr.pause(sid)
        await asyncio.sleep(0.05)
        await mgr.resume(sid)  # within the delay: a thaw, nothing captured
        assert ("checkpoint", sid) not in node.runtime.calls
        assert ("restore", sid) not in node.runtime.calls
        assert record.snapshot_id == before and not mgr.sandboxes.commits()

        # An eviction does not wait out the delay: it captures at once.
        await mgr.pause(sid)
        await asyncio.wait_for(mgr.evict(sid), 10)
        assert sid not in node.runtime.sandboxes and record.slot_index == 0
        await asyncio.gather(*mgr.sandboxes.commits())
        assert mgr.snapshots.get(record.snapshot_id).metadata["kind"] == "pause"
        await mgr.resume(sid)
        assert ("restore", sid) in node.runtime.calls

        # A create that finds every slot held, one by a sandbox paused a moment ago,
        # hurries that one's capture and takes its slot.
        other = await mgr.create(CreateRequest("base"))
        await mgr.pause(other.sandbox_id)
        third = await asyncio.wait_for(mgr.create(CreateRequest("base")), 10)
        assert other.slot_index == 0 and other.sandbox_id not in node.runtime.sandboxes
        for r in (record, other, third):
            await mgr.kill(r.sandbox_id)
        assert node.clean()

        # A node that stops destroys every runtime: one paused a moment ago (its
        # capture still waiting) is captured first, and resumes after the restart.
        last = await mgr.create(CreateRequest("base"))
        await mgr.pause(last.sandbox_id)
        await asyncio.wait_for(mgr.close(destroy=True), 10)
        assert ("checkpoint", last.sandbox_id) in node.runtime.calls and node.clean()
        mgr.store.close()
        import os
        os.close(mgr._home_lock)
        node.manager = mgr = node._manager()
        await mgr.start()
        await mgr.resume(last.sandbox_id)
        assert mgr.get(last.sandbox_id).state is SandboxState.RUNNING
        await mgr.kill(last.sandbox_id)
    finally:
        await mgr.close(destroy=True)
        mgr.store.close()


async def test_resident_pauses_are_evicted_when_idle_or_their_slot_is_needed(
        resident_node: Node) -> None:
    node = resident_node
    mgr = node.manager
    a, b, c = [await mgr.create(CreateRequest("base")) for _ in range(3)]
    for r in (a, b):
        await mgr.pause(r.sandbox_id)
        await _captured(mgr, r.sandbox_id)
    # All three slots held (c running, a and b frozen): a create evicts a, the oldest.
    d = await mgr.create(CreateRequest("base"))
    assert a.slot_index == 0 and a.sandbox_id not in node.runtime.sandboxes
    assert b.slot_index and node.runtime.sandboxes[b.sandbox_id].state == "paused"
    await mgr.resume(a.sandbox_id)  # from its capture: a restore
    assert ("restore", a.sandbox_id) in node.runtime.calls and a.state is SandboxState.RUNNING
    await mgr.kill(d.sandbox_id)

    assert mgr.residents is not None
    mgr.residents.books.idle_s = 0
    await mgr.residents.tend()
    assert b.slot_index == 0 and b.sandbox_id not in node.runtime.sandboxes
    await mgr.kill(b.sandbox_id)
    await mgr.kill(a.sandbox_id)
    await mgr.kill(c.sandbox_id)
    assert node.clean() and mgr.snapshots.list() == []


async def test_a_frozen_runtime_that_dies_keeps_what_was_captured(resident_node: Node) -> None:
    node = resident_node
    mgr = node.manager
    saved = await mgr.create(CreateRequest("base"))
    await mgr.pause(saved.sandbox_id)
    await _captured(mgr, saved.sandbox_id)
    node.runtime.crash(saved.sandbox_id, "was killed")
    await asyncio.sleep(0.05)
    assert saved.state is SandboxState.PAUSED and saved.slot_index == 0
    await mgr.resume(saved.sandbox_id)
    assert saved.state is SandboxState.RUNNING

    lost = await mgr.create(CreateRequest("base"))
    node.runtime.faults.delay("checkpoint", 0.5)
    await mgr.pause(lost.sandbox_id)
    await asyncio.sleep(0.05)  # its capture is under way
    node.runtime.crash(lost.sandbox_id, "was killed")
    await asyncio.sleep(0.6)
    assert lost.state is SandboxState.ERROR and "before its state was saved" in lost.error
    await mgr.kill(lost.sandbox_id)
    await mgr.kill(saved.sandbox_id)
    assert node.clean()


async def test_a_restart_captures_what_it_finds_frozen(resident_node: Node) -> None:
    node = resident_node
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    node.runtime.faults.delay("checkpoint", 5)
    await mgr.pause(sid)
    # The node dies before the capture: the frozen runtime and the record remain.
    assert mgr.residents is not None
    entry = mgr.residents.get(sid)
    assert entry is not None and entry.capture is not None
    entry.capture.cancel()
    node.runtime.faults.delays.clear()
    mgr = await node.restart()
    await _captured(mgr, sid)
    again = mgr.get(sid)
    assert again.state is SandboxState.PAUSED and again.slot_index
    assert mgr.snapshots.get(again.snapshot_id).metadata["source_sandbox_id"] == sid
    await mgr.resume(sid)
    assert ("restore", sid) not in node.runtime.calls and again.state is SandboxState.RUNNING
