"""The snapshot store's garbage collection, run in the background after deletes and
every ``snapshot_gc_interval_s`` (lazily loaded images' indexes expire with time, not
with a delete: ``snapshot.image_objects``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from ..snapshot import SnapshotStore

log = logging.getLogger(__name__)
# A collection started by a delete waits at most this long for commits under way
# (the next delete tries again); it never holds a request.
GC_WAIT_S = 30.0


class SnapshotCollector:
    """The store's garbage collection, run in the background after deletes: one run at
    a time, and deletes during a run get one more run after it."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._wanted = False
        self._task: asyncio.Task | None = None
        self._timer: asyncio.Task | None = None

    def start(self, every_s: float) -> None:
        """Also run every ``every_s`` seconds (0: only after deletes); the first run a
        random part of that after the start, so that nodes started together spread out."""
        if every_s > 0 and self._timer is None:
            self._timer = asyncio.create_task(self._every(every_s), name="snapshot-gc-timer")

    async def _every(self, every_s: float) -> None:
        await asyncio.sleep(random.uniform(0.1, 1.0) * every_s)
        while True:
            self.request()
            await asyncio.sleep(every_s)

    def request(self) -> None:
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="snapshot-gc")

    async def _run(self) -> None:
        while self._wanted:
            self._wanted = False
            try:
                await asyncio.to_thread(self.store.gc, GC_WAIT_S)
            except Exception:  # the next delete tries again; chunks cost disk only
                log.exception("snapshot garbage collection failed")

    async def idle(self) -> None:
        """Wait for the runs requested so far (tests, shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.gather(self._task, return_exceptions=True)

    async def close(self) -> None:
        self._wanted = False
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
