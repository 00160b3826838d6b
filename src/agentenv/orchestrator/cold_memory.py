"""Frozen sandboxes' memory moved out of RAM, so an idle sandbox keeps its envd awake.

Issue 27's trade: an idle sandbox either kept envd awake (~36 MiB, next command
~40-60 ms) or put it to sleep (~14 MiB, next command 0.3-0.7 s for envd's start,
seconds under load). Here neither: once a sandbox has stayed frozen (idling.py) for
``cold_memory_after_s`` (60 s), or for a second while the host is short of memory
(below the idle-memory watermark, ``envd_dormancy_mb``), the runtime moves its memory
to the host's compressed swap (runtime/reclaim.py, runtime/swap.py). envd never
stops; the next command thaws the sandbox and faults back only the pages it touches.

Why not always at once: each reclaim compresses what the last step touched (~50-100
ms of CPU), so with memory plentiful a short think gap costs CPU for RAM nobody
needs; past the watermark it is far cheaper than the alternatives (an envd wake ~1
CPU-s; a pause to disk and its restore).

One reclaim at a time, in one thread: each costs CPU in the kernel's compressor
(~3 ms a MiB), and a burst of sandboxes going quiet together must not take both cores
from the ones at work. Most idle first.

How it grows with the number of sandboxes N: per idle sandbox ~2-3 MiB resident plus
its compressed pages (~1/4 of what it held), linear in N; no CPU while idle; each
step after a reclaim pays the fault-back of its working set (~10 MiB, a few ms) and,
once idle again, the compression of what it touched (~30 ms of one core).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable

from .. import metrics
from ..runtime import Runtime
from ..runtime.reclaim import quiet_thread
from ..runtime.swap import active_swaps

log = logging.getLogger(__name__)

MAX_QUEUED = 4  # reclaims handed to the thread at once; the rest wait for the next tick
RETRY_ABOVE = 8 << 20  # a reclaim that left more resident is tried again, after the delay
MAX_TRIES = 3  # per freeze
SHORT_AFTER_S = 1.0  # the delay while the host is short of memory


class ColdMemory:
    """Each ``tend`` (the node's quick loop): queue the reclaims that are due."""

    def __init__(self, runtime: Runtime, after_s: float,
                 running: Callable[[], Iterable[str]],
                 short: Callable[[], bool] = lambda: False,
                 busy: Callable[[str], bool] = lambda sid: False) -> None:
        self.runtime = runtime
        self.after_s = after_s  # <= 0: never
        self._running = running  # IDs of the sandboxes that may be frozen
        self._short = short  # the host is short of memory: the delay is SHORT_AFTER_S
        self._busy = busy  # an operation holds the sandbox (a pause capturing it, say)
        self._frozen_since: dict[str, float] = {}
        self._cold: set[str] = set()  # reclaimed, frozen ever since
        self._queued: set[str] = set()
        self._tries: dict[str, int] = {}  # reclaims of this freeze that left much behind
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._swap_seen = (-1e9, False)

    @property
    def enabled(self) -> bool:
        return self.after_s > 0

    @property
    def has_swap(self) -> bool:
        """Whether the host has a swap to move memory to (looked at once a minute)."""
        now = time.monotonic()
        if now - self._swap_seen[0] > 60:
            self._swap_seen = (now, bool(active_swaps()))
        return self._swap_seen[1]

    def is_cold(self, sandbox_id: str) -> bool:
        return sandbox_id in self._cold

    def frozen(self, sandbox_id: str) -> None:
        """The idle freezer froze it just now: its delay starts, whatever an earlier
        freeze's reclaim did (a thaw and a new freeze can fall between two looks)."""
        self._frozen_since[sandbox_id] = time.monotonic()
        self._cold.discard(sandbox_id)
        self._tries.pop(sandbox_id, None)

    def tend(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        after = min(self.after_s, SHORT_AFTER_S) if self._short() else self.after_s
        frozen = {sid for sid in self._running() if self.runtime.is_frozen(sid)}
        for sid in set(self._frozen_since) - frozen:  # thawed (or gone) since last look
            del self._frozen_since[sid]
            self._cold.discard(sid)
            self._tries.pop(sid, None)
        for sid in frozen:
            self._frozen_since.setdefault(sid, now)
        due = sorted((since, sid) for sid, since in self._frozen_since.items()
                     if sid not in self._cold and sid not in self._queued
                     and now - since >= after and not self._busy(sid))
        room = MAX_QUEUED - len(self._queued)
        for _since, sid in due[:max(0, room)]:
            self._start(sid)

    def _start(self, sandbox_id: str) -> None:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="reclaim", initializer=quiet_thread)
        self._queued.add(sandbox_id)
        future = asyncio.get_running_loop().run_in_executor(
            self._thread, self.runtime.reclaim, sandbox_id)
        future.add_done_callback(lambda f: self._done(sandbox_id, f))

    def _done(self, sandbox_id: str, future: asyncio.Future[tuple[int, int]]) -> None:
        self._queued.discard(sandbox_id)
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            log.warning("sandbox %s: reclaiming its memory failed: %s", sandbox_id, exc)
            return
        moved, left = future.result()
        if moved:
            metrics.RECLAIMS.inc()
            metrics.RECLAIMED_BYTES.inc(moved)
        if sandbox_id not in self._frozen_since:  # thawed meanwhile (seen by a look)
            return
        tries = self._tries.get(sandbox_id, 0) + 1
        if left > RETRY_ABOVE and tries < MAX_TRIES:
            # The kernel left pages it found referenced (a freeze just done, pages
            # touched last): a later reclaim of the still frozen sandbox takes them.
            self._tries[sandbox_id] = tries
            self._frozen_since[sandbox_id] = time.monotonic()
            return
        self._tries.pop(sandbox_id, None)
        self._cold.add(sandbox_id)

    def forget(self, sandbox_id: str) -> None:
        self._frozen_since.pop(sandbox_id, None)
        self._cold.discard(sandbox_id)
        self._tries.pop(sandbox_id, None)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
