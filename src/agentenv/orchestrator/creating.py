"""Creates (the service ``Creates``): a sandbox from a template (a warm-pool member
handed out, the template's boot image restored, or a boot) or from a snapshot (by ID,
name or tag; ``Forks`` restores it), one at a time or a batch. Each create waits its
turn for room (admission.py) and runs as a task of its own (``Lifecycle.as_task``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from ..config import Config
from ..metrics import observed
from ..resources import ResourceLimits
from ..snapshot import Manifest
from ..templates import Template, TemplateNotFound, TemplateRegistry
from ..templates.registry import InvalidTemplateRef
from .admission import Ticket
from .boot_images import BootImage, BootImages, PooledSandbox
from .envd_client import EnvdClient
from .forking import as_they_come
from .lifecycle import Lifecycle
from .models import (
    BadRequest,
    CapacityExceeded,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
)
from .plans import Plans
from .records import new_record
from .requests import CreateRequest, check_batch_count, check_create
from .store import SandboxStore

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class Creates:
    config: Config
    templates: TemplateRegistry
    store: SandboxStore
    envd: EnvdClient
    limits: ResourceLimits
    boot_images: BootImages | None
    life: Lifecycle
    plans: Plans
    admit: Callable[[CreateRequest], Awaitable[Ticket]]  # a create's turn for room (Room.admit)
    resolve_snapshot: Callable[..., Awaitable[Manifest]]  # (name, missing, cause): UserSnapshots
    from_snapshot: Callable[..., Awaitable[SandboxRecord]]  # (req, manifest, ttl, template): Forks

    @observed("create")
    async def create(self, req: CreateRequest) -> SandboxRecord:
        ttl = self.plans.timeout(req.timeout)
        check_create(req, self.limits)
        source = await self._source(req)
        if isinstance(source, Manifest):
            return await self.from_snapshot(req, source, ttl)
        template = source
        pool = self.boot_images
        if template.snapshot_id and not (pool and pool.pool_size > 0):
            # A built template: restore its snapshot (with a warm pool, the path
            # below hands out pooled sandboxes restored from it).
            manifest = await self.resolve_snapshot(
                template.snapshot_id, f"snapshot of template '{req.template}' is gone")
            return await self.from_snapshot(req, manifest, ttl, template)
        ticket = await self.admit(req)
        try:
            record, member = self._new_create(req, template, ttl)
        finally:
            ticket.release()
        custom = req.custom_resources and not template.snapshot_id
        if member is not None:
            return await self.life.as_task(record, self._hand_out(record, member, template))
        image = await pool.image(template) if pool and not custom else None
        work = (self._restore_or_boot(record, template, image) if image
                else self._boot(record, template))
        return await self.life.as_task(record, work)

    def _new_create(self, req: CreateRequest, template: Template, ttl: int
                    ) -> tuple[SandboxRecord, PooledSandbox | None]:
        """The record of an admitted create (a warm-pool member's, if one is there)."""
        pool = self.boot_images
        # A built template's resources are its snapshot's: only a boot takes others.
        custom = req.custom_resources and not template.snapshot_id
        member = pool.take(template) if pool and not custom else None
        record = new_record(
            sandbox_id=member.sandbox_id if member else "", node_id=self.config.node_id,
            template_id=template.template_id, alias=template.alias,
            resources=self.plans.resources(
                (custom and req.cpu_count) or template.cpu_count or self.config.default_cpu_count,
                (custom and req.memory_mb) or template.memory_mb
                or self.config.default_memory_mb,
                template.disk_size_mb or self.config.default_disk_mb),
            ttl=ttl, auto_pause=req.auto_pause, auto_pause_memory=req.auto_pause_memory,
            internet=req.internet, network=req.network.to_json() if req.network else {},
            private_ports=not req.public_traffic, metadata=req.metadata,
            env_vars={**dict(template.envs), **req.env_vars}, **req.ingress(ttl),
            **req.stamps(), origin=f"template:{template.template_id}")
        self.life.add(record)
        return record, member

    async def _hand_out(self, record: SandboxRecord, member: PooledSandbox,
                        template: Template) -> SandboxRecord:
        """A sandbox the warm pool launched ahead of time becomes this record's: its
        egress policy and envd's token and env vars are set, nothing else."""
        t0 = time.perf_counter()
        self.life.started(record, member.slot)
        record.booted_at = time.time()
        self.store.put(record)
        try:
            await self.life.launcher.apply_egress(record.sandbox_id, member.slot, record.network,
                                             record.internet)
            init = self.plans.envd_init(record, template, member.envd_token, new_boot=True)
            await self.envd.init(member.slot.address, init.token, dict(init.env_vars),
                                 default_user=init.default_user,
                                 default_workdir=init.default_workdir,
                                 current_token=init.current_token, boot_id=init.boot_id,
                                 file_access=init.file_access)
            record.ready_at = time.time()
            self.life.transition(record, SandboxState.RUNNING)
        except Exception as exc:
            log.warning("handing out pooled sandbox %s failed: %s", record.sandbox_id, exc)
            raise OrchestratorError(f"sandbox failed to start: {exc}") from exc
        log.info("created %s in %.0f ms (from the warm pool)", record.sandbox_id,
                 (time.perf_counter() - t0) * 1000)
        return record

    async def _restore_or_boot(self, record: SandboxRecord, template: Template,
                               image: BootImage) -> SandboxRecord:
        """Restore the template's boot image; should that fail, boot as if there were none."""
        t0 = time.perf_counter()
        assert self.boot_images is not None
        try:
            with self.boot_images.using(image):
                await self.life.bring_up(record, self.plans.plan(
                    record, template, image=image.path, current_token=image.envd_token,
                    hostname_of=image.hostname_of or template.template_id, new_boot=True))
        except CapacityExceeded:
            raise
        except OrchestratorError as exc:
            if template.snapshot_id:  # a built template has nothing to boot
                raise
            log.warning("template %s: restoring its boot image failed (%s); booting instead",
                        template.template_id, exc)
            self.boot_images.forget(template, image)
            return await self._boot(record, template)
        log.info("created %s in %.0f ms (from the template image)", record.sandbox_id,
                 (time.perf_counter() - t0) * 1000)
        return record

    async def _boot(self, record: SandboxRecord, template: Template) -> SandboxRecord:
        if template.snapshot_id:  # its files and processes are only in its snapshot
            raise NotFound(f"snapshot of template '{template.template_id}' is not available")
        t0 = time.perf_counter()
        await self.life.bring_up(record, self.plans.plan(
            record, template, hostname_of=record.sandbox_id, start_command=True, new_boot=True))
        log.info("created %s in %.0f ms (booted)", record.sandbox_id,
                 (time.perf_counter() - t0) * 1000)
        return record

    async def create_each(self, req: CreateRequest, count: int
                          ) -> AsyncIterator[SandboxRecord | OrchestratorError]:
        """``count`` sandboxes of one create, each handed over as it comes up (a record,
        or the error that stopped it). They start at once from the same image (the
        template's boot image, or the snapshot), each taking its turn for room as a
        create does. A bad request (count, timeout, an unknown template) fails the
        batch as a whole, before any sandbox."""
        check_batch_count(count)
        self.plans.timeout(req.timeout)
        check_create(req, self.limits)
        await self._source(req)
        creates = [asyncio.create_task(self.create(req)) for _ in range(count)]
        async for result in as_they_come(creates, "sandbox failed to start"):
            yield result

    async def _source(self, req: CreateRequest) -> Template | Manifest:
        """What a create starts from: a template, or a snapshot (ID, name or tag)."""
        try:
            return self.templates.get(req.template)
        except TemplateNotFound as exc:
            try:
                return await self.resolve_snapshot(req.template, f"template or snapshot "
                                           f"'{req.template}' not found", exc)
            except NotFound:
                if isinstance(exc, InvalidTemplateRef):
                    raise BadRequest(str(exc)) from exc
                if ":" in req.template:  # say which tag is missing
                    raise NotFound(str(exc)) from exc
                raise

