"""Busy sandboxes yield to interactive ones.

Equal CPU weights split a saturated machine evenly, so one sandbox spinning on
every core doubles the time any other sandbox's short request takes. Once a
second the node looks at each sandbox's CPU use (cgroup ``cpuacct.usage``) and
gives a sandbox that used at least ``BUSY_CORES`` a small weight, and the
others their full weight by size. Weights only matter under contention: a busy
sandbox alone on the machine still gets all its quota; when a quiet one wakes,
it is served first, as a desktop scheduler favours interactive tasks.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
BUSY_CORES = 0.5
BUSY_SHARES = 64


class CpuBalancer:
    def __init__(self, cgroup_parent: str, root: Path = CGROUP_ROOT) -> None:
        self.cpu_dir = root / "cpu" / cgroup_parent
        self.acct_dir = root / "cpuacct" / cgroup_parent
        self._last: dict[str, tuple[float, int]] = {}
        self._full: dict[str, int] = {}  # the weight each sandbox was created with

    def tick(self, now: float | None = None) -> dict[str, float]:
        """Re-weigh every sandbox cgroup; returns cores used per sandbox since last tick."""
        now = time.monotonic() if now is None else now
        used: dict[str, float] = {}
        try:
            children = [p for p in self.cpu_dir.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return used
        seen = set()
        for cg in children:
            sid = cg.name
            seen.add(sid)
            try:
                usage = int((self.acct_dir / sid / "cpuacct.usage").read_text())
                shares_file = cg / "cpu.shares"
                shares = int(shares_file.read_text())
            except (OSError, ValueError):
                continue
            full = self._full.setdefault(sid, shares)
            last = self._last.get(sid)
            self._last[sid] = (now, usage)
            if last is None or now <= last[0]:
                continue
            cores = (usage - last[1]) / 1e9 / (now - last[0])
            used[sid] = cores
            want = BUSY_SHARES if cores >= BUSY_CORES else full
            if want != shares:
                with contextlib.suppress(OSError):
                    shares_file.write_text(str(want))
        for gone in set(self._last) - seen:
            self._last.pop(gone, None)
            self._full.pop(gone, None)
        return used
