"""The node's side of the cluster: register with the scheduler and keep heartbeating.

Each heartbeat is the node's status (capacity, load, free memory, caches, runtime)
and its sandboxes with their latest pause snapshot: all of them in the first beat and
whenever the scheduler asks (it lost track, the node was cut off, a periodic check),
else those changed since the beat it last applied (``cluster/beats.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import httpx

from ..api import models
from ..cluster.beats import Beats, send_beat
from ..cluster.common import Failover, NodeStatus, SandboxEntry
from ..images.store import hex_of
from ..orchestrator import SandboxState
from ..snapshot import SnapshotError, SnapshotNotFound

if TYPE_CHECKING:
    from ..orchestrator import SandboxManager

log = logging.getLogger(__name__)


def free_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def node_status(manager: SandboxManager, url: str) -> NodeStatus:
    cfg = manager.config
    # A template whose boot image this node holds makes a warm create here.
    templates = set(manager.boot_images.cached_templates() if manager.boot_images else [])
    store = manager.snapshots
    cached = store.cache_dir.iterdir() if store.cache_dir.is_dir() else iter(())
    snapshots = sorted(p.name for p in cached if p.is_dir() and store.is_cached(p.name))
    # So does a built template whose snapshot this node caches (by ID and alias: a
    # create names either).
    # And an image's template (a create from an image) whose layers are all here.
    held = set(snapshots)
    layers = manager.image_cache.store
    for template in manager.templates.list():
        if (template.snapshot_id and template.snapshot_id in held) or (
                template.image is not None and template.image.layers
                and all(layers.has(hex_of(d)) for d, _ in template.image.layers)):
            templates.update((template.template_id, *template.aliases))
    # A running sandbox's snapshot is its last pause (kept after the resume): what
    # it can be resumed from should this node be lost.
    sandboxes = [
        SandboxEntry(sandbox_id=r.sandbox_id, state=str(r.state.value), snapshot_id=r.snapshot_id,
                     committed=r.state in (SandboxState.PAUSED, SandboxState.RUNNING)
                     and manager.pause_committed(r),
                     item=models.listed(r).model_dump(mode="json", by_alias=True))
        for r in manager.list()
    ]
    return NodeStatus(
        node_id=cfg.node_id, url=url, capacity=cfg.max_sandboxes, load=manager.active_count(),
        free_memory_mb=free_memory_mb(), runtime_kind=manager.runtime.kind,
        runtime_version=manager.runtime.version, templates=sorted(templates),
        snapshots=snapshots,
        sandboxes=sandboxes,
    )


class Heartbeat:
    """Posts the node's status to ``scheduler_url`` every ``interval`` seconds."""

    def __init__(self, manager: SandboxManager, scheduler_url: str, advertise_url: str,
                 api_key: str, interval: float) -> None:
        self.manager = manager
        self.schedulers = Failover(scheduler_url)
        self.advertise_url = advertise_url
        self.interval = interval
        self._http = httpx.AsyncClient(headers={"X-API-Key": api_key}, trust_env=False,
                                       timeout=max(interval, 1.0))
        self._task: asyncio.Task | None = None
        self._failing = False
        self.beats = Beats()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._http.aclose()

    async def beat(self) -> None:
        # On the loop, not a thread: it reads the manager's live records (a few stats).
        status = node_status(self.manager, self.advertise_url)
        answer = await send_beat(self._http, self.schedulers, self.beats, status)
        for sandbox_id in answer.get("disown", []):
            self.manager.disown(sandbox_id)

    async def _drop_moved(self) -> None:
        """After a restart: paused sandboxes whose snapshot is gone from the repository
        were resumed or killed on another node while this one was down."""
        for record in list(self.manager.list()):
            if record.state is not SandboxState.PAUSED or not record.snapshot_id:
                continue
            try:
                await asyncio.to_thread(self.manager.snapshots.get, record.snapshot_id)
            except SnapshotNotFound:
                self.manager.disown(record.sandbox_id)
            except SnapshotError:
                return  # repository unreachable: decide another time

    async def _run(self) -> None:
        await self._drop_moved()
        while True:
            try:
                await self.beat()
                if self._failing:
                    log.info("heartbeats to the scheduler go through again")
                self._failing = False
            except Exception as exc:
                if not self._failing:  # once per outage, not once per beat
                    log.warning("heartbeat to %s failed: %s", ", ".join(self.schedulers.urls),
                                exc)
                self._failing = True
            await asyncio.sleep(self.interval)


def advertised_url(config) -> str:
    """Where the cluster reaches this node: ``advertise_url``, else ``http://host:port``."""
    return (config.advertise_url or f"http://{config.host}:{config.port}").rstrip("/")
