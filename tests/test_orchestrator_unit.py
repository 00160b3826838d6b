"""The sandbox manager's own logic, in seconds, without runsc: state transitions,
capacity, rollback of every failed launch, pause/resume, fork, exits and a restart.

The runtime, the slot pool and envd are the in-memory fakes of agentenv.testing
(tested for real elsewhere); the record store, the snapshot store (a posix_fs
repository) and the template registry are the real ones, on a temporary directory.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agentenv.orchestrator import (
    BadRequest,
    Conflict,
    CreateRequest,
    NotFound,
    OrchestratorError,
    SandboxState,
)
from agentenv.orchestrator.admission import TooManyRequests
from agentenv.orchestrator.envd_client import EnvdUnavailable
from agentenv.runtime import RuntimeFailure
from agentenv.snapshot import SnapshotNotFound, StorageFull
from unit_nodes import Node, started


@pytest.fixture
async def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    async with started(tmp_path, monkeypatch, capacity=3, slots=4) as n:
        yield n


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
    await asyncio.gather(*mgr.sandboxes.commits(), *mgr.sandboxes.releasing())
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


async def test_a_paused_sandbox_whose_runtime_outlives_its_destroy_frees_its_slot(
        node: Node) -> None:
    """A sandbox's undo stack (sandbox.py) runs every step whatever the one before did:
    a pause whose stopped runtime fails to be destroyed hands its slot back all the
    same (it used to keep it for good: one slot fewer for the node)."""
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    node.runtime.faults.fail("destroy", RuntimeFailure("destroy broke"))
    await mgr.pause(sid)
    await asyncio.gather(*mgr.sandboxes.releasing())
    assert record.state is SandboxState.PAUSED and record.slot_index == 0
    assert not node.slots.holding and not mgr.sandboxes.releasing()
    await node.runtime.destroy(sid)  # gone later (a restart's reconcile removes it)
    await mgr.resume(sid)
    assert record.state is SandboxState.RUNNING and len(node.slots.holding) == 1
    await mgr.kill(sid)
    assert node.clean()


async def test_a_filesystem_pause_reboots_and_a_failed_file_restore_keeps_it_paused(
        node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    await mgr.pause(sid, memory=False)
    assert record.state is SandboxState.PAUSED and ("checkpoint", sid) not in node.runtime.calls
    await asyncio.gather(*mgr.sandboxes.commits(), *mgr.sandboxes.releasing())
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
    # Capacity 3: the source and two children; the third is refused as a create is.
    assert len(children) == 2 and len(errors) == 1 and isinstance(errors[0], TooManyRequests)
    assert errors[0].status == 429 and "capacity" in str(errors[0])
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
    await asyncio.gather(*mgr.sandboxes.commits(), *mgr.sandboxes.releasing())
    node.runtime.sandboxes["orphan"] = node.runtime.sandboxes[running.sandbox_id]
    mgr = await node.restart()
    states = {r.sandbox_id: r.state for r in mgr.list()}
    assert states == {running.sandbox_id: SandboxState.RUNNING,
                      paused.sandbox_id: SandboxState.PAUSED}
    assert "orphan" not in node.runtime.sandboxes  # what no record claims is removed
    assert mgr.endpoint(running.sandbox_id, 1)[0] == running.slot_address
    await mgr.resume(paused.sandbox_id)
    assert mgr.get(paused.sandbox_id).state is SandboxState.RUNNING


async def test_a_pause_committed_just_before_a_crash_is_not_committed_again(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node killed after a pause's manifest was written but before it recorded the
    commit (its capture still staged, as pending): after the restart the commit finds the
    snapshot there, counts it as done and drops the staged copy; it was retried every
    30 s for good, the capture kept (seen in a whole-suite run of test_crash)."""
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    staging = mgr.snapshots.staging
    with monkeypatch.context() as m:
        # the crash's window: the manifest written, the capture not yet taken into the
        # cache nor the pause recorded as committed
        m.setattr(mgr.snapshots, "adopt_staging", False)
        m.setattr(staging, "committed", lambda snapshot_id: None)
        await mgr.pause(sid)
        await asyncio.gather(*mgr.sandboxes.commits(), *mgr.sandboxes.releasing())
    snapshot = record.snapshot_id
    assert mgr.snapshots.get(snapshot).metadata["kind"] == "pause"
    assert staging.pending(snapshot) is not None  # as the killed node left it
    mgr = await node.restart()
    await asyncio.gather(*mgr.sandboxes.commits())
    assert staging.pending(snapshot) is None and not staging.path(snapshot).exists()
    mgr.captures.retry_failed_commits()
    assert not list(mgr.sandboxes.commits())  # nothing left to commit
    await mgr.resume(sid)
    assert mgr.get(sid).state is SandboxState.RUNNING
    await mgr.kill(sid)
    assert node.clean()


