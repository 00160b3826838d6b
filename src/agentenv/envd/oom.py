"""An out-of-memory guard for the sandbox.

gVisor has no OOM killer of its own: past the host cgroup's limit the host
kills the whole sandbox. The node gives that cgroup headroom above the
sandbox's memory size and tells envd the size; this guard kills the largest
process once the sandbox's usage passes it, as a kernel's OOM killer would, so
one runaway process dies and the sandbox lives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

log = logging.getLogger(__name__)
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def used_bytes() -> int:
    """Memory in use by the sandbox: MemTotal - MemAvailable (gVisor's own accounting)."""
    total = avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    return max(0, total - avail)


def largest_process(exclude: set[int]) -> tuple[int, int] | None:
    """(pid, rss bytes) of the process holding the most resident memory."""
    best: tuple[int, int] | None = None
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in exclude:
            continue
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
        if best is None or rss > best[1]:
            best = (pid, rss)
    return best


class OomGuard:
    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.kills = 0
        # Killing a process this small frees too little to matter (the usage is
        # then in files of the in-memory root, say): leave such processes alone.
        self.min_victim = max(16 * MIB, limit_bytes // 20)
        # After a kill the freed memory shows up in the accounting a little later:
        # no further kill until the victim is gone (or this long has passed).
        self._victim: int | None = None
        self._victim_deadline = 0.0

    def interval(self, used: int) -> float:
        # Cheap when idle, tight when close: allocations run at GB/s.
        if used < self.limit // 2:
            return 0.25
        if used < self.limit * 8 // 10:
            return 0.05
        return 0.01

    def _settling(self) -> bool:
        if self._victim is None:
            return False
        if os.path.exists(f"/proc/{self._victim}") and time.monotonic() < self._victim_deadline:
            return True
        self._victim = None
        return False

    def check_once(self) -> int:
        used = used_bytes()
        if used > self.limit and not self._settling():
            victim = largest_process({1, os.getpid()})
            if victim is not None and victim[1] >= self.min_victim:
                pid, rss = victim
                log.warning("out of memory: %d MiB used of %d MiB; killing pid %d (rss %d MiB)",
                            used // MIB, self.limit // MIB, pid, rss // MIB)
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.kills += 1
                    self._victim, self._victim_deadline = pid, time.monotonic() + 2.0
                except ProcessLookupError:
                    pass
        return used

    async def run(self) -> None:
        while True:
            try:
                used = self.check_once()
            except OSError:
                used = 0
            await asyncio.sleep(self.interval(used))


def guard_from_env() -> OomGuard | None:
    """The guard for this sandbox, if the node told envd its memory size."""
    raw = os.environ.get("AENV_MEMORY_LIMIT_MB", "")
    if not raw.isdigit() or int(raw) <= 0:
        return None
    return OomGuard(int(raw) * MIB)
