"""The host's compressed swap, where frozen sandboxes' memory waits for their next step.

An idle sandbox whose envd is awake holds ~36-60 MiB of host memory (the sentry's
memory file: envd's Python heap, the guest's page cache, the in-memory root layer;
and the sentry's own Go heap). Putting envd to sleep gave most of it back but made
the next command wait 0.3-0.7 s for envd to start again (issue 27). A frozen
sandbox's pages are cold by construction, so the node moves them to a zram swap
device instead (``reclaim.py``): compressed ~4x in RAM, and the next command faults
back only the pages it touches (~10 MiB, a few ms of lz4 decompression) while envd
never stops.

The device is the host's, set up once by the first node that needs it, and left in
place when nodes stop (others may use it). An operator's own swap is used as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ZRAM_CONTROL = Path("/sys/class/zram-control")
SYS_BLOCK = Path("/sys/block")
PROC_SWAPS = Path("/proc/swaps")
LOCK = Path("/run/aenv-swap.lock")
# lz4 decompresses ~2x faster than the kernel's default lzo-rle at about the same
# ratio (3.5-4.4x on sandbox memory here): the step after a gap pays the decompression.
PREFERRED_ALGORITHMS = ("lz4", "lzo-rle", "lzo")
SWAP_PRIORITY = 100  # above any disk swap an operator set up: RAM first


@dataclass(frozen=True)
class SwapStats:
    """What the compressed swap holds: ``stored`` bytes of pages taking ``used`` of RAM."""

    device: str
    capacity: int
    stored: int
    compressed: int
    used: int


def active_swaps() -> dict[str, int]:
    """Active swap devices and files: path -> size in bytes."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in PROC_SWAPS.read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[2].isdigit():
                out[parts[0]] = int(parts[2]) * 1024
    return out


def ensure_compressed_swap(size_mb: int) -> str | None:
    """A swap the node's reclaim can use: an active zram device (made here of
    ``size_mb`` when none is), or the operator's own swap. None when neither can be
    had (no zram in the kernel, not root): reclaim then does nothing."""
    swaps = active_swaps()
    if size_mb <= 0:
        return next(iter(swaps), None)
    zram = next((dev for dev in swaps if dev.startswith("/dev/zram")), None)
    if zram is not None:
        return zram
    try:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK, "w") as lock:  # nodes starting together make one device
            fcntl.flock(lock, fcntl.LOCK_EX)
            swaps = active_swaps()
            zram = next((dev for dev in swaps if dev.startswith("/dev/zram")), None)
            return zram or _make_zram_swap(size_mb) or next(iter(swaps), None)
    except OSError as exc:
        log.warning("no compressed swap for idle sandboxes: %s", exc)
        return next(iter(swaps), None)


def _make_zram_swap(size_mb: int) -> str | None:
    device = _free_zram_device()
    if device is None:
        log.warning("no zram device to swap idle sandboxes' memory to")
        return None
    sys_dir = SYS_BLOCK / device
    algorithms = (sys_dir / "comp_algorithm").read_text().replace("[", "").replace("]", "")
    for algorithm in PREFERRED_ALGORITHMS:
        if algorithm in algorithms.split():
            (sys_dir / "comp_algorithm").write_text(algorithm)
            break
    (sys_dir / "disksize").write_text(str(size_mb << 20))
    path = f"/dev/{device}"
    for argv in (["mkswap", path], ["swapon", "-p", str(SWAP_PRIORITY), path]):
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log.warning("%s failed: %s", " ".join(argv), done.stderr.strip())
            with contextlib.suppress(OSError):
                (sys_dir / "reset").write_text("1")
            return None
    log.info("compressed swap for idle sandboxes: %s, %d MiB", path, size_mb)
    return path


def _free_zram_device() -> str | None:
    """An unused zram device (disksize 0), or a new one from zram-control."""
    for sys_dir in sorted(SYS_BLOCK.glob("zram*")):
        with contextlib.suppress(OSError, ValueError):
            if int((sys_dir / "disksize").read_text()) == 0:
                return sys_dir.name
    with contextlib.suppress(OSError, ValueError):
        return f"zram{int((ZRAM_CONTROL / 'hot_add').read_text())}"
    return None


def swap_stats() -> SwapStats | None:
    """Figures of the first active zram swap, None when there is none."""
    for device in active_swaps():
        if not device.startswith("/dev/zram"):
            continue
        sys_dir = SYS_BLOCK / Path(device).name
        try:
            fields = (sys_dir / "mm_stat").read_text().split()
            return SwapStats(device, int((sys_dir / "disksize").read_text()),
                             int(fields[0]), int(fields[1]), int(fields[2]))
        except (OSError, ValueError, IndexError):
            return None
    return None
