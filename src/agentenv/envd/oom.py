"""An out-of-memory guard for the sandbox.

gVisor has no OOM killer of its own: past the host cgroup's limit the host
kills the whole sandbox. The node gives that cgroup headroom above the
sandbox's memory size and tells envd the size; this guard kills the largest
process once the sandbox's usage passes it, as a kernel's OOM killer would, so
one runaway process dies and the sandbox lives.

The same guard keeps the sandbox's disk quota. The writable root layer lives in
sandbox memory (this runsc has no size limit for it), so a file filler grows
memory while its own RSS stays tiny: past the memory size, or past the disk
quota (``df /``), the process that has written the most is killed instead.
Files stay; deleting them frees the space.
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


def disk_used_bytes(path: str = "/") -> int:
    """Bytes in the sandbox's writable root layer (what ``df /`` reports as used)."""
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def top_writer(exclude: set[int]) -> tuple[int, int] | None:
    """(pid, bytes written) of the process that has written the most (``wchar``)."""
    best: tuple[int, int] | None = None
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"/proc/{name}/io") as f:
                wchar = next(int(ln.split()[1]) for ln in f if ln.startswith("wchar:"))
        except (OSError, ValueError, IndexError, StopIteration):
            continue
        if best is None or wchar > best[1]:
            best = (int(name), wchar)
    return best


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
    def __init__(self, limit_bytes: int, disk_limit_bytes: int = 0):
        self.limit = limit_bytes
        self.disk_limit = disk_limit_bytes
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
        """One look; returns the fuller of memory and disk, scaled to the memory limit
        (what ``interval`` wants)."""
        used = used_bytes()
        disk = disk_used_bytes() if self.disk_limit else 0
        if self._settling():
            return max(used, self._as_memory(disk))
        me = {1, os.getpid()}
        if used > self.limit:
            victim = largest_process(me)
            if victim is not None and victim[1] >= self.min_victim:
                self._kill(victim[0], f"out of memory: {used // MIB} MiB used of "
                           f"{self.limit // MIB} MiB; rss {victim[1] // MIB} MiB")
            else:  # the memory is in files of the in-memory root: stop their writer
                self._kill_writer(f"out of memory: {used // MIB} MiB used of "
                                  f"{self.limit // MIB} MiB, mostly files")
        elif self.disk_limit and disk > self.disk_limit:
            self._kill_writer(f"disk quota: {disk // MIB} MiB used of "
                              f"{self.disk_limit // MIB} MiB")
        return max(used, self._as_memory(disk))

    def _as_memory(self, disk: int) -> int:
        return disk * self.limit // self.disk_limit if self.disk_limit else 0

    def _kill_writer(self, why: str) -> None:
        victim = top_writer({1, os.getpid()})
        if victim is not None and victim[1] >= self.min_victim:
            self._kill(victim[0], f"{why}; wrote {victim[1] // MIB} MiB")

    def _kill(self, pid: int, why: str) -> None:
        log.warning("%s; killing pid %d", why, pid)
        try:
            os.kill(pid, signal.SIGKILL)
            self.kills += 1
            self._victim, self._victim_deadline = pid, time.monotonic() + 2.0
        except ProcessLookupError:
            pass

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
    disk = os.environ.get("AENV_DISK_LIMIT_MB", "")
    return OomGuard(int(raw) * MIB, int(disk) * MIB if disk.isdigit() else 0)
