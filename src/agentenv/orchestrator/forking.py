"""New sandboxes from a captured state: fork children, and creates from a snapshot.

A fork stops its source only while its state is captured; each child is then
restored from that capture into a slot of its own, with its own ID and envd token,
continuing the source's memory, processes and files.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from ..snapshot import Manifest, SnapshotError
from ..templates import Template, TemplateNotFound
from . import disk_pause
from .core import ManagerCore
from .models import (
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    new_sandbox_id,
)
from .records import Resources, new_record
from .requests import CreateRequest, check_fork_count

log = logging.getLogger(__name__)


class Forking(ManagerCore):
    async def fork(self, sandbox_id: str, count: int, ttl: int | None = None
                   ) -> list[SandboxRecord | OrchestratorError]:
        """Branch a running sandbox into ``count`` children that continue its exact state.

        The source is stopped only while its state is captured, then keeps its ID,
        state and TTL; each child is restored into a slot of its own. One result
        per child: its record, or the error that stopped it.
        """
        check_fork_count(count)
        seconds = self._check_timeout(ttl)
        image = self.config.run_dir / "images" / f"fork-{new_sandbox_id()}"
        try:
            async with self._lock(sandbox_id):
                source = self.get(sandbox_id)
                if source.state is not SandboxState.RUNNING:
                    raise Conflict(f"sandbox '{sandbox_id}' is {source.state}; only a running "
                                   "sandbox can be forked")
                await self._before_capture(sandbox_id)
                t0 = time.perf_counter()
                await self.runtime.checkpoint(sandbox_id, image, leave_running=True)
                paused_ms = (time.perf_counter() - t0) * 1000
            log.info("fork of %s: source stopped %.0f ms for the capture", sandbox_id, paused_ms)
            results = await asyncio.gather(
                *(self._fork_child(source, image, seconds) for _ in range(count)),
                return_exceptions=True)
        finally:
            await asyncio.to_thread(shutil.rmtree, image, True)
        out: list[SandboxRecord | OrchestratorError] = []
        for result in results:
            if isinstance(result, OrchestratorError | SandboxRecord):
                out.append(result)
            elif isinstance(result, BaseException):
                out.append(OrchestratorError(f"child failed to start: {result}"))
        return out

    async def _fork_child(self, source: SandboxRecord, image: Path, ttl: int) -> SandboxRecord:
        self._check_capacity()
        record = new_record(
            node_id=self.config.node_id, template_id=source.template_id, alias=source.alias,
            resources=Resources(source.cpu_count, source.memory_mb, source.disk_size_mb),
            ttl=ttl, auto_pause=source.auto_pause, auto_pause_memory=source.auto_pause_memory,
            internet=source.internet,
            network=source.network, private_ports=bool(source.traffic_token),
            metadata=source.metadata, env_vars=source.env_vars,
            auto_resume=source.auto_resume, resume_timeout=ttl,
            mask_request_host=source.mask_request_host)
        self._add(record)
        return await self._as_task(record, self._restore_new(
            record, image, source_token=source.envd_token, hostname_of=source.sandbox_id))

    async def _create_from_snapshot(self, req: CreateRequest, manifest: Manifest, ttl: int,
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
        ticket = await self._admit(req)
        try:
            record = self._snapshot_record(req, meta, ttl, template)
        finally:
            ticket.release()
        return await self._as_task(record, self._restore_new(
            record, image, source_token=meta["envd_token"],
            hostname_of=meta.get("source_sandbox_id", record.sandbox_id), new_boot=True,
            template=template))

    def _snapshot_record(self, req: CreateRequest, meta: dict, ttl: int,
                         template: Template | None) -> SandboxRecord:
        record = new_record(
            node_id=self.config.node_id,
            template_id=template.template_id if template else meta["template_id"],
            alias=template.alias if template else meta.get("alias") or meta["template_id"],
            resources=self._resources(meta.get("cpu_count"), meta.get("memory_mb"),
                                      meta.get("disk_size_mb")),
            ttl=ttl, auto_pause=req.auto_pause, auto_pause_memory=req.auto_pause_memory,
            internet=req.internet, network=req.network.to_json() if req.network else {},
            private_ports=not req.public_traffic,
            # A template build's sandbox metadata is not the template's sandboxes'.
            metadata={**({} if template else meta.get("metadata", {})), **req.metadata},
            env_vars={**meta.get("env_vars", {}), **dict(template.envs if template else ()),
                      **req.env_vars}, **req.ingress(ttl), **req.stamps())
        self._add(record)
        return record

    async def _restore_new(self, record: SandboxRecord, image: Path, source_token: str,
                           hostname_of: str, new_boot: bool = False,
                           template: Template | None = None) -> SandboxRecord:
        """Bring a new record up from a capture, rotating envd's token to its own; a
        create (``new_boot``) gets a boot ID of its own, a fork child keeps its source's.
        ``template``: the build the capture is of (a tag may name an older one)."""
        if disk_pause.is_disk_capture(image):  # files only: a boot, then the files
            return await self._bring_up(record, self._plan(
                record, template or self._bootable_template(record), files=image,
                hostname_of=record.sandbox_id, start_command=True, new_boot=True))
        try:
            template = template or self.templates.get(record.template_id)
        except TemplateNotFound as exc:
            raise NotFound(f"template of the snapshot is gone: {exc}") from exc
        return await self._bring_up(record, self._plan(
            record, template, image=image, hostname_of=hostname_of, current_token=source_token,
            new_boot=new_boot))
