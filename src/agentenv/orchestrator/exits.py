"""Sandboxes whose runtime ended without the node asking.

The runtime reports such an exit at once (``Runtime.on_exit``: the host's OOM
killer took the sandbox, or its engine crashed). The sandbox then goes to
``error`` with the reason in its record and the node's log; what it held (the
runtime's leftovers, its network slot, the proxy's pooled connections) is freed
at once, so calls to it fail fast with the reason instead of hanging. The
record stays, listed by ID, until the user deletes it or its timeout passes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .models import Conflict, SandboxRecord, SandboxState

if TYPE_CHECKING:
    from .core import ManagerCore

log = logging.getLogger(__name__)


def not_running(record: SandboxRecord) -> Conflict:
    """The error for a call that needs the sandbox running (the proxy answers it
    as a 502 "The sandbox X is not running: ...")."""
    if record.state is SandboxState.ERROR or record.error:
        return Conflict(f"sandbox '{record.sandbox_id}' {record.error or 'ended'}")
    return Conflict(f"sandbox '{record.sandbox_id}' is {record.state}")


class ExitHandler:
    """Turns runtime exits into ``error`` records (one task per exit, none idle)."""

    def __init__(self, manager: ManagerCore) -> None:
        self.manager = manager
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, sandbox_id: str, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self._handle(sandbox_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, sandbox_id: str, reason: str) -> None:
        mgr = self.manager
        record = mgr._records.get(sandbox_id)
        if record is None or record.state is not SandboxState.RUNNING:
            return  # being created (its start fails on its own), paused, or gone
        # Calls to it fail fast from now on, even while a pause, snapshot or fork
        # holding its lock finds out for itself.
        record.error = reason
        async with mgr._lock(sandbox_id):
            if mgr._records.get(sandbox_id) is not record or \
                    record.state is not SandboxState.RUNNING:
                return
            log.error("sandbox %s %s; it is now in state error", sandbox_id, reason)
            mgr._transition(record, SandboxState.ERROR)
            for listener in mgr.on_removed:  # e.g. the proxy drops its connections
                listener(sandbox_id)
            try:
                await mgr.runtime.destroy(sandbox_id)
            except Exception:
                log.exception("removing the ended runtime of %s failed", sandbox_id)
            await mgr._release_slot(record)
            mgr.store.put(record)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
