"""The sandbox lifecycle on one node: create, list, kill, TTL, restart reconciliation.

States move creating -> running -> killed; every move is checked against
``TRANSITIONS``. Records are written to the store before side effects begin so
a crash at any point leaves something the next start can clean up.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..envd.bundle import build_bundle, envd_command
from ..images import DEFAULT_MOUNTPOINTS, ImageError, ImageService, LayerStore
from ..network import EgressPolicy, Slot, SlotPool, SlotPoolExhausted, compile_policy
from ..resources import CPU, DISK, MEMORY, ResourceError
from ..runtime import Runtime, RuntimeFailure, SandboxSpec
from ..runtime.oci import files_quota_mb
from ..snapshot import SnapshotError, SnapshotNotFound, SnapshotStore
from ..templates import Template, TemplateNotFound, TemplateRegistry
from .envd_client import ENVD_PORT, EnvdClient, EnvdUnavailable
from .exits import ExitHandler, not_running
from .models import (
    TRANSITIONS,
    BadRequest,
    CapacityExceeded,
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    StorageFull,
    new_sandbox_id,
)
from .store import SandboxStore
from .template_images import PooledSandbox, TemplateImage, TemplateImages

log = logging.getLogger(__name__)
BUNDLE_MOUNT = "/.aenv"
MAX_METADATA_ENTRIES = 64
MAX_ENV_ENTRIES = 256
# Characters of one metadata key and value (metadata is stored with the sandbox, in
# its snapshots, and in every listing), and of one env var (Linux's MAX_ARG_STRLEN
# is 128 KiB for NAME=value).
MAX_METADATA_KEY, MAX_METADATA_VALUE = 256, 8 * 1024
MAX_ENV_NAME, MAX_ENV_VALUE = 1024, 128 * 1024 - 1024 - 2
MAX_FORK = 16
COMMIT_RETRY_TICKS = 30  # seconds between retries of failed pause commits


@dataclass
class CreateRequest:
    template: str
    timeout: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    internet: bool = True
    # Finer egress policy (E2B's network.allowOut / denyOut); None = by ``internet``.
    network: EgressPolicy | None = None
    # False: the sandbox's ports want its traffic access token (E2B allowPublicTraffic).
    public_traffic: bool = True
    # Resources other than the template's (template builds ask for them): such a
    # sandbox boots, as no template image or pooled sandbox has them.
    cpu_count: int | None = None
    memory_mb: int | None = None


class SandboxManager:
    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        slots: SlotPool,
        templates: TemplateRegistry,
        store: SandboxStore,
        snapshots: SnapshotStore,
    ):
        self.config = config
        self.snapshots = snapshots
        # Commits of pause snapshots still running in the background, by snapshot ID.
        self._commits: dict[str, asyncio.Task] = {}
        self.runtime = runtime
        self.slots = slots
        self.templates = templates
        # Resource bounds: requests beyond are refused, values from disk clamped.
        self.limits = config.resource_limits
        templates.limits = self.limits
        self.store = store
        self.envd = EnvdClient()
        self._records: dict[str, SandboxRecord] = {}
        # The network slot each sandbox holds: released from here, and only here.
        self._slots: dict[str, Slot] = {}
        # Paused sandboxes whose stopped runtime is still being freed.
        self._releasing: dict[str, asyncio.Task] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._bundle: Path | None = None
        self._init_argv: list[str] = []
        self._init_env: dict[str, str] = {}
        self._ttl_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        # Sandboxes whose runtime ends unasked go to ERROR (orchestrator/exits.py).
        self._exits = ExitHandler(self)
        # Called with a sandbox ID once it is gone (the proxy drops its connections).
        self.on_removed: list[Callable[[str], None]] = []
        self.images = (TemplateImages(self, config.warm_pool_size)
                       if config.template_snapshots else None)
        # Pulled images: their layers, and the rootfs mounts of image templates.
        self.image_cache = ImageService(
            LayerStore(config.images_cache_dir, config.image_cache_bytes,
                       mountpoints=(*DEFAULT_MOUNTPOINTS, BUNDLE_MOUNT)), templates,
            config.secrets_dir, in_use=self._templates_in_use,
            pinned=[n.strip() for n in config.pinned_templates.split(",") if n.strip()],
            local_sources_dir=config.image_imports_dir)

    # -- start / stop ---------------------------------------------------------

    async def start(self) -> None:
        self._hold_home()
        self._bundle = await asyncio.to_thread(build_bundle, self.config.bundles_dir)
        self._init_argv, self._init_env = envd_command(BUNDLE_MOUNT, ENVD_PORT)
        self.runtime.on_exit = self._exits
        await self._reconcile()
        # Mounts a crash left are removed, except those adopted sandboxes run on.
        await asyncio.to_thread(self.image_cache.start, {
            r.template_id for r in self._records.values() if r.state is SandboxState.RUNNING})
        self._ttl_task = asyncio.create_task(self._ttl_loop(), name="ttl")

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
        if self._ttl_task:
            self._ttl_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ttl_task
        for task in list(self._tasks):
            task.cancel()
        await self._exits.close()
        if self.images is not None:
            await self.images.close()
        if self._releasing:
            await asyncio.gather(*self._releasing.values(), return_exceptions=True)
        if self._commits:
            await asyncio.gather(*self._commits.values(), return_exceptions=True)
        if destroy:
            # Paused sandboxes live on in their snapshots; everything running stops.
            await asyncio.gather(
                *(self.kill(r.sandbox_id) for r in list(self._records.values())
                  if r.state is not SandboxState.PAUSED),
                return_exceptions=True,
            )
            await self.slots.close()
            await self.runtime.reconcile(keep=set())
            await asyncio.to_thread(self.image_cache.close)
        await self.envd.close()

    async def _reconcile(self) -> None:
        """Adopt sandboxes that survived a server crash; remove everything else."""
        # What a killed predecessor left the runtime doing finishes first: a
        # half-done pause capture stops its sandbox when it completes.
        await self.runtime.settle(120)
        alive = await self.runtime.list()
        keep: dict[str, SandboxRecord] = {}
        for record in self.store.all():
            running = alive.get(record.sandbox_id)
            if record.metadata.get("aenv.build"):  # no use without the build that died too
                log.info("reconcile: dropping template build sandbox %s", record.sandbox_id)
                self.store.delete(record.sandbox_id)
            elif record.state is SandboxState.RUNNING and running and running.state == "running":
                keep[record.sandbox_id] = record
            elif record.state in (SandboxState.PAUSED, SandboxState.ERROR):
                keep[record.sandbox_id] = record
            else:
                log.info("reconcile: dropping sandbox %s (%s)", record.sandbox_id, record.state)
                self.store.delete(record.sandbox_id)
        removed = await self.runtime.reconcile(
            {sid for sid, r in keep.items() if r.state is SandboxState.RUNNING}
        )
        if removed:
            log.info("reconcile: removed %d orphaned runtime sandboxes", len(removed))
        await self.slots.start({r.slot_index: r.internet for r in keep.values()
                                if r.state is SandboxState.RUNNING})
        self._records = keep
        await asyncio.to_thread(self._remove_stale_captures, keep)
        for record in keep.values():
            held = self.slots.held(record.slot_index) if record.slot_index else None
            if held is not None:
                self._slots[record.sandbox_id] = held
                if record.network:  # the rules are rebuilt from the record
                    try:
                        await self._apply_network(record, held)
                    except Exception:
                        log.exception("reconcile: egress policy of %s", record.sandbox_id)
            log.info("reconcile: adopted %s sandbox %s", record.state, record.sandbox_id)
            if record.state is SandboxState.PAUSED:
                self._recommit_if_staged(record)
        await self._drop_unanswering()

    async def _drop_unanswering(self) -> None:
        """A running sandbox is adopted only if its envd answers: one a killed node
        was pausing can still show as running while its capture stops it."""
        running = [r for r in self._records.values() if r.state is SandboxState.RUNNING]

        async def answers(record: SandboxRecord) -> bool:
            try:
                await self.envd.wait_ready(record.slot_address, deadline_s=10)
                return True
            except EnvdUnavailable:
                return False

        for record, ok in zip(running, await asyncio.gather(*map(answers, running)),
                              strict=True):
            if not ok:
                log.warning("reconcile: sandbox %s does not answer; removing it",
                            record.sandbox_id)
                await self._teardown(record, True)

    def _remove_stale_captures(self, keep: dict[str, SandboxRecord]) -> None:
        """Captures a crash interrupted: fork images, and staged snapshots that no
        paused sandbox's pending commit needs (a snapshot or pause whose capture or
        commit died with the node; the repository's collector takes their chunks)."""
        images = self.config.run_dir / "images"
        if images.is_dir():
            for leftover in images.iterdir():
                log.info("reconcile: removing fork image %s", leftover.name)
                shutil.rmtree(leftover, ignore_errors=True)
        pending = {r.snapshot_id for r in keep.values()
                   if r.state is SandboxState.PAUSED and r.snapshot_id}
        staging = self.snapshots.staging_dir
        if not staging.is_dir():
            return
        for entry in staging.iterdir():
            snapshot_id = entry.name.removesuffix(".meta.json")
            has_meta = (staging / f"{snapshot_id}.meta.json").is_file()
            if snapshot_id in pending and has_meta:
                continue
            log.info("reconcile: removing interrupted capture %s", entry.name)
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    # -- queries --------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        record = self._records.get(sandbox_id)
        if record is None or record.state is SandboxState.KILLED:
            raise NotFound(f"sandbox '{sandbox_id}' not found")
        return record

    def list(self) -> list[SandboxRecord]:
        return [r for r in self._records.values() if r.state is not SandboxState.KILLED]

    def active_count(self) -> int:
        """Sandboxes holding node resources (paused ones hold none)."""
        return sum(1 for r in self._records.values()
                   if r.state in (SandboxState.CREATING, SandboxState.RUNNING))

    def _check_capacity(self) -> None:
        if self.active_count() >= self.config.max_sandboxes:
            raise CapacityExceeded(
                f"node is at capacity ({self.config.max_sandboxes} sandboxes); retry later"
            )

    def endpoint(self, sandbox_id: str, port: int) -> tuple[str, int]:
        """Where the node reaches ``port`` inside a running sandbox."""
        record = self.get(sandbox_id)
        if record.state is not SandboxState.RUNNING or record.error:
            raise not_running(record)
        return record.slot_address, port

    # -- commands -------------------------------------------------------------

    async def create(self, req: CreateRequest) -> SandboxRecord:
        timeout = self._check_timeout(req.timeout)
        _check_str_map("metadata", req.metadata, MAX_METADATA_ENTRIES, MAX_METADATA_KEY,
                       MAX_METADATA_VALUE)
        _check_str_map("envVars", req.env_vars, MAX_ENV_ENTRIES, MAX_ENV_NAME, MAX_ENV_VALUE)
        _check_env(req.env_vars)
        try:
            self.limits.check(CPU, req.cpu_count)
            self.limits.check(MEMORY, req.memory_mb)
        except ResourceError as exc:
            raise BadRequest(str(exc)) from exc
        try:
            template = self.templates.get(req.template)
        except TemplateNotFound as exc:
            try:
                manifest = await asyncio.to_thread(self.snapshots.resolve, req.template)
            except SnapshotNotFound:
                raise NotFound(f"template or snapshot '{req.template}' not found") from exc
            except SnapshotError as snap_exc:
                raise OrchestratorError(f"snapshot repository: {snap_exc}") from snap_exc
            return await self._create_from_snapshot(req, manifest, timeout)
        if template.snapshot_id and not (self.images and self.images.pool_size > 0):
            # A built template: restore its snapshot (with a warm pool, the path
            # below hands out pooled sandboxes restored from it).
            try:
                manifest = await asyncio.to_thread(self.snapshots.resolve, template.snapshot_id)
            except SnapshotNotFound as exc:
                raise NotFound(f"snapshot of template '{req.template}' is gone") from exc
            except SnapshotError as exc:
                raise OrchestratorError(f"snapshot repository: {exc}") from exc
            return await self._create_from_snapshot(req, manifest, timeout, template)
        self._check_capacity()
        # (a built template's resources are its snapshot's)
        custom = bool(req.cpu_count or req.memory_mb) and not template.snapshot_id
        member = self.images.take(template) if self.images and not custom else None
        now = time.time()
        record = SandboxRecord(
            sandbox_id=member.sandbox_id if member else new_sandbox_id(),
            template_id=template.template_id,
            alias=template.alias,
            state=SandboxState.CREATING,
            node_id=self.config.node_id,
            cpu_count=self.limits.clamp(CPU, (custom and req.cpu_count) or template.cpu_count
                                        or self.config.default_cpu_count, 1),
            memory_mb=self.limits.clamp(MEMORY, (custom and req.memory_mb) or template.memory_mb
                                        or self.config.default_memory_mb, 512),
            disk_size_mb=self.limits.clamp(DISK, template.disk_size_mb
                                           or self.config.default_disk_mb),
            started_at=now,
            end_at=now + timeout,
            auto_pause=req.auto_pause,
            internet=req.internet,
            network=req.network.to_json() if req.network else {},
            traffic_token="" if req.public_traffic else secrets.token_urlsafe(32),
            metadata=dict(req.metadata),
            env_vars={**dict(template.envs), **req.env_vars},
            envd_token=secrets.token_urlsafe(32),
        )
        self._records[record.sandbox_id] = record
        self.store.put(record)
        # The work runs as its own task: a client that hangs up mid-create does
        # not leave a half-built sandbox; the task finishes or cleans up.
        if member is not None:
            work = self._adopt(record, member, template)
        else:
            image = await self.images.image(template) if self.images and not custom else None
            work = (self._restore_or_boot(record, template, image) if image
                    else self._build(record, template))
        task = asyncio.create_task(self._never_stuck(record, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _never_stuck(self, record: SandboxRecord, work) -> SandboxRecord:
        """Whatever ``work`` raises, its record does not stay ``creating`` (counted
        against capacity for ever): the failure paths tear down what they started,
        and an error none of them expected tears down the rest here."""
        try:
            return await work
        except BaseException:
            if record.state is SandboxState.CREATING and \
                    self._records.get(record.sandbox_id) is record:
                log.exception("create of %s failed unexpectedly", record.sandbox_id)
                await asyncio.shield(self._teardown(record, True))
            raise

    async def _adopt(self, record: SandboxRecord, member: PooledSandbox,
                     template: Template) -> SandboxRecord:
        """Hand out a sandbox the warm pool restored ahead of time."""
        t0 = time.perf_counter()
        self._hold(record, member.slot)
        self.store.put(record)
        try:
            await self._apply_network(record, member.slot)
            await self.envd.init(member.slot.address, record.envd_token, record.env_vars,
                                 default_user=template.default_user or "user",
                                 default_workdir=template.default_workdir,
                                 current_token=member.envd_token)
            self._transition(record, SandboxState.RUNNING)
        except BaseException as exc:
            log.warning("adopting pooled sandbox %s failed: %s", record.sandbox_id, exc)
            await asyncio.shield(self._teardown(record, True))
            raise OrchestratorError(f"sandbox failed to start: {exc}") from exc
        log.info("created %s in %.0f ms (from the warm pool)", record.sandbox_id,
                 (time.perf_counter() - t0) * 1000)
        return record

    async def _restore_or_boot(self, record: SandboxRecord, template: Template,
                               image: TemplateImage) -> SandboxRecord:
        """Restore the template's image; should that fail, boot as if there were none."""
        t0 = time.perf_counter()
        assert self.images is not None
        try:
            with self.images.using(image):
                await self._restore(record, image.path, source_token=image.envd_token,
                                    hostname_of=image.hostname_of or template.template_id)
        except CapacityExceeded:
            raise
        except OrchestratorError as exc:
            if template.snapshot_id:  # a built template has nothing to boot
                raise
            log.warning("template %s: restoring its image failed (%s); booting instead",
                        template.template_id, exc)
            self.images.forget(template, image)
            record.state, record.slot_index, record.slot_address = SandboxState.CREATING, 0, ""
            self._records[record.sandbox_id] = record
            self.store.put(record)
            return await self._build(record, template)
        log.info("created %s in %.0f ms (from the template image)", record.sandbox_id,
                 (time.perf_counter() - t0) * 1000)
        return record

    async def _build(self, record: SandboxRecord, template: Template) -> SandboxRecord:
        if template.snapshot_id:  # its files and processes are only in its snapshot
            await asyncio.shield(self._teardown(record, False))
            raise NotFound(f"snapshot of template '{template.template_id}' is not available")
        slot = None
        started = False
        t0 = time.perf_counter()
        try:
            await self.ensure_rootfs(template)
            try:
                slot = await self.slots.acquire(internet=record.internet)
            except SlotPoolExhausted as exc:
                raise CapacityExceeded(f"no network slot free: {exc}") from exc
            self._hold(record, slot)
            self.store.put(record)
            await self._apply_network(record, slot)
            spec = self._spec(record, template, slot.netns_path, record.sandbox_id)
            started = True
            t1 = time.perf_counter()
            await self.runtime.start(spec)
            t2 = time.perf_counter()
            await self.envd.wait_ready(slot.address)
            t3 = time.perf_counter()
            await self.envd.init(slot.address, record.envd_token, record.env_vars,
                                 default_user=template.default_user or "user",
                                 default_workdir=template.default_workdir)
            await self.run_start_command(template, slot.address, record.envd_token)
            self._transition(record, SandboxState.RUNNING)
            log.info("created %s in %.0f ms (booted: slot %.0f, runtime %.0f, envd %.0f, "
                     "init %.0f)", record.sandbox_id, (time.perf_counter() - t0) * 1000,
                     (t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000,
                     (time.perf_counter() - t3) * 1000)
            return record
        except BaseException as exc:
            raise await self._aborted(record, started, exc, "start")  # noqa: B904

    async def run_start_command(self, template: Template, address: str, token: str) -> None:
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
                    f"{template.ready_timeout_s:.0f}s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def fork(self, sandbox_id: str, count: int, ttl: int | None = None
                   ) -> list[SandboxRecord | OrchestratorError]:
        """Branch a running sandbox into ``count`` children that continue its exact state.

        The source is stopped only while its state is captured, then keeps its ID,
        state and TTL; each child is restored into a slot of its own. One result
        per child: its record, or the error that stopped it.
        """
        if not 1 <= count <= MAX_FORK:
            raise BadRequest(f"count must be between 1 and {MAX_FORK}")
        seconds = self._check_timeout(ttl)
        image = self.config.run_dir / "images" / f"fork-{new_sandbox_id()}"
        try:
            async with self._lock(sandbox_id):
                source = self.get(sandbox_id)
                if source.state is not SandboxState.RUNNING:
                    raise Conflict(f"sandbox '{sandbox_id}' is {source.state}; only a running "
                                   "sandbox can be forked")
                t0 = time.perf_counter()
                await self.runtime.checkpoint(sandbox_id, image, leave_running=True)
                paused_ms = (time.perf_counter() - t0) * 1000
            log.info("fork of %s: source stopped %.0f ms for the capture", sandbox_id, paused_ms)
            results = await asyncio.gather(
                *(self._restore_child(source, image, seconds) for _ in range(count)),
                return_exceptions=True,
            )
        finally:
            await asyncio.to_thread(shutil.rmtree, image, True)
        out: list[SandboxRecord | OrchestratorError] = []
        for result in results:
            if isinstance(result, OrchestratorError | SandboxRecord):
                out.append(result)
            elif isinstance(result, BaseException):
                out.append(OrchestratorError(f"child failed to start: {result}"))
        return out

    async def _restore_child(self, source: SandboxRecord, image: Path, ttl: int) -> SandboxRecord:
        self._check_capacity()
        now = time.time()
        record = SandboxRecord(
            sandbox_id=new_sandbox_id(), template_id=source.template_id, alias=source.alias,
            state=SandboxState.CREATING, node_id=self.config.node_id,
            cpu_count=source.cpu_count, memory_mb=source.memory_mb,
            disk_size_mb=source.disk_size_mb, started_at=now, end_at=now + ttl,
            auto_pause=source.auto_pause, internet=source.internet,
            network=dict(source.network),
            traffic_token=secrets.token_urlsafe(32) if source.traffic_token else "",
            metadata=dict(source.metadata), env_vars=dict(source.env_vars),
            envd_token=secrets.token_urlsafe(32),
        )
        self._records[record.sandbox_id] = record
        self.store.put(record)
        task = asyncio.create_task(
            self._restore(record, image, source_token=source.envd_token,
                          hostname_of=source.sandbox_id)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _restore(self, record: SandboxRecord, image: Path, source_token: str,
                       hostname_of: str) -> SandboxRecord:
        """Bring ``record`` up from a checkpoint image in a fresh slot."""
        slot = None
        started = False
        try:
            try:
                template = self.templates.get(record.template_id)
            except TemplateNotFound as exc:
                raise NotFound(f"template of the snapshot is gone: {exc}") from exc
            await self.ensure_rootfs(template)
            try:
                slot = await self.slots.acquire(internet=record.internet)
            except SlotPoolExhausted as exc:
                raise CapacityExceeded(f"no network slot free: {exc}") from exc
            self._hold(record, slot)
            self.store.put(record)
            await self._apply_network(record, slot)
            spec = self._spec(record, template, slot.netns_path, hostname_of)
            started = True
            await self.runtime.restore(spec, image)
            await self.envd.wait_ready(slot.address)
            await self.envd.init(slot.address, record.envd_token, record.env_vars,
                                 default_user=template.default_user or "user",
                                 default_workdir=template.default_workdir,
                                 current_token=source_token)
            self._transition(record, SandboxState.RUNNING)
            return record
        except BaseException as exc:
            raise await self._aborted(record, started, exc, "restore")  # noqa: B904

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

    def _templates_in_use(self) -> set[str]:
        """Templates whose rootfs must stay: sandboxes starting, running or being resumed,
        pooled ones and template images being built. Called from worker threads."""
        used = set()
        for r in list(self._records.values()):
            lock = self._locks.get(r.sandbox_id)
            if r.state in (SandboxState.CREATING, SandboxState.RUNNING) or \
                    (lock is not None and lock.locked()):
                used.add(r.template_id)
        if self.images is not None:
            used |= self.images.templates_in_use()
        return used

    def _spec(self, record: SandboxRecord, template: Template, netns_path: str,
              hostname_of: str) -> SandboxSpec:
        return self.spec_for(record.sandbox_id, template, record.cpu_count, record.memory_mb,
                             netns_path, hostname_of)

    def spec_for(self, sandbox_id: str, template: Template, cpu_count: int, memory_mb: int,
                 netns_path: str, hostname_of: str) -> SandboxSpec:
        """The runtime spec of a sandbox of ``template`` (the same for boot and restore:
        a restore must match what was checkpointed)."""
        assert self._bundle is not None
        # The last word on what runsc is given, whatever the record says.
        limits = self.limits
        disk_mb = limits.clamp(DISK, template.disk_size_mb or self.config.default_disk_mb, 1024)
        cpu_count = limits.clamp(CPU, cpu_count, 1)
        memory_mb = limits.clamp(MEMORY, memory_mb, 512)
        return SandboxSpec(
            sandbox_id=sandbox_id,
            rootfs=template.rootfs,
            hostname=f"sbx-{hostname_of[:8]}",
            cpu_count=cpu_count,
            memory_mb=memory_mb,
            netns_path=netns_path,
            runtime_bundle=self._bundle,
            bundle_mount=BUNDLE_MOUNT,
            init_args=self._init_argv,
            init_env={**self._init_env, "AENV_MEMORY_LIMIT_MB": str(memory_mb),
                      # envd's guard keeps / and /tmp together within the writable
                      # budget (runsc has no size limit for the in-memory root layer).
                      "AENV_DISK_LIMIT_MB": str(files_quota_mb(disk_mb, memory_mb))},
            disk_mb=disk_mb,
        )

    # -- snapshots, pause, resume --------------------------------------------------

    def _snapshot_metadata(self, record: SandboxRecord, kind: str) -> dict:
        return {
            "kind": kind,
            "template_id": record.template_id,
            "alias": record.alias,
            "source_sandbox_id": record.sandbox_id,
            "parent_snapshot_id": record.snapshot_id or None,
            "cpu_count": record.cpu_count,
            "memory_mb": record.memory_mb,
            "disk_size_mb": record.disk_size_mb,
            "internet": record.internet,
            "metadata": record.metadata,
            "env_vars": record.env_vars,
            # The token lives in the memory image too; a child rotates it.
            "envd_token": record.envd_token,
            # With the rest, enough for another node to rebuild the record (adopt_paused).
            "auto_pause": record.auto_pause,
            "started_at": record.started_at,
            "runtime": {"kind": self.runtime.kind, "version": self.runtime.version},
            "bundle": self._bundle.name if self._bundle else "",
            "created_at": time.time(),
        }

    def _resources_of(self, meta: dict) -> dict[str, int]:
        """A snapshot's resources as its metadata says, within the node's bounds."""
        return {"cpu_count": self.limits.clamp(CPU, meta.get("cpu_count"), 1),
                "memory_mb": self.limits.clamp(MEMORY, meta.get("memory_mb"), 512),
                "disk_size_mb": self.limits.clamp(DISK, meta.get("disk_size_mb"), 0)}

    def _check_restorable(self, metadata: dict) -> None:
        runtime = metadata.get("runtime", {})
        if runtime.get("kind") != self.runtime.kind or runtime.get("version") != \
                self.runtime.version:
            raise Conflict(
                f"snapshot was taken by runtime {runtime.get('kind')} {runtime.get('version')}; "
                f"this node runs {self.runtime.kind} {self.runtime.version}"
            )
        if self._bundle is not None and metadata.get("bundle") not in ("", self._bundle.name):
            raise Conflict(f"snapshot needs envd bundle {metadata.get('bundle')}, this node has "
                           f"{self._bundle.name}")

    async def snapshot(self, sandbox_id: str, name: str | None = None):
        """Capture a running sandbox (stopped only for the capture) and commit it."""
        snapshot_id = new_sandbox_id()
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox '{sandbox_id}' is {record.state}; only a running "
                               "sandbox can be snapshotted")
            staging = await self._capture(sandbox_id, snapshot_id, leave_running=True)
        metadata = self._snapshot_metadata(record, "snapshot")
        try:
            return await asyncio.to_thread(
                self.snapshots.commit, snapshot_id, staging, metadata, name
            )
        except BaseException:
            await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
            raise

    async def _capture(self, sandbox_id: str, snapshot_id: str, leave_running: bool) -> Path:
        """Checkpoint into a fresh staging dir; on failure nothing stays staged."""
        staging = await self._staging(snapshot_id)
        try:
            await self.runtime.checkpoint(sandbox_id, staging, leave_running=leave_running)
        except BaseException as exc:
            await asyncio.to_thread(self.snapshots.discard_staging, snapshot_id)
            if isinstance(exc, RuntimeFailure) and "no space left" in str(exc).lower():
                raise StorageFull(f"no space left on the node's snapshot staging disk "
                                  f"({self.snapshots.staging_dir})") from exc
            raise
        return staging

    async def _staging(self, snapshot_id: str) -> Path:
        try:
            return await asyncio.to_thread(self.snapshots.new_staging, snapshot_id)
        except SnapshotError as exc:
            raise OrchestratorError(f"cannot stage a snapshot: {exc}") from exc

    async def pause(self, sandbox_id: str) -> SandboxRecord:
        """Save the sandbox's full state and release everything it holds on the node.

        Returns once the state is captured locally; the commit to the repository
        continues in the background (a resume waits for it).
        """
        snapshot_id = new_sandbox_id()
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is SandboxState.PAUSED:
                raise Conflict(f"sandbox '{sandbox_id}' is already paused")
            if record.state is not SandboxState.RUNNING:
                raise not_running(record)
            try:
                staging = await self._capture(sandbox_id, snapshot_id, leave_running=False)
            except BaseException as exc:
                await self._after_failed_pause(record, exc)
                raise
            metadata = self._snapshot_metadata(record, "pause")
            (staging.parent / f"{snapshot_id}.meta.json").write_text(json.dumps(metadata))
            previous = record.snapshot_id
            # The state is saved: freeing the stopped runtime and its slot need not
            # hold up the answer. Whatever reuses the ID waits for it (_settled).
            slot = self._slots.pop(sandbox_id, None)
            record.slot_index, record.slot_address = 0, ""
            record.snapshot_id = snapshot_id
            self._transition(record, SandboxState.PAUSED)
            self._releasing[sandbox_id] = asyncio.create_task(self._free(sandbox_id, slot))
            for listener in self.on_removed:
                listener(sandbox_id)
            self._start_commit(snapshot_id, staging, metadata, replaces=previous)
            return record

    async def _free(self, sandbox_id: str, slot: Slot | None) -> None:
        try:
            await self.runtime.destroy(sandbox_id)
            if slot is not None:
                await self.slots.release(slot)
        except Exception:
            log.exception("freeing the runtime of paused sandbox %s failed", sandbox_id)
        finally:
            self._releasing.pop(sandbox_id, None)

    async def _settled(self, sandbox_id: str) -> None:
        """Wait until a paused sandbox's old runtime is gone (its ID can be reused)."""
        task = self._releasing.get(sandbox_id)
        if task is not None:
            await asyncio.shield(task)

    async def _after_failed_pause(self, record: SandboxRecord, exc: BaseException) -> None:
        """A failed capture may have stopped the sandbox: then nothing can be saved
        and the sandbox is gone; otherwise it keeps running as it was."""
        state = await self.runtime.state(record.sandbox_id)
        if state is None or state.state != "running":
            log.error("pause of %s failed and the sandbox stopped (%s): it is lost",
                      record.sandbox_id, exc)
            await asyncio.shield(self._teardown(record, True))

    def _start_commit(self, snapshot_id: str, staging: Path, metadata: dict,
                      replaces: str = "") -> None:
        async def run() -> None:
            try:
                await asyncio.to_thread(self.snapshots.commit, snapshot_id, staging, metadata)
                (staging.parent / f"{snapshot_id}.meta.json").unlink(missing_ok=True)
                if replaces:
                    with contextlib.suppress(SnapshotError):
                        await asyncio.to_thread(self.snapshots.delete, replaces)
            except Exception:
                log.exception("commit of pause snapshot %s failed; it stays staged", snapshot_id)
                raise
            finally:
                self._commits.pop(snapshot_id, None)

        self._commits[snapshot_id] = asyncio.create_task(run())

    def _recommit_if_staged(self, record: SandboxRecord) -> None:
        """After a restart: a pause whose commit did not finish is committed again."""
        staging = self.snapshots.staging_dir / record.snapshot_id
        meta = self.snapshots.staging_dir / f"{record.snapshot_id}.meta.json"
        if staging.is_dir() and meta.is_file():
            log.info("resuming the commit of pause snapshot %s", record.snapshot_id)
            self._start_commit(record.snapshot_id, staging, json.loads(meta.read_text()))

    async def _pause_image(self, record: SandboxRecord) -> Path:
        """Where a paused sandbox's state is on this node: the committed snapshot's
        cache, or, while its commit has not gone through (repository down), the
        capture still staged here."""
        pending = self._commits.get(record.snapshot_id)
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        staged = self.snapshots.staging_dir / record.snapshot_id
        if (self.snapshots.staging_dir / f"{record.snapshot_id}.meta.json").is_file() \
                and staged.is_dir():
            log.info("resuming %s from its uncommitted local capture", record.sandbox_id)
            return staged
        try:
            return await asyncio.to_thread(self.snapshots.materialize, record.snapshot_id)
        except SnapshotNotFound as exc:
            raise NotFound(f"snapshot of sandbox '{record.sandbox_id}' is gone") from exc
        except SnapshotError as exc:
            raise OrchestratorError(f"snapshot repository: {exc}") from exc

    def _drop_staged_pause(self, snapshot_id: str) -> None:
        self.snapshots.discard_staging(snapshot_id)
        (self.snapshots.staging_dir / f"{snapshot_id}.meta.json").unlink(missing_ok=True)

    def _retry_failed_commits(self) -> None:
        """Paused sandboxes whose capture is only staged get their commit again."""
        for record in self._records.values():
            if record.state is SandboxState.PAUSED and record.snapshot_id not in self._commits:
                self._recommit_if_staged(record)

    async def resume(self, sandbox_id: str, ttl: int | None = None,
                     auto_pause: bool | None = None) -> SandboxRecord:
        """Bring a paused sandbox back, same ID, from its pause snapshot."""
        seconds = self._check_timeout(ttl)
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is not SandboxState.PAUSED:
                raise Conflict(f"sandbox '{sandbox_id}' is {record.state}, not paused")
            image = await self._pause_image(record)
            await self._settled(sandbox_id)
            await self._restore_in_place(record, image)
            if image.parent == self.snapshots.staging_dir:
                await asyncio.to_thread(self._drop_staged_pause, record.snapshot_id)
            record.end_at = time.time() + seconds
            if auto_pause is not None:
                record.auto_pause = auto_pause
            self.store.put(record)
            return record

    def pause_committed(self, record: SandboxRecord) -> bool:
        """Whether a paused sandbox's snapshot is in the repository (not only staged here)."""
        sid = record.snapshot_id
        return bool(sid) and sid not in self._commits and not (
            self.snapshots.staging_dir / f"{sid}.meta.json").is_file()

    def disown(self, sandbox_id: str) -> bool:
        """Drop the record of a paused sandbox another node has taken over; its
        snapshot is that node's now, so it is left alone. False if not idle-paused."""
        record = self._records.get(sandbox_id)
        if record is None or record.state is not SandboxState.PAUSED \
                or self._lock(sandbox_id).locked() or sandbox_id in self._releasing \
                or not self.pause_committed(record):
            return False
        self.store.delete(sandbox_id)
        self._records.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        log.info("paused sandbox %s now lives on another node; record dropped", sandbox_id)
        return True

    async def adopt_paused(self, sandbox_id: str, snapshot_id: str) -> SandboxRecord:
        """Take over a paused sandbox whose node is gone, from its committed pause
        snapshot: the record is rebuilt from the snapshot's metadata, PAUSED, same ID
        and envd token; a resume then restores it on this node."""
        async with self._lock(sandbox_id):
            existing = self._records.get(sandbox_id)
            if existing is not None and existing.state is not SandboxState.KILLED:
                if existing.state is SandboxState.PAUSED and existing.snapshot_id == snapshot_id:
                    return existing
                raise Conflict(f"sandbox '{sandbox_id}' is already on this node "
                               f"({existing.state})")
            try:
                manifest = await asyncio.to_thread(self.snapshots.get, snapshot_id)
            except SnapshotNotFound as exc:
                raise NotFound(f"snapshot '{snapshot_id}' not found") from exc
            except SnapshotError as exc:
                raise OrchestratorError(f"snapshot repository: {exc}") from exc
            meta = manifest.metadata
            if meta.get("kind") != "pause" or meta.get("source_sandbox_id") != sandbox_id:
                raise BadRequest(f"snapshot '{snapshot_id}' is not a pause of '{sandbox_id}'")
            self._check_restorable(meta)
            now = time.time()
            record = SandboxRecord(
                sandbox_id=sandbox_id, template_id=meta["template_id"],
                alias=meta.get("alias") or meta["template_id"], state=SandboxState.PAUSED,
                node_id=self.config.node_id, **self._resources_of(meta),
                started_at=float(meta.get("started_at") or now), end_at=now,
                auto_pause=bool(meta.get("auto_pause", True)),
                internet=bool(meta.get("internet", True)),
                metadata=dict(meta.get("metadata") or {}),
                env_vars=dict(meta.get("env_vars") or {}),
                envd_token=meta["envd_token"], snapshot_id=snapshot_id,
            )
            self._records[sandbox_id] = record
            self.store.put(record)
            log.info("adopted paused sandbox %s from snapshot %s", sandbox_id, snapshot_id)
            return record

    async def connect(self, sandbox_id: str, ttl: int | None = None) -> SandboxRecord:
        """A running sandbox as it is (a given TTL extends it); a paused one is resumed."""
        record = self.get(sandbox_id)
        if record.state is SandboxState.PAUSED:
            return await self.resume(sandbox_id, ttl)
        if ttl is not None:
            return await self.set_timeout(sandbox_id, ttl)
        return record

    async def _restore_in_place(self, record: SandboxRecord, image: Path) -> None:
        """Restore a paused record; on failure it stays paused, holding nothing."""
        slot = None
        try:
            template = self.templates.get(record.template_id)
            await self.ensure_rootfs(template)
            try:
                slot = await self.slots.acquire(internet=record.internet)
            except SlotPoolExhausted as exc:
                raise CapacityExceeded(f"no network slot free: {exc}") from exc
            await self._apply_network(record, slot)
            spec = self._spec(record, template, slot.netns_path, record.sandbox_id)
            await self.runtime.restore(spec, image)
            await self.envd.wait_ready(slot.address)
        except BaseException as exc:
            if slot is not None:
                await asyncio.shield(self.runtime.destroy(record.sandbox_id))
                await asyncio.shield(self.slots.release(slot))
            if isinstance(exc, TemplateNotFound):
                raise NotFound(f"template of the snapshot is gone: {exc}") from exc
            if isinstance(exc, RuntimeFailure | EnvdUnavailable):
                raise OrchestratorError(f"sandbox failed to resume: {exc}") from exc
            raise
        self._hold(record, slot)
        self._transition(record, SandboxState.RUNNING)

    async def _create_from_snapshot(self, req: CreateRequest, manifest, ttl: int,
                                    template: Template | None = None) -> SandboxRecord:
        """A sandbox restored from a snapshot; ``template`` when that snapshot is a
        built template's (the sandbox is then of that template, with its env vars)."""
        meta = manifest.metadata
        self._check_restorable(meta)
        self._check_capacity()
        try:
            image = await asyncio.to_thread(self.snapshots.materialize, manifest.snapshot_id)
        except SnapshotError as exc:
            raise OrchestratorError(f"snapshot repository: {exc}") from exc
        now = time.time()
        record = SandboxRecord(
            sandbox_id=new_sandbox_id(),
            template_id=template.template_id if template else meta["template_id"],
            alias=template.alias if template else meta.get("alias") or meta["template_id"],
            state=SandboxState.CREATING,
            node_id=self.config.node_id, **self._resources_of(meta),
            started_at=now, end_at=now + ttl, auto_pause=req.auto_pause,
            internet=req.internet,
            network=req.network.to_json() if req.network else {},
            traffic_token="" if req.public_traffic else secrets.token_urlsafe(32),
            # A template build's sandbox metadata is not the template's sandboxes'.
            metadata={**({} if template else meta.get("metadata", {})), **req.metadata},
            env_vars={**meta.get("env_vars", {}), **dict(template.envs if template else ()),
                      **req.env_vars},
            envd_token=secrets.token_urlsafe(32),
        )
        self._records[record.sandbox_id] = record
        self.store.put(record)
        task = asyncio.create_task(self._restore(
            record, image, source_token=meta["envd_token"],
            hostname_of=meta.get("source_sandbox_id", record.sandbox_id)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def kill(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is SandboxState.CREATING:
                raise Conflict(f"sandbox '{sandbox_id}' is still being created")
            if record.state is SandboxState.PAUSED:
                await self._forget_paused(record)
                return
            # (an ERROR sandbox's runtime is gone already)
            await asyncio.shield(self._teardown(record, record.state is SandboxState.RUNNING))
            if record.snapshot_id:  # its last pause snapshot is of no further use
                with contextlib.suppress(SnapshotError):
                    await asyncio.to_thread(self.snapshots.delete, record.snapshot_id)

    async def _forget_paused(self, record: SandboxRecord) -> None:
        await self._settled(record.sandbox_id)
        pending = self._commits.get(record.snapshot_id)
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        with contextlib.suppress(SnapshotError):
            await asyncio.to_thread(self.snapshots.delete, record.snapshot_id)
        await asyncio.to_thread(self.snapshots.discard_staging, record.snapshot_id)
        record.state = SandboxState.KILLED
        self.store.delete(record.sandbox_id)
        self._records.pop(record.sandbox_id, None)
        self._locks.pop(record.sandbox_id, None)

    async def set_timeout(self, sandbox_id: str, ttl: int | None) -> SandboxRecord:
        seconds = self._check_timeout(ttl)
        record = self.get(sandbox_id)
        record.end_at = time.time() + seconds
        self.store.put(record)
        return record

    # -- internals ------------------------------------------------------------

    async def _aborted(self, record: SandboxRecord, started: bool, exc: BaseException,
                       verb: str) -> BaseException:
        """Undo a sandbox that failed to start or restore; the error to raise."""
        log.warning("%s of %s failed: %s", verb, record.sandbox_id, exc)
        await asyncio.shield(self._teardown(record, started))
        if isinstance(exc, RuntimeFailure | EnvdUnavailable):
            wrapped = OrchestratorError(f"sandbox failed to {verb}: {exc}")
            wrapped.__cause__ = exc
            return wrapped
        return exc

    async def set_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        """Replace a sandbox's egress policy; in force at once when it runs, and kept
        in its record for resume, fork and restarts."""
        async with self._lock(sandbox_id):
            record = self.get(sandbox_id)
            if record.state is SandboxState.CREATING:
                raise Conflict(f"sandbox '{sandbox_id}' is still being created")
            previous = (record.network, record.internet)
            record.network, record.internet = policy.to_json(), not policy.denies_all
            slot = self._slots.get(sandbox_id)
            if record.state is SandboxState.RUNNING and slot is not None:
                try:
                    await self._apply_network(record, slot, force=True)
                except BaseException:
                    record.network, record.internet = previous
                    raise
            self.store.put(record)
            return record

    async def _apply_network(self, record: SandboxRecord, slot: Slot, force: bool = False
                             ) -> None:
        """Put the record's egress policy in force on its slot (no-op for an open one
        unless ``force``: a fresh slot has no policy). Internet off is applied too:
        a sandbox from the warm pool sits in a slot that had it on."""
        if not record.network and record.internet and not force:
            return
        policy = EgressPolicy.from_json(record.network)
        if not record.internet and policy.is_open:
            policy = EgressPolicy(deny_out=("0.0.0.0/0",))
        compiled = await asyncio.to_thread(compile_policy, policy)
        if compiled.unresolved:
            log.warning("sandbox %s: allowOut names that did not resolve (retried every %.0fs): "
                        "%s", record.sandbox_id, self.config.egress_refresh_s,
                        ", ".join(compiled.unresolved))
        await self.slots.apply_policy(slot, compiled)

    async def _refresh_domain_policies(self) -> None:
        """Re-resolve the domains of running sandboxes' policies (addresses change)."""
        for record in list(self._records.values()):
            slot = self._slots.get(record.sandbox_id)
            if record.state is not SandboxState.RUNNING or slot is None or not record.network:
                continue
            if not EgressPolicy.from_json(record.network).domains:
                continue
            try:
                async with self._lock(record.sandbox_id):
                    if self._slots.get(record.sandbox_id) is slot:
                        await self._apply_network(record, slot)
            except Exception:
                log.exception("refreshing the egress policy of %s failed", record.sandbox_id)

    def _hold(self, record: SandboxRecord, slot: Slot) -> None:
        self._slots[record.sandbox_id] = slot
        record.slot_index, record.slot_address = slot.index, slot.address

    async def _release_slot(self, record: SandboxRecord) -> None:
        slot = self._slots.pop(record.sandbox_id, None)
        record.slot_index, record.slot_address = 0, ""
        if slot is not None:
            try:
                await self.slots.release(slot)
            except Exception:
                log.exception("release of slot %s of %s failed", slot.index, record.sandbox_id)

    async def _teardown(self, record: SandboxRecord, started: bool) -> None:
        record.state = SandboxState.KILLED
        if started:
            try:
                await self.runtime.destroy(record.sandbox_id)
            except Exception:
                log.exception("destroy %s failed", record.sandbox_id)
        await self._release_slot(record)
        self.store.delete(record.sandbox_id)
        self._records.pop(record.sandbox_id, None)
        self._locks.pop(record.sandbox_id, None)
        for listener in self.on_removed:
            listener(record.sandbox_id)

    def _transition(self, record: SandboxRecord, to: SandboxState) -> None:
        if to not in TRANSITIONS[record.state]:
            raise Conflict(f"sandbox '{record.sandbox_id}' cannot go from {record.state} to {to}")
        record.state = to
        self.store.put(record)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def _check_timeout(self, timeout: int | None) -> int:
        if timeout is None:
            return self.config.default_timeout
        if timeout < 0:
            raise BadRequest("timeout must not be negative")
        if timeout > self.config.max_timeout:
            raise BadRequest(f"timeout must be at most {self.config.max_timeout} seconds")
        return timeout

    async def _ttl_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.runtime.housekeeping()
            except Exception:
                log.exception("runtime housekeeping failed")
            ticks += 1
            if ticks % COMMIT_RETRY_TICKS == 0:
                self._retry_failed_commits()
            if ticks % max(1, int(self.config.egress_refresh_s)) == 0:
                await self._refresh_domain_policies()
            now = time.time()
            for record in list(self._records.values()):
                if record.state is SandboxState.RUNNING and record.expired(now):
                    log.info("sandbox %s reached its timeout: %s", record.sandbox_id,
                             "pausing" if record.auto_pause else "killing")
                    await self._expire(record)
                elif record.state is SandboxState.ERROR and record.expired(now):
                    with contextlib.suppress(NotFound, Conflict):
                        await self.kill(record.sandbox_id)


    async def _expire(self, record: SandboxRecord) -> None:
        """Pause (or kill) an expired sandbox; a pause that fails kills it, so an
        expired sandbox never goes on holding the node's resources."""
        if record.auto_pause:
            try:
                await self.pause(record.sandbox_id)
                return
            except NotFound:
                return
            except Exception as exc:
                log.error("pause of expired sandbox %s failed (%s); killing it",
                          record.sandbox_id, exc)
        with contextlib.suppress(NotFound, Conflict):
            await self.kill(record.sandbox_id)


def _check_env(env: dict[str, str]) -> None:
    """What a process environment can hold (a NUL byte once reached envd: a 500)."""
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise BadRequest(f"envVars: {k!r} is not a valid environment variable "
                             "(names are non-empty without '='; no NUL bytes)")


def _check_str_map(name: str, value: dict, limit: int, key_max: int, value_max: int) -> None:
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be an object of strings")
    if len(value) > limit:
        raise BadRequest(f"{name} has {len(value)} entries; at most {limit} are allowed")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise BadRequest(f"{name} must map strings to strings")
        if len(k) > key_max:
            raise BadRequest(f"{name}: a key of {len(k)} characters; at most {key_max}")
        if len(v) > value_max:
            raise BadRequest(f"{name}: the value of {k[:64]!r} has {len(v)} characters; "
                             f"at most {value_max}")
