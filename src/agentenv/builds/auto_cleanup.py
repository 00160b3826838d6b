"""Automatic clean-up of the templates creates from images make (``img-<16 hex>`` and
``setup-<16 hex>-<16 hex>``, see image_sources): one not used for ``idle_s`` seconds
goes, with its boot image or setup snapshot (deleted through the snapshot store, its
chunks then collected) and the mounts only it needed. A later create of the same
image pulls (or converts) and sets it up again.

Never while a sandbox of it exists (running, paused, starting, pooled), while a
create or setup of it is under way, while it is pinned (``pinned_templates``), while
a user's snapshot of one of its sandboxes exists, nor an image while a setup template
of it exists. A user's own named templates never match the names (builds and pulls
refuse them): they are never touched.

Cost with n such templates: memory O(n) (last use per name, in a heap); the start
lists the templates directory once (O(n) stats, no record read); a use is O(log n)
(the last use is written to disk at most once per ``idle_s / 8``); a sweep pops only
the expired names, O(k log n) for k of them, and reads only their records. Nothing
scans every record (TemplateRegistry.list does: it parses each template.json).

Crash-safe: a removal first writes ``.removing`` (the snapshots to delete) into the
template's directory, then drops its ``template.json`` (from then on the template is
gone: a create pulls again), then deletes the snapshots, mounts and files. A restart
finishes any removal it finds half done; stale mounts go with the node's usual start.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING

from ..snapshot import SnapshotError, SnapshotNotFound
from ..templates import Template, TemplateNotFound
from ..templates.registry import SHARED_MARK
from .base import AUTO_ID

if TYPE_CHECKING:
    from .image_sources import ImageSources

log = logging.getLogger(__name__)
USED_MARK = ".used"  # its mtime: the template's last use
REMOVING_MARK = ".removing"
MAX_SWEEP_S = 60.0


class TemplateCleanup:
    def __init__(self, sources: ImageSources, idle_s: float):
        self.sources = sources
        self.builder = sources.builder
        self.manager = sources.manager
        self.registry = self.manager.templates
        self.idle_s = float(idle_s)
        self._lock = threading.Lock()  # touch() comes from worker threads
        self._used: dict[str, float] = {}
        self._written: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        # Setup templates by the 16 hex of their image's digest: an image with one stays.
        self._setups: dict[str, set[str]] = {}
        # Removals under way: a create of the same name waits for its end.
        self.removing: dict[str, asyncio.Task] = sources.removing
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.idle_s > 0

    # -- life -----------------------------------------------------------------------

    async def start(self) -> None:
        if await asyncio.to_thread(self._load):
            self.manager.snapshot_gc.request()
        if self.enabled:
            self.manager.image_cache.on_use = self.touch
            self.sources.on_use = self.touch
            self._task = asyncio.create_task(self._run(), name="template-cleanup")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self.removing.values()):
            with contextlib.suppress(Exception):
                await task

    def _load(self) -> bool:
        """Finish removals a crash interrupted (True if any); index the rest by last use."""
        local = self.registry.local_dir
        if not local.is_dir():
            return False
        finished = False
        with os.scandir(local) as it:
            names = [e.name for e in it if AUTO_ID.match(e.name) and e.is_dir()]
        for name in names:
            directory = local / name
            if (directory / REMOVING_MARK).exists() and \
                    not (directory / "template.json").exists():
                log.info("templates: finishing the removal of %s (interrupted)", name)
                self._finish(name)
                finished = True
                continue
            for mark in (USED_MARK, "template.json"):
                with contextlib.suppress(OSError):
                    self._index(name, (directory / mark).stat().st_mtime)
                    break
        return finished

    def _index(self, name: str, when: float) -> None:
        with self._lock:
            self._used[name] = when
            heapq.heappush(self._heap, (when, name))
            if name.startswith("setup-"):
                self._setups.setdefault(name[6:22], set()).add(name)
            if len(self._heap) > 2 * len(self._used) + 64:  # drop superseded entries
                self._heap = [(t, n) for n, t in self._used.items()]
                heapq.heapify(self._heap)

    def touch(self, template_id: str) -> None:
        """The template was used now (a create, a resume). Any thread."""
        if not self.enabled or not AUTO_ID.match(template_id):
            return
        now = time.time()
        self._index(template_id, now)
        if now - self._written.get(template_id, 0.0) >= self.idle_s / 8:
            self._written[template_id] = now
            mark = self.registry.local_dir / template_id / USED_MARK
            with contextlib.suppress(OSError):
                mark.touch()

    # -- sweeps -----------------------------------------------------------------------

    async def _run(self) -> None:
        every = min(max(self.idle_s / 2, 0.5), MAX_SWEEP_S)
        while True:
            await asyncio.sleep(every)
            try:
                await self.sweep()
            except Exception:  # the next sweep tries again
                log.exception("templates: clean-up sweep failed")

    def _expired(self) -> list[str]:
        cutoff = time.time() - self.idle_s
        out = []
        with self._lock:
            while self._heap and self._heap[0][0] <= cutoff:
                when, name = heapq.heappop(self._heap)
                if self._used.get(name) == when:  # else superseded by a later use
                    out.append(name)
        return out

    async def sweep(self) -> list[str]:
        """Remove the expired templates nothing needs; their names."""
        expired = self._expired()
        if not expired:
            return []
        users = {r.template_id for r in self.manager.list()}
        removed = []
        for name in expired:
            try:
                template = await asyncio.to_thread(self.registry.get, name)
            except TemplateNotFound:  # deleted by hand meanwhile
                self._drop(name)
                continue
            if name in users or name in self.manager.image_cache.pinned or \
                    await asyncio.to_thread(self._needed, template) or \
                    not self._still_idle(name):
                self.touch(name)  # needed now: looked at again after another idle_s
                continue
            # From here to the task's registration nothing awaits: a create either
            # touched it before (then it stays) or waits for the removal.
            task = asyncio.create_task(self._remove(template), name=f"cleanup-{name}")
            self.removing[name] = task
            task.add_done_callback(self._removed)
            if await asyncio.shield(task):
                removed.append(name)
        return removed

    def _removed(self, task: asyncio.Task) -> None:
        for name, t in list(self.removing.items()):
            if t is task:
                del self.removing[name]

    def _still_idle(self, name: str) -> bool:
        """Not used since it expired, and no pull or setup is making it now."""
        with self._lock:
            used = self._used.get(name, 0.0)
        return used <= time.time() - self.idle_s and name not in self.sources.busy()

    def _needed(self, template: Template) -> bool:
        """A setup template of this image, or a user's snapshot of its sandboxes, exists."""
        name = template.template_id
        if name.startswith("img-") and template.image is not None:
            with self._lock:
                if self._setups.get(template.image.manifest_digest.split(":")[-1][:16]):
                    return True
        for sid in self.registry.snapshots_of(name):
            try:
                self.manager.snapshots.get(sid)
                return True
            except SnapshotNotFound:
                self.registry.forget_snapshot(name, sid)
            except SnapshotError:  # unreachable: keep the template
                return True
        return False

    def _drop(self, name: str) -> None:
        with self._lock:
            self._used.pop(name, None)
            self._written.pop(name, None)
            if name.startswith("setup-"):
                group = self._setups.get(name[6:22], set())
                group.discard(name)
                if not group:
                    self._setups.pop(name[6:22], None)

    # -- removal ----------------------------------------------------------------------

    async def _remove(self, template: Template) -> bool:
        name = template.template_id
        paused = {r.template_id for r in self.manager.list()}
        # A copy fetched from the cluster's repository: its node of origin unpublishes.
        shared = (self.registry.local_dir / name / SHARED_MARK).exists()
        try:
            done = await asyncio.to_thread(self._unlink, template)
        except Exception:
            log.exception("templates: removing unused %s failed", name)
            return False
        if not done:
            self.touch(name)
            return False
        self._drop(name)
        build = self.builder.store.get(template.build_id)
        if build is not None and build.template_id == name:  # a setup's one build
            self.builder.store.delete(build.build_id)
        if not shared:
            await asyncio.to_thread(self.registry.unpublish, template)
        await asyncio.to_thread(self.manager.image_cache.release, template, paused)
        await asyncio.to_thread(self._finish, name)
        self.manager.snapshot_gc.request()  # their chunks, unless others use them
        log.info("templates: %s removed (unused for %.0f s)", name, self.idle_s)
        return True

    def _unlink(self, template: Template) -> bool:
        """Note what to delete, then drop the record: the point after which the template
        is gone. False if a sandbox of it started meanwhile."""
        name = template.template_id
        images = self.manager.image_cache
        assert template.image is not None or template.snapshot_id
        lock = images.template_lock(template.image.manifest_digest) if template.image \
            else threading.Lock()
        snapshots = [template.snapshot_id] if template.snapshot_id else []
        boot = self.manager.boot_images
        if boot is not None and not template.snapshot_id:
            with contextlib.suppress(SnapshotError):
                snapshots.append(self.manager.snapshots.resolve(boot.alias(template)).snapshot_id)
            boot.drop(template)
        directory = self.registry.local_dir / name
        with lock:  # an ensure() of this image waits: no mount comes up under us
            if name in images.in_use():
                return False
            tmp = directory / f"{REMOVING_MARK}.tmp"
            tmp.write_text(json.dumps({"snapshots": snapshots}))
            os.replace(tmp, directory / REMOVING_MARK)
            (directory / "template.json").unlink(missing_ok=True)
        return True

    def _finish(self, name: str) -> None:
        """Delete what a removal noted, then the template's files (idempotent)."""
        directory = self.registry.local_dir / name
        try:
            noted = json.loads((directory / REMOVING_MARK).read_text()).get("snapshots", [])
        except (OSError, ValueError, AttributeError):
            noted = []
        for sid in noted if isinstance(noted, list) else []:
            if isinstance(sid, str) and sid:
                try:
                    self.manager.snapshots.delete(sid)
                except SnapshotNotFound:
                    pass
                except SnapshotError as exc:  # a stale snapshot costs disk only
                    log.warning("templates: snapshot %s of %s not deleted: %s", sid, name, exc)
        self.manager.image_cache.forget_credentials(name)
        self.registry.tags.drop(name)
        # The mark goes last: a crash in between leaves it for the restart to finish.
        with contextlib.suppress(FileNotFoundError):
            for child in directory.iterdir():
                if child.name != REMOVING_MARK:
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
        (directory / REMOVING_MARK).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