async def test_reset_in_place_keeps_the_slot_and_a_failed_one_ends_in_error(node: Node) -> None:
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid, slot, expiry = record.sandbox_id, record.slot_index, record.end_at
    manifest = await mgr.snapshot(sid, "start")
    back, used, mode = await mgr.reset(sid)
    assert back is record and used.snapshot_id == manifest.snapshot_id and mode == "memory"
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
    await asyncio.gather(*mgr.sandboxes.commits(), *mgr.sandboxes.releasing())
    assert record.state is SandboxState.PAUSED and node.clean()
    await mgr.reset(record.sandbox_id, ttl=60)
    assert record.state is SandboxState.RUNNING and record.slot_index


async def test_a_filesystem_reset_is_envd_s_once_layered_and_a_full_one_otherwise(
        node: Node) -> None:
    """mode filesystem (issue 28): no layer for the snapshot yet, a full reset (destroy,
    restore) then a push; the next, envd's alone (no runtime call); envd failing or
    refusing, a full one again; a bad mode, 400 before anything is touched."""
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    snap = (await mgr.snapshot(sid, "start")).snapshot_id
    with pytest.raises(BadRequest, match="mode must be"):
        await mgr.reset(sid, mode="files")
    calls = len(node.runtime.calls)
    _, _, mode = await mgr.reset(sid, mode="filesystem")
    assert mode == "memory" and node.runtime.calls[calls:] == [("destroy", sid),
                                                               ("restore", sid)]
    assert node.envd.layer_calls == [("reset", snap), ("push", snap)]
    calls = len(node.runtime.calls)
    _, _, mode = await mgr.reset(sid, mode="filesystem")
    assert mode == "filesystem" and node.runtime.calls[calls:] == []
    assert [r["mode"] for r in record.resets] == ["memory", "filesystem"]
    # envd not answering: a full reset puts the sandbox back all the same.
    node.envd.faults.fail("layer_reset", EnvdUnavailable("envd did not answer"))
    calls = len(node.runtime.calls)
    _, _, mode = await mgr.reset(sid, mode="filesystem")
    assert mode == "memory" and ("restore", sid) in node.runtime.calls[calls:]
    assert record.state is SandboxState.RUNNING
    await mgr.kill(sid)
    assert node.clean()


async def test_a_sandbox_being_killed_has_no_endpoint_from_the_start(node: Node) -> None:
    """A kill waiting for the sandbox's lock (a pause or snapshot holds it) already
    hides its endpoint: the proxy answers E2B's 502 "was not found" from then on, which
    the SDK reads as killed (issue 33, item 3). envd is told the node's file access."""
    mgr = node.manager
    record = await mgr.create(CreateRequest("base"))
    sid = record.sandbox_id
    assert node.envd.inits[record.slot_address]["file_access"] == "root"
    async with mgr.life.lock(sid):  # what a pause or snapshot in progress holds
        kill = asyncio.create_task(mgr.kill(sid))
        hidden = False
        for _ in range(100):  # the loop's turns until the kill has started
            await asyncio.sleep(0)
            try:
                mgr.endpoint(sid, 49983)
            except NotFound:
                hidden = True
                break
        assert hidden and not kill.done()  # it waits for the lock, the endpoint is gone
        assert mgr.get(sid).state is SandboxState.RUNNING  # still there, not yet killed
    await kill
    with pytest.raises(NotFound):
        mgr.endpoint(sid, 49983)


