"""After a restart (a crash included), the service ``Reconciler``: adopt the sandboxes
that survived, remove the rest.

Running sandboxes whose runtime still runs and whose envd answers are adopted with
their slots; paused ones and ones in ``error`` keep their records (a pause whose
commit did not finish is committed again); a running one whose runtime died while the
node was down, or whose envd no longer answers, is kept in ``error`` with that
reason, as a sandbox whose runtime dies under a running node is (a GET is then a 404
naming it, and it is listed under ``state=error``); anything else a crash left behind
(runtime sandboxes, slots, fork images, interrupted captures) is removed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..config import Config
from ..network import SlotPool
from ..runtime import Runtime
from ..snapshot import SnapshotError, SnapshotNotFound, SnapshotStore
from .captures import Captures
from .envd_client import EnvdClient, EnvdUnavailable
from .lifecycle import Lifecycle
from .models import SandboxRecord, SandboxState, new_sandbox_id
from .resident import Resident
from .resident_pauses import ResidentPauses
from .sandbox import Sandbox
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Reconciler:
    config: Config
    sandboxes: SandboxTable
    store: SandboxStore
    snapshots: SnapshotStore
    runtime: Runtime
    slots: SlotPool
    envd: EnvdClient
    life: Lifecycle
    captures: Captures
    residents: ResidentPauses | None
    # A running sandbox found dead (RuntimeExits.exited).
    exited: Callable[[str, str], Awaitable[None]]

    async def reconcile(self) -> None:
        # What a killed predecessor left the runtime doing finishes first: a
        # half-done pause capture stops its sandbox when it completes.
        await self.runtime.settle(120)
        alive = await self.runtime.list()
        keep: dict[str, SandboxRecord] = {}
        frozen: set[str] = set()  # resident paused sandboxes still frozen in place
        thawed: set[str] = set()  # resident paused ones whose frozen runtime is gone
        for record in self.store.all():
            running = alive.get(record.sandbox_id)
            if record.metadata.get("aenv.build"):  # no use without the build that died too
                log.info("reconcile: dropping template build sandbox %s", record.sandbox_id)
                self.store.delete(record.sandbox_id)
            elif record.state is SandboxState.RUNNING and running and running.state == "running":
                keep[record.sandbox_id] = record
            elif record.state is SandboxState.RUNNING:  # it died while the node was down
                record.error = ("ended while the node was down: its runtime was "
                                f"{running.state if running else 'gone'} at the restart")
                log.error("reconcile: sandbox %s %s; it is now in state error",
                          record.sandbox_id, record.error)
                record.state = SandboxState.ERROR
                record.slot_index, record.slot_address = 0, ""
                self.store.put(record)
                keep[record.sandbox_id] = record
            elif record.state in (SandboxState.PAUSED, SandboxState.ERROR):
                keep[record.sandbox_id] = record
                if record.state is SandboxState.PAUSED and record.slot_index:
                    if running and running.state == "paused" and self.residents is not None:
                        frozen.add(record.sandbox_id)
                    else:
                        thawed.add(record.sandbox_id)
                        record.slot_index, record.slot_address = 0, ""
            else:
                log.info("reconcile: dropping sandbox %s (%s)", record.sandbox_id, record.state)
                self.store.delete(record.sandbox_id)
        removed = await self.runtime.reconcile(
            {sid for sid, r in keep.items() if r.state is SandboxState.RUNNING} | frozen)
        if removed:
            log.info("reconcile: removed %d orphaned runtime sandboxes", len(removed))
        await self.slots.start({r.slot_index: r.internet for r in keep.values()
                                if r.state is SandboxState.RUNNING or r.sandbox_id in frozen})
        entries = self.sandboxes.replace(list(keep.values()))
        await asyncio.to_thread(self._remove_stale_captures, keep)
        for entry in entries:
            record = entry.record
            held = self.slots.held(record.slot_index) if record.slot_index else None
            if held is not None:
                entry.hold(held, self.life.give_back)
                if record.state is SandboxState.RUNNING or record.sandbox_id in frozen:
                    entry.runs(self.runtime.destroy)
                if record.network:  # the rules are rebuilt from the record
                    try:
                        await self.life.launcher.apply_egress(record.sandbox_id, held,
                                                         record.network, record.internet)
                    except Exception:
                        log.exception("reconcile: egress policy of %s", record.sandbox_id)
            log.info("reconcile: adopted %s sandbox %s", record.state, record.sandbox_id)
            if record.sandbox_id in frozen:
                await self._readopt_frozen(entry)
            elif record.state is SandboxState.PAUSED:
                if record.sandbox_id in thawed:
                    await self._check_paused_state_kept(record)
                self.captures.recommit_if_staged(entry)
            elif record.state is SandboxState.RUNNING:  # resumed before its pause committed
                self.captures.recommit_if_staged(entry)
        await self._drop_unanswering()

    async def _readopt_frozen(self, sandbox: Sandbox) -> None:
        """A paused sandbox left frozen by the node before: resident again; captured
        now unless its capture was staged or committed before the restart."""
        assert self.residents is not None
        record = sandbox.record
        snapshot_id = record.snapshot_id
        captured = self.snapshots.staging.pending(snapshot_id) is not None
        if not captured:
            try:
                await asyncio.to_thread(self.snapshots.get, snapshot_id)
                captured = True
            except SnapshotError:  # not committed, or the repository cannot tell now
                pass
        entry = Resident(captured=captured)
        if not captured:
            # A fresh ID: whatever the old one became is replaced once this commits.
            entry.previous_snapshot = snapshot_id
            record.snapshot_id = new_sandbox_id()
            self.store.put(record)
        self.residents.books.add(record.sandbox_id, entry)
        self.captures.recommit_if_staged(sandbox)
        if not captured:
            log.info("reconcile: capturing frozen paused sandbox %s", record.sandbox_id)
            self.residents.start_capture(record, entry)

    async def _check_paused_state_kept(self, record: SandboxRecord) -> None:
        """A paused sandbox that was resident when the machine went down (its frozen
        runtime is gone) has its state only if its capture was made."""
        if self.snapshots.staging.pending(record.snapshot_id) is not None:
            return
        try:
            await asyncio.to_thread(self.snapshots.get, record.snapshot_id)
        except SnapshotNotFound:
            record.error = "lost: the node stopped before its pause was saved"
            log.error("reconcile: paused sandbox %s %s", record.sandbox_id, record.error)
            self.life.transition(record, SandboxState.ERROR)
        except SnapshotError:
            pass  # the repository cannot tell now: a resume will

    async def _drop_unanswering(self) -> None:
        """A running sandbox is adopted only if its envd answers: one a killed node
        was pausing can still show as running while its capture stops it."""
        running = [e.record for e in self.sandboxes.in_state(SandboxState.RUNNING)]

        async def answers(record: SandboxRecord) -> bool:
            if self.runtime.envd_dormant(record.sandbox_id):
                return True  # its stub holds envd's port; a probe would only wake envd
            try:
                await self.envd.wait_ready(record.slot_address, deadline_s=10)
                return True
            except EnvdUnavailable:
                return False

        for record, ok in zip(running, await asyncio.gather(*map(answers, running)),
                              strict=True):
            if not ok:
                await self.exited(record.sandbox_id, "ended while the node was "
                                           "down: its envd did not answer at the restart")

    def _remove_stale_captures(self, keep: dict[str, SandboxRecord]) -> None:
        """Captures a crash interrupted: fork images, and staged snapshots that no
        paused sandbox's pending commit needs (a snapshot or pause whose capture or
        commit died with the node; the repository's collector takes their chunks)."""
        images = self.config.run_dir / "images"
        if images.is_dir():
            for leftover in images.iterdir():
                log.info("reconcile: removing fork image %s", leftover.name)
                shutil.rmtree(leftover, ignore_errors=True)
        # A running one's too: a resume does not wait for its pause's commit.
        pending = {r.snapshot_id for r in keep.values()
                   if r.state in (SandboxState.PAUSED, SandboxState.RUNNING) and r.snapshot_id}
        for name in self.snapshots.staging.remove_leftovers(pending):
            log.info("reconcile: removed interrupted capture %s", name)
