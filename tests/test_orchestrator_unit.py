"""The sandbox manager's own logic, in seconds, without runsc: state transitions,
capacity, rollback of every failed launch, pause/resume, fork, exits and a restart.

The runtime, the slot pool and envd are the in-memory fakes of agentenv.testing
(tested for real elsewhere); the record store, the snapshot store (a posix_fs
repository) and the template registry are the real ones, on a temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agentenv.config import Config
from agentenv.orchestrator import (
    BadRequest,
    CapacityExceeded,
    Conflict,
    CreateRequest,
    NotFound,
    OrchestratorError,
    SandboxManager,
    SandboxState,
    SandboxStore,
    StorageFull,
)
from agentenv.orchestrator import specs as specs_module
from agentenv.orchestrator.admission import TooManyRequests
from agentenv.orchestrator.envd_client import EnvdUnavailable
from agentenv.runtime import RuntimeFailure
from agentenv.snapshot import SnapshotNotFound, SnapshotStore, open_repository
from agentenv.templates import TemplateRegistry
from agentenv.testing.fakes import FakeEnvd, FakeRuntime, FakeSlots


class Node:
    """A manager over fakes; ``restart()`` makes a new one on the same home and runtime."""

    def __init__(self, root: Path, capacity: int, slots: int, resident: bool = False,
                 idle_s: int = 600, capture_delay_ms: int = 0) -> None:
        self.root = root
        templates = root / "images" / "templates" / "base"
        (templates / "rootfs").mkdir(parents=True, exist_ok=True)
        (templates / "template.json").write_text(json.dumps(
            {"templateID": "base", "aliases": ["base"], "cpuCount": 64, "memoryMB": 256}))
        self.config = Config(home=root / "home", images_dir=root / "images",
                             max_sandboxes=capacity, template_snapshots=False,
                             max_cpu_count=2, max_memory_mb=1024, node_id="unit",
                             resident_pause=resident, resident_pause_idle_s=idle_s,
                             resident_capture_delay_ms=capture_delay_ms,
                             admission_queue_timeout_s=1.0)
        self.runtime = FakeRuntime()
        self.slots = FakeSlots(slots)
        self.envd = FakeEnvd()
        self.manager = self._manager()

    def _manager(self) -> SandboxManager:
        cfg = self.config
        snapshots = SnapshotStore(open_repository(cfg.snapshot_repository()),
                                  cache_dir=cfg.home / "cache" / "snapshots",
                                  staging_dir=cfg.home / "snapshots-staging")
        return SandboxManager(cfg, self.runtime, self.slots,  # type: ignore[arg-type]
                              TemplateRegistry(cfg.templates_dir, cfg.local_templates_dir,
                                               cfg.rootfs_mounts_dir),
                              SandboxStore(cfg.db_path), snapshots,
                              envd=self.envd)  # type: ignore[arg-type]

    async def restart(self) -> SandboxManager:
        await self.manager.close(destroy=False)
        self.manager.store.close()
        import os
        os.close(self.manager._home_lock)  # the process would end here
        self.manager = self._manager()
        await self.manager.start()
        return self.manager

    def clean(self) -> bool:
        return not self.slots.holding and not self.runtime.sandboxes


@pytest.fixture
async def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    # envd's real bundle is built (and tested) by the node tests; here only its name counts.
    monkeypatch.setattr(specs_module, "build_bundle", lambda _dir: bundle)
    n = Node(tmp_path, capacity=3, slots=4)
    await n.manager.start()
    yield n
    await n.manager.close(destroy=True)
    n.manager.store.close()


async def test_create_runs_with_bounded_resources_and_its_env(node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base", env_vars={"A": "1"}, metadata={"k": "v"}))
    assert record.state is SandboxState.RUNNING
    stored = {r.sandbox_id: r.state for r in mgr.store.all()}
    assert stored == {record.sandbox_id: SandboxState.RUNNING}
    # template.json asked for 64 CPUs: clamped to the node's maximum, in record and spec.
    assert record.cpu_count == 2 and node.runtime.specs[record.sandbox_id].cpu_count == 2
    assert node.envd.inits[record.slot_address]["env"] == {"A": "1"}
    assert node.slots.holding[record.slot_index].address == record.slot_address
    assert mgr.endpoint(record.sandbox_id, 8080) == (record.slot_address, 8080)


async def test_capacity_is_a_clear_error_and_takes_nothing(node: Node) -> None:
    mgr = node.manager
    for _ in range(3):
        await mgr.create(CreateRequest("base"))
    with pytest.raises(TooManyRequests) as caught:  # after waiting the queue time
        await mgr.create(CreateRequest("base"))
    assert "capacity" in str(caught.value) and caught.value.retry_after >= 1
    assert caught.value.headers == {"Retry-After": str(caught.value.retry_after)}
    assert len(mgr.list()) == 3 and len(node.runtime.sandboxes) == 3
    assert mgr.admission.waiting == 0


@pytest.mark.parametrize("step", ["acquire", "start", "envd", "init"])
async def test_a_failed_create_leaves_no_record_and_nothing_held(node: Node, step: str) -> None:
    mgr = node.manager
    faults = {"acquire": node.slots.faults, "start": node.runtime.faults,
              "envd": node.envd.faults, "init": node.envd.faults}[step]
    faults.fail(step, RuntimeFailure("boom") if step == "start" else None)
    with pytest.raises((OrchestratorError, RuntimeError)):
        await mgr.create(CreateRequest("base"))
    assert mgr.list() == [] and mgr.store.all() == [] and node.clean()
    assert (await mgr.create(CreateRequest("base"))).state is SandboxState.RUNNING


async def test_a_client_hanging_up_mid_create_leaves_no_half_sandbox(node: Node) -> None:
    mgr = node.manager
    node.runtime.faults.delay("start", 0.3)
    caller = asyncio.create_task(mgr.create(CreateRequest("base")))
    await asyncio.sleep(0.05)
    (creating,) = mgr.list()
    assert creating.state is SandboxState.CREATING
    with pytest.raises(Conflict):  # no kill while it is being created
        await mgr.kill(creating.sandbox_id)
    caller.cancel()
    await asyncio.sleep(0.5)
    assert mgr.get(creating.sandbox_id).state is SandboxState.RUNNING  # it finished


async def test_pause_resume_kill(node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    await mgr.pause(sid)
    assert record.state is SandboxState.PAUSED and record.slot_index == 0
    await asyncio.gather(*mgr._commits.values(), *mgr._releasing.values())
    assert node.clean()  # a paused sandbox holds nothing on the node
    assert mgr.snapshots.get(record.snapshot_id).metadata["kind"] == "pause"
    with pytest.raises(Conflict):
        await mgr.pause(sid)

    node.runtime.faults.fail("restore", RuntimeFailure("restore broke"))
    with pytest.raises(OrchestratorError, match="sandbox failed to resume"):
        await mgr.resume(sid)
    assert record.state is SandboxState.PAUSED and node.clean()

    await mgr.resume(sid, ttl=60)
    assert record.state is SandboxState.RUNNING and node.slots.holding
    snapshot = record.snapshot_id
    await mgr.pause(sid)
    await mgr.kill(sid)
    with pytest.raises(NotFound):
        mgr.get(sid)
    with pytest.raises(SnapshotNotFound):
        mgr.snapshots.get(snapshot)
    assert node.clean() and mgr.store.all() == []


async def test_a_filesystem_pause_reboots_and_a_failed_file_restore_keeps_it_paused(
        node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    await mgr.pause(sid, memory=False)
    assert record.state is SandboxState.PAUSED and ("checkpoint", sid) not in node.runtime.calls
    await asyncio.gather(*mgr._commits.values(), *mgr._releasing.values())
    assert node.clean()
    assert mgr.snapshots.get(record.snapshot_id).metadata["memory"] is False

    node.envd.faults.fail("disk_import", EnvdUnavailable("envd /aenv/fs/import answered 500"))
    with pytest.raises(OrchestratorError, match="restoring the sandbox's files failed"):
        await mgr.resume(sid)
    assert record.state is SandboxState.PAUSED and node.clean()

    node.envd.disk_uploads.clear()
    await mgr.resume(sid)
    # Booted (not restored), pruned to the listing, then the archive, then the start.
    assert node.runtime.calls[-1] == ("start", sid) and record.state is SandboxState.RUNNING
    assert [op for _, op, _ in node.envd.disk_uploads] == ["prune", "import"]
    assert node.envd.disk_uploads[1][2] == b"an archive of /home/user/f"
    assert node.envd.inits[record.slot_address]["token"] == record.envd_token


@pytest.fixture
def small_staging(node: Node) -> Iterator[Path]:
    """The node's snapshot staging area on a 4 MiB tmpfs."""
    staging = node.manager.snapshots.staging_dir
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(staging)],
                   check=True)
    yield staging
    subprocess.run(["umount", "-l", str(staging)], check=False)


