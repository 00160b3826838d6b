"""The state changes every service makes to the node's sandboxes: adding a record,
a launch handing a sandbox its slot and runtime, moving between states, tearing down,
and the tasks that do this work apart from the caller.

Only this object adds and removes sandboxes of the table and changes their states
(``transition``), so the rules below hold everywhere:

- a record is in the store before anything is started for it, so a crash at any
  point leaves something the next start can clean up;
- a slot is handed back by the sandbox's undo stack only, never twice;
- every state change is checked against ``TRANSITIONS``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ..network import Slot, SlotPool
from ..runtime import Runtime
from .cold_memory import ColdMemory
from .idling import IdleFreezer
from .launch import Launcher, LaunchPlan
from .models import TRANSITIONS, Conflict, OrchestratorError, SandboxRecord, SandboxState
from .sandbox import Sandbox
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Lifecycle:
    sandboxes: SandboxTable
    store: SandboxStore
    runtime: Runtime
    slots: SlotPool
    launcher: Launcher
    wake: Callable[[], None]  # room may have come free (admission.py)
    freezer: IdleFreezer
    cold_memory: ColdMemory
    # Creates, fork children and other work under way: each a task of its own,
    # cancelled when the node stops.
    tasks: set[asyncio.Task] = field(default_factory=set, init=False)
    # Called with a sandbox ID once it is gone (the proxy drops its connections).
    on_removed: list[Callable[[str], None]] = field(default_factory=list, init=False)
    # Awaited with a sandbox ID before its running state is captured (snapshot,
    # pause, fork): the proxy closes its idle connections to it, which a copy
    # restored elsewhere would hold half-open (see SandboxProxy.release_idle).
    on_capture: list[Callable[[str], Awaitable[None]]] = field(default_factory=list,
                                                               init=False)

    def get(self, sandbox_id: str) -> SandboxRecord:
        return self.sandboxes.get(sandbox_id).record

    def paused(self, sandbox_id: str) -> SandboxRecord:
        """The record of a paused sandbox (a Conflict if it is not paused)."""
        record = self.get(sandbox_id)
        if record.state is not SandboxState.PAUSED:
            raise Conflict(f"sandbox '{sandbox_id}' is {record.state}, not paused")
        return record

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        return self.sandboxes.lock(sandbox_id)

    def add(self, record: SandboxRecord) -> Sandbox:
        """A new record: in the store before anything starts for it."""
        entry = self.sandboxes.add(record)
        self.store.put(record)
        return entry

    def started(self, record: SandboxRecord, slot: Slot) -> None:
        """A launch handed the sandbox its slot and runtime: its undo stack takes them
        over (the slot once, should the same one come back)."""
        entry = self.sandboxes.holds(record)
        if entry is None:  # (never: a record being launched is not removed)
            raise OrchestratorError(f"sandbox '{record.sandbox_id}' was removed while "
                                    "starting")
        entry.hold(slot, self.give_back)
        entry.runs(self.runtime.destroy)

    async def give_back(self, slot: Slot) -> None:
        try:
            await self.slots.release(slot)
        except Exception:
            log.exception("release of slot %s failed", slot.index)
        self.wake()

    async def release(self, entry: Sandbox, destroy: bool = True) -> None:
        """Give back what the sandbox holds: its runtime (destroyed, with ``destroy``
        even if no launch handed one over), then its slot."""
        if destroy:
            entry.runs(self.runtime.destroy)
        await entry.cleanup.run()
        entry.let_go_of_slot()

    async def before_capture(self, sandbox_id: str) -> None:
        for listener in self.on_capture:
            try:
                await listener(sandbox_id)
            except Exception:  # a capture goes on without it
                log.exception("before-capture step for %s failed", sandbox_id)

    def removed(self, sandbox_id: str) -> None:
        """The sandbox's connections are dead (it stopped, paused or was reset)."""
        for listener in self.on_removed:
            listener(sandbox_id)

    def forget(self, record: SandboxRecord) -> None:
        """Drop a record that holds nothing any more."""
        record.state = SandboxState.KILLED
        self.store.delete(record.sandbox_id)
        entry = self.sandboxes.holds(record)
        if entry is not None:
            self.sandboxes.remove(entry)
        self.wake()

    async def teardown(self, record: SandboxRecord, started: bool) -> None:
        """Stop a sandbox (if ``started``), free its slot and drop its record."""
        entry = self.sandboxes.holds(record)
        record.state = SandboxState.KILLED
        if entry is not None:
            await self.release(entry, destroy=started)
        self.forget(record)
        self.freezer.forget(record.sandbox_id)
        self.cold_memory.forget(record.sandbox_id)
        self.removed(record.sandbox_id)

    def transition(self, record: SandboxRecord, to: SandboxState) -> None:
        if to not in TRANSITIONS[record.state]:
            raise Conflict(f"sandbox '{record.sandbox_id}' cannot go from {record.state} to {to}")
        record.state = to
        self.store.put(record)
        self.wake()

    def ended_in_error(self, record: SandboxRecord, reason: str) -> None:
        """A running sandbox is in ``error`` with ``reason`` (its runtime is gone or
        going); the caller frees what it held."""
        record.error = reason
        log.error("sandbox %s %s; it is now in state error", record.sandbox_id, reason)
        self.transition(record, SandboxState.ERROR)
        self.removed(record.sandbox_id)

    # -- work apart from the caller -----------------------------------------------------

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Background work the node cancels when it stops."""
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def as_task(self, record: SandboxRecord,
                      work: Coroutine[Any, Any, SandboxRecord]) -> SandboxRecord:
        """Run a create as a task of its own: a client that hangs up mid-create leaves
        no half-built sandbox. Whatever the work raises, the record does not stay
        ``creating`` (counted against capacity for ever): it is torn down."""

        async def guarded() -> SandboxRecord:
            try:
                return await work
            except BaseException:
                if record.state is SandboxState.CREATING and \
                        self.sandboxes.holds(record) is not None:
                    await asyncio.shield(self.teardown(record, True))
                raise

        return await asyncio.shield(self.spawn(guarded()))

    async def bring_up(self, record: SandboxRecord, plan: LaunchPlan) -> SandboxRecord:
        """Launch a ``creating`` record's sandbox; it holds the slot and runs after.
        On failure the launcher has undone its part; the caller drops the record."""
        slot = await self.launcher.launch(plan)
        self.started(record, slot)
        record.ready_at = time.time()
        self.transition(record, SandboxState.RUNNING)
        return record
