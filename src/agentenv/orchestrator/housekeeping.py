"""The node's two loops (the service ``Housekeeping``): every second the TTL loop
(the runtime's housekeeping, resident pauses tended, runs' leases, retries of failed
pause commits, egress domains re-resolved, expired sandboxes paused or killed), and
every half second the quick loop (idle freezing, cold memory, memory pressure)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..config import Config
from ..network import SlotError, SlotPool
from ..runtime import Runtime
from .captures import Captures
from .cold_memory import ColdMemory
from .egress import EgressPolicies
from .idling import IdleFreezer
from .models import Conflict, NotFound, SandboxRecord, SandboxState
from .pressure import PressureRelief
from .resident_pauses import ResidentPauses
from .runs import Runs
from .table import SandboxTable

log = logging.getLogger(__name__)
COMMIT_RETRY_TICKS = 30  # seconds between retries of failed pause commits
QUICK_TICK_S = 0.5  # between idle-freezing passes and memory-pressure checks
# How long a freezing pass waits on the read of the host's connection table. The read
# walks the kernel's whole conntrack table in a thread; under load it took minutes, and
# the quick loop (memory pressure too) must not wait that long.
EGRESS_READ_WAIT_S = 1.0


@dataclass(eq=False, repr=False)
class Housekeeping:
    config: Config
    runtime: Runtime
    slots: SlotPool
    sandboxes: SandboxTable
    freezer: IdleFreezer
    cold_memory: ColdMemory
    pressure: PressureRelief
    captures: Captures
    residents: ResidentPauses | None
    runs: Runs
    egress: EgressPolicies
    kill: Callable[[str], Awaitable[None]]
    _tasks: list[asyncio.Task] = field(default_factory=list, init=False)
    _egress_read: asyncio.Task | None = field(default=None, init=False)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._ttl_loop(), name="ttl"),
                       asyncio.create_task(self._quick_loop(), name="quick")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._egress_read is not None:  # (its thread ends by itself)
            self._egress_read.cancel()
            with contextlib.suppress(asyncio.CancelledError, SlotError):
                await self._egress_read

    async def _quick_loop(self) -> None:
        """Idle freezing and the memory-pressure watch, apart from the TTL loop: its
        pauses and runsc calls take seconds under load, while a sweep over hundreds
        of sandboxes thaws them, or growing ones fill the host, far faster."""
        while True:
            await asyncio.sleep(QUICK_TICK_S)
            try:
                await self._freeze_idle()
            except Exception:
                log.exception("idle freezing failed")
            self.cold_memory.tend()
            self.pressure.tend()

    async def _freeze_idle(self) -> None:
        """Freeze the sandboxes idle for a window, but for those holding an outbound
        connection open: waiting on a remote answer costs no CPU, and a frozen
        sandbox would never see the answer arrive."""
        due = self.freezer.due()
        if not due:
            return
        held = await self._held_connections()
        if held is None:  # not known yet: they stay due, a later pass decides
            return
        for sandbox_id in due:
            entry = self.sandboxes.find(sandbox_id)
            slot = entry.slot if entry is not None else None
            if slot is not None and held[slot.address]:
                self.freezer.working(sandbox_id)
                continue
            if self.freezer.freeze(sandbox_id):
                self.cold_memory.frozen(sandbox_id)

    async def _held_connections(self) -> Counter[str] | None:
        """Outbound connections per slot address, from one read of the host's table
        (it answers for every sandbox at once), or None while that read is still under
        way after ``EGRESS_READ_WAIT_S``. One read at a time: a slow one is not
        abandoned for a new one, whose thread would queue behind it; the pass that
        finds it done uses its answer."""
        if self._egress_read is None:
            self._egress_read = asyncio.create_task(self.slots.egress_by_address(),
                                                    name="egress-read")
        done, _ = await asyncio.wait({self._egress_read}, timeout=EGRESS_READ_WAIT_S)
        if not done:
            return None
        read, self._egress_read = self._egress_read, None
        try:
            return read.result()
        except SlotError as exc:  # not known: frozen as if they held none
            log.debug("idle freezing: %s", exc)
            return Counter()

    async def _ttl_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.runtime.housekeeping()
            except Exception:
                log.exception("runtime housekeeping failed")
            ticks += 1
            if self.residents is not None:
                await self.residents.tend()
            self.runs.tend()
            if ticks % COMMIT_RETRY_TICKS == 0:
                self.captures.retry_failed_commits()
            if ticks % max(1, int(self.config.egress_refresh_s)) == 0:
                await self.egress.refresh_domains()
            now = time.time()
            for record in [e.record for e in self.sandboxes]:
                if record.state is SandboxState.RUNNING and record.expired(now):
                    log.info("sandbox %s reached its timeout: %s", record.sandbox_id,
                             "pausing" if record.auto_pause else "killing")
                    await self._expire(record)
                elif record.state is SandboxState.ERROR and record.expired(now):
                    with contextlib.suppress(NotFound, Conflict):
                        await self.kill(record.sandbox_id)

    async def _expire(self, record: SandboxRecord) -> None:
        """Pause (or kill) an expired sandbox; a pause that fails kills it."""
        if record.auto_pause:
            await self.runs.pause_else_kill(record.sandbox_id, memory=record.auto_pause_memory,
                                       why="its timeout")
            return
        with contextlib.suppress(NotFound, Conflict):
            await self.kill(record.sandbox_id)