async def test_a_capture_meeting_a_full_disk_is_a_507_and_the_sandbox_runs_on(
        node: Node, small_staging: Path) -> None:
    """Refused before it starts when it cannot fit; and when the runtime's estimate
    was short and the disk fills midway (runsc then may not say ENOSPC), still a
    StorageFull, the sandbox untouched, nothing left staged."""
    mgr = node.manager
    sid = (await mgr.create(CreateRequest("base"))).sandbox_id
    node.runtime.capture_bytes = 16 << 20
    node.runtime.estimated_capture_bytes = 16 << 20
    with pytest.raises(StorageFull, match="needs about 16 MiB"):
        await mgr.snapshot(sid, "too-big")
    assert ("checkpoint", sid) not in node.runtime.calls  # nothing was tried

    node.runtime.estimated_capture_bytes = 1 << 20
    for attempt in (mgr.snapshot(sid, "too-big"), mgr.pause(sid)):
        with pytest.raises(StorageFull, match="no space left"):
            await attempt
        assert mgr.get(sid).state is SandboxState.RUNNING
        assert list(small_staging.iterdir()) == []
    assert mgr.snapshots.list() == []

    node.runtime.capture_bytes = 1 << 20
    assert (await mgr.snapshot(sid, "fits")).alias == "fits"


