"""What a running sandbox's runtime watches, and what it does about each: its
process ending unasked (``exits.ExitWatcher``), its memory cgroup nearing the
limit at which the host would kill it whole (``exits.PressureWatcher``: envd is
told to free memory), and reaching it (``oom_hold.OomHold``: held there while envd
frees memory, ended by the node if it cannot).

A mixin of the gVisor runtime, which provides runsc, the cgroups and the bundles.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

from .exits import MIB, ExitWatcher, PressureWatcher, exit_reason, working_set
from .freezer import CgroupFreezer
from .oci import host_memory_limit, pressure_threshold
from .oom_hold import OomHold
from .reclaim import shut_swap

log = logging.getLogger("agentenv.runtime.gvisor")


class Watching:
    state_dir: Path
    freezer: CgroupFreezer
    on_exit: Callable[[str, str], None] | None

    def _init_watching(self) -> None:
        self._exits = ExitWatcher(self._exited)
        # Near the cgroup's limit envd is told to free memory (SIGUSR2) before the host
        # OOM-kills the whole sandbox.
        self._pressure = PressureWatcher(self._pressed)
        # At the limit itself the sandbox waits instead of being killed whole, while
        # envd frees memory (oom_hold.py).
        self._hold = OomHold(self._held_at_limit, self._give_up)
        self._signals: set[asyncio.Task] = set()

    # provided by the runtime
    def memory_cgroup(self, sandbox_id: str) -> Path:
        raise NotImplementedError

    def bundle_dir(self, sandbox_id: str) -> Path:
        raise NotImplementedError

    async def _runsc(self, *args: str, check: bool = True, limit: float = 30) -> str:
        raise NotImplementedError

    def _kill_processes(self, sandbox_id: str) -> None:
        raise NotImplementedError


    def _state_file(self, sandbox_id: str) -> Path:
        return self.state_dir / f"{sandbox_id}_sandbox:{sandbox_id}.state"

    def _watch(self, sandbox_id: str) -> int:
        """Watch the sandbox's process (pid from runsc's state file: no exec); 0 if
        there is none to watch."""
        try:
            state = json.loads(self._state_file(sandbox_id).read_text())
            pid = int(state["sandbox"]["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("sandbox %s: no runsc state to watch its process by", sandbox_id)
            return 0
        self._exits.watch(sandbox_id, pid)
        cgroup = self.memory_cgroup(sandbox_id)
        shut_swap(cgroup)  # (the spec says so too; a restore's cgroup is made anew)
        limit = read_int(cgroup / "memory.limit_in_bytes")
        if not limit:
            return pid
        memory_mb = self._memory_mb(sandbox_id)  # (config.json parsed once per start)
        if not self._pressure.watch(sandbox_id, cgroup, pressure_threshold(memory_mb, limit),
                                    limit):
            log.warning("sandbox %s: cannot watch its memory cgroup %s", sandbox_id, cgroup)
        self._hold.watch(sandbox_id, cgroup, host_memory_limit(memory_mb) if memory_mb else limit)
        return pid

    def _unwatch(self, sandbox_id: str) -> None:
        self._exits.unwatch(sandbox_id)
        self._pressure.unwatch(sandbox_id)
        self._hold.unwatch(sandbox_id)
        self._hold.given_up.discard(sandbox_id)

    def _pressed(self, sandbox_id: str) -> None:
        cgroup = self.memory_cgroup(sandbox_id)
        log.warning("sandbox %s: %d MB of its %d MB host memory limit in use (the sandbox "
                    "kernel's included); telling envd to free memory", sandbox_id,
                    working_set(cgroup) // MIB,
                    read_int(cgroup / "memory.limit_in_bytes") // MIB)
        self._signal_envd(sandbox_id)

    def _held_at_limit(self, sandbox_id: str) -> None:
        # A frozen sandbox would not run envd's guard, lifted or not.
        self.freezer.thaw(sandbox_id)
        self._signal_envd(sandbox_id)

    def _signal_envd(self, sandbox_id: str) -> None:
        task = asyncio.get_running_loop().create_task(
            self._runsc("kill", sandbox_id, "USR2", check=False, limit=5))
        self._signals.add(task)
        task.add_done_callback(self._signalled)

    def _signalled(self, task: asyncio.Task) -> None:
        self._signals.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("signalling a sandbox failed: %s", task.exception())

    def _give_up(self, sandbox_id: str) -> None:
        """End a sandbox held at its memory limit that envd could not free: what the
        host's OOM killer would have done. Its exit is reported as out of memory."""
        self.freezer.thaw(sandbox_id)
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self._kill_processes, sandbox_id))
        self._signals.add(task)
        task.add_done_callback(self._signalled)

    def _exited(self, sandbox_id: str) -> None:
        reason = exit_reason(self.memory_cgroup(sandbox_id), self._memory_mb(sandbox_id),
                             held_at_limit=sandbox_id in self._hold.given_up,
                             own_limit=self._hold.own_limit(sandbox_id),
                             lifted=self._hold.lifted_lately(sandbox_id))
        log.warning("sandbox %s %s", sandbox_id, reason)
        for line in _guard_lines(self.bundle_dir(sandbox_id) / "console.log"):
            log.warning("sandbox %s before it ended: %s", sandbox_id, line)
        if self.on_exit is not None:
            self.on_exit(sandbox_id, reason)

    def _memory_mb(self, sandbox_id: str) -> int:
        """The memory size the sandbox was started with (its bundle's config.json)."""
        try:
            spec = json.loads((self.bundle_dir(sandbox_id) / "config.json").read_text())
            env = dict(e.split("=", 1) for e in spec["process"]["env"])
            return int(env.get("AENV_MEMORY_LIMIT_MB", 0))
        except (OSError, ValueError, KeyError, TypeError):
            return 0


def read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def _guard_lines(console: Path, keep: int = 3) -> list[str]:
    """envd's last memory and disk guard actions (its warnings) in a console log."""
    try:
        with open(console, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.startswith("envd WARNING")][-keep:]
