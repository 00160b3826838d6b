"""One sandbox as the node holds it: its record, the network slot and runtime it
holds, the lock its operations take, its background work (pause commits, the freeing
of a stopped runtime, a resume that traffic started), and the undo stack that gives
back what it holds.

The undo stack (``Cleanup``) gets a step for everything the sandbox comes to hold on
the node (its slot when it is handed one, its runtime once a launch hands it over)
and every way out runs it: a kill, a runtime that died, a pause or an eviction (in
the background), a reset that failed. Each step runs once, last in first out, and a
step that fails is logged without stopping the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..network import Slot
from .models import SandboxRecord, SandboxState

log = logging.getLogger(__name__)

RUNTIME = "runtime"


class Cleanup:
    """Undo steps, run last in first out, each once."""

    def __init__(self, sandbox_id: str) -> None:
        self._sandbox_id = sandbox_id
        self._steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []

    def push(self, name: str, step: Callable[[], Awaitable[None]]) -> None:
        self._steps.append((name, step))

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self._steps)

    def discard(self, name: str) -> None:
        """Drop a step without running it (its caller undoes that part itself)."""
        self._steps = [s for s in self._steps if s[0] != name]

    def __len__(self) -> int:
        return len(self._steps)

    async def run(self) -> None:
        """Every step, newest first; one that fails is logged and the rest still run.
        Steps pushed meanwhile run too; two callers never run the same step."""
        while self._steps:
            name, step = self._steps.pop()
            try:
                await step()
            except Exception:
                log.exception("undoing %s of %s failed", name, self._sandbox_id)


@dataclass(eq=False)
class Sandbox:
    record: SandboxRecord
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The network slot it holds now (a paused one's is handed back in the background).
    slot: Slot | None = None
    cleanup: Cleanup = field(init=False)
    # Commits of its pause snapshots still running in the background, by snapshot ID.
    commits: dict[str, asyncio.Task] = field(default_factory=dict)
    # The freeing of its stopped runtime (a pause, an eviction): whatever reuses the
    # ID waits for it.
    releasing: asyncio.Task | None = None
    # A resume that traffic started (auto-resume): requests meanwhile wait for it.
    auto_resume: asyncio.Task | None = None
    # Kills under way: from the first, the sandbox has no endpoint.
    killing: int = 0

    def __post_init__(self) -> None:
        self.cleanup = Cleanup(self.record.sandbox_id)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    @property
    def state(self) -> SandboxState:
        return self.record.state

    def held(self) -> bool:
        """Whether an operation holds it (its lock)."""
        return self.lock.locked()

    def hold(self, slot: Slot, give_back: Callable[[Slot], Awaitable[None]]) -> None:
        """It holds ``slot`` now; the undo stack hands it back (once, however often
        the same slot is handed to it again, as a reset in place does)."""
        self.slot = slot
        self.record.slot_index, self.record.slot_address = slot.index, slot.address
        name = f"slot {slot.index}"
        if self.cleanup.has(name):
            return

        async def release() -> None:
            if self.slot is slot:
                self.let_go_of_slot()
            await give_back(slot)

        self.cleanup.push(name, release)

    def let_go_of_slot(self) -> None:
        """No slot any more as far as the node's counts go; its undo step still hands
        the slot back (after the runtime in it is gone)."""
        self.slot = None
        self.record.slot_index, self.record.slot_address = 0, ""

    def runs(self, destroy: Callable[[str], Awaitable[None]]) -> None:
        """A runtime runs for it: the undo stack destroys it."""
        if not self.cleanup.has(RUNTIME):
            self.cleanup.push(RUNTIME, lambda: destroy(self.sandbox_id))

    def releasing_now(self) -> bool:
        return self.releasing is not None and not self.releasing.done()

    def release_in_background(self) -> asyncio.Task:
        """Run the undo stack as a task of its own (``settled`` waits for it)."""
        task = asyncio.create_task(self.cleanup.run())
        self.releasing = task
        return task

    async def settled(self) -> None:
        """Once its old runtime is gone (the ID can be reused)."""
        if self.releasing is not None:
            await asyncio.shield(self.releasing)

    def background(self) -> list[asyncio.Task]:
        return [*self.commits.values(), *([self.releasing] if self.releasing else [])]
