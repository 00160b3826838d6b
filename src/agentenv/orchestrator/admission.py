"""Admission control: a create beyond the node's room waits its turn instead of failing.

A create asks ``Admission.admit(owner)`` before it makes a record. With room (the
node's sandboxes and network slots, the owner's concurrent-sandbox quota and its
creates-per-second bucket) and nobody waiting, it goes at once. Otherwise it waits in a
bounded queue: FIFO per owner (an API key's ID), owners served round-robin, so one
trainer's burst cannot starve another's single create. A waiter holds no record and no
slot, only its place; it is woken when something frees room (``wake``), and past
``timeout_s`` (or at once when ``max_waiting`` are already waiting) it gets
``TooManyRequests`` (429 with ``Retry-After``). A client that hangs up while waiting
(``gone``) just leaves the queue.

An admitted create holds a *reservation* until its record exists (``Ticket.release``),
so several admitted at once cannot overshoot the room they were counted against.

Every path that makes a sandbox run asks here, not only creates (issue 29): batches,
fork children, resumes (``connect`` and resume on traffic included), the reset of a
paused sandbox and a diff's temporary sandboxes. Those that do not boot anything new
at once (fork children, restored in parallel by design; a thaw in place) pass
``starting=False``: they count against the node's room and the owner's quotas but
not against the limit of sandboxes starting at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..metrics import REFUSALS
from .models import OrchestratorError

# How often a waiter asks whether its client is still there.
GONE_POLL_S = 1.0
# Admissions counted for the rate that Retry-After is estimated from.
_RATE_WINDOW_S = 10.0


class TooManyRequests(OrchestratorError):
    """A create that found no room within the queue time (or no place in the queue)."""

    status = 429

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))
        self.headers = {"Retry-After": str(self.retry_after)}


class ClientGone(OrchestratorError):
    """The client hung up while its create waited (nginx's 499: nobody reads it)."""

    status = 499


@dataclass(frozen=True)
class Quota:
    """One owner's limits; 0 is no limit."""

    max_sandboxes: int = 0
    creates_per_s: float = 0.0


@dataclass
class _Bucket:
    """A token bucket of ``rate`` creates per second, holding up to ``max(1, rate)``."""

    rate: float
    tokens: float = 0.0
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    @property
    def burst(self) -> float:
        return max(1.0, self.rate)

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, now: float) -> float:
        """Seconds until a token is there (0: one is)."""
        self.refill(now)
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate


@dataclass
class _Waiter:
    owner: str
    admitted: asyncio.Future[None]
    starting: bool = True


class Ticket:
    """An admitted create's reservation: released once its record exists (or it failed)."""

    def __init__(self, admission: Admission, owner: str) -> None:
        self._admission, self.owner, self._held = admission, owner, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._unreserve(self.owner)


