"""Host memory pressure: the least recently active sandboxes paused to disk (issue 17).

Sandboxes may together promise more memory than the host has (each ``memoryMB`` is a
ceiling, idle ones hold far less). When the host's available memory falls below
``memory_pressure_mb``, the node pauses running sandboxes, least recently active
first (a round of as many as hold the memory missing, frozen at once), and evicts
them (their full state captured to disk, memory and slot freed): they are listed
``paused`` and resume on request (or on traffic with auto-resume) with every file and process,
instead of the host's OOM killer ending any of them. A sandbox with a request in
flight, one an operation holds and one active in the last ``MIN_IDLE_S`` seconds are
left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .. import metrics
from ..config import Config
from ..resources import host_memory_mb
from ..runtime import Runtime
from .cold_memory import ColdMemory
from .envd_client import EnvdClient
from .envd_sleep import Candidate, EnvdSleeper
from .envd_sleep import default_watermark_mb as envd_watermark_mb
from .idling import IdleFreezer
from .models import OrchestratorError, SandboxState
from .table import SandboxTable

log = logging.getLogger(__name__)
MIN_IDLE_S = 2.0
MAX_ROUND = 16  # pauses per round at most, before memory is looked at again


def available_mb() -> int:
    """The host's MemAvailable in MiB (a large number when unknown)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 1 << 30


def default_watermark_mb() -> int:
    """5 % of the host's memory, between 256 MiB and 2 GiB."""
    return max(256, min(2048, host_memory_mb() // 20))


class PressureRelief:
    def __init__(self, config: Config, sandboxes: SandboxTable, runtime: Runtime,
                 envd: EnvdClient, freezer: IdleFreezer, cold_memory: ColdMemory,
                 pause: Callable[[str], Awaitable[Any]],
                 evict: Callable[[str], Awaitable[Any]]) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self.runtime = runtime
        self.envd = envd
        self.freezer = freezer
        self.cold_memory = cold_memory
        self._pause = pause
        self._evict = evict
        self._relief: asyncio.Task | None = None
        self._envd_sleeper: EnvdSleeper | None = None

    async def close(self) -> None:
        if self._relief is not None:
            self._relief.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._relief

    def tend(self) -> None:
        """Each tick of the node's quick loop: both tiers."""
        self._tend_envd_sleep()
        self._tend_pressure()

    # -- the first tier: idle envds asked to sleep (envd_sleep.py) --------------------
    def _envd_dormancy_watermark_mb(self) -> int:
        configured = self.config.envd_dormancy_mb
        if configured == 0:
            return envd_watermark_mb(self._pressure_watermark_mb())
        return max(0, configured)

    def _envd_sleep_candidates(self) -> list[Candidate]:
        """Running sandboxes whose envd is awake, most idle first (none in flight, none
        an operation holds)."""
        found = []
        for record in [e.record for e in self.sandboxes]:
            sid = record.sandbox_id
            if record.state is not SandboxState.RUNNING or record.error or \
                    not record.slot_address or record.metadata.get("aenv.build") or \
                    self.freezer.in_flight(sid) or self.sandboxes.held(sid):
                continue
            idle = self.freezer.idle_for(sid, record.ready_at)
            found.append(Candidate(sid, record.slot_address, record.envd_token, idle))
        found.sort(key=lambda c: c.idle_s, reverse=True)
        # (read lazily: each is a look at the sandbox's console log)
        return [c for c in found if not self.runtime.envd_dormant(c.sandbox_id)]

    async def _ask_envd_dormant(self, c: Candidate) -> str | None:
        with self.freezer.thawed(c.sandbox_id):
            return await self.envd.ask_dormant(c.address, c.token)

    def short_for_idle(self) -> bool:
        """Below the idle-memory watermark: frozen sandboxes' memory goes to swap after
        a second (cold_memory.py), or, on a host with no swap, idle envds sleep."""
        watermark = self._envd_dormancy_watermark_mb()
        return watermark > 0 and available_mb() < watermark

    def _tend_envd_sleep(self) -> None:
        if self.cold_memory.enabled and self.cold_memory.has_swap:
            return  # frozen sandboxes give their memory to swap instead: no wake to pay
        if self._envd_sleeper is None:
            self._envd_sleeper = EnvdSleeper(
                self._envd_dormancy_watermark_mb, self._envd_sleep_candidates,
                self._ask_envd_dormant, available_mb)
        self._envd_sleeper.tend()

    # -- the second tier: sandboxes paused to disk ------------------------------------

    def _pressure_watermark_mb(self) -> int:
        configured = self.config.memory_pressure_mb
        return default_watermark_mb() if configured == 0 else max(0, configured)

    def _tend_pressure(self) -> None:
        """Each tick: below the watermark, start one round of relief (one at a time)."""
        watermark = self._pressure_watermark_mb()
        if watermark <= 0 or (self._relief is not None and not self._relief.done()):
            return
        if available_mb() >= watermark:
            return
        self._relief = asyncio.create_task(self._relieve(watermark), name="memory-pressure")

    def _pressure_candidates(self) -> list[str]:
        now_idle = self.freezer.idle_for
        found = []
        for record in [e.record for e in self.sandboxes]:
            sid = record.sandbox_id
            if record.state is not SandboxState.RUNNING or record.error or \
                    record.metadata.get("aenv.build") or self.freezer.in_flight(sid) or \
                    self.sandboxes.held(sid):
                continue
            idle = now_idle(sid, record.ready_at)
            if idle >= MIN_IDLE_S:
                found.append((idle, sid))
        return [sid for _, sid in sorted(found, reverse=True)]

    async def _relieve(self, watermark: int) -> None:
        """One round: the round's sandboxes paused first (with resident pauses a
        freeze: their memory stops growing at once), then evicted one by one (each
        capture takes seconds on a busy host, while the others would go on growing)."""
        paused: list[str] = []
        # As many as hold the memory missing (at least one): a host far short of its
        # watermark while sandboxes grow would not be caught up with one at a time.
        deficit = (watermark - available_mb()) << 20
        for sandbox_id in self._pressure_candidates()[:MAX_ROUND]:
            if deficit <= 0 or available_mb() >= watermark:
                break
            held = self.runtime.capture_size(sandbox_id)
            try:
                await self._pause(sandbox_id)
            except OrchestratorError as exc:  # gone meanwhile, or its capture failed
                log.warning("memory pressure: pausing %s failed: %s", sandbox_id, exc)
                continue
            except Exception:
                log.exception("memory pressure: pausing %s failed", sandbox_id)
                continue
            paused.append(sandbox_id)
            deficit -= max(held, 1)
        for sandbox_id in paused:
            available = available_mb()
            try:
                await self._evict(sandbox_id)
            except OrchestratorError as exc:  # resumed or killed meanwhile
                log.warning("memory pressure: evicting %s failed: %s", sandbox_id, exc)
                continue
            except Exception:
                log.exception("memory pressure: evicting %s failed", sandbox_id)
                continue
            metrics.PRESSURE_PAUSES.inc()
            log.warning("host memory low (%d MiB available, watermark %d MiB): paused "
                        "sandbox %s to disk, the least recently active; it resumes on "
                        "request", available, watermark, sandbox_id)
