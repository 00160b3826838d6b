"""The node's load over the last minutes (``GET /load``): host CPU, memory and load
average and the node's sandboxes, sampled every few seconds into a bounded ring, for
the web console's plots (Prometheus, via /metrics, is the way to keep more)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

INTERVAL_S = 5.0
KEEP = 120  # ten minutes at 5 s


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot."""
    with contextlib.suppress(OSError, ValueError), open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu "):
                values = [int(v) for v in line.split()[1:]]
                idle = values[3] + (values[4] if len(values) > 4 else 0)
                return sum(values) - idle, sum(values)
    return None


def _memory() -> tuple[int, int]:
    """(used, total) bytes: total less what the kernel calls available."""
    info: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                info[key] = int(rest.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    return max(0, total - info.get("MemAvailable", total)), total


def _load1() -> float:
    with contextlib.suppress(OSError, ValueError), open("/proc/loadavg") as f:
        return float(f.read().split()[0])
    return 0.0


class LoadHistory:
    """A sample every ``interval_s`` seconds, the last ``keep`` of them."""

    def __init__(self, counts: Callable[[], dict[str, int]], interval_s: float = INTERVAL_S,
                 keep: int = KEEP) -> None:
        self.counts = counts
        self.interval_s = interval_s
        self.samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._last = _cpu_ticks()
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> dict[str, Any]:
        now = _cpu_ticks()
        cpu = 0.0
        if now is not None and self._last is not None and now[1] > self._last[1]:
            cpu = 100.0 * (now[0] - self._last[0]) / (now[1] - self._last[1])
        self._last = now
        used, total = _memory()
        counts = self.counts()
        point = {"t": round(time.time(), 3), "cpuPct": round(cpu, 1),
                 "memUsedBytes": used, "memTotalBytes": total, "load1": _load1(),
                 "running": counts.get("running", 0), "paused": counts.get("paused", 0)}
        self.samples.append(point)
        return point

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()

    def start(self) -> None:
        self.sample()
        self._task = asyncio.create_task(self._run(), name="load-history")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def answer(self) -> dict[str, Any]:
        return {"intervalSeconds": self.interval_s, "cpus": os.cpu_count() or 0,
                "samples": list(self.samples)}


router = APIRouter()


@router.get("/load")
async def node_load(request: Request) -> dict[str, Any]:
    """This node's host CPU (%), memory, load average and running and paused
    sandboxes, one sample every ``intervalSeconds``, oldest first (ten minutes)."""
    history: LoadHistory = request.app.state.load_history
    return history.answer()
