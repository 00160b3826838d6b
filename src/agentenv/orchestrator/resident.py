"""Resident paused sandboxes: frozen in place, their memory and slot still held.

A two-tier pause freezes a sandbox and answers at once; its durable capture and
commit follow in the background. While it stays resident a resume is a thaw. This
module only keeps the books (who is resident, since when, whether the capture is
done) and decides whom to evict; resident_pauses.py acts on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass
class Resident:
    paused_at: float = field(default_factory=time.monotonic)
    # The pause snapshot this one replaces (deleted once this one is committed; kept
    # as the sandbox's snapshot should the capture never happen).
    previous_snapshot: str = ""
    capture: asyncio.Task | None = None
    # The capture is staged (its commit pending or done): evicting loses nothing.
    captured: bool = False
    # Seconds the capture waits first (a resume meanwhile cancels it), unless hurried.
    grace_s: float = 0.0
    hurry: asyncio.Event = field(default_factory=asyncio.Event)


class ResidentSet:
    def __init__(self, budget_bytes: int, idle_s: float) -> None:
        self.budget_bytes = budget_bytes
        self.idle_s = idle_s
        self.entries: dict[str, Resident] = {}

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, sandbox_id: str) -> Resident | None:
        return self.entries.get(sandbox_id)

    def add(self, sandbox_id: str, entry: Resident) -> None:
        self.entries[sandbox_id] = entry

    def pop(self, sandbox_id: str) -> Resident | None:
        return self.entries.pop(sandbox_id, None)

    def oldest(self) -> str | None:
        """The least recently paused sandbox, captured or not."""
        return min(self.entries, key=lambda sid: self.entries[sid].paused_at, default=None)

    def oldest_captured(self) -> str | None:
        """The least recently paused sandbox that can be evicted now."""
        done = [(e.paused_at, sid) for sid, e in self.entries.items() if e.captured]
        return min(done)[1] if done else None

    def to_evict(self, held_bytes: Callable[[str], int],
                 now: float | None = None) -> list[str]:
        """Those idle past ``idle_s``, then the least recently paused until the rest
        fit the budget; only captured ones (the others' state exists nowhere else)."""
        now = time.monotonic() if now is None else now
        order = sorted(self.entries.items(), key=lambda item: item[1].paused_at)
        out = [sid for sid, e in order if e.captured and now - e.paused_at >= self.idle_s]
        held = {sid: held_bytes(sid) for sid, _ in order if sid not in out}
        total = sum(held.values())
        for sid, e in order:
            if total <= self.budget_bytes:
                break
            if sid in held and e.captured:
                out.append(sid)
                total -= held[sid]
        return out


def default_budget_bytes() -> int:
    """A quarter of the host's memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 // 4
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30
