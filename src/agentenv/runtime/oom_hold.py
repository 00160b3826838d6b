"""Holding a sandbox at its host memory limit instead of letting the host kill it.

The sandbox's memory cgroup holds gVisor's sentry, so the host's OOM killer at
its limit ends the whole sandbox, where a kernel would kill one process. envd
inside picks and kills that process (``envd/oom.py``), told early by the node's
thresholds (``exits.PressureWatcher``); a fast allocator on a loaded host can
still reach the limit before envd acts (seen in CI: 128 MB in ~200 ms).

So the kernel's OOM killer is off for these cgroups (cgroup v1
``memory.oom_control``): at the limit the sandbox's faulting threads wait
instead. A waiting sentry answers nothing (not even ``runsc kill``), so on the
kernel's OOM event (an eventfd, no polling) the node lifts the limit by a small
step, which wakes it, and asks envd to free memory. Each new OOM lifts it again,
up to ``MAX_LIFT`` over the sandbox's own limit. Once usage is back under that
limit the limit is put back; a sandbox still stuck at the last step after
``GIVE_UP_S`` is ended by the node, as the host's OOM killer would have ended it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .exits import MIB, event_fds, working_set

log = logging.getLogger(__name__)


@dataclass
class _Held:
    cgroup: Path
    limit: int  # the sandbox's own host limit, which lifts are taken back to
    efd: int
    control_fd: int
    lifted: int = 0  # bytes above ``limit`` now
    stuck_since: float | None = None  # at the last step and still waiting since
    last_lift: float = field(default=0.0)
    relook: asyncio.TimerHandle | None = None


def step_for(limit: int) -> int:
    """One lift: enough for envd to run and kill (it needs a few MB), small next to
    the limit."""
    return max(32 * MIB, limit // 16)


def max_lift(limit: int) -> int:
    return max(64 * MIB, limit // 4)


class OomHold:
    """Per watched sandbox: two file descriptors and no work until its cgroup hits
    its limit."""

    # Still at the limit this long after the last lift: envd could not free memory.
    GIVE_UP_S = 10.0
    # Each of the sandbox's waiting threads signals an OOM: one lift per this long,
    # so that envd gets a turn at each step instead of all steps going at once.
    MIN_GAP_S = 0.2

    def __init__(self, on_pressure: Callable[[str], None],
                 on_give_up: Callable[[str], None]) -> None:
        self._on_pressure = on_pressure
        self._on_give_up = on_give_up
        self._held: dict[str, _Held] = {}
        self._arming: dict[str, object] = {}
        # Registering an event waits for an RCU grace period in the kernel: off the loop.
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="oom-hold")
        self.given_up: set[str] = set()

    def __len__(self) -> int:
        return len(self._held)

    def watch(self, sandbox_id: str, cgroup: Path, limit: int) -> bool:
        """Turn the kernel's OOM killer off for ``cgroup`` and listen for its OOM
        events; ``limit`` is the sandbox's own (a node restarted while a lift was on
        takes it back to that)."""
        self.unwatch(sandbox_id)
        fds = event_fds(cgroup, "memory.oom_control")
        if fds is None:
            return False
        efd, control_fd = fds
        held = _Held(cgroup, limit, efd, control_fd)
        token = object()
        self._arming[sandbox_id] = token
        fut = asyncio.get_running_loop().run_in_executor(self._threads, _arm, cgroup, efd,
                                                         control_fd)
        fut.add_done_callback(lambda f: self._armed(f, sandbox_id, token, held))
        return True

    def _armed(self, fut: asyncio.Future, sandbox_id: str, token: object, held: _Held) -> None:
        failed = fut.cancelled() or fut.exception() is not None
        if self._arming.get(sandbox_id) is token:
            del self._arming[sandbox_id]
            if not failed:
                with contextlib.suppress(RuntimeError):  # loop closing
                    asyncio.get_running_loop().add_reader(held.efd, self._oom, sandbox_id)
                    self._held[sandbox_id] = held
                    self._oom(sandbox_id)  # an OOM while arming, or a lift left by a crash
                    return
            else:
                log.warning("sandbox %s: cannot hold it at its memory limit (%s); the "
                            "host's OOM killer stays on for it", sandbox_id, fut.exception())
        os.close(held.efd)
        os.close(held.control_fd)

    def unwatch(self, sandbox_id: str) -> None:
        self._arming.pop(sandbox_id, None)
        held = self._held.pop(sandbox_id, None)
        if held is None:
            return
        if held.relook is not None:
            held.relook.cancel()
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().remove_reader(held.efd)
        os.close(held.efd)
        os.close(held.control_fd)

    def close(self) -> None:
        for sandbox_id in [*self._held, *self._arming]:
            self.unwatch(sandbox_id)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def own_limit(self, sandbox_id: str) -> int:
        """The sandbox's own limit (0 if not held): what a lift is on top of."""
        held = self._held.get(sandbox_id)
        return held.limit if held else 0

    def lifted_lately(self, sandbox_id: str) -> bool:
        """Held at its limit now, or until moments ago (a dying sandbox's memory is
        freed and its lift taken back before its exit is told)."""
        held = self._held.get(sandbox_id)
        return held is not None and (held.lifted > 0 or (
            held.last_lift > 0 and time.monotonic() - held.last_lift < 2 * self.GIVE_UP_S))

    def _oom(self, sandbox_id: str) -> None:
        held = self._held.get(sandbox_id)
        if held is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(held.efd)
        wait = held.last_lift + self.MIN_GAP_S - time.monotonic()
        if wait > 0:
            if held.relook is None:
                held.relook = asyncio.get_running_loop().call_later(wait, self._relook,
                                                                    sandbox_id, held)
            return
        if not under_oom(held.cgroup):
            self._settle(sandbox_id, held)
            return
        try:
            self._lift(sandbox_id, held)
        except Exception:
            log.exception("sandbox %s: lifting its memory limit failed", sandbox_id)

    def _relook(self, sandbox_id: str, held: _Held) -> None:
        held.relook = None
        self._oom(sandbox_id)

    def _lift(self, sandbox_id: str, held: _Held) -> None:
        room = max_lift(held.limit) - held.lifted
        if room <= 0:
            if held.stuck_since is None:
                held.stuck_since = time.monotonic()
            return
        held.lifted += min(step_for(held.limit), room)
        held.stuck_since = None
        held.last_lift = time.monotonic()
        _write_limit(held.cgroup, held.limit + held.lifted)
        log.warning("sandbox %s reached its %d MB host memory limit; held there, lifted by "
                    "%d MB while envd frees memory", sandbox_id, held.limit // MIB,
                    held.lifted // MIB)
        self._on_pressure(sandbox_id)

    def _settle(self, sandbox_id: str, held: _Held) -> None:
        """Not waiting (any more): put the limit back once usage is under it."""
        held.stuck_since = None
        if not held.lifted and _read_int(held.cgroup / "memory.limit_in_bytes") <= held.limit:
            return
        if working_set(held.cgroup) >= held.limit - step_for(held.limit) // 2:
            return  # still above (or just under): a put back would stop it again at once
        try:
            _write_limit(held.cgroup, held.limit)
        except OSError:
            return  # the kernel could not reclaim down to it yet: next look
        log.info("sandbox %s: memory back under its limit; the lift of %d MB taken back",
                 sandbox_id, held.lifted // MIB)
        held.lifted = 0

    def recheck(self) -> None:
        """The runtime's once-a-second look: put lifts back, lift again a sandbox
        still waiting (an event can come while the last lift was being written), and
        end one stuck at the last step."""
        now = time.monotonic()
        for sandbox_id, held in list(self._held.items()):
            if held.lifted or under_oom(held.cgroup):
                self._oom(sandbox_id)
            stuck = held.stuck_since
            if stuck is not None and now - stuck > self.GIVE_UP_S \
                    and sandbox_id not in self.given_up:
                log.warning("sandbox %s: still at its memory limit %.0f s after the last "
                            "lift of %d MB; ending it", sandbox_id, now - stuck,
                            held.lifted // MIB)
                self.given_up.add(sandbox_id)
                self._on_give_up(sandbox_id)


def _arm(cgroup: Path, efd: int, control_fd: int) -> None:
    (cgroup / "memory.oom_control").write_text("1")
    (cgroup / "cgroup.event_control").write_text(f"{efd} {control_fd}")


def under_oom(cgroup: Path) -> bool:
    with contextlib.suppress(OSError):
        for line in (cgroup / "memory.oom_control").read_text().splitlines():
            if line.startswith("under_oom "):
                return line.split()[1] == "1"
    return False


def _write_limit(cgroup: Path, limit: int) -> None:
    (cgroup / "memory.limit_in_bytes").write_text(str(limit))


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0
