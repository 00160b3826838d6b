"""Reset in place (the service ``Resets``): a sandbox back to a snapshot's exact
state under the same identity.

An agentenv extension (E2B has no reset), for RL loops that return an environment to
its start state many times. A reset keeps the sandbox's record: its ID, envd access
token (the SDK's Sandbox object goes on working), traffic token, proxy routes,
metadata, env vars, egress policy and ``started_at``; its TTL is kept unless the
call gives a new one. What runs inside is replaced whole by the snapshot's memory,
processes and files.

A running sandbox keeps its network slot: its runtime is destroyed and the snapshot
restored into the same network namespace (the addresses gVisor took are put back,
the egress policy stays), which saves a slot and a new record over kill + create.
A paused sandbox is restored into a fresh slot, as a resume would. A files-only
snapshot (``memory: false``) reboots the template with the snapshot's files.

``mode: "filesystem"`` (issue 28) is for tasks whose state is their files: the first
such reset to a snapshot is the full one above, after which envd pushes a files layer
tagged with the snapshot (envd/layers.py); every later one, while the sandbox runs,
restores nothing: envd kills the processes started since, drops the layer's files and
starts a fresh layer, in milliseconds. The processes of the snapshot itself (its
services) keep running with their memory as it is. Whatever cannot be reset that way
(no layer for that snapshot, a paused sandbox, an envd without layers) is reset in
full; the answer says which it was (``mode``).

Everything that can be refused is checked before the sandbox is touched: unknown
snapshot (404), one of another template or other resources, or not a user snapshot
(400), one this node cannot restore (409). Should the restore itself fail, a paused
sandbox stays paused; a running one, whose old runtime is gone, goes to ``error``
with the reason (what it held is freed), as a sandbox whose runtime died does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from ..metrics import observed
from ..network import Slot, SlotError, SlotPool
from ..runtime import Runtime
from ..snapshot import Manifest, SnapshotStore
from ..templates import Template
from . import disk_pause
from .admission import Admission
from .captures import Captures
from .envd_client import EnvdClient, EnvdUnavailable, LayerRefused
from .lifecycle import Lifecycle
from .models import (
    MAX_RESETS,
    BadRequest,
    Conflict,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    not_running,
)
from .pausing import Pauses
from .plans import Plans
from .sandbox import RUNTIME
from .specs import SpecFactory
from .store import SandboxStore
from .table import SandboxTable

log = logging.getLogger(__name__)

RESET_MODES = ("memory", "filesystem")


@dataclass(eq=False, repr=False)
class Resets:
    config: Config
    sandboxes: SandboxTable
    store: SandboxStore
    snapshots: SnapshotStore
    runtime: Runtime
    slots: SlotPool
    envd: EnvdClient
    specs: SpecFactory
    admission: Admission
    life: Lifecycle
    plans: Plans
    captures: Captures
    pauses: Pauses

    @observed("reset")
    async def reset(self, sandbox_id: str, snapshot: str | None = None,
                    ttl: int | None = None, mode: str = "memory",
                    ) -> tuple[SandboxRecord, Manifest, str]:
        """Bring a running or paused sandbox back to ``snapshot`` (an ID or name; by
        default the last snapshot taken of it), same ID and tokens. ``ttl``: it then
        expires that many seconds from now; None keeps a running sandbox's expiry (a
        paused one gets the default, as a resume does). ``mode``: ``memory`` restores
        the snapshot whole; ``filesystem`` resets the files alone when it can (see the
        module's docstring). Returns the record, the snapshot and the mode it took."""
        if mode not in RESET_MODES:
            raise BadRequest(f"mode must be one of {', '.join(RESET_MODES)}")
        seconds = None if ttl is None else self.plans.timeout(ttl)
        record = self.life.get(sandbox_id)
        manifest = await (self._resolve_snapshot(snapshot) if snapshot
                          else self._last_snapshot(record))
        self._check_resettable(record, manifest)
        files_layer = mode == "filesystem"
        if files_layer and record.state is SandboxState.RUNNING:
            # A client hanging up must not stop a reset half-way (as below).
            fast = self.life.spawn(self._reset_files(sandbox_id, manifest, seconds))
            done = await asyncio.shield(fast)
            if done is not None:
                return done, manifest, "filesystem"
        # A paused sandbox's reset makes it run: admitted as a resume is (a running
        # one keeps its slot and its place in the counts, so it asks nothing).
        ticket = await self.admission.admit(record.owner) \
            if record.state is SandboxState.PAUSED else None
        try:
            if record.state is SandboxState.PAUSED:
                # Frozen in memory: out first (once its capture is made), so that the
                # reset restores into a fresh slot and a failure leaves it paused.
                await self.pauses.evict(sandbox_id)
            image = await asyncio.to_thread(self.snapshots.materialize, manifest.snapshot_id)
            # A client hanging up must not stop a reset half-way: it runs as its own task.
            task = self.life.spawn(self._reset_locked(sandbox_id, manifest, image, seconds,
                                                      files_layer))
        except BaseException:
            if ticket is not None:
                ticket.release()
            raise
        if ticket is not None:
            task.add_done_callback(lambda _: ticket.release())
        return await asyncio.shield(task), manifest, "memory"

    async def _reset_files(self, sandbox_id: str, manifest: Manifest,
                           seconds: int | None) -> SandboxRecord | None:
        """The files layer of ``manifest`` reset by envd, no restore; None when the
        sandbox has no such layer (or envd cannot say): then the reset is a full one."""
        async with self.life.lock(sandbox_id):
            record = self.life.get(sandbox_id)
            if record.state is not SandboxState.RUNNING or record.error or \
                    not record.slot_address:
                return None
            t0 = time.perf_counter()
            try:
                done = await self.envd.layer(record.slot_address, record.envd_token, "reset",
                                             manifest.snapshot_id)
            except LayerRefused as exc:
                log.info("reset %s: no files layer for %s (%s); a full reset", sandbox_id,
                         manifest.snapshot_id, exc)
                return None
            except (EnvdUnavailable, OSError, ValueError) as exc:
                log.warning("reset %s: envd did not reset its files layer (%s); a full reset",
                            sandbox_id, exc)
                return None
            # Connections to the processes that ended are dead: the proxy drops them.
            self.life.removed(sandbox_id)
            self._reset_done(record, manifest, seconds, "filesystem")
            log.info("reset %s to snapshot %s in %.1f ms (its files layer; envd %.1f ms, "
                     "of which its kill pass %.1f ms, %s processes ended)", sandbox_id,
                     manifest.snapshot_id, (time.perf_counter() - t0) * 1000,
                     done.get("ms", 0), done.get("kill_ms", 0), done.get("killed", 0))
            return record

    def _reset_done(self, record: SandboxRecord, manifest: Manifest, seconds: int | None,
                    mode: str, paused: bool = False) -> None:
        if paused or seconds is not None:
            record.end_at = time.time() + (
                seconds if seconds is not None else self.config.default_timeout)
        # An event in its history; its origin stays (lineage.py: no cycle with a
        # snapshot of its own).
        record.resets = [*record.resets, {"snapshotID": manifest.snapshot_id,
                                          "at": time.time(), "mode": mode}][-MAX_RESETS:]
        self.store.put(record)

    async def _push_layer(self, record: SandboxRecord, manifest: Manifest) -> None:
        """After a full reset in filesystem mode: envd layers the files, so that the next
        reset to this snapshot is one of files. A failure leaves the sandbox as the full
        reset made it (and the next reset a full one too)."""
        try:
            await self.envd.layer(record.slot_address, record.envd_token, "push",
                                  manifest.snapshot_id)
        except (LayerRefused, EnvdUnavailable, OSError, ValueError) as exc:
            log.warning("reset %s: no files layer pushed for %s (%s); its resets stay full",
                        record.sandbox_id, manifest.snapshot_id, exc)

    async def _resolve_snapshot(self, name: str) -> Manifest:
        return await asyncio.to_thread(self.snapshots.resolve, name)

    async def _last_snapshot(self, record: SandboxRecord) -> Manifest:
        taken = [m for m in await asyncio.to_thread(self.snapshots.list, record.sandbox_id)
                 if m.metadata.get("kind") == "snapshot"]
        if not taken:
            raise Conflict(f"sandbox '{record.sandbox_id}' has no snapshot to reset to: take "
                           "one first (POST /sandboxes/{id}/snapshots, `aenv snapshot "
                           "create`), or name the snapshot to reset to")
        return taken[-1]  # oldest first

    def _check_resettable(self, record: SandboxRecord, manifest: Manifest) -> None:
        meta = manifest.metadata
        sid = manifest.snapshot_id
        if meta.get("kind") != "snapshot":
            raise BadRequest(f"'{sid}' is not a sandbox snapshot (it is a {meta.get('kind')} "
                             "capture): reset to a snapshot taken with "
                             "POST /sandboxes/{id}/snapshots")
        if meta.get("template_id") != record.template_id:
            raise BadRequest(f"snapshot '{sid}' is of template '{meta.get('template_id')}'; "
                             f"sandbox '{record.sandbox_id}' is of template "
                             f"'{record.template_id}': a sandbox resets only to snapshots "
                             "of its own template")
        theirs = self.plans.resources(meta.get("cpu_count"), meta.get("memory_mb"),
                                 meta.get("disk_size_mb"))
        ours = (record.cpu_count, record.memory_mb, record.disk_size_mb)
        if (theirs.cpu_count, theirs.memory_mb, theirs.disk_size_mb) != ours:
            raise BadRequest(
                f"snapshot '{sid}' has {theirs.cpu_count} CPUs, {theirs.memory_mb} MB of "
                f"memory and {theirs.disk_size_mb} MB of disk; sandbox '{record.sandbox_id}' "
                f"has {ours[0]}, {ours[1]} and {ours[2]}: a sandbox resets only to snapshots "
                "with its own resources")
        self.specs.check_restorable(meta)

    def _reset_template(self, record: SandboxRecord, files: bool) -> Template:
        if files:  # a boot: the template must be bootable
            return self.plans.bootable_template(record)
        return self.plans.template_of(record)

    async def _reset_locked(self, sandbox_id: str, manifest: Manifest, image: Path,
                            seconds: int | None, files_layer: bool = False) -> SandboxRecord:
        async with self.life.lock(sandbox_id):
            record = self.life.get(sandbox_id)
            paused = record.state is SandboxState.PAUSED
            if record.state is SandboxState.CREATING:
                raise Conflict(f"sandbox '{sandbox_id}' is still being created")
            if not paused and (record.state is not SandboxState.RUNNING or record.error):
                raise not_running(record)
            files = disk_pause.is_disk_capture(image)
            template = self._reset_template(record, files)
            meta = manifest.metadata
            entry = self.sandboxes.get(sandbox_id)
            slot = None if paused else entry.slot
            if files:  # a boot of the template, then the snapshot's files
                plan = self.plans.plan(record, template, files=image, hostname_of=sandbox_id,
                                  start_command=True, purpose="reset", slot=slot)
            else:  # envd wakes with the snapshot's token and is given the record's
                # (unless it has them already: a snapshot of this very sandbox)
                same = meta.get("envd_token") == record.envd_token and \
                    meta.get("env_vars") == record.env_vars
                plan = self.plans.plan(record, template, image=image, purpose="reset", slot=slot,
                                  hostname_of=meta.get("source_sandbox_id") or sandbox_id,
                                  init=not same, current_token=meta.get("envd_token") or "")
            t0 = time.perf_counter()
            destroyed_ms = 0.0
            if paused:
                await self.captures.settled(sandbox_id)
                # On failure the launch has undone itself: the sandbox stays paused.
                slot = await self.life.launcher.launch(plan)
                self.life.started(record, slot)
                self.life.transition(record, SandboxState.RUNNING)
            else:
                try:
                    entry.cleanup.discard(RUNTIME)  # destroyed here, and started again
                    await self._drop_runtime(sandbox_id, slot)
                    destroyed_ms = (time.perf_counter() - t0) * 1000
                    # Connections to the old processes are dead: the proxy drops them.
                    self.life.removed(sandbox_id)
                    # The same slot back (a new one only if it somehow held none).
                    self.life.started(record, await self.life.launcher.launch(plan))
                except BaseException as exc:
                    await asyncio.shield(self._reset_failed(record, manifest, exc))
                    if isinstance(exc, Exception):
                        err = OrchestratorError(
                            f"reset of sandbox '{sandbox_id}' to snapshot "
                            f"'{manifest.snapshot_id}' failed and the sandbox ended (state "
                            f"error): {exc}")
                        err.status = getattr(exc, "status", 500)
                        raise err from exc
                    raise
            if files_layer:
                await self._push_layer(record, manifest)
            self._reset_done(record, manifest, seconds, "memory", paused)
            log.info("reset %s to snapshot %s in %.0f ms (%s; old runtime destroyed in "
                     "%.0f ms)", sandbox_id, manifest.snapshot_id,
                     (time.perf_counter() - t0) * 1000,
                     "rebooted with its files" if files else
                     "restored into a new slot" if paused else "restored in place", destroyed_ms)
            return record

    async def _drop_runtime(self, sandbox_id: str, slot: Slot | None) -> None:
        """Destroy the sandbox's runtime and ready its slot for the restore, at the same
        time: the addresses can go back on eth0 while the old sandbox ends (its
        connections are being dropped anyway), which takes the slot off the path."""
        steps = [self.runtime.destroy(sandbox_id)]
        if slot is not None:
            steps.append(self.slots.reuse(slot))
        for result in await asyncio.gather(*steps, return_exceptions=True):
            if isinstance(result, BaseException):
                if isinstance(result, SlotError | OSError | ValueError):
                    raise OrchestratorError(f"network slot of the sandbox: {result}") from result
                raise result

    async def _reset_failed(self, record: SandboxRecord, manifest: Manifest,
                            exc: BaseException) -> None:
        """A running sandbox whose reset failed after its runtime went: ``error``, with
        the reason, holding nothing (the launch destroyed what it had started)."""
        self.life.ended_in_error(
            record, f"ended: its reset to snapshot {manifest.snapshot_id} failed ({exc})")
        entry = self.sandboxes.holds(record)
        if entry is not None:
            await self.life.release(entry)
        self.store.put(record)
