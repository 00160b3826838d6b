"""SlotPool: a warm pool of network slots with low/high watermarks.

* ``acquire`` takes a warm slot (no system call unless the internet switch must
  flip) or, when none is warm, builds one on the spot.
* ``release`` returns at once; the slot is reset (fresh sandbox netns and veth,
  conntrack flushed, policy reset) in the background and goes back to the pool
  while it holds fewer than ``high`` slots, otherwise it is destroyed.
* a background task keeps at least ``low`` slots warm, never on a caller's path.
* ``capacity`` bounds all slots that exist or are being built (acquired, warm,
  in flight).
* ``expect(n)`` announces a burst of ``n`` acquires (a fork): for a while the pool
  keeps up to ``n`` released slots warm, so the next burst of that size finds its
  slots built instead of building them beside its restores.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from . import nsutil
from .host import install_host_rules, leftovers, others_in_cidr, remove_host_rules
from .policy import CompiledPolicy, private_rules
from .slot import (
    Slot,
    SlotError,
    SlotLayout,
    apply_policy,
    create_slot,
    destroy_slot,
    egress_by_address,
    readdress_sandbox_side,
    reset_slot,
    set_egress,
)

log = logging.getLogger(__name__)
# How long the pool keeps a burst's worth of released slots warm after ``expect``.
BURST_HOLD_S = 600.0


class SlotPoolExhausted(RuntimeError):
    """Every slot the pool may hold is acquired."""


class SlotPoolClosed(RuntimeError):
    """The pool was closed or never started."""


class SlotPool:
    def __init__(self, prefix: str, pool_cidr: str, low: int, high: int, capacity: int,
                 private_open: tuple[str, ...] | None = None) -> None:
        """``private_open``: the private networks (policy.PRIVATE_NETS) sandboxes may
        reach without a policy saying so; None: no private network is refused (the
        node always gives its configured list, empty by default)."""
        if not 0 <= low <= high:
            raise ValueError("need 0 <= low <= high")
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.layout = SlotLayout(prefix, pool_cidr)
        if capacity > self.layout.max_index:
            raise ValueError(f"pool {pool_cidr} holds only {self.layout.max_index} slots")
        self.prefix = prefix
        self.pool_cidr = self.layout.pool_cidr
        self.low, self.high, self.capacity = low, high, capacity
        self.private = private_rules(private_open) if private_open is not None else None
        self._free: deque[Slot] = deque()
        self._acquired: dict[int, Slot] = {}
        self._busy: set[int] = set()  # indices under construction, reset or teardown
        self._pending = 0  # background jobs that will put a slot into _free
        self._direct = 0  # slots being built by acquire() itself
        self._burst, self._burst_until = 0, 0.0  # expect(): slots kept warm, until when
        self._changed: asyncio.Condition | None = None
        self._wake: asyncio.Event | None = None
        self._refiller: asyncio.Task[None] | None = None
        self._jobs: set[asyncio.Task[Any]] = set()
        self._open = False
        self._counts = {"created": 0, "recycled": 0, "destroyed": 0, "failures": 0}
        self._timings: dict[str, deque[float]] = {
            k: deque(maxlen=200)
            for k in ("create", "reset", "destroy", "set_internet", "apply_policy", "reuse")
        }

    # --- lifecycle ------------------------------------------------------------

    async def start(self, in_use: dict[int, bool] | None = None) -> None:
        """Install host rules, remove crash leftovers, adopt ``in_use`` slots, start refilling."""
        if self._open:
            return
        in_use = dict(in_use or {})
        others = await nsutil.run_in_thread(others_in_cidr, self.layout)
        if others:
            raise SlotError(f"net_pool_cidr {self.pool_cidr} is in use on this host "
                            f"({', '.join(others[:3])}): another node's pool or a host "
                            "network; give this node a net_pool_cidr of its own")
        await nsutil.run_in_thread(install_host_rules, self.prefix, self.pool_cidr)
        existing = await nsutil.run_in_thread(leftovers, self.layout)
        for index in sorted(existing - set(in_use)):
            log.info("network: removing leftover slot %s%d", self.prefix, index)
            await nsutil.run_in_thread(destroy_slot, self.layout.slot(index))
        for index, internet in sorted(in_use.items()):
            slot = self.layout.slot(index, internet)
            try:
                await nsutil.run_in_thread(set_egress, slot, internet)
            except Exception as exc:
                log.warning("network: adopted slot %d has no working router: %s", index, exc)
            self._acquired[index] = slot
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._open = True
        self._refiller = asyncio.create_task(self._refill_loop(), name=f"{self.prefix}-refill")
        self._wake.set()

    async def close(self) -> None:
        """Destroy every slot (warm and acquired) and remove the host rules."""
        if not self._open and self._refiller is None:
            return
        self._open = False
        if self._refiller is not None:
            # Not cancelled: it may be mid-build, and a built slot must be destroyed.
            self._kick()
            await asyncio.gather(self._refiller, return_exceptions=True)
            self._refiller = None
        while self._jobs:
            await asyncio.gather(*list(self._jobs), return_exceptions=True)
        slots = list(self._free) + list(self._acquired.values())
        self._free.clear()
        self._acquired.clear()
        for slot in slots:
            try:
                await nsutil.run_in_thread(destroy_slot, slot)
            except Exception:
                log.exception("network: destroying slot %d", slot.index)
        await nsutil.run_in_thread(remove_host_rules, self.prefix)
        await self._notify()

    # --- slots ----------------------------------------------------------------

    async def acquire(self, internet: bool = True) -> Slot:
        self._check_open()
        assert self._changed is not None
        while True:
            if self._free:
                slot = self._free.popleft()
                break
            if self._total() < self.capacity:
                slot = await self._build_direct(internet)
                break
            if self._pending:
                async with self._changed:
                    await self._changed.wait()
                self._check_open()
                continue
            raise SlotPoolExhausted(
                f"all {self.capacity} network slots of pool {self.prefix} are in use"
            )
        self._acquired[slot.index] = slot
        self._busy.discard(slot.index)  # a directly built slot's index was kept reserved
        self._kick()
        if slot.internet != internet:
            try:
                await self.set_internet(slot, internet)
            except BaseException:
                self._acquired.pop(slot.index, None)
                self._spawn(self._destroy_job(slot))
                raise
        return slot

    async def release(self, slot: Slot) -> None:
        """Hand ``slot`` back; it is reset or destroyed in the background."""
        # Only the holder's own Slot object releases it: a stale copy of an index
        # that has since been handed to someone else must not take it from them.
        if self._acquired.get(slot.index) is not slot:
            raise ValueError(f"slot {slot.index} is not held by this caller in pool {self.prefix}")
        del self._acquired[slot.index]
        self._busy.add(slot.index)
        if self._open and len(self._free) + self._pending < self._keep():
            self._pending += 1
            self._spawn(self._recycle_job(slot))
        else:
            self._spawn(self._destroy_job(slot))

    def expect(self, count: int, hold_s: float = BURST_HOLD_S) -> None:
        """A burst of ``count`` acquires begins: for ``hold_s`` up to ``count`` released
        slots are kept warm (reset, not destroyed) beyond ``high``; then trimmed back.
        Nothing is built for it: a burst's own slots are what the next one reuses."""
        self._burst = max(self._burst if self._burst_until > time.monotonic() else 0,
                          min(count, self.capacity))
        self._burst_until = time.monotonic() + hold_s
        self._kick()  # the refill loop trims once the hold ends

    def _keep(self) -> int:
        """How many slots the pool keeps warm at most now."""
        if self._burst_until > time.monotonic():
            return max(self.high, self._burst)
        return self.high

    async def reuse(self, slot: Slot) -> None:
        """Ready an acquired slot, whose sandbox is gone, for its holder's next sandbox
        (same addresses, same egress policy): a reset restores into the slot it had."""
        if self._acquired.get(slot.index) is not slot:
            raise ValueError(f"slot {slot.index} is not held by this caller in pool {self.prefix}")
        t0 = time.perf_counter()
        try:
            await nsutil.run_in_thread(readdress_sandbox_side, slot)
        except (OSError, NetlinkError) as exc:
            raise SlotError(f"readying slot {slot.index} again: {exc}") from exc
        self._timings["reuse"].append(time.perf_counter() - t0)

    async def set_internet(self, slot: Slot, allowed: bool) -> None:
        t0 = time.perf_counter()
        await nsutil.run_in_thread(set_egress, slot, allowed)
        self._timings["set_internet"].append(time.perf_counter() - t0)
        slot.internet = allowed
        held = self._acquired.get(slot.index)
        if held is not None:
            held.internet = allowed

    async def apply_policy(self, slot: Slot, compiled: CompiledPolicy) -> None:
        """Put an egress policy in force on an acquired slot (released slots lose it)."""
        t0 = time.perf_counter()
        await nsutil.run_in_thread(apply_policy, slot, self.pool_cidr, compiled, self.private)
        self._timings["apply_policy"].append(time.perf_counter() - t0)

    async def egress_by_address(self) -> Counter[str]:
        """Outbound TCP connections held open, per slot address (``slot.egress_by_address``)."""
        try:
            return await asyncio.to_thread(egress_by_address)
        except (OSError, NetlinkError) as exc:
            raise SlotError(f"reading the host's connections: {exc}") from exc

    def stats(self) -> dict[str, Any]:
        def pct(values: deque[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

        return {
            "prefix": self.prefix,
            "pool_cidr": self.pool_cidr,
            "open": self._open,
            "warm": len(self._free),
            "acquired": len(self._acquired),
            "in_flight": len(self._busy),
            "pending": self._pending,
            "low": self.low,
            "high": self.high,
            "capacity": self.capacity,
            **self._counts,
            "ms": {k: {"p50": pct(v, 0.5), "p90": pct(v, 0.9)} for k, v in self._timings.items()},
        }

    def held(self, index: int) -> Slot | None:
        """The Slot object of an acquired (or adopted) index."""
        return self._acquired.get(index)

    def acquired(self) -> dict[int, bool]:
        """index -> internet flag of acquired slots (what a restart passes to start)."""
        return {i: s.internet for i, s in self._acquired.items()}

    async def wait_warm(self, count: int | None = None) -> None:
        """Wait until at least ``count`` (default ``low``) slots are warm; add a timeout."""
        want = self.low if count is None else count
        assert self._changed is not None
        while len(self._free) < want:
            self._check_open()
            async with self._changed:
                await self._changed.wait()

    async def wait_change(self, seconds: float) -> None:
        """Wait (at most ``seconds``) until a slot is freed, built or destroyed."""
        self._check_open()
        assert self._changed is not None
        with contextlib.suppress(TimeoutError):
            async with self._changed:
                await asyncio.wait_for(self._changed.wait(), seconds)

    # --- internals ------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._open:
            raise SlotPoolClosed(f"slot pool {self.prefix} is not running")

    def _total(self) -> int:
        return len(self._acquired) + len(self._free) + self._pending + self._direct

    def _reserve_index(self) -> int:
        used = self._busy | set(self._acquired) | {s.index for s in self._free}
        for index in range(1, self.layout.max_index + 1):
            if index not in used:
                self._busy.add(index)
                return index
        raise SlotPoolExhausted(f"no free slot index in {self.pool_cidr}")

    async def _timed(self, kind: str, fn: Callable[..., Any], *args: Any) -> None:
        t0 = time.perf_counter()
        await nsutil.run_in_thread(fn, *args)
        self._timings[kind].append(time.perf_counter() - t0)

    async def _build_direct(self, internet: bool) -> Slot:
        index = self._reserve_index()
        self._direct += 1
        slot = self.layout.slot(index, internet)
        job = asyncio.ensure_future(self._timed("create", create_slot, slot, self.pool_cidr,
                                       self.private))

        def keep_or_drop() -> None:
            self._busy.discard(index)
            if self._open and len(self._free) < self._keep():
                self._free.append(slot)
            else:
                self._spawn(self._destroy_job(slot))
            self._spawn(self._notify())

        def settle(done: asyncio.Future[None]) -> None:
            if done.cancelled() or done.exception() is not None:
                self._direct -= 1
                self._busy.discard(index)
                self._counts["failures"] += 1
                return
            self._counts["created"] += 1
            if abandoned:  # the caller went away: keep the slot warm, or drop it
                self._direct -= 1
                keep_or_drop()
            # Else the slot stays counted (``_direct``) and its index reserved until
            # the caller resumes and `acquire` holds it: this callback runs first,
            # and in between another acquire once built past the capacity, or
            # reserved the index again and built over it (two slots, one netns).

        abandoned = False
        job.add_done_callback(settle)
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            abandoned = True
            if job.done() and not job.cancelled() and job.exception() is None:
                self._direct -= 1
                keep_or_drop()  # built, and settled before the cancellation came
            raise
        self._direct -= 1  # `acquire` holds it next, with no await in between
        return slot

    async def _refill_loop(self) -> None:
        assert self._wake is not None
        backoff = 0.0
        while self._open:
            hold = self._burst_until - time.monotonic() if self._burst else 0.0
            if self._burst and hold <= 0:
                self._burst = 0  # the hold ended: what is warm beyond ``high`` goes
                while len(self._free) > self.high:
                    self._spawn(self._destroy_job(self._free.pop()))
            wait = min((x for x in (backoff, hold) if x > 0), default=None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
            self._wake.clear()
            while (
                self._open
                and len(self._free) + self._pending < self.low
                and self._total() < self.capacity
            ):
                index = self._reserve_index()
                slot = self.layout.slot(index, True)
                self._pending += 1
                try:
                    await self._timed("create", create_slot, slot, self.pool_cidr,
                                       self.private)
                except Exception:
                    self._counts["failures"] += 1
                    log.exception("network: building warm slot %d", index)
                    self._pending -= 1
                    self._busy.discard(index)
                    await self._notify()
                    backoff = min(max(backoff * 2, 0.2), 5.0)
                    break  # retry after the backoff (or sooner, when kicked)
                backoff = 0.0
                self._counts["created"] += 1
                self._pending -= 1
                self._busy.discard(index)
                if self._open:
                    self._free.append(slot)
                else:
                    await nsutil.run_in_thread(destroy_slot, slot)
                await self._notify()

    async def _recycle_job(self, slot: Slot) -> None:
        try:
            await self._timed("reset", reset_slot, slot, True)
        except Exception:
            self._counts["failures"] += 1
            log.exception("network: resetting slot %d; destroying it", slot.index)
            self._pending -= 1
            await self._destroy_job(slot)
            self._kick()
            return
        self._counts["recycled"] += 1
        self._pending -= 1
        self._busy.discard(slot.index)
        if self._open:
            self._free.append(slot)
        else:
            await self._destroy_job(slot)
        await self._notify()

    async def _destroy_job(self, slot: Slot) -> None:
        self._busy.add(slot.index)
        try:
            await self._timed("destroy", destroy_slot, slot)
            self._counts["destroyed"] += 1
        except Exception:
            self._counts["failures"] += 1
            log.exception("network: destroying slot %d", slot.index)
        finally:
            self._busy.discard(slot.index)
        await self._notify()
        self._kick()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()
