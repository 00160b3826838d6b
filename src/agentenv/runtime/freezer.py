"""Freezing idle sandboxes in place with the host's cgroup v1 freezer.

An idle gVisor sandbox still costs CPU: the sentry's timers and the systrap stubs wake
many times a second (about 2 % of a core for `sleep infinity`, 4 % with envd), so
hundreds of idle sandboxes fill a machine doing nothing. Frozen, every task of the
sandbox (sentry, gofer, stubs) is stopped by the host kernel: no CPU at all, memory
kept, and a thaw is one write (well under a millisecond measured here; `runsc pause`
takes ~28 ms each way and the paused sentry still burns 3.5 % of a core).

A frozen sandbox cannot answer anything, runsc's control RPCs included, so every
runtime operation on a sandbox thaws it first and keeps it awake meanwhile
(``awake``); ``freeze`` refuses a sandbox that an operation holds.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupFreezer:
    def __init__(self, cgroup_parent: str, root: Path = CGROUP_ROOT) -> None:
        self.parent = cgroup_parent
        self.root = root
        self._frozen: set[str] = set()
        self._busy: Counter[str] = Counter()

    def _state(self, sandbox_id: str) -> Path:
        return self.root / "freezer" / self.parent / sandbox_id / "freezer.state"

    def available(self) -> bool:
        return (self.root / "freezer").is_dir()

    def frozen(self, sandbox_id: str) -> bool:
        return sandbox_id in self._frozen

    def frozen_count(self) -> int:
        return len(self._frozen)

    def freeze(self, sandbox_id: str) -> bool:
        """Freeze the sandbox's tasks (the kernel finishes it on its own); False when an
        operation holds the sandbox or it has no freezer cgroup."""
        if self._busy[sandbox_id] or sandbox_id in self._frozen:
            return False
        try:
            self._state(sandbox_id).write_text("FROZEN")
        except OSError as exc:
            log.debug("cannot freeze %s: %s", sandbox_id, exc)
            return False
        self._frozen.add(sandbox_id)
        return True

    def thaw(self, sandbox_id: str) -> bool:
        """Thaw the sandbox if this node froze it; True if it was frozen."""
        if sandbox_id not in self._frozen:
            return False
        self._frozen.discard(sandbox_id)
        try:
            self._state(sandbox_id).write_text("THAWED")
        except FileNotFoundError:  # gone with its sandbox
            return False
        return True

    def forget(self, sandbox_id: str) -> None:
        self._frozen.discard(sandbox_id)
        self._busy.pop(sandbox_id, None)

    @contextlib.contextmanager
    def awake(self, sandbox_id: str) -> Iterator[None]:
        """Thawed, and not frozen again while the block runs."""
        self._busy[sandbox_id] += 1
        try:
            self.thaw(sandbox_id)
            yield
        finally:
            self._busy[sandbox_id] -= 1
            if self._busy[sandbox_id] <= 0:
                del self._busy[sandbox_id]

    def thaw_all(self) -> int:
        """Thaw every sandbox cgroup under the parent (a node restarting finds those its
        predecessor froze: they must answer to be adopted). Returns how many were."""
        parent = self.root / "freezer" / self.parent
        thawed = 0
        for state in parent.glob("*/freezer.state") if parent.is_dir() else []:
            with contextlib.suppress(OSError):
                if state.read_text().strip() != "THAWED":
                    state.write_text("THAWED")
                    thawed += 1
        self._frozen.clear()
        return thawed

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        """CPU time all the sandbox's host tasks used so far (None: unknown)."""
        try:
            usage = (self.root / "cpuacct" / self.parent / sandbox_id / "cpuacct.usage")
            return int(usage.read_text()) / 1e9
        except (OSError, ValueError):
            return None

