"""Boot images of templates, and a warm pool of sandboxes restored from them.

A template's boot image is a sandbox of that template captured right after it became
ready (envd up, start command running). Creating a sandbox then restores the
image instead of booting a kernel and envd: the restore costs a fraction of a
cold boot. The image lives in the snapshot repository under an alias derived
from everything it depends on (template build, envd bundle, runtime version,
resources, and envd's settings as it started: its dormancy and guards, which a
restored envd keeps), so a changed template or node never restores a stale one,
and nodes configured apart never restore each other's.

The warm pool keeps ``size`` sandboxes per hot template already restored, each
in its own slot; a create adopts one (a single envd call) and the pool refills
in the background.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..config import Config
from ..network import Slot
from ..runtime import Runtime
from ..snapshot import SnapshotError, SnapshotNotFound, SnapshotStore
from ..templates import Template
from .launch import EnvdInit, Launcher, LaunchPlan, SlotSource
from .models import CapacityExceeded, OrchestratorError, new_sandbox_id
from .specs import SpecFactory

log = logging.getLogger(__name__)
# A template's image must pass its ready check in a trial restore, TRIAL_SETTLE_S after
# it; one that does not is captured again, this many times in all.
IMAGE_CAPTURES = 3
TRIAL_SETTLE_S = 1.0


@dataclass(frozen=True)
class BootImage:
    snapshot_id: str
    path: Path  # node-local copy of the checkpoint files
    envd_token: str  # the token envd holds in the image (a restore rotates it)
    hostname_of: str = ""  # whose hostname the image has, when not the template ID's


@dataclass
class PooledSandbox:
    sandbox_id: str
    template_id: str
    slot: Slot
    envd_token: str


class Host(Protocol):
    """What boot images need of the sandbox manager that keeps them."""

    @property
    def config(self) -> Config: ...
    @property
    def runtime(self) -> Runtime: ...
    @property
    def slots(self) -> SlotSource: ...
    @property
    def snapshots(self) -> SnapshotStore: ...
    @property
    def specs(self) -> SpecFactory: ...
    @property
    def launcher(self) -> Launcher: ...

    def active_count(self) -> int: ...

    def file_access(self, template: Template) -> str: ...

    def creates_waiting(self) -> int: ...


class BootImages:
    def __init__(self, manager: Host, pool_size: int = 0):
        self.manager = manager
        self.pool_size = pool_size
        self._images: dict[str, BootImage] = {}
        self._pooled_templates: dict[str, Template] = {}
        # Restores reading each image's files now, and images forgotten meanwhile
        # (deleted when their last restore ends), by snapshot ID.
        self._users: collections.Counter[str] = collections.Counter()
        self._forgotten: set[str] = set()
        self._building: dict[str, asyncio.Task] = {}
        # Aliases no capture of which passed its trial: their templates boot. And
        # aliases whose new capture is on trial.
        self._unimageable: set[str] = set()
        self._trying: set[str] = set()
        self._pool: dict[str, list[PooledSandbox]] = {}
        self._refilling: dict[str, asyncio.Task] = {}
        self._shedding: dict[str, asyncio.Task] = {}  # members given up for room
        self._closed = False
        # Called when a capture or a refill ends (the slot it held may be free).
        self.on_freed: Callable[[], None] = lambda: None

    # -- images -----------------------------------------------------------------

    def alias(self, template: Template) -> str:
        m = self.manager
        key = "|".join(str(x) for x in (
            template.template_id, template.created_at, template.build_id, template.rootfs,
            template.image.manifest_digest if template.image else "",
            template.cpu_count, template.memory_mb, template.start_cmd, template.ready_cmd,
            m.specs.bundle_name, m.runtime.kind, m.runtime.version, m.specs.image_stamp(template),
        ))
        return f"tpl.{template.template_id}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    async def image(self, template: Template) -> BootImage | None:
        """The template's image if this node can restore it now; otherwise None, and
        the image is built in the background for the creates that follow."""
        if template.snapshot_id:
            return await self._built(template)
        alias = self.alias(template)
        known = self._images.get(alias)
        if known is not None and known.path.is_dir():
            return known
        if alias in self._unimageable or alias in self._trying:
            return None
        try:
            manifest = await asyncio.to_thread(self.manager.snapshots.resolve, alias)
            path = await asyncio.to_thread(self.manager.snapshots.materialize,
                                           manifest.snapshot_id)
        except SnapshotNotFound:
            self._build_in_background(template, alias)
            return None
        except SnapshotError as exc:
            log.warning("template image %s unavailable: %s", alias, exc)
            return None
        image = BootImage(manifest.snapshot_id, path, manifest.metadata["envd_token"])
        self._images[alias] = image
        return image

    async def _built(self, template: Template) -> BootImage | None:
        """A built template's image is the snapshot its build published."""
        known = self._images.get(template.snapshot_id)
        if known is not None and known.path.is_dir():
            return known
        try:
            manifest = await asyncio.to_thread(self.manager.snapshots.get, template.snapshot_id)
            self.manager.specs.check_restorable(manifest.metadata)
            path = await asyncio.to_thread(self.manager.snapshots.materialize,
                                           manifest.snapshot_id)
        except SnapshotError as exc:
            log.warning("template %s: its snapshot is unavailable: %s", template.template_id, exc)
            return None
        meta = manifest.metadata
        image = BootImage(manifest.snapshot_id, path, meta["envd_token"],
                              meta.get("source_sandbox_id", ""))
        self._images[template.snapshot_id] = image
        return image

    def forget(self, template: Template, failed: BootImage | None = None) -> None:
        """Drop a template image that failed to restore; the next create rebuilds it.
        Its files go once no other restore is reading them (deleting them under
        concurrent restores failed them all, each then forgetting and booting)."""
        if template.snapshot_id:  # a built template's snapshot is the template itself
            self._images.pop(template.snapshot_id, None)
            return
        alias = self.alias(template)
        image = self._images.get(alias)
        if image is None or (failed is not None and image is not failed):
            return  # already forgotten (and maybe rebuilt) by another failed restore
        del self._images[alias]
        self._forgotten.add(image.snapshot_id)
        if not self._users[image.snapshot_id]:
            self._delete(image)

    def drop(self, template: Template) -> None:
        """The template is being removed: forget its image (its snapshot is deleted by
        the remover, so a restore under way keeps reading the files it opened)."""
        self._images.pop(template.snapshot_id or self.alias(template), None)

    @contextlib.contextmanager
    def using(self, image: BootImage) -> Iterator[None]:
        """A restore reads ``image`` within this block."""
        self._users[image.snapshot_id] += 1
        try:
            yield
        finally:
            self._users[image.snapshot_id] -= 1
            if not self._users[image.snapshot_id]:
                del self._users[image.snapshot_id]
                if image.snapshot_id in self._forgotten:
                    self._delete(image)

    def _delete(self, image: BootImage) -> None:
        self._forgotten.discard(image.snapshot_id)
        with contextlib.suppress(SnapshotError):
            self.manager.snapshots.delete(image.snapshot_id)

    def _build_in_background(self, template: Template, alias: str) -> None:
        if self._closed or alias in self._building:
            return
        task = asyncio.create_task(self._build(template, alias), name=f"image-{alias}")
        self._building[alias] = task
        task.add_done_callback(lambda _: self._building.pop(alias, None))
        task.add_done_callback(lambda _: self.on_freed())

    async def _build(self, template: Template, alias: str) -> None:
        """Capture the template's image; one that fails its trial restore is captured
        again, up to IMAGE_CAPTURES times, then the template's sandboxes boot."""
        for capture in range(1, IMAGE_CAPTURES + 1):
            snapshot_id = await self._capture(template, alias)
            if snapshot_id is None:
                return
            self._trying.add(alias)  # committed under its alias: no create takes it yet
            try:
                if await self._passes_trial(template, snapshot_id):
                    return
            finally:
                self._trying.discard(alias)
            log.warning("template %s: image %s failed its ready check after a trial restore "
                        "(capture %d of %d): discarded", template.template_id, alias,
                        capture, IMAGE_CAPTURES)
            self._discard(template, alias, snapshot_id)
        self._unimageable.add(alias)
        log.warning("template %s: no capture of it passed its ready check once restored; "
                    "its sandboxes boot instead", template.template_id)

    async def _capture(self, template: Template, alias: str) -> str | None:
        """Boot a sandbox of the template (no record: a crash leaves nothing the
        restart does not remove), wait until it is ready, capture and commit it; the
        snapshot's ID, or None if that failed."""
        m = self.manager
        sandbox_id, token = new_sandbox_id(), secrets.token_urlsafe(32)
        snapshot_id = new_sandbox_id()
        t0 = time.perf_counter()
        try:
            slot = await m.launcher.launch(LaunchPlan(
                sandbox_id=sandbox_id, template=template, cpu_count=template.cpu_count,
                memory_mb=template.memory_mb, hostname_of=template.template_id,
                init=EnvdInit(token), start_command=True))
        except Exception as exc:
            log.warning("template %s: booting for its image failed: %s", template.template_id,
                        exc)
            return None
        try:
            # One command first, as the SDK runs them: the first spawn in a sandbox
            # is 15-20 ms slower than the next (cold caches in envd and in the sandbox
            # kernel), and every sandbox restored from this image would pay it.
            with contextlib.suppress(Exception):
                await m.launcher.envd.run(slot.address, token, "true",
                                 user=template.default_user or "user", deadline_s=30)
            staging = await asyncio.to_thread(m.snapshots.new_staging, snapshot_id)
            await m.runtime.checkpoint(sandbox_id, staging, leave_running=False)
            metadata = {
                "kind": "template", "template_id": template.template_id,
                "alias": template.alias, "cpu_count": template.cpu_count,
                "memory_mb": template.memory_mb, "envd_token": token,
                **m.specs.stamp(), "created_at": time.time(),
            }
            await asyncio.to_thread(m.snapshots.commit, snapshot_id, staging, metadata, alias)
            log.info("template %s: image %s built in %.0f ms", template.template_id,
                     alias, (time.perf_counter() - t0) * 1000)
            return snapshot_id
        except Exception as exc:
            log.warning("template %s: building its image failed: %s", template.template_id, exc)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(m.snapshots.discard_staging, snapshot_id)
            return None
        finally:
            await asyncio.shield(m.runtime.destroy(sandbox_id))
            await asyncio.shield(m.slots.release(slot))

    async def _passes_trial(self, template: Template, snapshot_id: str) -> bool:
        """Restore the image once as a create would and run the template's ready check
        a moment later.
        A capture can hold state its processes do not survive a restore with (this
        runsc saves epoll state mid-notification: a server died on an event for a
        freed poller entry, in every restore of that image); such an image would hand
        every create a sandbox whose service is down. Passes when there is nothing to
        check, or no room to check it in."""
        if not template.ready_cmd:
            return True
        m = self.manager
        sandbox_id, token = new_sandbox_id(), secrets.token_urlsafe(32)
        try:
            manifest = await asyncio.to_thread(m.snapshots.get, snapshot_id)
            path = await asyncio.to_thread(m.snapshots.materialize, snapshot_id)
            # envd told what a create tells it (a new token, a new boot).
            init = EnvdInit(token, default_user=template.default_user or "user",
                            default_workdir=template.default_workdir,
                            current_token=manifest.metadata["envd_token"],
                            boot_id=str(uuid.uuid4()), file_access=m.file_access(template))
            slot = await m.launcher.launch(LaunchPlan(
                sandbox_id=sandbox_id, template=template, cpu_count=template.cpu_count,
                memory_mb=template.memory_mb, hostname_of=template.template_id, image=path,
                init=init))
        except CapacityExceeded:
            return True
        except Exception as exc:
            log.warning("template %s: trial restore of its image failed: %s",
                        template.template_id, exc)
            return False
        try:
            await asyncio.sleep(TRIAL_SETTLE_S)
            return await m.launcher.envd.run(slot.address, token, template.ready_cmd,
                                             deadline_s=10) == 0
        except Exception as exc:
            log.warning("template %s: ready check of its trial restore failed: %s",
                        template.template_id, exc)
            return False
        finally:
            await asyncio.shield(m.runtime.destroy(sandbox_id))
            await asyncio.shield(m.slots.release(slot))

    def _discard(self, template: Template, alias: str, snapshot_id: str) -> None:
        image = self._images.get(alias)
        if image is not None and image.snapshot_id == snapshot_id:
            self.forget(template, image)  # a create found it meanwhile: once unused
        else:
            with contextlib.suppress(SnapshotError):
                self.manager.snapshots.delete(snapshot_id)

    # -- warm pool --------------------------------------------------------------

    def take(self, template: Template) -> PooledSandbox | None:
        """A sandbox already restored from the template's image, if the pool has one."""
        if self.pool_size <= 0:
            return None
        members = self._pool.get(template.template_id) or []
        member = members.pop(0) if members else None
        self._refill(template)
        return member

    async def member_exited(self, sandbox_id: str, reason: str) -> bool:
        """A pooled sandbox's runtime ended unasked: out of the pool at once (before any
        create is handed it), its slot freed, and the pool refilled. False: not ours."""
        for tid, members in self._pool.items():
            member = next((m for m in members if m.sandbox_id == sandbox_id), None)
            if member is None:
                continue
            members.remove(member)
            log.warning("warm pool of %s: pooled sandbox %s %s; replacing it", tid,
                        sandbox_id, reason)
            await self._destroy(member)
            template = self._pooled_templates.get(tid)
            if template is not None:
                self._refill(template)
            self.on_freed()
            return True
        return False

    def _refill(self, template: Template) -> None:
        tid = template.template_id
        self._pooled_templates[tid] = template  # (to refill after a member died)
        if self._closed or self.pool_size <= 0 or tid in self._refilling:
            return
        task = asyncio.create_task(self._fill(template), name=f"pool-{tid}")
        self._refilling[tid] = task
        task.add_done_callback(lambda _: self._refilling.pop(tid, None))
        task.add_done_callback(lambda _: self.on_freed())

    async def _fill(self, template: Template) -> None:
        m = self.manager
        members = self._pool.setdefault(template.template_id, [])
        while not self._closed and len(members) < self.pool_size:
            if m.active_count() + self.pooled() >= m.config.max_sandboxes or m.creates_waiting():
                return  # the pool never takes capacity users need
            try:
                image = await self.image(template)
            except OrchestratorError as exc:  # e.g. taken by another runtime version
                log.warning("warm pool of %s: %s", template.template_id, exc)
                return
            if image is None:
                build = self._building.get(self.alias(template))
                if build is None:
                    return
                await asyncio.shield(build)
                continue
            member = await self._restore_member(template, image)
            if member is None:
                return
            members.append(member)

    async def _restore_member(self, template: Template, image: BootImage
                              ) -> PooledSandbox | None:
        """A sandbox restored from the image ahead of any create; envd is initialised
        when it is handed out."""
        sandbox_id = new_sandbox_id()
        try:
            with self.using(image):
                slot = await self.manager.launcher.launch(LaunchPlan(
                    sandbox_id=sandbox_id, template=template, cpu_count=template.cpu_count,
                    memory_mb=template.memory_mb,
                    hostname_of=image.hostname_of or template.template_id, image=image.path))
        except CapacityExceeded:
            return None
        except Exception as exc:
            log.warning("warm pool of %s: restore failed: %s", template.template_id, exc)
            return None
        return PooledSandbox(sandbox_id, template.template_id, slot, image.envd_token)

    def cached_templates(self) -> list[str]:
        """Templates whose boot image this node holds (a create of them is warm)."""
        return sorted({alias.split(".")[1] for alias, image in list(self._images.items())
                       if alias.startswith("tpl.") and alias.count(".") >= 2
                       and image.path.is_dir()})

    def templates_in_use(self) -> set[str]:
        """Templates this pool holds sandboxes of or builds images of (aliases are
        ``tpl.<template ID>.<hash>``)."""
        building = {alias[4:].rsplit(".", 1)[0] for alias in list(self._building)}
        return building | set(self._refilling) | {tid for tid, members in
                                                  list(self._pool.items()) if members}

    def slots_held(self) -> int:
        """Slots this holds outside any record, at most: one per image being captured
        and per pool refill under way, and the pooled sandboxes'."""
        return len(self._building) + len(self._refilling) + self.pooled() + len(self._shedding)

    def shed(self) -> bool:
        """Give a pooled sandbox's room to a create that waits for room (the pool never
        takes capacity users need): a member of the largest pool is destroyed, its slot
        still counted until it is gone, then ``on_freed``. True if room is coming."""
        if self._shedding:
            return True  # one at a time: the waiter is woken when it is gone
        members = max(self._pool.values(), key=len, default=[])
        if not members:
            return False
        member = members.pop()
        task = asyncio.create_task(self._destroy(member), name=f"shed-{member.sandbox_id}")
        self._shedding[member.sandbox_id] = task
        task.add_done_callback(lambda _: self._shedding.pop(member.sandbox_id, None))
        task.add_done_callback(lambda _: self.on_freed())
        return True

    async def _destroy(self, member: PooledSandbox) -> None:
        m = self.manager
        try:
            await m.runtime.destroy(member.sandbox_id)
        except Exception:
            log.exception("destroying pooled sandbox %s failed", member.sandbox_id)
        await m.slots.release(member.slot)

    def pooled(self) -> int:
        return sum(len(v) for v in self._pool.values())

    def stats(self) -> dict:
        return {"images": len(self._images), "building": len(self._building),
                "pooled": {k: len(v) for k, v in self._pool.items()}}

    async def close(self) -> None:
        """Stop building and refilling; destroy every pooled sandbox."""
        self._closed = True
        for task in [*self._building.values(), *self._refilling.values()]:
            task.cancel()
        await asyncio.gather(*self._building.values(), *self._refilling.values(),
                             return_exceptions=True)
        await asyncio.gather(*self._shedding.values(), return_exceptions=True)
        for members in self._pool.values():
            for member in members:
                await self._destroy(member)
        self._pool.clear()
