"""Host memory of sandboxes: PSS of runsc processes, each address space counted once.

systrap stubs of one guest process share an mm and each reports it whole in its
smaps_rollup: ``kcmp(KCMP_VM)`` finds them, so each mm is counted once.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterable
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
SYS_KCMP, KCMP_VM = 312, 1  # x86_64
MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")


def same_mm(a: int, b: int) -> bool:
    return _libc.syscall(SYS_KCMP, a, b, KCMP_VM, 0, 0) == 0


def pss(pid: int) -> int:
    """Bytes of the process's proportional set size (0 if it is gone)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def procs_pss(pids: Iterable[int]) -> tuple[int, int]:
    """(PSS with each address space once, naive per-process sum) of these processes."""
    dedup = naive = 0
    firsts: list[int] = []
    for pid in pids:
        size = pss(pid)
        naive += size
        if not any(same_mm(pid, other) for other in firsts):
            firsts.append(pid)
            dedup += size
    return dedup, naive


def sandbox_pss(cgroup: str) -> int:
    """PSS of one sandbox's processes: those of its memory cgroup (``prefix/id``)."""
    procs = MEMORY_CGROUPS / cgroup / "cgroup.procs"
    return procs_pss(int(p) for p in procs.read_text().split())[0]
