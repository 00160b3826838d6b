"""Resident pauses (two tiers: a freeze now, the capture after).

A memory pause with resident pauses on freezes the sandbox in place and answers; its
durable capture and commit follow in the background (``Captures``), and while it
stays resident a resume is a thaw. Residents are evicted (their memory and slot
freed, the capture kept) when idle, over the budget, when a launch needs a slot, or
on request. ``ResidentSet`` (resident.py) keeps the books; this service acts on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from ..config import Config
from ..metrics import EVICTIONS
from ..runtime import Runtime, RuntimeFailure
from .captures import Captures
from .lifecycle import Lifecycle
from .models import OrchestratorError, SandboxRecord, SandboxState
from .resident import Resident, ResidentSet
from .sandbox import Sandbox
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class ResidentPauses:
    config: Config
    books: ResidentSet
    sandboxes: SandboxTable
    store: SandboxStore
    runtime: Runtime
    life: Lifecycle
    captures: Captures

    def get(self, sandbox_id: str) -> Resident | None:
        return self.books.get(sandbox_id)

    def pop(self, sandbox_id: str) -> Resident | None:
        return self.books.pop(sandbox_id)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self.books

    async def freeze(self, record: SandboxRecord, snapshot_id: str) -> SandboxRecord:
        """Freeze the sandbox in place and mark it paused; its capture follows."""
        sandbox_id = record.sandbox_id
        await self.life.before_capture(sandbox_id)  # its capture follows the freeze
        try:
            await self.runtime.pause(sandbox_id)
        except RuntimeFailure as exc:
            raise OrchestratorError(f"sandbox failed to pause: {exc}") from exc
        entry = Resident(previous_snapshot=record.snapshot_id,
                         grace_s=self.config.resident_capture_delay_ms / 1000)
        record.snapshot_id = snapshot_id
        # Stored with its slot: a restart finds it frozen and captures it if need be.
        self.life.transition(record, SandboxState.PAUSED)
        self.books.add(sandbox_id, entry)
        self.life.removed(sandbox_id)
        self.start_capture(record, entry)
        return record

    def start_capture(self, record: SandboxRecord, entry: Resident) -> None:
        entry.capture = asyncio.create_task(self._capture(record, entry))

    async def _capture(self, record: SandboxRecord, entry: Resident) -> None:
        """The durable capture of a frozen sandbox (it stays frozen), then its commit.
        A resume or kill that takes the lock first cancels it."""
        sandbox_id, snapshot_id = record.sandbox_id, record.snapshot_id
        if entry.grace_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.hurry.wait(), entry.grace_s)
            entry.grace_s = 0.0  # a retry captures at once
        async with self.life.lock(sandbox_id):
            if self.books.get(sandbox_id) is not entry or entry.captured:
                return
            try:
                staging = await self.captures.capture(sandbox_id, snapshot_id, leave_running=True)
            except Exception as exc:
                # It stays frozen and resident (never evicted uncaptured); retried.
                log.error("capture of paused sandbox %s failed: %s; retried", sandbox_id, exc)
                return
            finally:
                entry.capture = None
            metadata = {**self.captures.metadata(record, "pause"), "memory": True,
                        "parent_snapshot_id": entry.previous_snapshot or None}
            self.captures.snapshots.staging.hold_for_commit(snapshot_id, metadata)
            entry.captured = True
            sandbox = self.sandboxes.holds(record)
            if sandbox is not None:
                self.captures.start_commit(sandbox, snapshot_id, staging, metadata,
                                   replaces=entry.previous_snapshot)

    async def thaw(self, record: SandboxRecord, entry: Resident) -> None:
        """Resume a resident sandbox in place; on failure it stays paused as it was."""
        if entry.capture is not None:
            entry.capture.cancel()  # it waits for the lock this holds: never began
            entry.capture = None
        try:
            await self.runtime.resume(record.sandbox_id)
        except RuntimeFailure as exc:
            if not entry.captured:
                self.start_capture(record, entry)
            raise OrchestratorError(f"sandbox failed to resume: {exc}") from exc
        if not entry.captured:  # the capture never happened: the last one stands
            record.snapshot_id = entry.previous_snapshot
        self.books.pop(record.sandbox_id)

    async def evict_now(self, sandbox_id: str) -> bool:
        """Free a resident paused sandbox's memory and slot; its capture stays."""
        async with self.life.lock(sandbox_id):
            entry = self.books.get(sandbox_id)
            sandbox = self.sandboxes.find(sandbox_id)
            if entry is None or not entry.captured or sandbox is None:
                return False
            self.books.pop(sandbox_id)
            sandbox.let_go_of_slot()
            self.store.put(sandbox.record)
            task = self.captures.free_in_background(sandbox)
        log.info("paused sandbox %s evicted from memory (its capture is kept)", sandbox_id)
        EVICTIONS.labels("resident_pause").inc()
        await asyncio.shield(task)
        return True

    async def evict(self, sandbox_id: str) -> SandboxRecord:
        """A paused sandbox's memory and slot freed now (once its capture is made); a
        later resume restores it. Idempotent; a running sandbox is a Conflict."""
        record = self.life.paused(sandbox_id)
        entry = self.books.get(sandbox_id)
        if entry is None:
            return record
        entry.hurry.set()
        if entry.capture is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(entry.capture)
        if not entry.captured and sandbox_id in self.books:
            raise OrchestratorError(f"sandbox '{sandbox_id}' is paused in memory but its "
                                    "capture failed (retried); it cannot be evicted yet")
        await self.evict_now(sandbox_id)
        return record

    async def capture_all_now(self) -> None:
        """Capture every resident paused sandbox not captured yet (a stopping node
        destroys their runtimes); each capture's commit is started as usual."""
        pending: list[asyncio.Task] = []
        for sandbox_id, entry in list(self.books.entries.items()):
            record = self.sandboxes.records.get(sandbox_id)
            if record is None or entry.captured:
                continue
            entry.hurry.set()
            if entry.capture is None:
                self.start_capture(record, entry)
            if entry.capture is not None:
                pending.append(entry.capture)
        if pending:
            log.info("capturing %d paused sandboxes before the node stops", len(pending))
            await asyncio.gather(*pending, return_exceptions=True)

    async def make_room(self) -> bool:
        """A launch found no slot free: evict the least recently paused resident."""
        victim = self.books.oldest_captured()
        if victim is not None:
            return await self.evict_now(victim)
        victim = self.books.oldest()  # its capture is pending: hurried, then evicted
        if victim is None:
            return False
        try:
            await self.evict(victim)
        except OrchestratorError as exc:
            log.warning("could not evict paused sandbox %s for room: %s", victim, exc)
            return False
        return victim not in self.books

    async def tend(self) -> None:
        """Each tick: retry failed captures; evict the idle and what exceeds the budget."""
        for sandbox_id, entry in list(self.books.entries.items()):
            record = self.sandboxes.records.get(sandbox_id)
            if record is not None and not entry.captured and entry.capture is None:
                self.start_capture(record, entry)
        for sandbox_id in self.books.to_evict(self.runtime.capture_size):
            await self.evict_now(sandbox_id)


    async def exited(self, entry: Sandbox, reason: str) -> None:
        """A resident paused sandbox's frozen runtime ended: it resumes from its
        capture if that was made; else its state is lost (error)."""
        sandbox_id, record = entry.sandbox_id, entry.record
        async with entry.lock:
            resident = self.books.pop(sandbox_id)
            if resident is None or self.sandboxes.find(sandbox_id) is not entry:
                return
            if resident.capture is not None:
                resident.capture.cancel()
            await self.life.release(entry)
            if resident.captured:
                log.warning("paused sandbox %s %s; it resumes from its capture",
                            sandbox_id, reason)
                self.store.put(record)
                return
            record.error = f"{reason} while paused, before its state was saved"
            record.snapshot_id = resident.previous_snapshot
            log.error("paused sandbox %s %s; it is now in state error", sandbox_id, record.error)
            self.life.transition(record, SandboxState.ERROR)