async def test_a_timeout_and_a_run_s_end_pause_else_kill(node: Node) -> None:
    """One policy for both (Runs.pause_else_kill): the sandbox is paused; one whose
    pause fails is killed (it must not go on holding the node); one paused meanwhile
    stays paused."""
    mgr = node.manager

    async def state_after_its_timeout(sandbox_id: str) -> SandboxState | None:
        mgr.get(sandbox_id).end_at = 0
        for _ in range(100):  # the TTL loop looks every second
            states = {r.sandbox_id: r.state for r in mgr.list()}
            if states.get(sandbox_id) is not SandboxState.RUNNING:
                return states.get(sandbox_id)
            await asyncio.sleep(0.05)
        return SandboxState.RUNNING

    timed = await mgr.create(CreateRequest("base", auto_pause=True))
    assert await state_after_its_timeout(timed.sandbox_id) is SandboxState.PAUSED
    unpausable = await mgr.create(CreateRequest("base", auto_pause=True))
    node.runtime.faults.fail("checkpoint", RuntimeFailure("checkpoint broke"))
    assert await state_after_its_timeout(unpausable.sandbox_id) is None  # killed
    assert unpausable.sandbox_id not in node.runtime.sandboxes

    run = mgr.create_run("trainer-2", 60, "pause")
    failing, pausing = [(await mgr.create(CreateRequest("base", run_id=run.run_id))).sandbox_id
                        for _ in range(2)]
    node.runtime.faults.fail("checkpoint", RuntimeFailure("checkpoint broke"))  # the first's
    await mgr.end_run(run.run_id)
    states = {r.sandbox_id: r.state for r in mgr.list()}
    assert failing not in states and states[pausing] is SandboxState.PAUSED

    await mgr.runs.pause_else_kill(timed.sandbox_id, memory=True, why="a test")  # paused already
    assert mgr.get(timed.sandbox_id).state is SandboxState.PAUSED


async def test_a_slow_read_of_the_host_connections_holds_up_neither_freezing_nor_pressure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The freezing pass reads the host's connection table (a kernel walk in a thread,
    minutes under load once). While that read hangs, the quick loop goes on (memory
    pressure is tended), no second read piles up behind it, and the idle sandbox is not
    frozen on a guess; once the read answers, it is."""
    async with started(tmp_path, monkeypatch, capacity=2, slots=2, idle_freeze_s=1) as node:
        mgr = node.manager
        tends = 0
        tend = mgr.housekeeping.pressure.tend

        def counted() -> None:
            nonlocal tends
            tends += 1
            tend()

        monkeypatch.setattr(mgr.housekeeping.pressure, "tend", counted)
        gate = node.slots.faults.hold("egress_read")
        record = await mgr.create(CreateRequest("base"))
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while not node.slots.faults.reached.get("egress_read"):
            assert loop.time() < end, "the idle sandbox never came due for freezing"
            await asyncio.sleep(0.05)
        before = tends
        await asyncio.sleep(3)
        assert tends - before >= 2, "the quick loop waited on the connection read"
        assert node.slots.faults.reached["egress_read"] == 1
        assert not node.runtime.is_frozen(record.sandbox_id)
        gate.set()
        end = loop.time() + 5
        while not node.runtime.is_frozen(record.sandbox_id):
            assert loop.time() < end, "not frozen once the read answered"
            await asyncio.sleep(0.05)
