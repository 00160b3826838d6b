"""One launch path: every way a sandbox comes to life is a ``LaunchPlan`` handed to the
``Launcher``.

A boot, the restore of a pause, a template image being built, a warm-pool member, a
fork child and a create from a snapshot differ only in their plan: boot or restore
(``image``), whether envd is initialised now (``init``), whether the template's start
command runs (``start_command``). The steps are always the same:

    rootfs -> slot -> egress -> spec -> start | restore -> envd ready -> init -> files
    -> start command

A reset launches into the slot its sandbox already holds (``slot``: the caller
keeps it). Every step that holds something pushes its undo onto one rollback stack.
Should any later step fail, or the launch be cancelled, the stack unwinds in reverse
order (shielded from a second cancellation) and nothing the launch took stays held.
On success the caller owns the slot and the running sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..network import CompiledPolicy, EgressPolicy, Slot, SlotPoolExhausted, compile_policy
from ..runtime import Runtime, RuntimeFailure, SandboxSpec
from ..templates import Template
from . import disk_pause
from .envd_client import EnvdClient, EnvdUnavailable
from .models import CapacityExceeded, OrchestratorError

log = logging.getLogger(__name__)
# Residents one launch evicts at most to find a free slot (others may take what it frees).
MAX_EVICTIONS = 8


@dataclass(frozen=True)
class EnvdInit:
    """What envd is told once it answers: its access token, env vars and defaults."""

    token: str
    env_vars: Mapping[str, str] = field(default_factory=dict)
    default_user: str = "user"
    default_workdir: str = ""
    # The token envd already holds (a restored image's): it authorises the rotation.
    current_token: str = ""
    # A new boot's ID (a create); empty for a fork or a resume, which continue theirs.
    boot_id: str = ""
    # envd's file operations: "root" (E2B's) or "user" (strict); empty: envd's own.
    file_access: str = ""


@dataclass(frozen=True)
class LaunchPlan:
    sandbox_id: str
    template: Template
    cpu_count: int
    memory_mb: int
    # Whose hostname the sandbox has: a restore must keep the one it was captured with.
    hostname_of: str
    # A checkpoint to restore; None boots the template's rootfs.
    image: Path | None = None
    internet: bool = True
    # The egress policy as its JSON form ({}: only ``internet`` decides).
    network: Mapping = field(default_factory=dict)
    # None leaves envd as it is (a warm-pool member is initialised when handed out).
    init: EnvdInit | None = None
    # A filesystem-only capture (disk_pause) to bring the booted sandbox's files to,
    # before the start command runs.
    files: Path | None = None
    # Run the template's start command and wait for its ready check (boots only).
    start_command: bool = False
    # What the launch is for, as errors and logs name it ("resume"); by default
    # "start" or "restore".
    purpose: str = ""
    # A slot the caller holds and keeps, whose sandbox is gone and which the caller
    # readied again (a reset: SlotPool.reuse): launched into as it is, egress policy
    # and all, instead of a slot from the pool.
    slot: Slot | None = None
    # Called once the runtime has started or restored (the record's ``booted_at``).
    on_started: Callable[[], None] | None = None

    @property
    def verb(self) -> str:
        return self.purpose or ("restore" if self.image is not None else "start")


class SlotSource(Protocol):
    """The part of the slot pool a launch uses."""

    async def acquire(self, internet: bool = True) -> Slot: ...

    async def release(self, slot: Slot) -> None: ...

    async def apply_policy(self, slot: Slot, compiled: CompiledPolicy) -> None: ...

    async def wait_change(self, seconds: float) -> None: ...


SpecBuilder = Callable[[LaunchPlan, str], SandboxSpec]


class Launcher:
    def __init__(self, runtime: Runtime, slots: SlotSource, envd: EnvdClient,
                 spec: SpecBuilder, ensure_rootfs: Callable[[Template], Awaitable[None]],
                 egress_refresh_s: float = 60.0,
                 make_room: Callable[[], Awaitable[bool]] | None = None,
                 slot_wait_s: float = 0.0) -> None:
        self.runtime = runtime
        self.slots = slots
        self.envd = envd
        self.spec = spec
        self.ensure_rootfs = ensure_rootfs
        self.egress_refresh_s = egress_refresh_s
        # Frees a slot held by something idle (a resident paused sandbox); True if it did.
        self.make_room = make_room
        # How long a launch waits for a slot held outside the records admission counts
        # (a template's boot image being captured, a slot still being reset).
        self.slot_wait_s = slot_wait_s

    async def launch(self, plan: LaunchPlan) -> Slot:
        """Bring the plan's sandbox up; return the slot it runs in (now the caller's).

        Raises CapacityExceeded when no slot is free, OrchestratorError("sandbox
        failed to start|restore: ...") when the runtime or envd failed, and whatever
        else a step raised; in every case nothing the launch took is still held.
        """
        t0 = time.perf_counter()
        marks: list[tuple[str, float]] = []
        async with contextlib.AsyncExitStack() as undo:
            try:
                await self.ensure_rootfs(plan.template)
                if plan.slot is not None:  # the caller's, readied, and it stays theirs
                    slot = plan.slot
                else:
                    slot = await self._acquire(plan.internet)
                    undo.push_async_callback(_shielded, self.slots.release, slot)
                    await self.apply_egress(plan.sandbox_id, slot, plan.network, plan.internet)
                marks.append(("slot", time.perf_counter()))
                spec = self.spec(plan, slot.netns_path)
                # From here the engine may hold something even if start/restore fails.
                undo.push_async_callback(_shielded, self.runtime.destroy, plan.sandbox_id)
                if plan.image is not None:
                    await self.runtime.restore(spec, plan.image)
                else:
                    await self.runtime.start(spec)
                marks.append((plan.verb, time.perf_counter()))
                if plan.on_started is not None:
                    plan.on_started()
                await self.envd.wait_ready(
                    slot.address, progress=functools.partial(self.runtime.cpu_seconds,
                                                             plan.sandbox_id))
                marks.append(("envd", time.perf_counter()))
                if plan.init is not None:
                    await self._init(slot.address, plan.init)
                if plan.files is not None:
                    await disk_pause.restore(self.envd, slot.address,
                                             plan.init.token if plan.init else "", plan.files)
                    marks.append(("files", time.perf_counter()))
                if plan.start_command:
                    await self.run_start_command(plan.template, slot.address,
                                                 plan.init.token if plan.init else "")
                marks.append(("init", time.perf_counter()))
            except BaseException as exc:
                log.warning("%s of %s failed: %s", plan.verb, plan.sandbox_id, exc)
                if isinstance(exc, RuntimeFailure | EnvdUnavailable):
                    raise OrchestratorError(f"sandbox failed to {plan.verb}: {exc}") from exc
                raise
            undo.pop_all()  # success: the caller holds the slot and the sandbox now
        log.debug("%s of %s: %s", plan.verb, plan.sandbox_id, _timings(t0, marks))
        return slot

    async def _init(self, address: str, init: EnvdInit) -> None:
        await self.envd.init(address, init.token, dict(init.env_vars),
                             default_user=init.default_user or "user",
                             default_workdir=init.default_workdir,
                             current_token=init.current_token or None,
                             boot_id=init.boot_id, file_access=init.file_access)

    async def run_start_command(self, template: Template, address: str, token: str) -> None:
        """The template's start command, then its ready check until it passes."""
        if template.start_cmd:
            await self.envd.start(address, token, template.start_cmd)
        if not template.ready_cmd:
            return
        end = time.monotonic() + template.ready_timeout_s
        delay = 0.05
        while True:
            if await self.envd.run(address, token, template.ready_cmd, deadline_s=10) == 0:
                return
            if time.monotonic() > end:
                raise EnvdUnavailable(
                    f"template {template.template_id}: ready check did not pass within "
                    f"{template.ready_timeout_s:.0f}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _acquire(self, internet: bool) -> Slot:
        try:
            return await self.slots.acquire(internet=internet)
        except SlotPoolExhausted as exc:
            # Launches at once may evict the same resident, or one take the slot
            # another freed: each goes on evicting while that frees anything.
            for _ in range(MAX_EVICTIONS):
                if self.make_room is None or not await self.make_room():
                    break
                try:
                    return await self.slots.acquire(internet=internet)
                except SlotPoolExhausted:
                    continue
            end = time.monotonic() + self.slot_wait_s
            while (left := end - time.monotonic()) > 0:
                await self.slots.wait_change(left)
                try:
                    return await self.slots.acquire(internet=internet)
                except SlotPoolExhausted:
                    continue
            raise CapacityExceeded(f"no network slot free: {exc}") from exc

    async def apply_egress(self, sandbox_id: str, slot: Slot, network: Mapping, internet: bool,
                           force: bool = False) -> None:
        """Put an egress policy in force on a slot (a no-op for an open one unless
        ``force``: a fresh slot has no policy). Internet off is applied too: a pooled
        slot was built with it on."""
        if not network and internet and not force:
            return
        policy = EgressPolicy.from_json(dict(network))
        if not internet and policy.is_open:
            policy = EgressPolicy(deny_out=("0.0.0.0/0",))
        compiled = await asyncio.to_thread(compile_policy, policy)
        if compiled.unresolved:
            log.warning("sandbox %s: allowOut names that did not resolve (retried every %.0fs): "
                        "%s", sandbox_id, self.egress_refresh_s, ", ".join(compiled.unresolved))
        await self.slots.apply_policy(slot, compiled)


async def _shielded(undo: Callable[..., Awaitable[object]], *args: object) -> None:
    """One rollback step: it runs to its end even if the launch is being cancelled, and
    its own failure is logged, not raised over the launch's error."""
    try:
        await asyncio.shield(undo(*args))
    except Exception:
        log.exception("rollback step %s%r failed", getattr(undo, "__name__", undo), args)


def _timings(t0: float, marks: list[tuple[str, float]]) -> str:
    out, last = [], t0
    for name, t in marks:
        out.append(f"{name} {(t - last) * 1000:.0f} ms")
        last = t
    return ", ".join(out)
