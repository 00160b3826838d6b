"""Idle sandboxes frozen, thawed by the next request (issue 17).

A running sandbox nobody talks to is frozen in place (the runtime's ``freeze``: no CPU,
memory kept) once it has had no request in flight for ``idle_freeze_s`` seconds and
used at most ``idle_freeze_cpu_pct`` of a core over that time, so a sandbox whose own
processes work (a build, a training job, a busy server) is never frozen. Anything that
reaches the sandbox thaws it first, in well under a millisecond: the proxy (SDK
traffic to envd and to user ports holds it awake while the request or the stream
lasts), the node's own envd calls, and every runtime operation (pause, snapshot, fork,
kill). The record stays ``running``: clients see no difference but the CPU saved.

With more than ``crowd`` sandboxes awake the window is ``CROWDED_S`` instead: an idle
gVisor sandbox still costs 1-3 % of a core, and a sweep over hundreds of them would
keep them all awake for a whole window. Never shorter than ``early_s`` though: envd
goes dormant after ``envd_dormant_after_s`` idle (envd/dormancy.py), and a sandbox
frozen before that keeps its ~22 MiB envd for as long as it stays frozen.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from .. import metrics
from ..runtime import Runtime
from .models import SandboxRecord, SandboxState

log = logging.getLogger(__name__)
# Metadata with which a sandbox is never frozen: one whose processes wait on the
# outside at no CPU (an agent loop awaiting a model's answer, a job polling a queue).
OPT_OUT = "aenv.idle_freeze"
CROWDED_S = 1.0  # the quiet window while more than ``crowd`` sandboxes are awake


@dataclass
class _Watch:
    since: float  # when the current quiet window began (monotonic)
    cpu: float | None  # the sandbox's CPU seconds then


class IdleFreezer:
    def __init__(self, runtime: Runtime, idle_s: float, cpu_pct: float,
                 records: Callable[[], Mapping[str, SandboxRecord]],
                 busy: Callable[[str], bool], crowd: int = 0,
                 early_s: float = CROWDED_S) -> None:
        self.runtime = runtime
        self.idle_s = idle_s
        self.early_s = max(CROWDED_S, early_s)  # the crowded window
        self.crowd = crowd  # 0: no limit
        self.cpu_pct = cpu_pct
        self._by_id = records  # (the node replaces its mapping when it adopts records)
        # slot address -> the sandbox last found there: the node's own envd calls
        # (every create's wait and init) look a sandbox up by address
        self._at: dict[str, str] = {}
        self._busy = busy  # an operation holds the sandbox (its lock)
        self._in_flight: dict[str, int] = {}
        self._watch: dict[str, _Watch] = {}
        self._last_active: dict[str, float] = {}  # wall time of the last request

    @property
    def enabled(self) -> bool:
        return self.idle_s > 0

    def touch(self, sandbox_id: str) -> None:
        """Activity now: thawed if frozen, and a new quiet window begins."""
        self._last_active[sandbox_id] = time.time()
        t0 = time.perf_counter()
        if self.runtime.thaw(sandbox_id):
            metrics.THAW_SECONDS.observe(time.perf_counter() - t0)
        self._watch.pop(sandbox_id, None)

    @contextlib.contextmanager
    def _kept_thawed(self, sandbox_id: str) -> Iterator[None]:
        """Never frozen while the block runs."""
        self._in_flight[sandbox_id] = self._in_flight.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            left = self._in_flight.pop(sandbox_id) - 1
            if left > 0:
                self._in_flight[sandbox_id] = left

    @contextlib.contextmanager
    def awake(self, sandbox_id: str) -> Iterator[None]:
        """Thawed, and never frozen while the block runs (a request, a stream)."""
        with self._kept_thawed(sandbox_id):
            try:
                self.touch(sandbox_id)
                yield
            finally:
                self._watch.pop(sandbox_id, None)
                self._last_active[sandbox_id] = time.time()

    @contextlib.contextmanager
    def thawed(self, sandbox_id: str) -> Iterator[None]:
        """Thawed and never frozen while the block runs, but no activity: the node's
        own housekeeping (asking envd to sleep) leaves the sandbox as idle as it was."""
        with self._kept_thawed(sandbox_id):
            self.runtime.thaw(sandbox_id)
            yield

    def in_flight(self, sandbox_id: str) -> bool:
        return bool(self._in_flight.get(sandbox_id))

    def idle_for(self, sandbox_id: str, since: float) -> float:
        """Seconds since the sandbox's last request (or ``since``, when it had none)."""
        return time.time() - max(self._last_active.get(sandbox_id, 0.0), since)

    def awake_at(self, address: str) -> contextlib.AbstractContextManager[None]:
        """``awake`` for the running sandbox at a slot address (the node's envd client
        knows addresses); a sandbox still starting has nothing to thaw."""
        record = self._by_id().get(self._at.get(address, ""))
        if record is None or record.slot_address != address:
            # slots are reused: the cache is a hint, checked against the record
            record = next((r for r in self._by_id().values() if r.slot_address == address), None)
            if record is None:
                self._at.pop(address, None)
                return contextlib.nullcontext()
            self._at[address] = record.sandbox_id
        if record.state is not SandboxState.RUNNING:
            return contextlib.nullcontext()
        return self.awake(record.sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        self._watch.pop(sandbox_id, None)
        self._last_active.pop(sandbox_id, None)

    def due(self) -> list[str]:
        """The running sandboxes quiet for a whole window, at no more than
        ``cpu_pct`` of a core: each is then frozen (``freeze``) unless the caller
        finds it still at work another way (``working``: open outbound connections)."""
        if not self.enabled:
            return []
        now = time.monotonic()
        due: list[str] = []
        early: list[str] = []  # quiet for early_s, frozen early while crowded
        candidates = [r.sandbox_id for r in self._by_id().values()
                      if r.state is SandboxState.RUNNING and not r.error
                      and not r.metadata.get("aenv.build") and r.metadata.get(OPT_OUT) != "off"]
        frozen = {sid for sid in candidates if self.runtime.is_frozen(sid)}
        excess = len(candidates) - len(frozen) - self.crowd if self.crowd else 0
        for sid in candidates:
            if self._in_flight.get(sid) or self._busy(sid) or sid in frozen:
                # (an operation that thawed it, a snapshot say, holds its lock meanwhile)
                self._watch.pop(sid, None)
                continue
            watch = self._watch.get(sid)
            if watch is None or watch.cpu is None:
                self._watch[sid] = _Watch(now, self.runtime.cpu_seconds(sid))
                continue
            quiet = now - watch.since
            if quiet >= self.idle_s:
                if self._quiet(sid, watch, now):
                    due.append(sid)
            elif excess > 0 and quiet >= self.early_s:
                early.append(sid)
        # Past the crowd: the least recently active go first, down to the crowd.
        early.sort(key=lambda sid: self._last_active.get(sid, 0.0))
        for sid in early:
            if len(due) >= excess:
                break
            if self._quiet(sid, self._watch[sid], now):
                due.append(sid)
        for sid in set(self._watch) - set(candidates):
            del self._watch[sid]
        return due

    def _quiet(self, sandbox_id: str, watch: _Watch, now: float) -> bool:
        """Used at most ``cpu_pct`` of a core since its window began; if not (or no
        accounting), a new window begins."""
        cpu = self.runtime.cpu_seconds(sandbox_id)
        if cpu is not None and watch.cpu is not None and \
                (cpu - watch.cpu) / (now - watch.since) * 100 <= self.cpu_pct:
            return True
        self._watch[sandbox_id] = _Watch(now, cpu)
        return False

    def freeze(self, sandbox_id: str) -> bool:
        """Freeze a sandbox ``due`` named, unless a request or an operation reached it
        since (the caller may have waited on a check meanwhile)."""
        if sandbox_id not in self._watch or self._in_flight.get(sandbox_id) \
                or self._busy(sandbox_id):
            return False
        del self._watch[sandbox_id]
        if not self.runtime.freeze(sandbox_id):
            return False
        metrics.FREEZES.inc()
        return True

    def working(self, sandbox_id: str) -> None:
        """Still at work (a sandbox ``due`` named): a new quiet window begins."""
        self._watch[sandbox_id] = _Watch(time.monotonic(), self.runtime.cpu_seconds(sandbox_id))
