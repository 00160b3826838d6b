"""The node's sandboxes by ID (``Sandbox`` objects, sandbox.py): the one map of what
each sandbox holds, read and changed on the event loop (``records`` is safe to copy
from a worker thread).

A sandbox removed while its runtime is still being freed or a pause of it is still
being committed is kept aside until that work ends: the node waits for it when it
stops, and a sandbox that comes back under the same ID (adopted again) waits for the
old runtime to be gone before it starts one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping

from .models import NotFound, SandboxRecord, SandboxState
from .sandbox import Sandbox


class _Records(Mapping[str, SandboxRecord]):
    """The records, by sandbox ID (a live view)."""

    def __init__(self, entries: dict[str, Sandbox]) -> None:
        self._entries = entries

    def __getitem__(self, sandbox_id: str) -> SandboxRecord:
        return self._entries[sandbox_id].record

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class SandboxTable:
    def __init__(self) -> None:
        self._entries: dict[str, Sandbox] = {}
        self._leaving: dict[str, Sandbox] = {}  # removed, their background work goes on
        self._claims: dict[str, asyncio.Lock] = {}  # IDs being added (adopt_paused)
        self.records: Mapping[str, SandboxRecord] = _Records(self._entries)

    # -- lookups ------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> Sandbox:
        """The sandbox, unless unknown or killed (NotFound)."""
        entry = self._entries.get(sandbox_id)
        if entry is None or entry.state is SandboxState.KILLED:
            raise NotFound(f"sandbox '{sandbox_id}' not found")
        return entry

    def find(self, sandbox_id: str) -> Sandbox | None:
        """The sandbox in whatever state, or None."""
        return self._entries.get(sandbox_id)

    def holds(self, record: SandboxRecord) -> Sandbox | None:
        """The sandbox ``record`` is the record of, if still in the table."""
        entry = self._entries.get(record.sandbox_id)
        return entry if entry is not None and entry.record is record else None

    def __iter__(self) -> Iterator[Sandbox]:
        """A copy: the loop may add or remove sandboxes meanwhile."""
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def in_state(self, *states: SandboxState) -> list[Sandbox]:
        return [e for e in self._entries.values() if e.state in states]

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """The lock of the sandbox's operations (a lock of its own for an unknown ID:
        whoever takes it then finds no sandbox)."""
        entry = self._entries.get(sandbox_id)
        if entry is not None:
            return entry.lock
        return self._claims.get(sandbox_id) or asyncio.Lock()

    def held(self, sandbox_id: str) -> bool:
        entry = self._entries.get(sandbox_id)
        return entry is not None and entry.held()

    # -- changes ------------------------------------------------------------------------

    def claim(self, sandbox_id: str) -> asyncio.Lock:
        """The lock of an ID about to be added: ``add`` hands it to the new sandbox."""
        entry = self._entries.get(sandbox_id)
        if entry is not None:
            return entry.lock
        return self._claims.setdefault(sandbox_id, asyncio.Lock())

    def unclaim(self, sandbox_id: str) -> None:
        lock = self._claims.get(sandbox_id)
        if lock is not None and not lock.locked():
            del self._claims[sandbox_id]

    def add(self, record: SandboxRecord) -> Sandbox:
        sandbox_id = record.sandbox_id
        lock = self._claims.pop(sandbox_id, None)
        entry = Sandbox(record, lock) if lock is not None else Sandbox(record)
        gone = self._leaving.get(sandbox_id)
        if gone is not None and gone.releasing_now():
            entry.releasing = gone.releasing
        self._entries[sandbox_id] = entry
        return entry

    def remove(self, entry: Sandbox) -> None:
        """Out of the table (if it is still the one under its ID)."""
        sandbox_id = entry.sandbox_id
        if self._entries.get(sandbox_id) is entry:
            del self._entries[sandbox_id]
        pending = [t for t in entry.background() if not t.done()]
        if not pending:
            return
        self._leaving[sandbox_id] = entry

        def done(_: asyncio.Future) -> None:
            if self._leaving.get(sandbox_id) is entry and \
                    not any(not t.done() for t in entry.background()):
                del self._leaving[sandbox_id]

        for task in pending:
            task.add_done_callback(done)

    def replace(self, records: list[SandboxRecord]) -> list[Sandbox]:
        """The table as a restart finds it: these records, nothing else."""
        self._entries.clear()
        return [self.add(r) for r in records]

    # -- background work ----------------------------------------------------------------

    def commits(self) -> list[asyncio.Task]:
        """Commits of pause snapshots still running (of sandboxes gone too)."""
        return [t for e in (*self._entries.values(), *self._leaving.values())
                for t in e.commits.values()]

    def releasing(self) -> list[asyncio.Task]:
        """Freeing of stopped runtimes still running (of sandboxes gone too)."""
        return [e.releasing for e in (*self._entries.values(), *self._leaving.values())
                if e.releasing is not None and not e.releasing.done()]
