"""The sandbox manager of one node: create, kill, start and stop.

States move creating -> running -> (paused <-> running) -> killed, or running ->
error when a sandbox's runtime dies; every move is checked against ``TRANSITIONS``
(lifecycle.py). ``SandboxManager`` is the one object the API calls, a plain class:
it builds the node's collaborators (runtime, slots, stores, admission, the idle
freezer, caches) and the services, each a plain object given what it uses (creates,
captures, resident pauses, pauses, forks, resets, runtime exits, reconcile, egress,
user snapshots, runs, connections, pressure, housekeeping, diffs); it answers the
lookups and keeps kill, start and stop, and the API's calls into the services as
one-line delegations.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator

from ..config import Config
from ..images import ImageError
from ..metrics import observed
from ..network import EgressPolicy, SlotPool
from ..resources import host_cpus
from ..runtime import Runtime
from ..snapshot import Manifest, SnapshotError, SnapshotStore
from ..templates import Template, TemplateNotFound, TemplateRegistry
from .boot_images import BootImages
from .captures import Captures
from .cold_memory import ColdMemory
from .collect import SnapshotCollector
from .comparing import Diffs
from .connecting import Connections
from .creating import Creates
from .diffing import DiffGate
from .egress import EgressPolicies
from .envd_client import EnvdClient
from .exits import ExitHandler, RuntimeExits
from .forking import Forks
from .housekeeping import Housekeeping
from .idempotency import IdempotencyKeys
from .idling import IdleFreezer
from .launch import Launcher
from .lifecycle import Lifecycle
from .lineage import Lineage
from .local_cache import LocalCache, node_images
from .models import (
    BadRequest,
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    not_running,
)
from .pausing import Pauses
from .plans import Plans
from .pressure import PressureRelief
from .reconcile import Reconciler
from .requests import CreateRequest
from .resetting import Resets
from .resident import ResidentSet, default_budget_bytes
from .resident_pauses import ResidentPauses
from .room import Room
from .runbook import Run, RunBook
from .runs import Runs
from .snapshots import UserSnapshots
from .specs import SpecFactory
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


class SandboxManager:
    def __init__(self, config: Config, runtime: Runtime, slots: SlotPool,
                 templates: TemplateRegistry, store: SandboxStore, snapshots: SnapshotStore,
                 envd: EnvdClient | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.slots = slots
        self.templates = templates
        self.store = store
        self.snapshots = snapshots
        # Chunks of deleted snapshots are collected in the background after a delete.
        self.snapshot_gc = SnapshotCollector(snapshots)
        self.envd = envd or EnvdClient()
        # Resource bounds: requests beyond are refused, values from disk clamped.
        self.limits = config.resource_limits
        templates.limits = self.limits
        self.specs = SpecFactory(config, runtime, self.limits)
        self.plans = Plans(config, templates, self.limits)
        self.launcher = Launcher(runtime, slots, self.envd, self.specs, self.ensure_rootfs,
                                 config.egress_refresh_s,
                                 slot_wait_s=config.admission_queue_timeout_s)
        # Every sandbox of the node and what it holds (its slot, lock, background work).
        self.sandboxes = SandboxTable()
        # Runs own sandboxes: their leases, persisted beside the records (runs.py).
        self.runbook = RunBook(store.path)
        # Creates beyond the node's room wait, fair across API keys (room.py, admission.py).
        self.room = Room(config, self.sandboxes, self.runbook)
        self.admission = self.room.admission
        # Diffs in flight, per key and in all (diffing.py: each may restore snapshots).
        self.diff_gate = DiffGate()
        # Answers of creates sent with an Idempotency-Key (idempotency.py).
        self.idempotency = IdempotencyKeys(store.path, config.idempotency_ttl_s,
                                           config.idempotency_max_keys)
        # Idle running sandboxes frozen in place, thawed by the next request (idling.py).
        self.freezer = IdleFreezer(runtime, config.idle_freeze_s, config.idle_freeze_cpu_pct,
                                   lambda: self.sandboxes.records, self.sandboxes.held,
                                   crowd=config.idle_freeze_crowd or 16 * host_cpus(),
                                   # envd's dormancy first (a second to exec the stub)
                                   early_s=config.envd_dormant_after_s + 1
                                   if config.envd_dormant_after_s else 0)
        self.envd.awake_at = self.freezer.awake_at
        # Frozen sandboxes' memory moved to the host's compressed swap (cold_memory.py).
        self.cold_memory = ColdMemory(runtime, config.cold_memory_after_s, self._running_ids,
                                      lambda: self.pressure.short_for_idle(),
                                      self.sandboxes.held)
        # The state changes of sandboxes, and the work done apart from callers.
        self.life = Lifecycle(self.sandboxes, store, runtime, slots, self.launcher,
                              self.admission.wake, self.freezer, self.cold_memory)
        self.on_removed = self.life.on_removed  # the proxy listens (lifecycle.py)
        self.on_capture = self.life.on_capture
        # Templates' boot images and the warm pool (None: every create boots).
        self.boot_images = (BootImages(self, config.warm_pool_size)
                            if config.template_snapshots else None)
        self.room.boot_images = self.boot_images
        if self.boot_images is not None:
            self.boot_images.on_freed = self.admission.wake
        # Pulled OCI images: their layers, and the rootfs mounts of image templates.
        self.image_cache = node_images(config, templates, snapshots, self._templates_in_use)
        # One budget for the node-local cache: image layers and materialized snapshots.
        self.local_cache = LocalCache(config.cache_budget(), self.image_cache, snapshots,
                                      pinned_snapshots=self._pinned_snapshots,
                                      grace_s=config.cache_snapshot_grace_s)
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
                           self.room.admit)
        self.user_snapshots = UserSnapshots(self.templates, self.snapshots, self.snapshot_gc)
        self.creates = Creates(config, templates, store, self.envd, self.limits,
                               self.boot_images, self.life, self.plans, self.room.admit,
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

    # -- queries ------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        return self.sandboxes.get(sandbox_id).record

    def list(self) -> builtins.list[SandboxRecord]:
        return [e.record for e in self.sandboxes if e.state is not SandboxState.KILLED]

    def creates_waiting(self) -> int:
        """Creates queued for room (admission.py)."""
        return self.admission.waiting

    def active_count(self) -> int:
        """Sandboxes holding node resources (paused ones hold none)."""
        return len(self.sandboxes.in_state(SandboxState.CREATING, SandboxState.RUNNING))

    def endpoint(self, sandbox_id: str, port: int) -> tuple[str, int]:
        """Where the node reaches ``port`` inside a running sandbox (thawed: whoever
        asks is about to talk to it; requests that last use ``awake``)."""
        entry = self.sandboxes.get(sandbox_id)
        record = entry.record
        # From the moment a kill starts the sandbox has no endpoint, so the proxy
        # answers E2B's 502 "was not found" (the SDK's /health probe after a cut
        # stream then says the sandbox was killed), not "not running" or a hang.
        if entry.killing or record.state is SandboxState.KILLED:
            raise NotFound(f"sandbox '{sandbox_id}' is being killed")
        if record.state is not SandboxState.RUNNING or record.error:
            raise not_running(record)
        self.freezer.touch(sandbox_id)
        return record.slot_address, port

    def frozen(self, sandbox_id: str) -> bool:
        """Whether the running sandbox is frozen idle now (asking does not thaw it)."""
        return self.freezer.enabled and self.runtime.is_frozen(sandbox_id)

    def envd_dormant(self, sandbox_id: str) -> bool:
        """Whether the running sandbox's envd is dormant now (asking does not wake it)."""
        return self.runtime.envd_dormant(sandbox_id)

    def awake(self, sandbox_id: str) -> contextlib.AbstractContextManager[None]:
        """Kept thawed while a request to the sandbox is in flight (the proxy)."""
        return self.freezer.awake(sandbox_id)

    def _running_ids(self) -> builtins.list[str]:
        return [e.sandbox_id for e in self.sandboxes.in_state(SandboxState.RUNNING)]

    async def set_timeout(self, sandbox_id: str, ttl: int | None) -> SandboxRecord:
        """The sandbox now ends ``ttl`` seconds from now (the default when None)."""
        seconds = self.plans.timeout(ttl)
        record = self.get(sandbox_id)
        record.end_at = time.time() + seconds
        self.store.put(record)
        return record

    # -- templates' root filesystems ----------------------------------------------------

    async def ensure_rootfs(self, template: Template) -> None:
        """An image template's layers fetched (if evicted) and mounted. Held for as long
        as a sandbox of the template runs or is being started (``_templates_in_use``)."""
        if template.image is None:
            return
        try:
            await asyncio.to_thread(self.image_cache.ensure, template)
        except ImageError as exc:
            err = OrchestratorError(f"rootfs of template '{template.template_id}': {exc}")
            err.status = 502 if exc.status in (401, 404, 502) else exc.status
            raise err from exc

    def _pinned_snapshots(self) -> set[str]:
        """The snapshots of pinned (built) templates: never evicted from the cache."""
        out = set()
        for name in self.image_cache.pinned:
            with contextlib.suppress(TemplateNotFound):
                if snapshot_id := self.templates.get(name).snapshot_id:
                    out.add(snapshot_id)
        return out

    def _templates_in_use(self) -> set[str]:
        """Templates whose rootfs must stay: sandboxes starting, running or being resumed,
        pooled ones and boot images being built. Called from worker threads."""
        used = set()
        for e in self.sandboxes:
            if e.state in (SandboxState.CREATING, SandboxState.RUNNING) or e.held():
                used.add(e.record.template_id)
        if self.boot_images is not None:
            used |= self.boot_images.templates_in_use()
        return used

    # -- launching a record -------------------------------------------------------------

    def file_access(self, template: Template) -> str:
        return self.plans.file_access(template)

    # -- what a sandbox holds, and states -----------------------------------------------

    # -- what the API calls of the services ---------------------------------------------

    async def set_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        return await self.egress.set_network(sandbox_id, policy)

    def user_snapshot_holder(self, manifest: Manifest) -> str | None:
        return self.user_snapshots.holder(manifest)

    async def delete_snapshot(self, name: str) -> Manifest:
        return await self.user_snapshots.delete(name)

    def create_run(self, name: object, lease_s: object, on_expiry: object) -> Run:
        return self.runs.create(name, lease_s, on_expiry)

    def run_members(self, run_id: str) -> builtins.list[SandboxRecord]:
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
                   owner: str | None = None) -> builtins.list[SandboxRecord | OrchestratorError]:
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
        self.snapshot_gc.start(self.config.snapshot_gc_interval_s)

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
