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
Files stay; deleting them frees the space. /tmp is a tmpfs of its own (the node
bounds its size); it counts against the same quota as the root layer.

The host sees more than the guest: the sandbox's cgroup also holds gVisor's own
memory (socket buffers, for one, which the guest's ``free`` never shows). When
that cgroup nears its limit the node sends envd SIGUSR2; the guard then kills
the process with the largest footprint (resident memory plus its open files,
each of which costs the sandbox kernel memory) before the host's OOM killer
takes the whole sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
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


WRITABLE = ("/", "/tmp")


def writable_used_bytes(paths: tuple[str, ...] = WRITABLE) -> int:
    """Bytes in files the sandbox wrote: the root layer and /tmp (each filesystem once),
    and the files layers of filesystem-mode resets when envd is in one (layers.py)."""
    from .layers import LAYERS

    layered = LAYERS.written_bytes()
    if layered is not None:
        return layered
    seen: set[int] = set()
    total = 0
    for path in paths:
        try:
            dev = os.stat(path).st_dev
            if dev in seen:
                continue
            seen.add(dev)
            total += disk_used_bytes(path)
        except OSError:
            continue
    return total


# An idle sandbox's guard looks at most every IDLE_MAX_S; usage moving by IDLE_DELTA or
# more between looks is not idle.
IDLE_MAX_S = 2.0
IDLE_DELTA = 4 * MIB

# What an open file costs the sandbox kernel (a loopback TCP socket: ~10 KiB of
# sentry memory measured, 30 000 of them 310 MB) beyond the process's own RSS.
FD_COST = 16 * 1024


def largest_footprint(exclude: set[int]) -> tuple[int, int] | None:
    """(pid, bytes) of the process that costs the sandbox most: rss + open files."""
    best: tuple[int, int] | None = None
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            with open(f"/proc/{name}/statm") as f:
                size = int(f.read().split()[1]) * PAGE
            size += len(os.listdir(f"/proc/{name}/fd")) * FD_COST
        except (OSError, ValueError, IndexError):
            continue
        if best is None or size > best[1]:
            best = (int(name), size)
    return best


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
        self._killed: dict[int, float] = {}  # pid -> until when it is not chosen again

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
        disk = writable_used_bytes() if self.disk_limit else 0
        if self.disk_limit and disk > self.disk_limit:
            # Files stay when their writer dies, so there is nothing to wait for:
            # parallel writers are stopped one a look (four dd at GB/s overshot by
            # ~100 MB when each kill waited for the last victim to be gone).
            self._kill_writer(f"disk quota: {disk // MIB} MiB used of "
                              f"{self.disk_limit // MIB} MiB", settle=False)
            return max(used, self._as_memory(disk))
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
        return max(used, self._as_memory(disk))

    def host_pressure(self) -> None:
        """The node says the sandbox's host cgroup (gVisor's own memory included) is
        close to its limit: free memory now, or the host kills the whole sandbox."""
        if self._settling():
            return
        me = {1, os.getpid()}
        why = (f"host memory pressure (the sandbox kernel's memory included; "
               f"{used_bytes() // MIB} MiB used inside)")
        # Resident memory first: the host gets it back at once. Then open files (the
        # sandbox kernel's memory they hold comes back later), then the top writer.
        for find, what in ((largest_process, "rss"), (largest_footprint, "footprint")):
            victim = find(me)
            if victim is not None and victim[1] >= self.min_victim:
                self._kill(victim[0], f"{why}; {what} {victim[1] // MIB} MiB")
                return
        self._kill_writer(why)

    def _as_memory(self, disk: int) -> int:
        return disk * self.limit // self.disk_limit if self.disk_limit else 0

    def _kill_writer(self, why: str, settle: bool = True) -> None:
        now = time.monotonic()
        self._killed = {p: t for p, t in self._killed.items() if t > now}
        victim = top_writer({1, os.getpid(), *self._killed})
        if victim is not None and victim[1] >= self.min_victim:
            self._kill(victim[0], f"{why}; wrote {victim[1] // MIB} MiB", settle)

    def _on_signal(self) -> None:
        try:
            self.host_pressure()
        except OSError:
            log.exception("acting on host memory pressure failed")

    def _kill(self, pid: int, why: str, settle: bool = True) -> None:
        log.warning("%s; killing pid %d", why, pid)
        try:
            os.kill(pid, signal.SIGKILL)
            self.kills += 1
            # (killed, it may still show in /proc a moment: not chosen again)
            self._killed[pid] = time.monotonic() + 2.0
            if settle:
                self._victim, self._victim_deadline = pid, time.monotonic() + 2.0
        except ProcessLookupError:
            pass

    def next_interval(self, used: int, last: int, idle: float) -> float:
        """The wait before the next look. While usage stays low and unchanged (an idle
        sandbox) the wait doubles up to IDLE_MAX_S: each look costs a few syscalls,
        dear under gVisor, and an idle sandbox should cost nothing. A sudden surge
        from there is caught by the node's cgroup threshold (SIGUSR2), which needs no
        polling; any change brings the tight intervals back at once."""
        base = self.interval(used)
        if used < self.limit // 2 and abs(used - last) < IDLE_DELTA:
            return min(max(idle * 2, base), IDLE_MAX_S)
        return base

    async def run(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, self._on_signal)
        last, wait = -IDLE_DELTA, 0.0
        while True:
            try:
                used = self.check_once()
            except OSError:
                used = 0
            wait = self.next_interval(used, last, wait)
            last = used
            await asyncio.sleep(wait)


def guard_from_env() -> OomGuard | None:
    """The guard for this sandbox, if the node told envd its memory size."""
    raw = os.environ.get("AENV_MEMORY_LIMIT_MB", "")
    if not raw.isdigit() or int(raw) <= 0:
        return None
    disk = os.environ.get("AENV_DISK_LIMIT_MB", "")
    return OomGuard(int(raw) * MIB, int(disk) * MIB if disk.isdigit() else 0)
