"""Sandboxes whose runtime ended without the node asking.

The runtime reports such an exit at once (``Runtime.on_exit``: the host's OOM
killer took the sandbox, or its engine crashed). The sandbox then goes to
``error`` with the reason in its record and the node's log; what it held (the
runtime's leftovers, its network slot, the proxy's pooled connections) is freed
at once, so calls to it fail fast with the reason instead of hanging. The
record stays, listed under ``state=error``, until the user deletes it or its
timeout passes. (The state change itself is ``ManagerCore._runtime_exited``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


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
