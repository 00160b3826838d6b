"""Captures of a sandbox's state, and the commits of pause captures to the repository.

``Captures`` is the service the pausing, resident and reconciling services share.
A capture is written into the node's staging area (the runtime's checkpoint, or a
filesystem-only capture through envd, see disk_pause); a pause's capture is held
there as pending until its commit goes through (in the background; a restart
commits it again), and a resume finds it staged or in the repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime import Runtime, RuntimeFailure
from ..snapshot import (
    SnapshotError,
    SnapshotExists,
    SnapshotNotFound,
    SnapshotStore,
    StorageFull,
)
from . import disk_pause
from .disk_pause import TemplateListings
from .envd_client import EnvdClient
from .lifecycle import Lifecycle
from .models import NotFound, OrchestratorError, SandboxRecord, SandboxState
from .plans import Plans
from .sandbox import Sandbox
from .specs import SpecFactory
from .table import SandboxTable

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Captures:
    sandboxes: SandboxTable
    snapshots: SnapshotStore
    runtime: Runtime
    envd: EnvdClient
    specs: SpecFactory
    plans: Plans
    life: Lifecycle
    # What each template's rootfs holds (filesystem-only pauses compare with it).
    template_listings: TemplateListings = field(default_factory=TemplateListings, init=False)

    def metadata(self, record: SandboxRecord, kind: str) -> dict:
        return {
            "kind": kind,
            "template_id": record.template_id,
            "alias": record.alias,
            "source_sandbox_id": record.sandbox_id,
            "parent_snapshot_id": record.snapshot_id or None,
            # What the sandbox came from: the lineage outlives the sandbox.
            "origin": record.origin,
            "cpu_count": record.cpu_count,
            "memory_mb": record.memory_mb,
            "disk_size_mb": record.disk_size_mb,
            "internet": record.internet,
            # The egress policy and the private-traffic token must follow a paused
            # sandbox to a node that adopts it: without them it would come back open.
            "network": record.network,
            "traffic_token": record.traffic_token,
            "owner": record.owner,
            "metadata": record.metadata,
            "env_vars": record.env_vars,
            # The token lives in the memory image too; a child rotates it.
            "envd_token": record.envd_token,
            # With the rest, enough for another node to rebuild the record (adopt_paused).
            "auto_pause": record.auto_pause,
            "auto_pause_memory": record.auto_pause_memory,
            "auto_resume": record.auto_resume,
            "resume_timeout": record.resume_timeout,
            "mask_request_host": record.mask_request_host,
            "started_at": record.started_at,
            **self.specs.stamp(),
            "created_at": time.time(),
        }

    async def capture(self, sandbox_id: str, snapshot_id: str, leave_running: bool) -> Path:
        """Checkpoint into a fresh staging dir; on failure nothing stays staged."""
        t0 = time.perf_counter()
        await self._check_staging_room(sandbox_id)
        t1 = time.perf_counter()
        await self.life.before_capture(sandbox_id)
        t2 = time.perf_counter()
        try:
            staging = await asyncio.to_thread(self.snapshots.new_staging, snapshot_id)
        except SnapshotError as exc:
            raise OrchestratorError(f"cannot stage a snapshot: {exc}") from exc
        t3 = time.perf_counter()
        try:
            await self.runtime.checkpoint(sandbox_id, staging, leave_running=leave_running)
            log.debug("capture of %s, ms: room %.0f, before %.0f, staging %.0f, checkpoint %.0f",
                      sandbox_id, (t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000,
                      (time.perf_counter() - t3) * 1000)
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

    async def capture_files(self, record: SandboxRecord, snapshot_id: str) -> Path:
        """A filesystem-only capture of a running sandbox (which runs on if it fails)."""
        template = self.plans.bootable_template(record)
        try:
            staging = await asyncio.to_thread(self.snapshots.new_staging, snapshot_id)
        except SnapshotError as exc:
            raise OrchestratorError(f"cannot stage a snapshot: {exc}") from exc
        t0 = time.perf_counter()
        try:
            size = await disk_pause.capture(
                self.envd, record.slot_address, record.envd_token, template.rootfs,
                self.template_listings, staging, record.disk_size_mb << 20)
        except BaseException:
            await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
            raise
        log.info("files of %s captured: %d bytes differ from template %s, in %.0f ms",
                 record.sandbox_id, size, template.template_id,
                 (time.perf_counter() - t0) * 1000)
        return staging

    def free_in_background(self, entry: Sandbox) -> asyncio.Task:
        """A paused sandbox's stopped runtime destroyed and its slot handed back, in the
        background: it counts as holding no slot from now on."""
        entry.let_go_of_slot()
        entry.runs(self.runtime.destroy)
        return entry.release_in_background()

    async def settled(self, sandbox_id: str) -> None:
        """Wait until a paused sandbox's old runtime is gone (its ID can be reused)."""
        entry = self.sandboxes.find(sandbox_id)
        if entry is not None:
            await entry.settled()

    # -- commits of pauses --------------------------------------------------------------

    def start_commit(self, entry: Sandbox, snapshot_id: str, staging: Path, metadata: dict,
                      replaces: str = "") -> None:
        async def run() -> None:
            try:
                try:
                    await asyncio.to_thread(self.snapshots.commit, snapshot_id, staging,
                                            metadata)
                    self.snapshots.staging.committed(snapshot_id)
                except SnapshotExists:
                    # Committed before a crash kept the node from recording it (the
                    # manifest is written last): the staged copy is needed no more. (It
                    # was retried every 30 s for good, its staging kept.)
                    log.info("pause snapshot %s was committed before the node restarted",
                             snapshot_id)
                    await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
                if replaces:
                    earlier = entry.commits.get(replaces)  # a resume did not wait for it
                    if earlier is not None:
                        await asyncio.gather(earlier, return_exceptions=True)
                    with contextlib.suppress(SnapshotError):
                        await asyncio.to_thread(self.snapshots.delete, replaces)
            except Exception:
                log.exception("commit of pause snapshot %s failed; it stays staged", snapshot_id)
                raise
            finally:
                entry.commits.pop(snapshot_id, None)

        entry.commits[snapshot_id] = asyncio.create_task(run())

    def recommit_if_staged(self, entry: Sandbox) -> None:
        """After a restart: a pause whose commit did not finish is committed again."""
        record = entry.record
        if not record.snapshot_id:  # never paused
            return
        metadata = self.snapshots.staging.pending(record.snapshot_id)
        if metadata is not None:
            log.info("resuming the commit of pause snapshot %s", record.snapshot_id)
            # It replaces the sandbox's pause before it, as its first commit would have.
            self.start_commit(entry, record.snapshot_id,
                               self.snapshots.staging.path(record.snapshot_id), metadata,
                               replaces=str(metadata.get("parent_snapshot_id") or ""))

    def retry_failed_commits(self) -> None:
        """Paused sandboxes (and running ones resumed before it went through) whose
        pause capture is only staged get its commit again."""
        for entry in self.sandboxes.in_state(SandboxState.PAUSED, SandboxState.RUNNING):
            if entry.record.snapshot_id not in entry.commits:
                self.recommit_if_staged(entry)

    async def pause_image(self, record: SandboxRecord) -> tuple[Path, str]:
        """Where a paused sandbox's state is on this node, and what it is: "" the
        committed snapshot's cache; "staged" the capture still staged here (its commit
        has not gone through: repository down; discarded once restored); "linked" hard
        links to a capture whose commit is under way (removed once restored)."""
        entry = self.sandboxes.holds(record)
        pending = entry.commits.get(record.snapshot_id) if entry is not None else None
        if pending is not None and not pending.done():
            # A resume right after a pause to disk: restoring from the capture itself
            # spares waiting for the commit (0.4-0.8 s of a 0.9-1.3 s resume here).
            with contextlib.suppress(SnapshotError):
                linked = await asyncio.to_thread(self.snapshots.staging.linked,
                                                 record.snapshot_id)
                log.info("resuming %s from its capture while its commit goes on",
                         record.sandbox_id)
                return linked, "linked"
        if pending is not None:  # its capture is being moved into the cache: nearly done
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        if self.snapshots.staging.pending(record.snapshot_id) is not None:
            log.info("resuming %s from its uncommitted local capture", record.sandbox_id)
            return self.snapshots.staging.path(record.snapshot_id), "staged"
        try:
            return await asyncio.to_thread(self.snapshots.materialize, record.snapshot_id), ""
        except SnapshotNotFound as exc:
            raise NotFound(f"snapshot of sandbox '{record.sandbox_id}' is gone") from exc
        except SnapshotError as exc:
            raise OrchestratorError(f"snapshot repository: {exc}") from exc
