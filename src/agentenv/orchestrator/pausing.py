"""Snapshots, pause and resume.

A pause captures the sandbox's full state (memory, processes, files), frees what it
held on the node, and answers once the capture is staged locally; the commit to the
repository goes on in the background (a resume waits for it, or restores from the
staged capture while the repository is down; a restart commits it again). A paused
sandbox whose node is gone can be adopted by another node from its committed pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from ..network import Slot
from ..runtime import RuntimeFailure
from ..snapshot import Manifest, SnapshotError, SnapshotNotFound
from ..templates import TemplateNotFound
from .core import ManagerCore
from .models import (
    BadRequest,
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    StorageFull,
    new_sandbox_id,
    not_running,
)
from .records import new_record

log = logging.getLogger(__name__)


class Pausing(ManagerCore):
    def _snapshot_metadata(self, record: SandboxRecord, kind: str) -> dict:
        return {
            "kind": kind,
            "template_id": record.template_id,
            "alias": record.alias,
            "source_sandbox_id": record.sandbox_id,
            "parent_snapshot_id": record.snapshot_id or None,
            "cpu_count": record.cpu_count,
            "memory_mb": record.memory_mb,
            "disk_size_mb": record.disk_size_mb,
            "internet": record.internet,
            "metadata": record.metadata,
            "env_vars": record.env_vars,
            # The token lives in the memory image too; a child rotates it.
            "envd_token": record.envd_token,
            # With the rest, enough for another node to rebuild the record (adopt_paused).
            "auto_pause": record.auto_pause,
            "started_at": record.started_at,
            **self.specs.stamp(),
            "created_at": time.time(),
        }

    # -- snapshot -----------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> Manifest:
        """Capture a running sandbox (stopped only for the capture) and commit it."""
        snapshot_id = new_sandbox_id()
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox '{sandbox_id}' is {record.state}; only a running "
                               "sandbox can be snapshotted")
            staging = await self._capture(sandbox_id, snapshot_id, leave_running=True)
        metadata = self._snapshot_metadata(record, "snapshot")
        try:
            return await asyncio.to_thread(
                self.snapshots.commit, snapshot_id, staging, metadata, name)
        except BaseException:
            await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
            raise

    async def _capture(self, sandbox_id: str, snapshot_id: str, leave_running: bool) -> Path:
        """Checkpoint into a fresh staging dir; on failure nothing stays staged."""
        await self._check_staging_room(sandbox_id)
        try:
            staging = await asyncio.to_thread(self.snapshots.new_staging, snapshot_id)
        except SnapshotError as exc:
            raise OrchestratorError(f"cannot stage a snapshot: {exc}") from exc
        try:
            await self.runtime.checkpoint(sandbox_id, staging, leave_running=leave_running)
        except BaseException as exc:
            full = isinstance(exc, RuntimeFailure) and (
                "no space left" in str(exc).lower()
                or await asyncio.to_thread(self.snapshots.staging.is_nearly_full))
            await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
            if full:
                raise StorageFull(f"no space left on the node's snapshot staging disk "
                                  f"({self.snapshots.staging_dir})") from exc
            raise
        return staging

    async def _check_staging_room(self, sandbox_id: str) -> None:
        """Refuse a capture that cannot fit before it starts: runsc meeting a full disk
        midway may fail without saying so (or panic), and fills the disk for others."""
        need = self.runtime.capture_size(sandbox_id)
        free = await asyncio.to_thread(self.snapshots.staging.free_bytes)
        if need and free < need:
            raise StorageFull(
                f"no space left on the node's snapshot staging disk "
                f"({self.snapshots.staging_dir}): the capture needs about {need >> 20} MiB, "
                f"{free >> 20} MiB are free")

    # -- pause --------------------------------------------------------------------------

    async def pause(self, sandbox_id: str) -> SandboxRecord:
        """Save the sandbox's full state and release everything it holds on the node.

        Returns once the state is captured locally; the commit to the repository
        continues in the background (a resume waits for it).
        """
        snapshot_id = new_sandbox_id()
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is SandboxState.PAUSED:
                raise Conflict(f"sandbox '{sandbox_id}' is already paused")
            if record.state is not SandboxState.RUNNING:
                raise not_running(record)
            try:
                staging = await self._capture(sandbox_id, snapshot_id, leave_running=False)
            except BaseException as exc:
                await self._after_failed_pause(record, exc)
                raise
            metadata = self._snapshot_metadata(record, "pause")
            self.snapshots.staging.hold_for_commit(snapshot_id, metadata)
            previous = record.snapshot_id
            # The state is saved: freeing the stopped runtime and its slot need not
            # hold up the answer. Whatever reuses the ID waits for it (_settled).
            slot = self._slots.pop(sandbox_id, None)
            record.slot_index, record.slot_address = 0, ""
            record.snapshot_id = snapshot_id
            self._transition(record, SandboxState.PAUSED)
            self._releasing[sandbox_id] = asyncio.create_task(self._free(sandbox_id, slot))
            for listener in self.on_removed:
                listener(sandbox_id)
            self._start_commit(snapshot_id, staging, metadata, replaces=previous)
            return record

    async def _free(self, sandbox_id: str, slot: Slot | None) -> None:
        try:
            await self.runtime.destroy(sandbox_id)
            if slot is not None:
                await self.slots.release(slot)
        except Exception:
            log.exception("freeing the runtime of paused sandbox %s failed", sandbox_id)
        finally:
            self._releasing.pop(sandbox_id, None)

    async def _settled(self, sandbox_id: str) -> None:
        """Wait until a paused sandbox's old runtime is gone (its ID can be reused)."""
        task = self._releasing.get(sandbox_id)
        if task is not None:
            await asyncio.shield(task)

    async def _after_failed_pause(self, record: SandboxRecord, exc: BaseException) -> None:
        """A failed capture may have stopped the sandbox: then nothing can be saved
        and the sandbox is gone; otherwise it keeps running as it was."""
        state = await self.runtime.state(record.sandbox_id)
        if state is None or state.state != "running":
            log.error("pause of %s failed and the sandbox stopped (%s): it is lost",
                      record.sandbox_id, exc)
            await asyncio.shield(self._teardown(record, True))

    # -- commits of pauses --------------------------------------------------------------

    def _start_commit(self, snapshot_id: str, staging: Path, metadata: dict,
                      replaces: str = "") -> None:
        async def run() -> None:
            try:
                await asyncio.to_thread(self.snapshots.commit, snapshot_id, staging, metadata)
                self.snapshots.staging.committed(snapshot_id)
                if replaces:
                    with contextlib.suppress(SnapshotError):
                        await asyncio.to_thread(self.snapshots.delete, replaces)
            except Exception:
                log.exception("commit of pause snapshot %s failed; it stays staged", snapshot_id)
                raise
            finally:
                self._commits.pop(snapshot_id, None)

        self._commits[snapshot_id] = asyncio.create_task(run())

    def _recommit_if_staged(self, record: SandboxRecord) -> None:
        """After a restart: a pause whose commit did not finish is committed again."""
        metadata = self.snapshots.staging.pending(record.snapshot_id)
        if metadata is not None:
            log.info("resuming the commit of pause snapshot %s", record.snapshot_id)
            self._start_commit(record.snapshot_id,
                               self.snapshots.staging.path(record.snapshot_id), metadata)

    def _retry_failed_commits(self) -> None:
        """Paused sandboxes whose capture is only staged get their commit again."""
        for record in self._records.values():
            if record.state is SandboxState.PAUSED and record.snapshot_id not in self._commits:
                self._recommit_if_staged(record)

    def pause_committed(self, record: SandboxRecord) -> bool:
        """Whether a paused sandbox's snapshot is in the repository (not only staged here)."""
        sid = record.snapshot_id
        return bool(sid) and sid not in self._commits and \
            not self.snapshots.staging.is_pending(sid)

    # -- resume -------------------------------------------------------------------------

    async def _pause_image(self, record: SandboxRecord) -> tuple[Path, bool]:
        """Where a paused sandbox's state is on this node, and whether that is the capture
        still staged here (its commit has not gone through: repository down) rather
        than the committed snapshot's cache."""
        pending = self._commits.get(record.snapshot_id)
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        if self.snapshots.staging.pending(record.snapshot_id) is not None:
            log.info("resuming %s from its uncommitted local capture", record.sandbox_id)
            return self.snapshots.staging.path(record.snapshot_id), True
        try:
            return await asyncio.to_thread(self.snapshots.materialize, record.snapshot_id), False
        except SnapshotNotFound as exc:
            raise NotFound(f"snapshot of sandbox '{record.sandbox_id}' is gone") from exc
        except SnapshotError as exc:
            raise OrchestratorError(f"snapshot repository: {exc}") from exc

    async def resume(self, sandbox_id: str, ttl: int | None = None,
                     auto_pause: bool | None = None) -> SandboxRecord:
        """Bring a paused sandbox back, same ID, from its pause snapshot. On failure it
        stays paused, holding nothing."""
        seconds = self._check_timeout(ttl)
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is not SandboxState.PAUSED:
                raise Conflict(f"sandbox '{sandbox_id}' is {record.state}, not paused")
            image, staged = await self._pause_image(record)
            await self._settled(sandbox_id)
            try:
                template = self.templates.get(record.template_id)
            except TemplateNotFound as exc:
                raise NotFound(f"template of the snapshot is gone: {exc}") from exc
            # envd keeps its token across a pause: no init.
            slot = await self.launcher.launch(self._plan(
                record, template, image=image, hostname_of=record.sandbox_id, init=False,
                purpose="resume"))
            self._hold(record, slot)
            self._transition(record, SandboxState.RUNNING)
            if staged:
                await asyncio.to_thread(self.snapshots.discard_staging, record.snapshot_id)
            record.end_at = time.time() + seconds
            if auto_pause is not None:
                record.auto_pause = auto_pause
            self.store.put(record)
            return record

    async def connect(self, sandbox_id: str, ttl: int | None = None) -> SandboxRecord:
        """A running sandbox as it is (a given TTL extends it); a paused one is resumed."""
        record = self.get(sandbox_id)
        if record.state is SandboxState.PAUSED:
            return await self.resume(sandbox_id, ttl)
        if ttl is not None:
            return await self.set_timeout(sandbox_id, ttl)
        return record

    async def _forget_paused(self, record: SandboxRecord) -> None:
        """Kill a paused sandbox: its snapshot (committed or staged) goes too."""
        await self._settled(record.sandbox_id)
        pending = self._commits.get(record.snapshot_id)
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        with contextlib.suppress(SnapshotError):
            await asyncio.to_thread(self.snapshots.delete, record.snapshot_id)
            self.snapshot_gc.request()  # its chunks, unless other snapshots use them
        await asyncio.to_thread(self.snapshots.discard_staging, record.snapshot_id)
        self._forget(record)

    # -- paused sandboxes changing node -------------------------------------------------

    def disown(self, sandbox_id: str) -> bool:
        """Drop the record of a paused sandbox another node has taken over; its
        snapshot is that node's now, so it is left alone. False if not idle-paused."""
        record = self._records.get(sandbox_id)
        if record is None or record.state is not SandboxState.PAUSED \
                or self._lock(sandbox_id).locked() or sandbox_id in self._releasing \
                or not self.pause_committed(record):
            return False
        self._forget(record)
        log.info("paused sandbox %s now lives on another node; record dropped", sandbox_id)
        return True

    async def adopt_paused(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        """Take over a paused sandbox whose node is gone, from its committed pause
        snapshot: the record is rebuilt from the snapshot's metadata, PAUSED, same ID
        and envd token; a resume then restores it on this node."""
        async with self._lock(sandbox_id):
            existing = self._records.get(sandbox_id)
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
                resources=self._resources(meta.get("cpu_count"), meta.get("memory_mb"),
                                          meta.get("disk_size_mb")),
                ttl=0, started_at=float(meta.get("started_at") or time.time()),
                auto_pause=bool(meta.get("auto_pause", True)),
                internet=bool(meta.get("internet", True)), metadata=meta.get("metadata"),
                env_vars=meta.get("env_vars"), envd_token=meta["envd_token"],
                snapshot_id=snapshot_id)
            self._add(record)
            log.info("adopted paused sandbox %s from snapshot %s", sandbox_id, snapshot_id)
            return record
