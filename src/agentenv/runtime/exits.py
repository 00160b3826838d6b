"""Noticing at once when a sandbox's engine process ends, and why; and when its
memory cgroup nears the limit at which the host would kill it whole.

Each watched sandbox has a pidfd (Linux 5.3+) on its sandbox process (gVisor's
sentry) in the event loop's own epoll set: the loop wakes when, and only when,
one of them exits. Nothing is polled: a node with N sandboxes holds N more file
descriptors and does no work per tick; an exit costs one callback and a few
small cgroup file reads.

Why it ended is read from the sandbox's memory cgroup before the runtime
removes it: the kernel counts its OOM kills there (``memory.oom_control``,
``oom_kill``), with the peak usage and the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)
MIB = 1 << 20


class ExitWatcher:
    """Calls ``on_exit(sandbox_id)`` in the event loop when a watched process ends."""

    def __init__(self, on_exit: Callable[[str], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def watch(self, sandbox_id: str, pid: int) -> bool:
        """Start watching ``pid``; False (and ``on_exit`` soon) when it is already gone."""
        self.unwatch(sandbox_id)
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            loop.call_soon(self._on_exit, sandbox_id)
            return False
        self._fds[sandbox_id] = fd
        loop.add_reader(fd, self._fired, sandbox_id, fd)
        return True

    def watching(self, sandbox_id: str) -> bool:
        return sandbox_id in self._fds

    def unwatch(self, sandbox_id: str) -> None:
        """Stop watching (before the node itself stops or checkpoints the sandbox)."""
        fd = self._fds.pop(sandbox_id, None)
        if fd is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        for sandbox_id in list(self._fds):
            self.unwatch(sandbox_id)

    def _fired(self, sandbox_id: str, fd: int) -> None:
        if self._fds.get(sandbox_id) != fd:
            return
        self.unwatch(sandbox_id)
        try:
            self._on_exit(sandbox_id)
        except Exception:
            log.exception("handling the exit of sandbox %s failed", sandbox_id)


def exit_reason(memory_cgroup: Path, memory_mb: int = 0, held_at_limit: bool = False,
                own_limit: int = 0, lifted: bool = False) -> str:
    """Why a sandbox's process ended, from its memory cgroup (read before it is removed):
    "killed: out of memory (...)" when the kernel's OOM killer acted there, when the
    node ended it after holding it at its limit (``oom_hold.py``: ``held_at_limit``), or
    when it ended while held there (``lifted``: its limit was lifted just now)."""
    oom_kills = 0
    with contextlib.suppress(OSError, ValueError):
        for line in (memory_cgroup / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                oom_kills = int(value)
    peak = _read_int(memory_cgroup / "memory.max_usage_in_bytes")
    limit = _read_int(memory_cgroup / "memory.limit_in_bytes")
    # Held at its limit (oom_hold.py), the sandbox's runtime may end on its own before
    # the node gives up on it: a memory allocation its kernel cannot wait for fails.
    at_limit = lifted and bool(own_limit) and peak >= own_limit
    if own_limit and (held_at_limit or at_limit):
        limit = own_limit  # not the lift it was held with
    if oom_kills or held_at_limit or at_limit:
        size = f"{memory_mb} MB of memory plus {limit // MIB - memory_mb} MB for its kernel" \
            if memory_mb and limit // MIB > memory_mb else "its memory"
        if held_at_limit:
            return (f"was killed: out of memory: the sandbox reached its {limit // MIB} MB "
                    f"limit ({size}) and envd could not free memory; the node ended it")
        if not oom_kills:
            return (f"was killed: out of memory: the sandbox reached its {limit // MIB} MB "
                    f"limit ({size}) and its runtime ended there")
        return (f"was killed: out of memory: the sandbox used {peak // MIB} MB of its "
                f"{limit // MIB} MB limit ({size}); the host's OOM killer stopped it")
    return "exited: its runtime process ended" + (
        f" (peak memory {peak // MIB} MB of its {limit // MIB} MB limit)" if limit else "")


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


class PressureWatcher:
    """Tells ``on_pressure(sandbox_id)`` when a sandbox's memory cgroup (gVisor's sentry
    and gofer included: what the host's OOM killer judges) nears its limit.

    The kernel does the watching: a cgroup v1 memory threshold (``cgroup.event_control``)
    signals an eventfd when usage crosses it, and the eventfd is in the event loop's
    epoll set. Per sandbox: two file descriptors and no work until it crosses. Usage
    counts reclaimable page cache, so on a crossing the working set (rss + shmem: the
    sandbox's memory file is shmem) decides; a sandbox that stays above is looked at
    again by ``recheck`` (the runtime's once-a-second housekeeping).
    """

    # At most one report per sandbox this often (envd ignores reports while its last
    # victim is still going).
    MIN_INTERVAL = 0.1
    # Thresholds from the first one up to the limit, at least this far apart and at
    # most LEVELS of them: a sandbox still growing after a kill is reported again at
    # once, not at the next recheck.
    STEP = 16 << 20
    LEVELS = 8

    def __init__(self, on_pressure: Callable[[str], None]) -> None:
        self._on_pressure = on_pressure
        self._watched: dict[str, tuple[int, int, Path, int]] = {}  # efd, usage fd, cg, at
        self._arming: dict[str, object] = {}  # thresholds being written (in a thread)
        # its own threads: a slow arming must not hold up the loop's to_thread work
        self._threads = ThreadPoolExecutor(8, thread_name_prefix="memory-thresholds")
        self._above: set[str] = set()
        self._last: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, sandbox_id: str, cgroup: Path, threshold: int, limit: int) -> bool:
        """Arm the thresholds; False when the cgroup cannot be watched at all.

        Each threshold write waits for an RCU grace period in the kernel (20-60 ms on
        a busy host: 100-500 ms for eight, and a fork of 16 did 128 in a row), so they
        are written in a thread, off the event loop and off the start's critical path;
        a crossing meanwhile is not lost (the eventfd counts it, the loop reads it once
        armed).
        """
        self.unwatch(sandbox_id)
        fds = event_fds(cgroup, "memory.usage_in_bytes")
        if fds is None:
            return False
        efd, usage_fd = fds
        step = max(self.STEP, (limit - threshold) // self.LEVELS)
        levels = list(range(threshold, max(limit, threshold + 1), step))
        token = object()
        self._arming[sandbox_id] = token
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._threads, _arm, cgroup, efd, usage_fd, levels)
        fut.add_done_callback(
            lambda f: self._armed(f, sandbox_id, token, (efd, usage_fd, cgroup, threshold)))
        return True

    def _armed(self, fut: asyncio.Future, sandbox_id: str, token: object,
               entry: tuple[int, int, Path, int]) -> None:
        # Read in every case: a sandbox gone while arming (its cgroup with it) must not
        # leave an unretrieved exception for asyncio to log as an error.
        failed = fut.cancelled() or fut.exception() is not None
        if self._arming.get(sandbox_id) is token:
            del self._arming[sandbox_id]
            if not failed:
                self._watched[sandbox_id] = entry
                with contextlib.suppress(RuntimeError):  # loop closing
                    asyncio.get_running_loop().add_reader(entry[0], self._crossed, sandbox_id)
                    return
                del self._watched[sandbox_id]
            else:
                log.warning("sandbox %s: cannot watch its memory cgroup %s", sandbox_id,
                            entry[2])
        # unwatched (or failed) while arming: the fds were the thread's until now
        os.close(entry[0])
        os.close(entry[1])

    def unwatch(self, sandbox_id: str) -> None:
        self._arming.pop(sandbox_id, None)  # its thread's callback closes its fds
        entry = self._watched.pop(sandbox_id, None)
        self._above.discard(sandbox_id)
        self._last.pop(sandbox_id, None)
        if entry is None:
            return
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_reader(entry[0])
        os.close(entry[0])
        os.close(entry[1])

    def close(self) -> None:
        for sandbox_id in [*self._watched, *self._arming]:
            self.unwatch(sandbox_id)

    def _crossed(self, sandbox_id: str) -> None:
        entry = self._watched.get(sandbox_id)
        if entry is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(entry[0])
        self._check(sandbox_id)

    def recheck(self) -> None:
        """Look again at sandboxes last seen above their threshold."""
        for sandbox_id in list(self._above):
            self._check(sandbox_id)

    def _check(self, sandbox_id: str) -> None:
        entry = self._watched.get(sandbox_id)
        if entry is None:
            return
        _, _, cgroup, threshold = entry
        if _read_int(cgroup / "memory.usage_in_bytes") < threshold:
            self._above.discard(sandbox_id)
            return
        self._above.add(sandbox_id)
        if working_set(cgroup) < threshold:
            return  # page cache, which the kernel reclaims before it kills
        now = time.monotonic()
        if now - self._last.get(sandbox_id, 0.0) < self.MIN_INTERVAL:
            return
        self._last[sandbox_id] = now
        try:
            self._on_pressure(sandbox_id)
        except Exception:
            log.exception("handling memory pressure of sandbox %s failed", sandbox_id)


def event_fds(cgroup: Path, control: str) -> tuple[int, int] | None:
    """(an eventfd, the control file open) for a cgroup v1 notification on ``control``
    (``cgroup.event_control``), or None when the cgroup cannot be watched."""
    try:
        control_fd = os.open(cgroup / control, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK), control_fd


def _arm(cgroup: Path, efd: int, usage_fd: int, levels: list[int]) -> None:
    """Register each threshold (in a thread: each write waits for a grace period)."""
    for level in levels:
        (cgroup / "cgroup.event_control").write_text(f"{efd} {usage_fd} {level}")


def working_set(cgroup: Path) -> int:
    """What the cgroup cannot give back without killing: rss + shmem (gVisor's memory
    file is shmem), without the page cache the kernel would reclaim first."""
    return _memory_stat(cgroup, ("total_rss", "total_shmem"))


def memory_file_bytes(cgroup: Path) -> int:
    """The sandbox kernel's memory file in use (shmem): what a capture saves of memory."""
    return _memory_stat(cgroup, ("total_shmem",))


def _memory_stat(cgroup: Path, keys: tuple[str, ...]) -> int:
    total = 0
    with contextlib.suppress(OSError, ValueError):
        for line in (cgroup / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in keys:
                total += int(value)
    return total