async def test_fork_children_run_with_their_own_tokens_within_capacity(node: Node) -> None:
    mgr = node.manager
    source = await mgr.create(CreateRequest("base"))
    results = await mgr.fork(source.sandbox_id, 3)
    children = [r for r in results if not isinstance(r, Exception)]
    errors = [r for r in results if isinstance(r, Exception)]
    # Capacity 3: the source and two children.
    assert len(children) == 2 and len(errors) == 1 and isinstance(errors[0], CapacityExceeded)
    tokens = {source.envd_token, *(c.envd_token for c in children)}
    assert len(tokens) == 3 and source.state is SandboxState.RUNNING
    assert all(node.envd.inits[c.slot_address]["current"] == source.envd_token
               for c in children)  # each child's envd rotated the source's token
    # A create names a new boot; a child continues its source's (it names none).
    assert len(node.envd.inits[source.slot_address]["boot_id"]) == 36
    assert all(node.envd.inits[c.slot_address]["boot_id"] == "" for c in children)
    assert not list((node.config.run_dir / "images").iterdir())  # the capture is gone


async def test_a_runtime_that_dies_makes_an_error_record_at_once(node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    node.runtime.crash(record.sandbox_id, "was killed: out of memory")
    await asyncio.sleep(0.05)
    assert record.state is SandboxState.ERROR and "out of memory" in record.error
    assert not node.slots.holding
    with pytest.raises(Conflict, match="out of memory"):
        mgr.endpoint(record.sandbox_id, 49983)
    await mgr.kill(record.sandbox_id)
    assert mgr.list() == []


async def test_a_restart_adopts_running_and_paused_sandboxes(node: Node) -> None:
    mgr = node.manager
    running = await mgr.create(CreateRequest("base"))
    paused = await mgr.create(CreateRequest("base"))
    await mgr.pause(paused.sandbox_id)
    await asyncio.gather(*mgr._commits.values(), *mgr._releasing.values())
    node.runtime.sandboxes["orphan"] = node.runtime.sandboxes[running.sandbox_id]
    mgr = await node.restart()
    states = {r.sandbox_id: r.state for r in mgr.list()}
    assert states == {running.sandbox_id: SandboxState.RUNNING,
                      paused.sandbox_id: SandboxState.PAUSED}
    assert "orphan" not in node.runtime.sandboxes  # what no record claims is removed
    assert mgr.endpoint(running.sandbox_id, 1)[0] == running.slot_address
    await mgr.resume(paused.sandbox_id)
    assert mgr.get(paused.sandbox_id).state is SandboxState.RUNNING


# -- two-tier (resident) pauses --------------------------------------------------------

@pytest.fixture
async def resident_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                        ) -> AsyncIterator[Node]:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    monkeypatch.setattr(specs_module, "build_bundle", lambda _dir: bundle)
    n = Node(tmp_path, capacity=3, slots=3, resident=True)
    await n.manager.start()
    yield n
    await n.manager.close(destroy=True)
    n.manager.store.close()


