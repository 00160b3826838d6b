"""A frozen sandbox's memory moved to the host's compressed swap (swap.py).

The kernel never swaps a sandbox by itself: every sandbox's memory cgroup has
``memory.swappiness`` 0, so its memory limit is a limit on RAM, as without swap, and
the host's own reclaim leaves it alone. Only ``reclaim_frozen`` lets it swap, for the
time of one reclaim of a frozen sandbox (whose pages nothing touches), then shuts it
again. cgroup v1's ``memory.force_empty`` reclaims the whole cgroup: measured here on
a sandbox with envd awake, 63.6 MiB resident became 2.3 MiB in two passes (50 and
140 ms, the compression's CPU) with 57 MiB of pages in zram taking ~13 MiB of RAM;
the next command took 52-69 ms against 40 ms warm, faulting back ~10 MiB.

Bounded: a sandbox whose memory and swap together already reach its memory limit is
not reclaimed again, so no sandbox holds more swap than its own limit.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MIB = 1 << 20
# force_empty gives up on pages it found referenced (it moves them to the active list);
# the next pass takes them. Seen: 2 passes, sometimes 3 or more; each later one is ~ms.
PASSES = 8
DONE_BELOW = 4 * MIB  # what stays resident of a reclaimed sandbox (kernel objects, page tables)
SWAPPINESS_WHILE_RECLAIMING = 100
MAX_INTERRUPTIONS = 20


def quiet_thread() -> None:
    """For the thread that reclaims: no signal is delivered to it (a signal pending
    on the writer interrupts the kernel's reclaim), the process's other threads
    take them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())


def shut_swap(cgroup: Path) -> None:
    """The sandbox's memory never goes to swap but through ``reclaim_frozen``."""
    with contextlib.suppress(OSError):
        (cgroup / "memory.swappiness").write_text("0")


def _read(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def reclaim_frozen(cgroup: Path, still_frozen: Callable[[], bool]) -> tuple[int, int]:
    """Move what the cgroup holds in RAM to swap while the sandbox stays frozen; return
    how many bytes left RAM and how many are still there. Blocking (the kernel
    compresses in the caller's time: ~3 ms of CPU per MiB): call it from a thread."""
    usage = _read(cgroup / "memory.usage_in_bytes")
    limit = _read(cgroup / "memory.limit_in_bytes")
    with_swap = _read(cgroup / "memory.memsw.usage_in_bytes")
    if usage < DONE_BELOW or (limit and with_swap > limit):
        return 0, usage
    try:
        (cgroup / "memory.swappiness").write_text(str(SWAPPINESS_WHILE_RECLAIMING))
    except OSError:  # gone with its sandbox
        return 0, 0
    try:
        passes = interruptions = 0
        last = usage
        while passes < PASSES and still_frozen():  # (thawed: its pages are wanted again)
            try:
                (cgroup / "memory.force_empty").write_text("0")
            except InterruptedError:
                # A signal for the process landed on this thread (the node's SIGCHLD):
                # the kernel stops reclaiming at once. Again, a few times.
                interruptions += 1
                if interruptions > MAX_INTERRUPTIONS:
                    break
                continue
            except OSError as exc:
                log.debug("reclaim of %s: %s", cgroup, exc)
                break
            passes += 1
            now = _read(cgroup / "memory.usage_in_bytes")
            if now < DONE_BELOW or (passes >= 2 and last - now < MIB):
                break  # done, or no pass frees more now
            last = now
    finally:
        shut_swap(cgroup)
    left = _read(cgroup / "memory.usage_in_bytes")
    log.debug("reclaim of %s: %d -> %d MiB in %d passes (%d interrupted)%s", cgroup.name,
              usage // MIB, left // MIB, passes, interruptions,
              "" if still_frozen() else ", thawed meanwhile")
    return max(0, usage - left), left
