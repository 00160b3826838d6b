"""New sandboxes from a captured state (the service ``Forks``): fork children, and
creates from a snapshot.

A fork stops its source only while its state is captured; each child is then
restored from that capture into a slot of its own, with its own ID and envd token,
continuing the source's memory, processes and files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..metrics import LIFECYCLE
from ..network import SlotPool
from ..runtime import Runtime
from ..snapshot import Manifest, SnapshotError, SnapshotStore
from ..templates import Template
from . import disk_pause
from .admission import Admission, Ticket, TooManyRequests
from .envd_client import EnvdClient, EnvdUnavailable
from .idling import IdleFreezer
from .lifecycle import Lifecycle
from .lineage import fork_origin
from .models import (
    Conflict,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    new_sandbox_id,
)
from .plans import Plans
from .records import Resources, new_record
from .requests import CreateRequest, check_fork_count
from .runbook import RunBook
from .specs import SpecFactory

log = logging.getLogger(__name__)


async def as_they_come(starts: list[asyncio.Task[SandboxRecord]], failed: str
                       ) -> AsyncIterator[SandboxRecord | OrchestratorError]:
    """Each sandbox as its start ends: its record, or the error that stopped it."""
    for start in asyncio.as_completed(starts):
        try:
            yield await start
        except OrchestratorError as exc:
            yield exc
        except Exception as exc:
            yield OrchestratorError(f"{failed}: {exc}")


@dataclass(eq=False, repr=False)
class Forks:
    config: Config
    runtime: Runtime
    slots: SlotPool
    envd: EnvdClient
    snapshots: SnapshotStore
    specs: SpecFactory
    admission: Admission
    freezer: IdleFreezer
    runbook: RunBook
    life: Lifecycle
    plans: Plans
    admit: Callable[[CreateRequest], Awaitable[Ticket]]  # a create's turn for room (Room.admit)

    async def fork(self, sandbox_id: str, count: int, ttl: int | None = None,
                   owner: str | None = None) -> list[SandboxRecord | OrchestratorError]:
        """Branch a running sandbox into ``count`` children that continue its exact state.

        One result per child, in the order they came up: its record, or the error
        that stopped it (``fork_each`` hands each over as soon as it is up).
        """
        return [result async for result in self.fork_each(sandbox_id, count, ttl, owner)]

    async def fork_each(self, sandbox_id: str, count: int, ttl: int | None = None,
                        owner: str | None = None
                        ) -> AsyncIterator[SandboxRecord | OrchestratorError]:
        """The children of a fork as each comes up (a record, or the error that
        stopped it). The source is stopped only while its state is captured, then
        keeps its ID, state and TTL; the children are restored from that one capture
        at once, each into a slot of its own.

        Errors of the fork as a whole (no such sandbox, not running, bad count) are
        raised before the first child. Children are tasks of their own: one the
        caller stops waiting for still comes up (its TTL bounds it), and the capture
        is removed once every child is done with it.

        Children are admitted as creates are (admission.py), against the node's room
        and the quotas of ``owner`` (the caller; default the source's owner), before
        the source is touched: the first waits its turn (a 429 for the whole fork if
        it finds none), the others go only if there is room now, else are 429 results.
        """
        check_fork_count(count)
        seconds = self.plans.timeout(ttl)
        owner = self.life.get(sandbox_id).owner if owner is None else owner
        tickets, refused = await self._admit_children(owner, count)
        image = self.config.run_dir / "images" / f"fork-{new_sandbox_id()}"
        started = time.perf_counter()
        # Its children's slots are kept warm when released: a next fork reuses them
        # instead of building netns beside its restores (0.5-0.9 s a child at 16).
        self.slots.expect(len(tickets))
        try:
            source = await self._capture_for_fork(sandbox_id, image)
        except BaseException:
            for ticket in tickets:
                ticket.release()
            await asyncio.to_thread(shutil.rmtree, image, True)
            raise
        children = [asyncio.create_task(self._fork_child(source, image, seconds, owner, t))
                    for t in tickets]
        for error in refused:
            yield error
        cleanup = self.life.spawn(self._remove_when_done(children, image, started))
        async for result in as_they_come(children, "child failed to start"):
            yield result
        await asyncio.shield(cleanup)  # every child is up: the capture is gone on return

    async def _admit_children(self, owner: str, count: int
                              ) -> tuple[list[Ticket], list[TooManyRequests]]:
        first = await self.admission.admit(owner, starting=False)  # raises the fork's 429
        tickets, refused = [first], []
        for _ in range(count - 1):
            ticket = self.admission.try_admit(owner, starting=False)
            if ticket is None:
                refused.append(self.admission.refusal(owner, starting=False))
            else:
                tickets.append(ticket)
        return tickets, refused

    async def _wake_envd(self, source: SandboxRecord) -> None:
        """A dormant envd is woken before a fork's capture: every child restored from a
        capture of the stub runs envd's whole start again on its first request, about
        1 CPU-second inside gVisor each, against 0.2-0.3 for a child of an awake envd
        (bench/results/lifecycle_cpu.md); waking it here costs that once per fork."""
        if not self.runtime.envd_dormant(source.sandbox_id):
            return
        with self.freezer.awake(source.sandbox_id), contextlib.suppress(EnvdUnavailable):
            await self.envd.wait_ready(source.slot_address)

    async def _capture_for_fork(self, sandbox_id: str, image: Path) -> SandboxRecord:
        async with self.life.lock(sandbox_id):
            source = self.life.get(sandbox_id)
            if source.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox '{sandbox_id}' is {source.state}; only a running "
                               "sandbox can be forked")
            await self._wake_envd(source)
            await self.life.before_capture(sandbox_id)
            t0 = time.perf_counter()
            await self.runtime.checkpoint(sandbox_id, image, leave_running=True)
            paused_ms = (time.perf_counter() - t0) * 1000
        log.info("fork of %s: source stopped %.0f ms for the capture", sandbox_id, paused_ms)
        return source

    @staticmethod
    async def _remove_when_done(children: list[asyncio.Task[SandboxRecord]],
                                image: Path, started: float) -> None:
        try:
            results = await asyncio.gather(*children, return_exceptions=True)
            failed = any(isinstance(r, BaseException) for r in results)
            # The fork as a whole: from its call until the last child is up.
            LIFECYCLE.labels("fork", "error" if failed else "ok").observe(
                time.perf_counter() - started)
        finally:  # a node stopping cancels this; a crash leaves it to reconcile
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, image, True))

    async def _fork_child(self, source: SandboxRecord, image: Path, ttl: int, owner: str,
                          ticket: Ticket) -> SandboxRecord:
        try:
            record = self._child_record(source, ttl, owner)
        finally:
            ticket.release()
        return await self.life.as_task(record, self._restore_new(
            record, image, source_token=source.envd_token, hostname_of=source.sandbox_id))

    def _child_record(self, source: SandboxRecord, ttl: int, owner: str) -> SandboxRecord:
        record = new_record(
            node_id=self.config.node_id, template_id=source.template_id, alias=source.alias,
            resources=Resources(source.cpu_count, source.memory_mb, source.disk_size_mb),
            ttl=ttl, auto_pause=source.auto_pause, auto_pause_memory=source.auto_pause_memory,
            internet=source.internet,
            network=source.network, private_ports=bool(source.traffic_token),
            metadata=source.metadata, env_vars=source.env_vars,
            auto_resume=source.auto_resume, resume_timeout=ttl,
            mask_request_host=source.mask_request_host, owner=owner,
            # Children belong to their source's run while it goes on (they end with it).
            run_id=source.run_id if self.runbook.joinable(source.run_id) else "",
            origin=fork_origin(source))
        self.life.add(record)
        return record

    async def create_from_snapshot(self, req: CreateRequest, manifest: Manifest, ttl: int,
                                    template: Template | None = None) -> SandboxRecord:
        """A sandbox restored from a snapshot; ``template`` when that snapshot is a
        built template's (the sandbox is then of that template, with its env vars)."""
        meta = manifest.metadata
        self.specs.check_restorable(meta)
        self.runbook.check_joinable(req.run_id)
        try:
            image = await asyncio.to_thread(self.snapshots.materialize, manifest.snapshot_id)
        except SnapshotError as exc:
            raise OrchestratorError(f"snapshot repository: {exc}") from exc
        ticket = await self.admit(req)
        try:
            record = self._snapshot_record(req, meta, ttl, template, manifest.snapshot_id)
        finally:
            ticket.release()
        return await self.life.as_task(record, self._restore_new(
            record, image, source_token=meta["envd_token"],
            hostname_of=meta.get("source_sandbox_id", record.sandbox_id), new_boot=True,
            template=template))

    def _snapshot_record(self, req: CreateRequest, meta: dict, ttl: int,
                         template: Template | None, snapshot_id: str) -> SandboxRecord:
        record = new_record(
            node_id=self.config.node_id,
            template_id=template.template_id if template else meta["template_id"],
            alias=template.alias if template else meta.get("alias") or meta["template_id"],
            resources=self.plans.resources(meta.get("cpu_count"), meta.get("memory_mb"),
                                      meta.get("disk_size_mb")),
            ttl=ttl, auto_pause=req.auto_pause, auto_pause_memory=req.auto_pause_memory,
            internet=req.internet, network=req.network.to_json() if req.network else {},
            private_ports=not req.public_traffic,
            # A template build's sandbox metadata is not the template's sandboxes'.
            metadata={**({} if template else meta.get("metadata", {})), **req.metadata},
            env_vars={**meta.get("env_vars", {}), **dict(template.envs if template else ()),
                      **req.env_vars}, **req.ingress(ttl), **req.stamps(),
            # A built template's snapshot is the template's own: its sandboxes are of it.
            origin=f"template:{template.template_id}" if template
            else f"snapshot:{snapshot_id}")
        self.life.add(record)
        return record

    async def _restore_new(self, record: SandboxRecord, image: Path, source_token: str,
                           hostname_of: str, new_boot: bool = False,
                           template: Template | None = None) -> SandboxRecord:
        """Bring a new record up from a capture, rotating envd's token to its own; a
        create (``new_boot``) gets a boot ID of its own, a fork child keeps its source's.
        ``template``: the build the capture is of (a tag may name an older one)."""
        if disk_pause.is_disk_capture(image):  # files only: a boot, then the files
            return await self.life.bring_up(record, self.plans.plan(
                record, template or self.plans.bootable_template(record), files=image,
                hostname_of=record.sandbox_id, start_command=True, new_boot=True))
        template = template or self.plans.template_of(record, "template of the snapshot is gone")
        return await self.life.bring_up(record, self.plans.plan(
            record, template, image=image, hostname_of=hostname_of, current_token=source_token,
            new_boot=new_boot))