class Admission:
    def __init__(self, *, timeout_s: float, max_waiting: int,
                 no_room: Callable[[int, bool], str | None],
                 owned: Callable[[str], int],
                 quotas: Callable[[str], Quota]) -> None:
        """``no_room(reserved, starting)``: why the node has no room for one more create
        with ``reserved`` creates admitted but not yet recorded (None: it has room;
        ``starting``: counting the limit of sandboxes starting at once).
        ``owned(owner)``: the owner's sandboxes holding resources. ``quotas(owner)``:
        its limits."""
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self._no_room = no_room
        self._owned = owned
        self._quotas = quotas
        # Waiters by owner, in arrival order; the dict's order is the round-robin turn.
        self._queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        self._waiting = 0
        self._reserved: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._admits: deque[float] = deque()
        self._timer: asyncio.TimerHandle | None = None
        # Since start: admitted at once, admitted after waiting, refused (429), gave up.
        self._counts = {"admitted": 0, "waited": 0, "refused": 0, "gone": 0}

    # -- what callers use ---------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self._waiting

    def stats(self) -> dict[str, int]:
        return {**self._counts, "waiting": self._waiting,
                "reserved": sum(self._reserved.values())}

    async def admit(self, owner: str = "",
                    gone: Callable[[], Awaitable[bool]] | None = None,
                    starting: bool = True) -> Ticket:
        """Wait for room (at most ``timeout_s``); the ticket must be released once the
        create's record exists (or the resumed sandbox runs). Raises TooManyRequests or
        ClientGone."""
        if not self._waiting and self._why_not(owner, starting) is None:
            self._counts["admitted"] += 1
            return self._grant(owner)
        if self._waiting >= self.max_waiting:
            self._counts["refused"] += 1
            REFUSALS.labels("queue_full").inc()
            raise TooManyRequests(
                f"{self._waiting} creates are already waiting for room on this node (the "
                f"most it queues); retry later", self._retry_after(owner))
        waiter = _Waiter(owner, asyncio.get_running_loop().create_future(), starting)
        self._queues.setdefault(owner, deque()).append(waiter)
        self._waiting += 1
        try:
            self._pump()
            await self._wait(waiter, gone)
        except BaseException as exc:
            refused = isinstance(exc, TooManyRequests)
            self._counts["refused" if refused else "gone"] += 1
            REFUSALS.labels("queue_timeout" if refused else "client_gone").inc()
            self._drop(waiter)
            if waiter.admitted.done() and not waiter.admitted.cancelled() and \
                    waiter.admitted.exception() is None:
                self._unreserve(owner)  # admitted as it gave up: hand the room on
            raise
        self._counts["waited"] += 1
        return Ticket(self, owner)

    def try_admit(self, owner: str = "", starting: bool = True) -> Ticket | None:
        """A ticket now, or None (no room, a quota, or others waiting): never queues."""
        if self._waiting or self._why_not(owner, starting) is not None:
            return None
        self._counts["admitted"] += 1
        return self._grant(owner)

    def refusal(self, owner: str = "", starting: bool = True) -> TooManyRequests:
        """The 429 for one that ``try_admit`` turned away."""
        self._counts["refused"] += 1
        REFUSALS.labels("no_room").inc()
        why = self._why_not(owner, starting) or "others are waiting for room"
        return TooManyRequests(f"no room for another sandbox now ({why}); retry after the "
                               "time in Retry-After", self._retry_after(owner))

    def wake(self) -> None:
        """Something freed room (a sandbox gone, paused or failed; a slot released)."""
        if self._waiting:
            self._pump()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for queue in self._queues.values():
            for waiter in queue:
                if not waiter.admitted.done():
                    waiter.admitted.set_exception(
                        TooManyRequests("the node is stopping; retry later", 5))
        self._queues.clear()
        self._waiting = 0

    # -- the queue ----------------------------------------------------------------------

    async def _wait(self, waiter: _Waiter, gone: Callable[[], Awaitable[bool]] | None) -> None:
        end = time.monotonic() + self.timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TooManyRequests(self._timeout_message(waiter.owner, waiter.starting),
                                      self._retry_after(waiter.owner))
            step = min(left, GONE_POLL_S) if gone is not None else left
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiter.admitted), step)
            if waiter.admitted.done():
                waiter.admitted.result()
                return
            if gone is not None and await gone():
                raise ClientGone("the client hung up while its create waited for room")

    def _timeout_message(self, owner: str, starting: bool = True) -> str:
        why = self._why_not(owner, starting) or "others were ahead in the queue"
        return (f"no room for a new sandbox within {self.timeout_s:g}s ({why}); "
                "retry after the time in Retry-After")

    def _why_not(self, owner: str, starting: bool = True) -> str | None:
        """Why a create of ``owner`` cannot go now (None: it can)."""
        why = self._no_room(sum(self._reserved.values()), starting)
        if why is not None:
            return why
        quota = self._quotas(owner)
        if quota.max_sandboxes and \
                self._owned(owner) + self._reserved.get(owner, 0) >= quota.max_sandboxes:
            return (f"this API key's quota of {quota.max_sandboxes} concurrent sandboxes "
                    "is in use")
        if quota.creates_per_s > 0 and self._bucket(owner, quota).wait_s(time.monotonic()) > 0:
            return f"this API key's quota of {quota.creates_per_s:g} creates per second"
        return None

    def _bucket(self, owner: str, quota: Quota) -> _Bucket:
        bucket = self._buckets.get(owner)
        if bucket is None or bucket.rate != quota.creates_per_s:
            bucket = self._buckets[owner] = _Bucket(quota.creates_per_s)
        return bucket

    def _grant(self, owner: str) -> Ticket:
        quota = self._quotas(owner)
        if quota.creates_per_s > 0:
            self._bucket(owner, quota).tokens -= 1.0
        self._reserved[owner] = self._reserved.get(owner, 0) + 1
        now = time.monotonic()
        self._admits.append(now)
        while self._admits and self._admits[0] < now - _RATE_WINDOW_S:
            self._admits.popleft()
        return Ticket(self, owner)

    def _unreserve(self, owner: str) -> None:
        left = self._reserved.get(owner, 0) - 1
        if left > 0:
            self._reserved[owner] = left
        else:
            self._reserved.pop(owner, None)
        self.wake()

    def _pump(self) -> None:
        """Admit waiters while there is room: one per owner per round, owners in turn."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        progress = True
        while progress and self._waiting:
            progress = False
            for owner in list(self._queues):
                queue = self._queues[owner]
                while queue and queue[0].admitted.done():  # gave up meanwhile
                    queue.popleft()
                    self._waiting -= 1
                if not queue:
                    del self._queues[owner]
                    continue
                if self._no_room(sum(self._reserved.values()), False) is not None:
                    return  # nothing frees by itself: wake() comes when room does
                if self._why_not(owner, queue[0].starting) is not None:
                    continue  # this owner's quota: the others go on
                waiter = queue.popleft()
                self._waiting -= 1
                self._queues.move_to_end(owner)  # its turn is over
                if not queue:
                    del self._queues[owner]
                self._grant(owner)
                waiter.admitted.set_result(None)
                progress = True
                break  # start the round again from the owner whose turn it is
        self._arm_rate_timer()

    def _arm_rate_timer(self) -> None:
        """Rate quotas free room with time alone: come back when the next token is due."""
        now = time.monotonic()
        due = [self._bucket(o, q).wait_s(now) for o in self._queues
               if (q := self._quotas(o)).creates_per_s > 0]
        due = [d for d in due if d > 0]
        if due:
            self._timer = asyncio.get_running_loop().call_later(min(due) + 0.001, self._pump)

    def _drop(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.owner)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._waiting -= 1
            if not queue:
                del self._queues[waiter.owner]

    def _retry_after(self, owner: str) -> int:
        """Seconds after which a retry may find room: the wait of the rate quota, else the
        queue ahead drained at the recent admission rate (bounded to 1..60)."""
        quota = self._quotas(owner)
        if quota.creates_per_s > 0:
            wait = self._bucket(owner, quota).wait_s(time.monotonic())
            if wait > 0 and self._no_room(0, True) is None:
                return math.ceil(wait)
        now = time.monotonic()
        recent = [t for t in self._admits if t >= now - _RATE_WINDOW_S]
        if not recent:
            return 5
        rate = len(recent) / _RATE_WINDOW_S
        return min(60, max(1, math.ceil((self._waiting + 1) / rate)))
