"""What every part of the sandbox manager shares: the node's collaborators (the
runtime, slots, stores, admission, the idle freezer, caches), the table of sandboxes,
and the queries and admission rules over them.

The state changes of sandboxes are ``Lifecycle``'s (lifecycle.py), what a request
or a record launches from is ``Plans``' (plans.py); the jobs on sandboxes are
services that receive these (captures, pausing, forking, resetting, reconcile,
connecting, egress, runs, pressure, snapshots, comparing), built and joined in
``SandboxManager`` (manager.py: create, kill, TTL).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import time
from typing import Any

from ..config import Config
from ..images import ImageError
from ..network import SlotPool
from ..resources import host_cpus
from ..runtime import Runtime
from ..snapshot import SnapshotStore
from ..templates import Template, TemplateNotFound, TemplateRegistry
from .admission import Admission, Quota, Ticket
from .boot_images import BootImages
from .cold_memory import ColdMemory
from .collect import SnapshotCollector
from .diffing import DiffGate
from .envd_client import EnvdClient
from .idempotency import IdempotencyKeys
from .idling import IdleFreezer
from .launch import Launcher
from .lifecycle import Lifecycle
from .local_cache import LocalCache, node_images
from .models import (
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    not_running,
)
from .plans import Plans
from .runbook import RunBook
from .specs import SpecFactory
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)


class ManagerCore:
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
        configured = config.admission_max_starting
        self._max_starting = configured if configured else max(4, 2 * (os.cpu_count() or 1))
        # Creates beyond the node's room wait here, fair across API keys (admission.py).
        self.admission = Admission(
            timeout_s=config.admission_queue_timeout_s, max_waiting=config.admission_queue_max,
            no_room=self._no_room, owned=self._owned, quotas=self._quota)
        # Diffs in flight, per key and in all (diffing.py: each may restore snapshots).
        self.diff_gate = DiffGate()
        # Runs own sandboxes: their leases, persisted beside the records (runs.py).
        self.runbook = RunBook(store.path)
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
                                      lambda: self._short_for_idle(), self.sandboxes.held)
        # The state changes of sandboxes, and the work done apart from callers.
        self.life = Lifecycle(self.sandboxes, store, runtime, slots, self.launcher,
                              self.admission.wake, self.freezer, self.cold_memory)
        self.on_removed = self.life.on_removed  # the proxy listens (lifecycle.py)
        self.on_capture = self.life.on_capture
        # Templates' boot images and the warm pool (None: every create boots).
        self.boot_images = (BootImages(self, config.warm_pool_size)
                            if config.template_snapshots else None)
        if self.boot_images is not None:
            self.boot_images.on_freed = self.admission.wake
        # Pulled OCI images: their layers, and the rootfs mounts of image templates.
        self.image_cache = node_images(config, templates, snapshots, self._templates_in_use)
        # One budget for the node-local cache: image layers and materialized snapshots.
        self.local_cache = LocalCache(config.cache_budget(), self.image_cache, snapshots,
                                      pinned_snapshots=self._pinned_snapshots,
                                      grace_s=config.cache_snapshot_grace_s)

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

    def _short_for_idle(self) -> bool:
        """Below the idle-memory watermark (pressure.py, SandboxManager's)."""
        raise NotImplementedError

    def _running_ids(self) -> builtins.list[str]:
        return [e.sandbox_id for e in self.sandboxes.in_state(SandboxState.RUNNING)]

    async def set_timeout(self, sandbox_id: str, ttl: int | None) -> SandboxRecord:
        """The sandbox now ends ``ttl`` seconds from now (the default when None)."""
        seconds = self.plans.timeout(ttl)
        record = self.get(sandbox_id)
        record.end_at = time.time() + seconds
        self.store.put(record)
        return record

    def _no_room(self, reserved: int, starting: bool = True) -> str | None:
        """Why one more sandbox does not fit now, with ``reserved`` creates admitted but
        not yet recorded (None: it fits). A sandbox being torn down still holds its slot
        until the slot is handed back, so it still counts (a burst right after kills
        otherwise found "no network slot free"); a resident paused one does not (a
        launch evicts it when it needs the slot)."""
        cap = self.config.max_sandboxes
        busy = sum(1 for e in self.sandboxes
                   if e.state in (SandboxState.CREATING, SandboxState.RUNNING)
                   or (e.slot is not None and e.state is not SandboxState.PAUSED))
        if self.boot_images is not None:  # captures of boot images, pooled sandboxes
            busy += self.boot_images.slots_held()
        if busy + reserved >= cap:
            if self.boot_images is not None and self.boot_images.shed():
                return "a warm-pool sandbox is giving up its room"
            return (f"node is at capacity ({cap} sandboxes, counting those whose slots "
                    "are being released)")
        limit = self._max_starting
        if starting and limit > 0:
            launching = len(self.sandboxes.in_state(SandboxState.CREATING))
            if launching + reserved >= limit:
                return f"{limit} sandboxes are starting, the most at once"
        return None

    def _owned(self, owner: str) -> int:
        return sum(1 for e in self.sandboxes.in_state(SandboxState.CREATING,
                                                      SandboxState.RUNNING)
                   if e.record.owner == owner)

    def _quota(self, owner: str) -> Quota:
        own = self.config.key_quotas.get(owner) or {}
        return Quota(int(own.get("max_sandboxes", self.config.key_max_sandboxes)),
                     float(own.get("creates_per_s", self.config.key_creates_per_s)))

    async def _admit(self, req: Any) -> Ticket:
        """Wait for room for a create (admission.py); it joins its run (if it names
        one) only if that run is still going once admitted."""
        self.runbook.check_joinable(req.run_id)
        ticket = await self.admission.admit(req.owner, req.client_gone)
        try:
            self.runbook.check_joinable(req.run_id)
        except BaseException:
            ticket.release()
            raise
        return ticket

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
