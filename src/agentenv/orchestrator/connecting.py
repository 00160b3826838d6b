"""Connecting to a sandbox: a running one as it is, a paused one resumed (by ``connect``
or, for auto-resume sandboxes, by traffic through the proxy). Resumes are admitted
like creates (pausing.py's ``resume``)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..config import Config
from .models import Conflict, SandboxRecord, SandboxState, not_running
from .sandbox import Sandbox
from .table import SandboxTable

log = logging.getLogger(__name__)


class Connections:
    def __init__(self, sandboxes: SandboxTable, config: Config,
                 resume: Callable[..., Coroutine[Any, Any, SandboxRecord]],
                 set_timeout: Callable[[str, int | None], Awaitable[SandboxRecord]]) -> None:
        self.sandboxes = sandboxes
        self.config = config
        self._resume = resume  # (sandbox_id, ttl, memory=...)
        self._set_timeout = set_timeout

    async def connect(self, sandbox_id: str, ttl: int | None = None,
                      memory: bool = True) -> SandboxRecord:
        """A running sandbox as it is (a given TTL extends it); a paused one is resumed."""
        record = self.sandboxes.get(sandbox_id).record
        if record.state is SandboxState.PAUSED:
            return await self._resume(sandbox_id, ttl, memory=memory)
        if ttl is not None:
            return await self._set_timeout(sandbox_id, ttl)
        return record

    async def ensure_running(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox, running: a paused one created with auto-resume is resumed first
        (E2B's resume on traffic). Concurrent callers share one resume; a sandbox that
        cannot run raises as ``endpoint`` does (NotFound, Conflict), a failed resume
        as ``resume`` does (it then stays paused)."""
        entry = self.sandboxes.get(sandbox_id)
        record = entry.record
        if record.state is SandboxState.PAUSED and record.auto_resume:
            task = entry.auto_resume
            if task is None:
                ttl = min(record.resume_timeout or self.config.default_timeout,
                          self.config.max_timeout)
                task = asyncio.create_task(self._resume(sandbox_id, ttl))
                entry.auto_resume = task
                task.add_done_callback(functools.partial(_auto_resume_done, entry))
                log.info("sandbox %s: traffic arrived while paused; resuming it", sandbox_id)
            try:
                await asyncio.shield(task)
            except Conflict:
                pass  # resumed (or killed) by someone else meanwhile: see below
            record = self.sandboxes.get(sandbox_id).record
        if record.state is not SandboxState.RUNNING or record.error:
            raise not_running(record)
        return record


def _auto_resume_done(entry: Sandbox, task: asyncio.Task) -> None:
    if entry.auto_resume is task:
        entry.auto_resume = None
    # Read here: every request that waited for it may have hung up before it ended.
    if not task.cancelled() and task.exception() is not None:
        log.warning("resume on traffic failed: %s", task.exception())
