"""Idle envds put to sleep when the host needs their memory, not after a fixed delay.

An awake envd holds ~22 MiB of host memory in its sandbox; a dormant one almost none
(envd/dormancy.py), but the next request to it waits for envd to start again: 0.3-0.7 s
on a quiet 2-core host, seconds under load (issue 27). In an agent's episode every
command follows an idle gap (the model thinking), so a fixed idle delay made nearly
every step pay that wake. A frozen sandbox whose envd is awake answers its next
command in a warm command's time (the thaw is ~1 ms), so the node keeps envds awake
while the memory is not needed elsewhere, and only when the host's available memory
falls below ``envd_dormancy_mb`` asks the idle ones to sleep, least recently active
first, as many a round as hold the memory missing. Below ``memory_pressure_mb``
(lower), pausing to disk follows (pressure.py).

How the figures grow with the number of sandboxes N: memory ~22 MiB x N above the
dormant cost until the watermark; past it, dormant sandboxes stop growing the total
and the share of steps that pay a wake grows with the share of envds asleep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..resources import host_memory_mb

log = logging.getLogger(__name__)

ENVD_MB = 22  # what a dormant envd gives back (3857f5a:bench/results/dormant.md: 22.5 MiB)
MAX_ROUND = 32  # envds asked per round at most, before memory is looked at again
ROUND_GAP_S = 2.0  # between rounds: the memory of those asked takes a moment to return
REFUSED_RETRY_S = 10.0  # one that said it was busy is not asked again for this long
MIN_IDLE_S = 5.0  # a sandbox active more recently than this is left awake


def default_watermark_mb(pressure_watermark_mb: int) -> int:
    """Above the pause-to-disk watermark by 10 % of the host's memory (1 GiB at least):
    envds sleep first, and pauses come only if that was not enough."""
    return max(0, pressure_watermark_mb) + max(1024, host_memory_mb() // 10)


@dataclass(frozen=True)
class Candidate:
    sandbox_id: str
    address: str
    token: str
    idle_s: float


class EnvdSleeper:
    """Each ``tend`` (the node's quick loop): below the watermark, one round of asks."""

    def __init__(self, watermark_mb: Callable[[], int],
                 candidates: Callable[[], list[Candidate]],
                 ask: Callable[[Candidate], Awaitable[str | None]],
                 available_mb: Callable[[], int]) -> None:
        self._watermark_mb = watermark_mb  # <= 0: never
        self._candidates = candidates  # running, idle, envd awake: most idle first
        self._ask = ask  # -> None (it will sleep) or why not
        self._available_mb = available_mb
        self._round: asyncio.Task | None = None
        self._last_round = 0.0
        self._refused: dict[str, float] = {}  # sandbox ID -> when it said busy
        self.asked = 0  # envds that agreed to sleep (for the logs and tests)

    def tend(self) -> None:
        if self._round is not None and not self._round.done():
            return
        now = time.monotonic()
        if now - self._last_round < ROUND_GAP_S:
            return
        watermark = self._watermark_mb()
        if watermark <= 0:
            return
        available = self._available_mb()
        if available >= watermark:
            return
        self._last_round = now
        self._round = asyncio.create_task(self._sleep_round(watermark - available),
                                          name="envd-sleep")

    def forget(self, sandbox_id: str) -> None:
        self._refused.pop(sandbox_id, None)

    async def _sleep_round(self, missing_mb: int) -> None:
        wanted = max(1, min(MAX_ROUND, -(-missing_mb // ENVD_MB)))
        now = time.monotonic()
        self._refused = {sid: t for sid, t in self._refused.items()
                         if now - t < REFUSED_RETRY_S}
        agreed = 0
        for c in self._candidates():
            if agreed >= wanted:
                break
            if c.sandbox_id in self._refused or c.idle_s < MIN_IDLE_S:
                continue
            try:
                why = await self._ask(c)
            except Exception as exc:  # gone meanwhile, envd not answering: not ours to judge
                log.debug("envd sleep: asking %s failed: %s", c.sandbox_id, exc)
                why = f"{type(exc).__name__}"
            if why is None:
                agreed += 1
            else:
                log.debug("envd sleep: %s stays awake: %s", c.sandbox_id, why)
                self._refused[c.sandbox_id] = time.monotonic()
        if agreed:
            self.asked += agreed
            log.info("host memory low (%d MiB short of the envd watermark): %d idle "
                     "sandboxes' envds asked to sleep", missing_mb, agreed)
