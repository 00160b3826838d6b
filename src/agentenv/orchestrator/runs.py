"""Runs own sandboxes: a run ends when its lease lapses (no heartbeat for its
``leaseSeconds``) or on DELETE, and every sandbox created in it is then killed (or
paused, if the run asked so). A trainer killed with -9 thus leaks nothing past its
lease. The books (and their persistence) are ``runbook.py``'s.

``pause_else_kill`` is the one "pause, else kill" policy: a run's end and a timeout's
auto-pause both go through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .models import Conflict, NotFound, SandboxRecord, SandboxState
from .runbook import Run, RunBook, check_run
from .table import SandboxTable

log = logging.getLogger(__name__)
# How long ending a run waits for its sandboxes still being created.
END_WAIT_S = 120.0


class Runs:
    def __init__(self, sandboxes: SandboxTable, runbook: RunBook,
                 pause: Callable[..., Awaitable[Any]], kill: Callable[[str], Awaitable[None]],
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task]) -> None:
        self.sandboxes = sandboxes
        self.runbook = runbook
        self._pause = pause  # (sandbox_id, memory=...)
        self._kill = kill
        self._spawn = spawn  # a task the node cancels when it stops

    def create(self, name: object, lease_s: object, on_expiry: object) -> Run:
        return self.runbook.create(*check_run(name, lease_s, on_expiry))

    def members(self, run_id: str) -> list[SandboxRecord]:
        return [e.record for e in self.sandboxes
                if e.record.run_id == run_id and e.state is not SandboxState.KILLED]

    async def end(self, run_id: str) -> None:
        """DELETE: the run's sandboxes killed (or paused), then the run gone."""
        run = self.runbook.get(run_id)
        await self._end(run, "deleted")

    def tend(self) -> None:
        """Runs whose lease lapsed end (in the background: the TTL loop goes on)."""
        for run in self.runbook.lapsed(time.time()):
            log.info("run %s (%s): its lease of %ss lapsed; ending it", run.run_id, run.name,
                     run.lease_s)
            self._spawn(self._end(run, "lease lapsed"))

    async def _end(self, run: Run, why: str) -> None:
        run.ending = True  # no create joins it from now on
        end = time.monotonic() + END_WAIT_S
        while True:
            creating = False
            for record in self.members(run.run_id):
                if record.state is SandboxState.CREATING:
                    creating = True  # it is killed once it runs (or it fails by itself)
                    continue
                try:
                    if record.state is SandboxState.RUNNING and run.on_expiry == "pause":
                        await self.pause_else_kill(record.sandbox_id, memory=True,
                                                   why="its run ended")
                    elif record.state is not SandboxState.PAUSED or run.on_expiry == "kill":
                        with contextlib.suppress(NotFound, Conflict):
                            await self._kill(record.sandbox_id)
                except Exception:  # the others still go; its own TTL ends it at worst
                    log.exception("ending %s of run %s failed", record.sandbox_id, run.run_id)
            if not creating or time.monotonic() > end:
                break
            await asyncio.sleep(0.2)
        self.runbook.forget(run.run_id)
        log.info("run %s (%s) ended (%s)", run.run_id, run.name, why)

    async def pause_else_kill(self, sandbox_id: str, memory: bool, why: str) -> None:
        """The end of a sandbox that asked to be paused (at its timeout, at its run's
        end): a pause; if the pause fails, a kill, so it never goes on holding the
        node's resources. One paused or gone meanwhile is left as it is."""
        try:
            await self._pause(sandbox_id, memory=memory)
            return
        except Exception as exc:
            entry = self.sandboxes.find(sandbox_id)
            if entry is None or entry.state in (SandboxState.PAUSED, SandboxState.KILLED) \
                    or entry.killing:
                return
            log.error("pausing %s (%s) failed (%s); killing it", sandbox_id, why, exc)
        with contextlib.suppress(NotFound, Conflict):
            await self._kill(sandbox_id)
