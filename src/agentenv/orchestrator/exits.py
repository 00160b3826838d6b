"""Sandboxes whose runtime ended without the node asking.

The runtime reports such an exit at once (``Runtime.on_exit``: the host's OOM
killer took the sandbox, or its engine crashed). The sandbox then goes to
``error`` with the reason in its record and the node's log; what it held (the
runtime's leftovers, its network slot, the proxy's pooled connections) is freed
at once, so calls to it fail fast with the reason instead of hanging. The
record stays, listed under ``state=error``, until the user deletes it or its
timeout passes. ``RuntimeExits`` says what an exit means for whom it was: a
running sandbox, a resident paused one, a warm-pool member.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from .boot_images import BootImages
from .lifecycle import Lifecycle
from .models import SandboxState
from .resident_pauses import ResidentPauses
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


class ExitHandler:
    """Turns the runtime's exit reports (called in the event loop) into one task each;
    none is kept while nothing exits."""

    def __init__(self, handle: Callable[[str, str], Coroutine[Any, Any, None]]) -> None:
        self.handle = handle
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, sandbox_id: str, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.handle(sandbox_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass(eq=False, repr=False)
class RuntimeExits:
    sandboxes: SandboxTable
    store: SandboxStore
    life: Lifecycle
    boot_images: BootImages | None
    residents: ResidentPauses | None

    async def exited(self, sandbox_id: str, reason: str) -> None:
        """A running sandbox's runtime ended unasked: the record goes to ``error``
        with the reason, and what the sandbox held is freed."""
        entry = self.sandboxes.find(sandbox_id)
        if entry is None and self.boot_images is not None:
            await self.boot_images.member_exited(sandbox_id, reason)  # a pooled one
            return
        if entry is not None and entry.state is SandboxState.PAUSED:
            if self.residents is not None:
                await self.residents.exited(entry, reason)
            return
        if entry is None or entry.state is not SandboxState.RUNNING:
            return  # being created (its start fails on its own), or gone
        record = entry.record
        # Calls to it fail fast from now on, even while a pause, snapshot or fork
        # holding its lock finds out for itself.
        record.error = reason
        async with entry.lock:
            if self.sandboxes.find(sandbox_id) is not entry or \
                    record.state is not SandboxState.RUNNING:
                return
            self.life.ended_in_error(record, reason)  # the proxy drops its connections
            await self.life.release(entry)
            self.store.put(record)
