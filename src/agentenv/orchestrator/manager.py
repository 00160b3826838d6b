"""The sandbox manager of one node: create, kill, start and stop.

States move creating -> running -> (paused <-> running) -> killed, or running ->
error when a sandbox's runtime dies; every move is checked against ``TRANSITIONS``
(lifecycle.py). ``SandboxManager`` is the one object the API calls. Over the node's
collaborators (core.py) it builds the services, each a plain object given what it
uses (captures, resident pauses, pauses, forks, resets, runtime exits, reconcile,
egress, user snapshots, runs, connections, pressure, housekeeping, diffs), and keeps
the API's calls into them as one-line delegations.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator

from ..config import Config
from ..metrics import observed
from ..network import EgressPolicy, SlotPool
from ..runtime import Runtime
from ..snapshot import Manifest, SnapshotError, SnapshotStore
from ..templates import Template, TemplateRegistry
from .captures import Captures
from .comparing import Diffs
from .connecting import Connections
from .core import ManagerCore
from .creating import Creates
from .egress import EgressPolicies
from .envd_client import EnvdClient
from .exits import ExitHandler, RuntimeExits
from .forking import Forks
from .housekeeping import Housekeeping
from .lineage import Lineage
from .models import (
    BadRequest,
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
)
from .pausing import Pauses
from .pressure import PressureRelief
from .reconcile import Reconciler
from .requests import CreateRequest
from .resetting import Resets
from .resident import ResidentSet, default_budget_bytes
from .resident_pauses import ResidentPauses
from .runbook import Run
from .runs import Runs
from .snapshots import UserSnapshots
from .store import SandboxStore

log = logging.getLogger(__name__)


class SandboxManager(ManagerCore):
    def __init__(self, config: Config, runtime: Runtime, slots: SlotPool,
                 templates: TemplateRegistry, store: SandboxStore, snapshots: SnapshotStore,
                 envd: EnvdClient | None = None) -> None:
        super().__init__(config, runtime, slots, templates, store, snapshots, envd)
        # The services: each gets what it uses.
        self.captures = Captures(self.sandboxes, snapshots, runtime, self.envd, self.specs,
                                 self.plans, self.life)
        # Paused sandboxes still frozen in place (None: pauses always capture at once).
        self.residents = ResidentPauses(
            config, ResidentSet((config.resident_pause_mb << 20) or default_budget_bytes(),
                                config.resident_pause_idle_s),
            self.sandboxes, store, runtime, self.life, self.captures) \
            if config.resident_pause else None
        if self.residents is not None:  # a launch finding no slot free evicts one
            self.launcher.make_room = self.residents.make_room
        self.pauses = Pauses(config, self.sandboxes, store, snapshots, self.snapshot_gc,
                             templates, self.specs, runtime, self.admission, self.freezer,
                             self.life, self.plans, self.captures, self.residents)
        self.forks = Forks(config, runtime, slots, self.envd, snapshots, self.specs,
                           self.admission, self.freezer, self.runbook, self.life, self.plans,
                           self._admit)
        self.user_snapshots = UserSnapshots(self.templates, self.snapshots, self.snapshot_gc)
        self.creates = Creates(config, templates, store, self.envd, self.limits,
                               self.boot_images, self.life, self.plans, self._admit,
                               self.user_snapshots.resolve, self.forks.create_from_snapshot)
        self.resets = Resets(config, self.sandboxes, store, snapshots, runtime, slots,
                             self.envd, self.specs, self.admission, self.life, self.plans,
                             self.captures, self.pauses)
        # Sandboxes whose runtime ends unasked go to ERROR (exits.py).
        self.exits = RuntimeExits(self.sandboxes, store, self.life, self.boot_images,
                                  self.residents)
        self._exits = ExitHandler(self.exits.exited)
        self.reconciler = Reconciler(config, self.sandboxes, store, snapshots, runtime, slots,
                                     self.envd, self.life, self.captures, self.residents,
                                     self.exits.exited)
        self.egress = EgressPolicies(self.sandboxes, self.store, self.launcher)
        self.runs = Runs(self.sandboxes, self.runbook, self.pauses.pause, self.kill,
                         self.life.spawn)
        self.connections = Connections(self.sandboxes, self.config, self.pauses.resume,
                                       self.set_timeout)
        self.pressure = PressureRelief(self.config, self.sandboxes, self.runtime, self.envd,
                                       self.freezer, self.cold_memory, self.pauses.pause,
                                       self.pauses.evict)
        self.housekeeping = Housekeeping(config, runtime, slots, self.sandboxes, self.freezer,
                                         self.cold_memory, self.pressure, self.captures,
                                         self.residents, self.runs, self.egress, self.kill)
        self.diffs = Diffs(self.sandboxes, self.envd, self.diff_gate,
                           self.config.run_dir / "diffs", self.user_snapshots.resolve, self.create,
                           self.kill, self.endpoint)

    def _short_for_idle(self) -> bool:
        return self.pressure.short_for_idle()

    # -- what the API calls of the services ---------------------------------------------

    async def set_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        return await self.egress.set_network(sandbox_id, policy)

    def user_snapshot_holder(self, manifest: Manifest) -> str | None:
        return self.user_snapshots.holder(manifest)

    async def delete_snapshot(self, name: str) -> Manifest:
        return await self.user_snapshots.delete(name)

    def create_run(self, name: object, lease_s: object, on_expiry: object) -> Run:
        return self.runs.create(name, lease_s, on_expiry)

    def run_members(self, run_id: str) -> list[SandboxRecord]:
        return self.runs.members(run_id)

    async def end_run(self, run_id: str) -> None:
        await self.runs.end(run_id)

    async def connect(self, sandbox_id: str, ttl: int | None = None,
                      memory: bool = True) -> SandboxRecord:
        return await self.connections.connect(sandbox_id, ttl, memory)

    async def ensure_running(self, sandbox_id: str) -> SandboxRecord:
        return await self.connections.ensure_running(sandbox_id)

    async def diff(self, before: str, after: str, text: bool = False,
                   owner: str = "", may_restore: bool = True) -> dict:
        return await self.diffs.diff(before, after, text, owner, may_restore)

    def pause_committed(self, record: SandboxRecord) -> bool:
        return self.pauses.pause_committed(record)

    async def snapshot(self, sandbox_id: str, name: str | None = None,
                       memory: bool = True) -> Manifest:
        return await self.pauses.snapshot(sandbox_id, name, memory)

    async def pause(self, sandbox_id: str, memory: bool = True) -> SandboxRecord:
        return await self.pauses.pause(sandbox_id, memory)

    async def resume(self, sandbox_id: str, ttl: int | None = None,
                     auto_pause: bool | None = None, memory: bool = True) -> SandboxRecord:
        return await self.pauses.resume(sandbox_id, ttl, auto_pause, memory)

    async def evict(self, sandbox_id: str) -> SandboxRecord:
        return await self.pauses.evict(sandbox_id)

    def disown(self, sandbox_id: str) -> bool:
        return self.pauses.disown(sandbox_id)

    async def adopt_paused(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        return await self.pauses.adopt_paused(sandbox_id, snapshot_id)

    async def fork(self, sandbox_id: str, count: int, ttl: int | None = None,
                   owner: str | None = None) -> list[SandboxRecord | OrchestratorError]:
        return await self.forks.fork(sandbox_id, count, ttl, owner)

    def fork_each(self, sandbox_id: str, count: int, ttl: int | None = None,
                  owner: str | None = None) -> AsyncIterator[SandboxRecord | OrchestratorError]:
        return self.forks.fork_each(sandbox_id, count, ttl, owner)

    async def reset(self, sandbox_id: str, snapshot: str | None = None, ttl: int | None = None,
                    mode: str = "memory") -> tuple[SandboxRecord, Manifest, str]:
        return await self.resets.reset(sandbox_id, snapshot, ttl, mode)

    async def create(self, req: CreateRequest) -> SandboxRecord:
        return await self.creates.create(req)

    def create_each(self, req: CreateRequest, count: int
                    ) -> AsyncIterator[SandboxRecord | OrchestratorError]:
        return self.creates.create_each(req, count)

    # -- start / stop -------------------------------------------------------------------

    async def start(self) -> None:
        self._hold_home()
        await self.specs.prepare()
        self.runtime.on_exit = self._exits
        await self.reconciler.reconcile()
        # Mounts a crash left are removed, except those adopted sandboxes run on.
        await asyncio.to_thread(self.image_cache.start, {
            e.record.template_id for e in self.sandboxes.in_state(SandboxState.RUNNING)})
        self.housekeeping.start()

    def _hold_home(self) -> None:
        """One node process per home: a second one would reconcile the first one's
        sandboxes as its own (and destroy them all when it stops). The lock goes
        with the process, however it ends."""
        self.config.home.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config.home / "node.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OrchestratorError(
                f"another node process is serving {self.config.home}") from None
        self._home_lock = fd

    async def close(self, destroy: bool = True) -> None:
        """Stop background work; with ``destroy``, kill every sandbox and free every slot."""
        await self.housekeeping.close()
        self.admission.close()
        self.cold_memory.close()
        await self.pressure.close()
        for task in list(self.life.tasks):
            task.cancel()
        if destroy:  # their runtimes go below: what is frozen is captured first
            if self.residents is not None:
                await self.residents.capture_all_now()
        await self._exits.close()
        await self.snapshot_gc.close()
        if self.boot_images is not None:
            await self.boot_images.close()
        if releasing := self.sandboxes.releasing():
            await asyncio.gather(*releasing, return_exceptions=True)
        if commits := self.sandboxes.commits():
            await asyncio.gather(*commits, return_exceptions=True)
        if destroy:
            # Paused sandboxes live on in their snapshots; everything running stops.
            await asyncio.gather(
                *(self.kill(e.sandbox_id) for e in self.sandboxes
                  if e.state is not SandboxState.PAUSED),
                return_exceptions=True,
            )
            await self.slots.close()
            await self.runtime.reconcile(keep=set())
            await asyncio.to_thread(self.image_cache.close)
        await self.envd.close()

    # -- create -------------------------------------------------------------------------

    async def run_start_command(self, template: Template, address: str, token: str) -> None:
        """The template's start command and ready check (template builds run them too)."""
        await self.launcher.run_start_command(template, address, token)

    # -- kill and timeouts --------------------------------------------------------------

    async def lineage(self, snapshot_id: str | None = None) -> dict:
        """Where snapshots and sandboxes came from (lineage.py): one snapshot's
        ancestors and everything made from it, or (no ID) every tree."""
        records = self.list()  # read on the loop, which alone changes them
        try:
            manifests = await asyncio.to_thread(self.snapshots.list)
        except SnapshotError as exc:
            raise OrchestratorError(f"snapshot repository: {exc}") from exc
        graph = await asyncio.to_thread(Lineage, manifests, records)
        if snapshot_id is None:
            return {"roots": [graph.tree(k) for k in graph.roots()]}
        manifest = await self.user_snapshots.resolve(snapshot_id,
                                                     f"snapshot '{snapshot_id}' not found")
        key = f"snapshot:{manifest.snapshot_id}"
        if key not in graph.nodes:
            raise BadRequest(f"'{snapshot_id}' is a {manifest.metadata.get('kind')} capture, "
                             "not a snapshot of a sandbox")
        return {"snapshotID": manifest.snapshot_id, "ancestors": graph.ancestors(key),
                "tree": graph.tree(key)}

    @observed("delete")
    async def kill(self, sandbox_id: str) -> None:
        entry = self.sandboxes.find(sandbox_id)
        if entry is None:
            raise NotFound(f"sandbox '{sandbox_id}' not found")
        entry.killing += 1  # before the lock: a pause may hold it a while
        try:
            await self._kill(sandbox_id)
        finally:
            entry.killing -= 1

    async def _kill(self, sandbox_id: str) -> None:
        async with self.life.lock(sandbox_id):
            entry = self.sandboxes.get(sandbox_id)
            record = entry.record
            if record.state is SandboxState.CREATING:
                raise Conflict(f"sandbox '{sandbox_id}' is still being created")
            if record.state is SandboxState.PAUSED:
                await self.pauses.forget_paused(record)
                return
            # (an ERROR sandbox's runtime is gone already)
            await asyncio.shield(self.life.teardown(record, record.state is SandboxState.RUNNING))
            if record.snapshot_id:  # its last pause snapshot is of no further use
                pending = entry.commits.get(record.snapshot_id)  # resumed before it landed
                if pending is not None:
                    await asyncio.gather(pending, return_exceptions=True)
                with contextlib.suppress(SnapshotError):
                    await asyncio.to_thread(self.snapshots.delete, record.snapshot_id)