async def _captured(mgr: SandboxManager, sandbox_id: str) -> None:
    entry = mgr._resident.get(sandbox_id)
    if entry is not None and entry.capture is not None:
        await entry.capture
    await asyncio.gather(*mgr._commits.values())


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
    assert record.snapshot_id == before and not mgr._commits
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
        assert record.snapshot_id == before and not mgr._commits

        # An eviction does not wait out the delay: it captures at once.
        await mgr.pause(sid)
        await asyncio.wait_for(mgr.evict(sid), 10)
        assert sid not in node.runtime.sandboxes and record.slot_index == 0
        await asyncio.gather(*mgr._commits.values())
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

    assert mgr._resident is not None
    mgr._resident.idle_s = 0
    await mgr._tend_residents()
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
    entry = mgr._resident.get(sid)
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


async def test_reset_in_place_keeps_the_slot_and_a_failed_one_ends_in_error(node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid, slot, expiry = record.sandbox_id, record.slot_index, record.end_at
    manifest = await mgr.snapshot(sid, "start")
    back, used = await mgr.reset(sid)
    assert back is record and used.snapshot_id == manifest.snapshot_id
    assert record.state is SandboxState.RUNNING and record.end_at == expiry
    assert record.slot_index == slot and list(node.slots.holding) == [slot]  # the same slot
    assert node.runtime.calls[-2:] == [("destroy", sid), ("restore", sid)]
    # Its own snapshot: envd wakes with this token and env already, so no /init.
    assert node.envd.inits[record.slot_address]["current"] is None
    # Another sandbox's snapshot: envd wakes with that one's token and gets this one's.
    other = await mgr.create(CreateRequest("base"))
    await mgr.reset(sid, (await mgr.snapshot(other.sandbox_id)).snapshot_id)
    init = node.envd.inits[record.slot_address]
    assert (init["current"], init["token"]) == (other.envd_token, record.envd_token)
    await mgr.kill(other.sandbox_id)

    # Refused before anything is touched: the sandbox runs on as it was.
    custom = await mgr.create(CreateRequest("base", memory_mb=512))
    theirs = await mgr.snapshot(custom.sandbox_id)
    with pytest.raises(BadRequest, match="its own resources"):
        await mgr.reset(sid, theirs.snapshot_id)
    with pytest.raises(SnapshotNotFound):
        await mgr.reset(sid, "nope")
    assert node.runtime.calls[-1] == ("checkpoint", custom.sandbox_id)

    # The restore fails after the old runtime went: error, with why, holding nothing.
    node.runtime.faults.fail("restore", RuntimeFailure("restore broke"))
    with pytest.raises(OrchestratorError, match="failed and the sandbox ended"):
        await mgr.reset(sid, "start")
    assert record.state is SandboxState.ERROR and "restore broke" in record.error
    assert sid not in node.runtime.sandboxes and slot not in node.slots.holding
    with pytest.raises(Conflict, match="its reset to snapshot"):
        mgr.endpoint(sid, 49983)
    with pytest.raises(Conflict):
        await mgr.reset(sid, "start")
    await mgr.kill(sid)
    await mgr.kill(custom.sandbox_id)
    assert node.clean()


async def test_a_paused_sandbox_whose_reset_fails_stays_paused(node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    await mgr.snapshot(record.sandbox_id, "start")
    await mgr.pause(record.sandbox_id)
    node.runtime.faults.fail("restore", RuntimeFailure("restore broke"))
    with pytest.raises(OrchestratorError, match="sandbox failed to reset"):
        await mgr.reset(record.sandbox_id)
    await asyncio.gather(*mgr._commits.values(), *mgr._releasing.values())
    assert record.state is SandboxState.PAUSED and node.clean()
    await mgr.reset(record.sandbox_id, ttl=60)
    assert record.state is SandboxState.RUNNING and record.slot_index


# -- admission, runs -----------------------------------------------------------------


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
    await mgr._tend_runs()
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
