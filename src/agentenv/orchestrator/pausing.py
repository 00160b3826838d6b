"""Snapshots, pause and resume: the service ``Pauses``.

A pause captures the sandbox's full state (memory, processes, files), frees what it
held on the node, and answers once the capture is staged locally; the commit to the
repository goes on in the background (a resume waits for it, or restores from the
staged capture while the repository is down; a restart commits it again). A paused
sandbox whose node is gone can be adopted by another node from its committed pause.
With resident pauses a memory pause is a freeze first (resident_pauses.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..metrics import observed
from ..runtime import Runtime
from ..snapshot import Manifest, SnapshotError, SnapshotNotFound, SnapshotStore
from ..templates import TemplateRegistry
from . import disk_pause
from .admission import Admission
from .captures import Captures
from .collect import SnapshotCollector
from .idling import IdleFreezer
from .lifecycle import Lifecycle
from .models import (
    BadRequest,
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    new_sandbox_id,
    not_running,
)
from .plans import Plans
from .records import new_record
from .resident_pauses import ResidentPauses
from .specs import SpecFactory
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Pauses:
    config: Config
    sandboxes: SandboxTable
    store: SandboxStore
    snapshots: SnapshotStore
    snapshot_gc: SnapshotCollector
    templates: TemplateRegistry
    specs: SpecFactory
    runtime: Runtime
    admission: Admission
    freezer: IdleFreezer
    life: Lifecycle
    plans: Plans
    captures: Captures
    # Resident pauses (None: a pause always captures at once).
    residents: ResidentPauses | None

    def pause_committed(self, record: SandboxRecord) -> bool:
        """Whether a paused sandbox's snapshot is in the repository (not only staged here)."""
        sid = record.snapshot_id
        resident = self.residents.get(record.sandbox_id) if self.residents is not None else None
        if resident is not None and not resident.captured:
            return False  # frozen, its capture not made yet
        entry = self.sandboxes.holds(record)
        return bool(sid) and (entry is None or sid not in entry.commits) and \
            not self.snapshots.staging.is_pending(sid)


    # -- snapshot -----------------------------------------------------------------------

    @observed("snapshot")
    async def snapshot(self, sandbox_id: str, name: str | None = None,
                       memory: bool = True) -> Manifest:
        """Capture a running sandbox (stopped only for the capture; ``memory=False``:
        its files only, not stopped) and commit it."""
        snapshot_id = new_sandbox_id()
        async with self.life.lock(sandbox_id):
            record = self.life.get(sandbox_id)
            if record.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox '{sandbox_id}' is {record.state}; only a running "
                               "sandbox can be snapshotted")
            t0 = time.perf_counter()
            if memory:
                staging = await self.captures.capture(sandbox_id, snapshot_id, leave_running=True)
            else:
                staging = await self.captures.capture_files(record, snapshot_id)
        metadata = {**self.captures.metadata(record, "snapshot"), "memory": memory}
        t1 = time.perf_counter()
        try:
            manifest = await asyncio.to_thread(
                self.snapshots.commit, snapshot_id, staging, metadata, name)
        except BaseException:
            await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
            raise
        # An automatic clean-up of the template waits for this snapshot to go.
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.templates.note_snapshot, record.template_id, snapshot_id)
        # bench/bench_snapshots.py capture reads this line: the capture is what the sandbox
        # is stopped for, the commit runs beside it.
        log.info("snapshot %s of %s: capture %.0f ms, commit %.0f ms, %d bytes",
                 snapshot_id, sandbox_id, (t1 - t0) * 1000,
                 (time.perf_counter() - t1) * 1000, manifest.total_bytes)
        return manifest

    # -- pause --------------------------------------------------------------------------

    @observed("pause")
    async def pause(self, sandbox_id: str, memory: bool = True) -> SandboxRecord:
        """Save the sandbox's full state (``memory=False``: its files only, so that
        a resume reboots it) and release everything it holds on the node.

        With resident pauses (the default) a memory pause freezes the sandbox and
        returns; the capture and its commit follow in the background and the sandbox
        stays resident until evicted. Otherwise it returns once the state is captured
        locally, the commit to the repository going on in the background (a resume
        waits for it).
        """
        snapshot_id = new_sandbox_id()
        async with self.life.lock(sandbox_id):
            record = self.life.get(sandbox_id)
            if record.state is SandboxState.PAUSED:
                raise Conflict(f"sandbox '{sandbox_id}' is already paused")
            if record.state is not SandboxState.RUNNING:
                raise not_running(record)
            if memory and self.residents is not None:
                return await self.residents.freeze(record, snapshot_id)
            if memory:
                try:
                    staging = await self.captures.capture(sandbox_id, snapshot_id,
                                                          leave_running=False)
                except BaseException as exc:
                    await self._after_failed_pause(record, exc)
                    raise
            else:
                staging = await self.captures.capture_files(record, snapshot_id)
            metadata = {**self.captures.metadata(record, "pause"), "memory": memory}
            self.snapshots.staging.hold_for_commit(snapshot_id, metadata)
            previous = record.snapshot_id
            # The state is saved: freeing the stopped runtime and its slot need not
            # hold up the answer. Whatever reuses the ID waits for it (Captures.settled).
            entry = self.sandboxes.get(sandbox_id)
            entry.let_go_of_slot()
            record.snapshot_id = snapshot_id
            self.life.transition(record, SandboxState.PAUSED)
            self.captures.free_in_background(entry)
            self.life.removed(sandbox_id)
            self.captures.start_commit(entry, snapshot_id, staging, metadata, replaces=previous)
            return record

    # -- resident pauses (two tiers: a freeze now, the capture after) --------------------

    async def _after_failed_pause(self, record: SandboxRecord, exc: BaseException) -> None:
        """A failed capture may have stopped the sandbox: then nothing can be saved
        and the sandbox is gone; otherwise it keeps running as it was."""
        state = await self.runtime.state(record.sandbox_id)
        if state is None or state.state != "running":
            log.error("pause of %s failed and the sandbox stopped (%s): it is lost",
                      record.sandbox_id, exc)
            await asyncio.shield(self.life.teardown(record, True))

    async def evict(self, sandbox_id: str) -> SandboxRecord:
        """A paused sandbox's memory and slot freed now (once its capture is made); a
        later resume restores it. Idempotent; a running sandbox is a Conflict."""
        if self.residents is not None:
            return await self.residents.evict(sandbox_id)
        return self.life.paused(sandbox_id)

    # -- resume -------------------------------------------------------------------------

    @observed("resume")
    async def resume(self, sandbox_id: str, ttl: int | None = None,
                     auto_pause: bool | None = None, memory: bool = True) -> SandboxRecord:
        """Bring a paused sandbox back, same ID, from its pause snapshot: restored as it
        was, or rebooted with its files when the pause kept no memory. On failure it
        stays paused, holding nothing.

        Admitted as a create is (admission.py), against the node's room and its
        owner's quotas, whoever asks (``connect``, resume on traffic): a 429 with
        Retry-After when none comes within the queue time."""
        seconds = self.plans.timeout(ttl)
        record = self.life.paused(sandbox_id)
        # A thaw in place boots nothing: it does not wait for the starting limit.
        thaw = self.residents is not None and self.residents.get(sandbox_id) is not None
        ticket = await self.admission.admit(record.owner, starting=not thaw)
        try:
            return await self._resume_admitted(sandbox_id, seconds, auto_pause, memory)
        finally:
            ticket.release()  # after the state changed: the room is counted as running

    async def _resume_admitted(self, sandbox_id: str, seconds: int,
                               auto_pause: bool | None, memory: bool) -> SandboxRecord:
        async with self.life.lock(sandbox_id):
            record = self.life.paused(sandbox_id)
            entry = self.residents.get(sandbox_id) if self.residents is not None else None
            if entry is not None and self.residents is not None:
                if not memory:
                    raise BadRequest(f"sandbox '{sandbox_id}' was paused with its memory: "
                                     "resuming from its disk state alone is not supported")
                t0 = time.perf_counter()
                await self.residents.thaw(record, entry)
                self.life.transition(record, SandboxState.RUNNING)
                log.info("resumed %s in %.0f ms (thawed in place)", sandbox_id,
                         (time.perf_counter() - t0) * 1000)
                return self._resumed(record, seconds, auto_pause)
            image, kind = await self.captures.pause_image(record)
            try:
                return await self._restore_paused(record, image, kind, memory, seconds,
                                                  auto_pause)
            finally:
                if kind == "linked":  # its own hard links: not needed once restored
                    await asyncio.shield(asyncio.to_thread(shutil.rmtree, image, True))

    async def _restore_paused(self, record: SandboxRecord, image: Path, kind: str,
                              memory: bool, seconds: int, auto_pause: bool | None
                              ) -> SandboxRecord:
        """The resume of a paused sandbox no longer in memory, from ``image``."""
        sandbox_id = record.sandbox_id
        await self.captures.settled(sandbox_id)
        if disk_pause.is_disk_capture(image):
            plan = self.plans.plan(record, self.plans.bootable_template(record), files=image,
                              hostname_of=record.sandbox_id, start_command=True,
                              purpose="resume", new_boot=True)
        elif not memory:
            raise BadRequest(f"sandbox '{sandbox_id}' was paused with its memory: "
                             "resuming from its disk state alone is not supported")
        else:
            template = self.plans.template_of(record, "template of the snapshot is gone")
            # envd keeps its token across a pause: no init.
            plan = self.plans.plan(record, template, image=image,
                              hostname_of=record.sandbox_id, init=False, purpose="resume")
        t0 = time.perf_counter()
        slot = await self.life.launcher.launch(plan)
        self.life.started(record, slot)
        self.life.transition(record, SandboxState.RUNNING)
        log.info("resumed %s in %.0f ms (%s)", sandbox_id, (time.perf_counter() - t0) * 1000,
                 "rebooted with its files" if plan.files else "restored")
        if kind == "staged":
            await asyncio.to_thread(self.snapshots.discard_staging, record.snapshot_id)
        return self._resumed(record, seconds, auto_pause)

    def _resumed(self, record: SandboxRecord, seconds: int,
                 auto_pause: bool | None) -> SandboxRecord:
        record.end_at = time.time() + seconds
        if auto_pause is not None:
            record.auto_pause = auto_pause
        self.store.put(record)
        self.freezer.touch(record.sandbox_id)  # active now (memory pressure picks the idle)
        return record

    async def forget_paused(self, record: SandboxRecord) -> None:
        """Kill a paused sandbox: its snapshot (committed or staged) goes too, and a
        resident one's frozen runtime and slot."""
        entry = self.residents.pop(record.sandbox_id) if self.residents is not None else None
        sandbox = self.sandboxes.holds(record)
        doomed = [record.snapshot_id]
        if entry is not None:
            if entry.capture is not None:
                entry.capture.cancel()
            if not entry.captured and entry.previous_snapshot:
                doomed.append(entry.previous_snapshot)  # no commit will replace it
            if sandbox is not None:
                await asyncio.shield(self.captures.free_in_background(sandbox))
        await self.captures.settled(record.sandbox_id)
        commits = sandbox.commits if sandbox is not None else {}
        pending = [t for t in map(commits.get, doomed) if t is not None]
        await asyncio.gather(*pending, return_exceptions=True)
        for snapshot_id in doomed:
            with contextlib.suppress(SnapshotError):
                await asyncio.to_thread(self.snapshots.delete, snapshot_id)
                self.snapshot_gc.request()  # its chunks, unless other snapshots use them
            await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
        self.life.forget(record)

    # -- paused sandboxes changing node -------------------------------------------------

    async def _drop_copy(self, record: SandboxRecord) -> None:
        async with self.life.lock(record.sandbox_id):
            if self.sandboxes.holds(record) is not None:
                await self.life.teardown(record, True)

    def disown(self, sandbox_id: str) -> bool:
        """Drop the record of a paused sandbox another node has taken over; its
        snapshot is that node's now, so it is left alone (a frozen runtime still here
        is freed). False if not idle-paused with its pause committed.

        A running one was taken over from its last pause while this node was lost (past
        its heartbeat TTL): this copy is destroyed, its snapshot left to the other."""
        sandbox = self.sandboxes.find(sandbox_id)
        record = sandbox.record if sandbox is not None else None
        if sandbox is not None and sandbox.state is SandboxState.RUNNING \
                and not sandbox.held() and not sandbox.releasing_now():
            log.warning("sandbox %s was taken over by another node while this one was lost; "
                        "destroying this copy", sandbox_id)
            sandbox.releasing = asyncio.create_task(self._drop_copy(sandbox.record))
            return True
        entry = self.residents.get(sandbox_id) if self.residents is not None else None
        if sandbox is None or record is None or record.state is not SandboxState.PAUSED \
                or sandbox.held() or sandbox.releasing_now() \
                or (entry is not None and not entry.captured) \
                or not self.pause_committed(record):
            return False
        if entry is not None and self.residents is not None:
            self.residents.pop(sandbox_id)
            self.captures.free_in_background(sandbox)
        self.life.forget(record)
        log.info("paused sandbox %s now lives on another node; record dropped", sandbox_id)
        return True

    async def adopt_paused(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        """Take over a paused sandbox whose node is gone, from its committed pause
        snapshot: the record is rebuilt from the snapshot's metadata, PAUSED, same ID
        and envd token; a resume then restores it on this node."""
        try:
            return await self._adopt_paused(sandbox_id, snapshot_id)
        finally:
            self.sandboxes.unclaim(sandbox_id)

    async def _adopt_paused(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        async with self.sandboxes.claim(sandbox_id):
            existing = self.sandboxes.records.get(sandbox_id)
            if existing is not None and existing.state is not SandboxState.KILLED:
                if existing.state is SandboxState.PAUSED and existing.snapshot_id == snapshot_id:
                    return existing
                raise Conflict(f"sandbox '{sandbox_id}' is already on this node "
                               f"({existing.state})")
            try:
                manifest = await asyncio.to_thread(self.snapshots.get, snapshot_id)
            except SnapshotNotFound as exc:
                raise NotFound(f"snapshot '{snapshot_id}' not found") from exc
            except SnapshotError as exc:
                raise OrchestratorError(f"snapshot repository: {exc}") from exc
            meta = manifest.metadata
            if meta.get("kind") != "pause" or meta.get("source_sandbox_id") != sandbox_id:
                raise BadRequest(f"snapshot '{snapshot_id}' is not a pause of '{sandbox_id}'")
            self.specs.check_restorable(meta)
            record = new_record(
                sandbox_id=sandbox_id, state=SandboxState.PAUSED, node_id=self.config.node_id,
                template_id=meta["template_id"], alias=meta.get("alias") or meta["template_id"],
                resources=self.plans.resources(meta.get("cpu_count"), meta.get("memory_mb"),
                                          meta.get("disk_size_mb")),
                ttl=0, started_at=float(meta.get("started_at") or time.time()),
                auto_pause=bool(meta.get("auto_pause", True)),
                auto_pause_memory=bool(meta.get("auto_pause_memory", True)),
                internet=bool(meta.get("internet", True)), metadata=meta.get("metadata"),
                network=meta.get("network") if isinstance(meta.get("network"), dict) else None,
                traffic_token=str(meta.get("traffic_token") or ""),
                owner=str(meta.get("owner") or ""),
                env_vars=meta.get("env_vars"), envd_token=meta["envd_token"],
                snapshot_id=snapshot_id, auto_resume=bool(meta.get("auto_resume")),
                resume_timeout=int(meta.get("resume_timeout") or 0),
                mask_request_host=str(meta.get("mask_request_host") or ""),
                origin=str(meta.get("origin") or ""))
            self.life.add(record)
            log.info("adopted paused sandbox %s from snapshot %s", sandbox_id, snapshot_id)
            return record
