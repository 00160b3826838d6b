"""Template builds: steps run in a sandbox, which is then snapshotted with its start
command running and published as a template. TemplateBuilder takes the requests
(build, upload, start, cancel, delete), keeps the builds' lifecycle and publishes
the result; the steps themselves run in ``runner``, the base template comes from
``base`` and the uploaded COPY sources are kept by ``context_files``.

The steps are the Dockerfile subset E2B templates use (RUN, COPY, ENV, WORKDIR,
USER) plus a start command and a ready check. COPY sources arrive beforehand as
tar archives named by their files hash (``upload``). A published template is
``<local_dir>/<templateID>/template.json`` naming the snapshot and the rootfs
under it; creating a sandbox from it restores that snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import shutil
import string
import time
import uuid
from collections.abc import AsyncIterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..resources import CPU, MEMORY, ResourceError
from ..snapshot import SnapshotError, SnapshotNotFound
from ..templates import Template, TemplateNotFound, TemplateRegistry
from ..templates.registry import BUILDS_DIR
from ..templates.tags import DEFAULT_TAG, InvalidTag, normalize_tags
from .base import AUTO_ID, resolve_base
from .context_files import UPLOAD_URL_TTL, ContextFiles
from .errors import BuildError, StepFailed
from .runner import STEPS, BuildState, StepRunner, initial_state
from .store import BUILDING, ERROR, READY, REASON_LOG_LINES, WAITING, Build, BuildStore, log_entry
from .tagging import write_json

if TYPE_CHECKING:
    from ..orchestrator import SandboxManager

log = logging.getLogger(__name__)

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
ID_ALPHABET = string.ascii_lowercase + string.digits
BUILD_SANDBOX_TTL = 3600
BUILD_METADATA_KEY = "aenv.build"
KEEP_BUILDS = 10  # finished builds kept per template
# How long a cancel waits for the build to let go before it ends the build's sandbox
# (which ends whatever step is running in it) and answers anyway.
CANCEL_GRACE_S = 5.0
# Builds requested and not started (their records cost disk and memory): at most
# this many at once (a 429 past it), each dropped after an upload URL's lifetime.
MAX_WAITING_BUILDS = 100


class TemplateBuilder:
    """The template build API of a node: its builds, their runs and their templates."""

    def __init__(self, manager: SandboxManager, home: Path):
        self.manager = manager
        self.registry: TemplateRegistry = manager.templates
        self.local_dir = self.registry.local_dir
        self.files = ContextFiles(home / "build-files",
                                  int(manager.config.build_context_max_bytes))
        self.files_dir = self.files.files_dir
        self.store = BuildStore(home / "builds", manager.config.build_log_max_bytes)
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()  # builds whose cancel came while they ran
        self._publish_lock = asyncio.Lock()
        self.ready_timeout_s = float(manager.config.build_ready_timeout)

    @property
    def max_context_bytes(self) -> int:
        return self.files.max_bytes

    # -- life ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Builds a crash interrupted fail, and their sandboxes go."""
        for build in self.store.all():
            if build.done:
                continue
            log.info("build %s was interrupted by a node restart", build.build_id)
            self._finish(build, ERROR, {"message": "the build was interrupted by a node restart"})
            await self._kill_sandbox(build)
        await asyncio.to_thread(self.files.prune)

    def _prune_builds(self, template_id: str) -> None:
        """Only the last few finished builds of a template keep their records and logs."""
        done = sorted((b for b in self.store.all() if b.template_id == template_id and b.done),
                      key=lambda b: b.created_at)
        for old in done[:-KEEP_BUILDS]:
            self.store.delete(old.build_id)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # -- requests -----------------------------------------------------------------------

    def request(self, name: str, tags: list[str] | None, cpu_count: int | None,
                memory_mb: int | None) -> Build:
        """A new build of the template called ``name`` (``name:tag`` allowed); the
        template keeps its ID when it exists."""
        alias, _, tag = (name or "").partition(":")
        alias = alias.strip()
        if not NAME.match(alias):
            raise BuildError(f"invalid template name '{name}': lowercase letters, digits, "
                             "'.', '_' and '-', starting with a letter or digit")
        try:
            tags = normalize_tags([*(tags or []), *([tag] if tag else [])] or [DEFAULT_TAG])
        except InvalidTag as exc:
            raise BuildError(str(exc)) from exc
        try:
            cpu_count = self.manager.limits.check(CPU, cpu_count)
            memory_mb = self.manager.limits.check(MEMORY, memory_mb)
        except ResourceError as exc:
            raise BuildError(str(exc)) from exc
        self._check_waiting()
        template_id = self._template_id_for(alias)
        build = Build(build_id=str(uuid.uuid4()), template_id=template_id, names=[alias],
                      tags=sorted(tags), cpu_count=cpu_count, memory_mb=memory_mb)
        self.store.put(build)
        return build

    def _check_waiting(self) -> None:
        cutoff = time.time() - UPLOAD_URL_TTL
        waiting = 0
        for build in self.store.all():
            if build.status != WAITING or build.build_id in self._tasks:
                continue
            if build.created_at < cutoff:  # never started: its uploads have expired too
                self.store.delete(build.build_id)
            else:
                waiting += 1
        if waiting >= MAX_WAITING_BUILDS:
            raise BuildError(f"{waiting} template builds were requested and not started (at "
                             f"most {MAX_WAITING_BUILDS}): start them or delete their "
                             "templates first", 429)

    def name_in_use(self, name: str) -> bool:
        """A template by that ID or alias, or one whose build under way will take it."""
        try:
            self.registry.get(name)
            return True
        except TemplateNotFound:
            return any(name in b.names and not b.done for b in self.store.all())

    async def check_not_a_snapshot(self, name: str) -> None:
        """A new template must not take a snapshot's name or ID: creates look the name
        up as a template first, so the snapshot could no longer be reached by it."""
        alias = (name or "").partition(":")[0].strip()
        if not NAME.match(alias) or self.name_in_use(alias):
            return  # refused by request(), or the template has the name already
        try:
            manifest = await asyncio.to_thread(self.manager.snapshots.resolve, alias)
        except SnapshotNotFound:
            return
        except SnapshotError as exc:
            raise BuildError(f"snapshot repository: {exc}", 503) from exc
        raise BuildError(f"template name '{alias}' is the name of snapshot "
                         f"{manifest.snapshot_id}; choose another (it would hide the snapshot)",
                         409)

    def _template_id_for(self, alias: str) -> str:
        try:
            existing = self.registry.get(alias)
        except TemplateNotFound:
            existing = None
        if existing is not None:
            if not self._is_local(existing.template_id):
                raise BuildError(f"'{alias}' is a built-in template; choose another name", 409)
            if existing.image is not None and not existing.snapshot_id:
                raise BuildError(f"'{alias}' is a pulled image; choose another name", 409)
            return existing.template_id
        if AUTO_ID.match(alias):  # a setup of an image (users may not take these names)
            return alias
        for build in self.store.all():  # a template whose first build is under way
            if alias in build.names:
                return build.template_id
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(20))

    def _is_local(self, template_id: str) -> bool:
        return (self.local_dir / template_id / "template.json").is_file() and \
            self.local_dir != self.registry.templates_dir

    def build(self, template_id: str, build_id: str) -> Build:
        build = self.store.get(build_id)
        if build is None or build.template_id != template_id:
            raise BuildError(f"build '{build_id}' of template '{template_id}' not found", 404)
        return build

    def known_template(self, template_id: str) -> bool:
        return self._is_local(template_id) or any(
            b.template_id == template_id for b in self.store.all())

    def start_build(self, template_id: str, build_id: str, spec: dict[str, Any]) -> Build:
        build = self.build(template_id, build_id)
        if build.status != WAITING or build_id in self._tasks:
            raise BuildError(f"build '{build_id}' was already started", 409)
        if bool(spec.get("fromImage")) == bool(spec.get("fromTemplate")):
            raise BuildError("exactly one of fromImage and fromTemplate is required")
        for i, step in enumerate(spec.get("steps") or [], 1):
            if step.get("type") not in STEPS:
                raise BuildError(f"step {i}: unsupported instruction '{step.get('type')}' "
                                 f"(supported: {', '.join(STEPS)})")
            if step.get("type") == "COPY" and not self.file_path(step.get("filesHash", "")):
                raise BuildError(f"step {i}: COPY of '{(step.get('args') or ['?'])[0]}': "
                                 "its files were not uploaded")
        build.status = BUILDING
        self.store.put(build)
        task = asyncio.create_task(self._run(build, spec), name=f"build-{build_id}")
        self._tasks[build_id] = task
        def forget(_: asyncio.Task) -> None:
            self._tasks.pop(build_id, None)
            self._cancelled.discard(build_id)

        task.add_done_callback(forget)
        return build

    async def wait(self, build_id: str) -> Build:
        """The build once it has finished (a waiter's cancellation leaves it running)."""
        task = self._tasks.get(build_id)
        if task is not None:
            await asyncio.wait([task])
        build = self.store.get(build_id)
        if build is None:
            raise BuildError(f"build '{build_id}' not found", 404)
        return build

    async def cancel(self, build_id: str) -> None:
        task = self._tasks.get(build_id)
        if task is None:
            return
        self._cancelled.add(build_id)
        task.cancel()
        _, pending = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not pending:
            return
        # Seen only in a node that had served a long while (the suite): the cancel did
        # not end the step in time. Its sandbox goes, which ends any step in it; the
        # build is recorded as cancelled either way, and the caller is answered.
        build = self.store.get(build_id)
        log.warning("build %s did not stop %.0fs after its cancel (status %s); ending its "
                    "sandbox", build_id, CANCEL_GRACE_S, build.status if build else "?")
        if build is not None:
            if not build.done:
                self._finish(build, ERROR, {"message": "the build was cancelled"})
            await asyncio.wait({asyncio.ensure_future(self._kill_sandbox(build))},
                               timeout=CANCEL_GRACE_S)
        task.cancel()

    def logs(self, build_id: str) -> list[dict]:
        return self.store.logs(build_id)

    # -- files (ContextFiles) -------------------------------------------------------------

    def file_path(self, files_hash: str) -> Path | None:
        return self.files.path(files_hash)

    def upload_token(self, template_id: str, files_hash: str, expires: int) -> str:
        return self.files.upload_token(template_id, files_hash, expires)

    def check_upload(self, template_id: str, files_hash: str, expires: str,
                     signature: str) -> None:
        self.files.check_upload(template_id, files_hash, expires, signature)

    async def receive(self, files_hash: str, body: AsyncIterable[bytes]) -> int:
        """Store an uploaded context archive under its hash (atomically); one larger
        than build_context_max_bytes is refused (413) and nothing of it kept."""
        return await self.files.receive(files_hash, body)

    def context_too_large(self) -> str:
        return self.files.too_large()

    # -- deleting -------------------------------------------------------------------------

    async def delete_template(self, name: str) -> str:
        """Remove a built template, its snapshots, tags and builds; returns its ID. A
        ``:tag`` (one the template has) is ignored, as E2B does: the whole template goes."""
        try:
            template = self.registry.get(self.registry.get(name).template_id)
            template_id = template.template_id
        except TemplateNotFound:
            template, template_id = None, name
            if not any(b.template_id == name for b in self.store.all()):
                raise BuildError(f"template '{name}' not found", 404) from None
        if template is not None and not self._is_local(template_id):
            raise BuildError(f"'{name}' is a built-in template and cannot be deleted", 403)
        users = [r.sandbox_id for r in self.manager.list() if r.template_id == template_id]
        if users:
            raise BuildError(f"template '{name}' has {len(users)} sandbox(es) running or paused "
                             f"({', '.join(users[:3])}); kill them first", 409)
        if template is not None and template.image is not None and not template.snapshot_id:
            await self._delete_image(template)  # as DELETE /images/{name} does
            return template_id
        for build in [b for b in self.store.all() if b.template_id == template_id]:
            await self.cancel(build.build_id)
            self.store.delete(build.build_id)
        if template is not None:
            await asyncio.to_thread(self.registry.unpublish, template)
            async with self._publish_lock:
                kept = self._kept_builds(template_id)
                await asyncio.to_thread(shutil.rmtree, self.local_dir / template_id, True)
                self.registry.tags.drop(template_id)
            for snapshot_id in {template.snapshot_id, *(b.snapshot_id for b in kept)}:
                await self._delete_snapshot(snapshot_id)
            if template.image is not None:  # built from an image: its mounts, if only its
                await asyncio.to_thread(self.manager.image_cache.release, template)
        return template_id

    async def _delete_image(self, template: Template) -> None:
        """A pulled image template: its record, credentials, unused layers and mounts."""
        from ..images import ImageError

        try:
            await asyncio.to_thread(self.manager.image_cache.delete, template.template_id)
        except ImageError as exc:
            raise BuildError(str(exc), exc.status) from exc
        await asyncio.to_thread(self.registry.unpublish, template)

    def _kept_builds(self, template_id: str) -> list[Template]:
        directory = self.local_dir / template_id / BUILDS_DIR
        out = []
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            built = self.registry.load_build(template_id, path.stem)
            if built is not None:
                out.append(built)
        return out

    async def _delete_snapshot(self, snapshot_id: str) -> None:
        if snapshot_id:
            try:
                await asyncio.to_thread(self.manager.snapshots.delete, snapshot_id)
            except Exception as exc:  # a stale snapshot costs disk only
                log.warning("deleting template snapshot %s failed: %s", snapshot_id, exc)
            else:
                self.manager.snapshot_gc.request()  # its chunks, unless others use them

    # -- the build ------------------------------------------------------------------------

    def _log(self, build: Build, message: str, level: str = "info", step: str = "") -> None:
        self.store.append(build.build_id, log_entry(message, level, step))

    def _finish(self, build: Build, status: str, reason: dict | None = None) -> None:
        build.status, build.reason, build.finished_at = status, reason, time.time()
        self.store.put(build)

    async def _run(self, build: Build, spec: dict[str, Any]) -> None:
        from ..orchestrator import CreateRequest, OrchestratorError

        t0 = time.monotonic()
        limits = self.manager.limits
        try:
            base = await resolve_base(self.manager, spec,
                                      lambda message: self._log(build, message, step="base"))
            self._log(build, f"FROM {spec.get('fromImage') or spec.get('fromTemplate')}"
                             f" (template {base.template_id})", step="base")
            try:
                record = await self.manager.create(CreateRequest(
                    # the base's ID with the tag asked for (a tag names a build)
                    template=_with_tag(base.template_id, spec.get("fromTemplate")),
                    timeout=min(BUILD_SANDBOX_TTL,
                                                           self.manager.config.max_timeout),
                    metadata={BUILD_METADATA_KEY: build.build_id},
                    # (a record from disk is clamped into the node's bounds, not trusted)
                    cpu_count=build.cpu_count and limits.clamp(CPU, build.cpu_count),
                    memory_mb=build.memory_mb and limits.clamp(MEMORY, build.memory_mb)))
                if base.snapshot_id and (build.cpu_count or build.memory_mb):
                    self._log(build, f"cpu/memory are those of template {base.template_id} "
                                     "(a snapshot's resources are fixed)", "warn", "base")
            except OrchestratorError as exc:
                raise StepFailed(f"the build sandbox did not start: {exc}", "base") from exc
            build.sandbox_id = record.sandbox_id
            self.store.put(build)
            state = initial_state(base)
            runner = StepRunner(self.manager, self.store, self.files, build, record, state,
                                self.ready_timeout_s)
            steps = spec.get("steps") or []
            for i, step in enumerate(steps, 1):
                await runner.step(step, str(i), len(steps))
            await runner.finalize(spec)
            manifest = await self.manager.snapshot(record.sandbox_id)
            build.snapshot_id = manifest.snapshot_id
            self.store.put(build)
            await self._publish(build, base, record, state, spec)
            self._log(build, f"Template {build.template_id} ({', '.join(build.names)}) is ready "
                             f"in {time.monotonic() - t0:.1f}s", step="finalize")
            self._finish(build, READY)
        except asyncio.CancelledError:
            self._log(build, "the build was cancelled", "error")
            self._finish(build, ERROR, {"message": "the build was cancelled"})
            raise
        except Exception as exc:
            if build.build_id in self._cancelled:  # its sandbox ended by the cancel
                self._finish(build, ERROR, {"message": "the build was cancelled"})
                return
            step = exc.step if isinstance(exc, StepFailed) else "finalize"
            if not isinstance(exc, StepFailed):
                log.exception("build %s failed", build.build_id)
            message = str(exc) if isinstance(exc, StepFailed) else f"build failed: {exc}"
            self._log(build, message, "error", step)
            entries = [e for e in self.store.logs(build.build_id)
                       if e.get("step") == step][-REASON_LOG_LINES:]
            self._finish(build, ERROR, {"message": message, "step": step, "logEntries": entries})
        finally:
            await asyncio.shield(self._kill_sandbox(build))
            if build.status == ERROR and build.snapshot_id:
                await self._delete_snapshot(build.snapshot_id)
            self._prune_builds(build.template_id)

    async def _kill_sandbox(self, build: Build) -> None:
        if not build.sandbox_id:
            return
        with contextlib.suppress(Exception):
            await self.manager.kill(build.sandbox_id)

    # -- publishing ---------------------------------------------------------------------

    async def _publish(self, build: Build, base: Template, record, state: BuildState,
                       spec: dict[str, Any]) -> None:
        """Keep the build (``builds/<buildID>.json``) and point its tags at it; with
        ``default`` (or as the first build) it becomes ``template.json`` atomically.
        Builds no tag names any more lose their snapshots."""
        base_meta = self._meta(base.template_id)
        meta = {
            "templateID": build.template_id, "aliases": build.names, "tags": build.tags,
            "buildID": build.build_id, "snapshotID": build.snapshot_id,
            "cpuCount": record.cpu_count,
            "memoryMB": record.memory_mb, "diskSizeMB": record.disk_size_mb,
            "envs": state.envs, "defaultUser": state.user, "defaultWorkdir": state.workdir,
            "startCmd": spec.get("startCmd") or "", "readyCmd": spec.get("readyCmd") or "",
            "fromImage": spec.get("fromImage") or "", "fromTemplate": spec.get("fromTemplate")
            or "", "createdAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if base.file_access:  # a strict base's children are strict (docs/security.md)
            meta["fileAccess"] = base.file_access
        # An image's rootfs is its mounted layers (found again by the image block);
        # any other is a directory.
        if isinstance(base_meta.get("image"), dict):
            meta["image"] = base_meta["image"]
        else:
            meta["rootfs"] = str(base.rootfs)
        directory = self.local_dir / build.template_id
        async with self._publish_lock:
            previous = None
            with contextlib.suppress(TemplateNotFound):
                previous = self.registry.get(build.template_id)
            write_json(self.registry.build_path(build.template_id, build.build_id), meta)
            if DEFAULT_TAG in build.tags or previous is None:
                write_json(directory / "template.json", meta)
            self.registry.tags.assign(build.template_id, build.build_id,
                                      [t for t in build.tags if t != DEFAULT_TAG])
            stale = self._unreferenced(build.template_id, previous)
        await asyncio.to_thread(self.registry.publish, build.template_id)
        for snapshot_id in stale:
            await self._delete_snapshot(snapshot_id)

    def _unreferenced(self, template_id: str, previous: Template | None) -> set[str]:
        """Forget the builds no tag names (the current one is ``default``'s); their
        snapshots, unless a named build uses them too."""
        current = self.registry.get(template_id)
        named = {current.build_id, *(t.build_id for t in
                                     self.registry.tags.read(template_id).values())}
        builds = self._kept_builds(template_id)
        if previous is not None and not any(b.build_id == previous.build_id for b in builds):
            builds.append(previous)  # published before builds were kept
        keep = {b.snapshot_id for b in builds if b.build_id in named}
        stale = set()
        for built in builds:
            if built.build_id not in named:
                self.registry.build_path(template_id, built.build_id).unlink(missing_ok=True)
                if built.snapshot_id not in keep:
                    stale.add(built.snapshot_id)
        return stale

    def _meta(self, template_id: str) -> dict:
        for directory in self.registry.dirs:
            with contextlib.suppress(OSError, ValueError):
                return json.loads((directory / template_id / "template.json").read_text())
        return {}


def _with_tag(template_id: str, ref: str | None) -> str:
    """``ref``'s tag on the template's ID (a tag names one build of it)."""
    _, sep, tag = (ref or "").partition(":")
    return f"{template_id}:{tag}" if sep and tag else template_id
