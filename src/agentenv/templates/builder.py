"""Template builds: steps run in a sandbox, which is then snapshotted with its start
command running and published as a template.

The steps are the Dockerfile subset E2B templates use (RUN, COPY, ENV, WORKDIR,
USER) plus a start command and a ready check. COPY sources arrive beforehand as
tar archives named by their files hash (``upload``). A published template is
``<local_dir>/<templateID>/template.json`` naming the snapshot and the rootfs
under it; creating a sandbox from it restores that snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import string
import threading
import time
import uuid
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from ..resources import CPU, MEMORY, ResourceError
from ..snapshot import SnapshotError, SnapshotNotFound
from .builds import BUILDING, ERROR, READY, REASON_LOG_LINES, WAITING, Build, BuildStore, log_entry
from .registry import Template, TemplateNotFound, TemplateRegistry
from .steps import LineLog, copy_script, expand

if TYPE_CHECKING:
    from ..orchestrator import SandboxManager

log = logging.getLogger(__name__)

HASH = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
ID_ALPHABET = string.ascii_lowercase + string.digits
BUILD_SANDBOX_TTL = 3600
UPLOAD_URL_TTL = 3600
BUILD_METADATA_KEY = "aenv.build"
MAX_CAPTURE = 4 << 20  # bytes of a command's output the builder reads for itself (env -0)
KEEP_BUILDS = 10  # finished builds kept per template
# Builds requested and not started (their records cost disk and memory): at most
# this many at once (a 429 past it), each dropped after an upload URL's lifetime.
MAX_WAITING_BUILDS = 100
FILES_KEEP_S = 7 * 24 * 3600
# E2B's default base image is the counterpart of the built-in ``base`` template.
BASE_IMAGES = {"e2bdev/base": "base"}


class BuildError(Exception):
    """A request the builder refuses; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class StepFailed(Exception):
    def __init__(self, message: str, step: str):
        super().__init__(message)
        self.step = step


@dataclass
class BuildState:
    """What the steps so far have set, carried into later steps and the template."""

    user: str = "user"
    workdir: str = ""
    envs: dict[str, str] = field(default_factory=dict)


class TemplateBuilder:
    def __init__(self, manager: SandboxManager, home: Path):
        self.manager = manager
        self.registry: TemplateRegistry = manager.templates
        self.local_dir = self.registry.local_dir
        self.files_dir = home / "build-files"
        self.files_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.store = BuildStore(home / "builds", manager.config.build_log_max_bytes)
        # Signs upload URLs; of this process only (the URLs live an hour, the SDKs use
        # them at once), so a leaked URL or API key never outlives a restart.
        self._key = secrets.token_bytes(32)
        self._tasks: dict[str, asyncio.Task] = {}
        self._publish_lock = asyncio.Lock()
        self.ready_timeout_s = float(manager.config.build_ready_timeout)
        self.max_context_bytes = int(manager.config.build_context_max_bytes)

    # -- life ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Builds a crash interrupted fail, and their sandboxes go."""
        for build in self.store.all():
            if build.done:
                continue
            log.info("build %s was interrupted by a node restart", build.build_id)
            self._finish(build, ERROR, {"message": "the build was interrupted by a node restart"})
            await self._kill_sandbox(build)
        await asyncio.to_thread(self._prune_files)

    def _prune_files(self) -> None:
        """Context archives no build used for a while go (a COPY touches its archive)."""
        cutoff = time.time() - FILES_KEEP_S
        for path in self.files_dir.iterdir():
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()

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
            cpu_count = self.manager.limits.check(CPU, cpu_count)
            memory_mb = self.manager.limits.check(MEMORY, memory_mb)
        except ResourceError as exc:
            raise BuildError(str(exc)) from exc
        self._check_waiting()
        template_id = self._template_id_for(alias)
        build = Build(build_id=str(uuid.uuid4()), template_id=template_id, names=[alias],
                      tags=sorted({*(tags or []), *([tag] if tag else [])}) or ["default"],
                      cpu_count=cpu_count, memory_mb=memory_mb)
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
        task.add_done_callback(lambda _: self._tasks.pop(build_id, None))
        return build

    async def cancel(self, build_id: str) -> None:
        task = self._tasks.get(build_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def logs(self, build_id: str) -> list[dict]:
        return self.store.logs(build_id)

    # -- files ----------------------------------------------------------------------------

    def file_path(self, files_hash: str) -> Path | None:
        if not HASH.match(files_hash or ""):
            return None
        path = self.files_dir / files_hash
        return path if path.is_file() else None

    def upload_token(self, template_id: str, files_hash: str, expires: int) -> str:
        raw = f"{template_id}:{files_hash}:{expires}".encode()
        return hmac.new(self._key, raw, hashlib.sha256).hexdigest()

    def check_upload(self, template_id: str, files_hash: str, expires: str,
                     signature: str) -> None:
        if not HASH.match(files_hash):
            raise BuildError("files hash must be 64 lowercase hex digits")
        try:
            when = int(expires)
        except ValueError:
            raise BuildError("invalid upload URL", 403) from None
        if when < time.time():
            raise BuildError("the upload URL has expired", 403)
        if not hmac.compare_digest(self.upload_token(template_id, files_hash, when), signature):
            raise BuildError("invalid upload URL signature", 403)

    async def receive(self, files_hash: str, body: AsyncIterable[bytes]) -> int:
        """Store an uploaded context archive under its hash (atomically); one larger
        than build_context_max_bytes is refused (413) and nothing of it kept."""
        tmp = self.files_dir / f".{files_hash}.{secrets.token_hex(4)}.tmp"
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in body:
                    size += len(chunk)
                    if size > self.max_context_bytes:
                        raise BuildError(self.context_too_large(), 413)
                    await asyncio.to_thread(f.write, chunk)
            os.replace(tmp, self.files_dir / files_hash)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    def context_too_large(self) -> str:
        return (f"the build context archive exceeds {self.max_context_bytes} bytes "
                "(build_context_max_bytes)")

    # -- deleting -------------------------------------------------------------------------

    async def delete_template(self, name: str) -> str:
        """Remove a built template, its snapshot and its builds; returns its ID."""
        try:
            template = self.registry.get(name)
            template_id = template.template_id
        except TemplateNotFound:
            template, template_id = None, name
            if not any(b.template_id == name for b in self.store.all()):
                raise BuildError(f"template '{name}' not found", 404) from None
        if template is not None and not self._is_local(template_id):
            raise BuildError(f"'{name}' is a built-in template and cannot be deleted", 403)
        if template is not None and template.image is not None and not template.snapshot_id:
            raise BuildError(f"'{name}' is a pulled image: remove it with DELETE /images/{name}",
                             409)
        users = [r.sandbox_id for r in self.manager.list() if r.template_id == template_id]
        if users:
            raise BuildError(f"template '{name}' has {len(users)} sandbox(es) running or paused "
                             f"({', '.join(users[:3])}); kill them first", 409)
        for build in [b for b in self.store.all() if b.template_id == template_id]:
            await self.cancel(build.build_id)
            self.store.delete(build.build_id)
        if template is not None:
            async with self._publish_lock:
                await asyncio.to_thread(shutil.rmtree, self.local_dir / template_id, True)
            await self._delete_snapshot(template.snapshot_id)
        return template_id

    async def _delete_snapshot(self, snapshot_id: str) -> None:
        if snapshot_id:
            try:
                await asyncio.to_thread(self.manager.snapshots.delete, snapshot_id)
            except Exception as exc:  # a stale snapshot costs disk only
                log.warning("deleting template snapshot %s failed: %s", snapshot_id, exc)

    # -- the build ------------------------------------------------------------------------

    def _log(self, build: Build, message: str, level: str = "info", step: str = "") -> None:
        self.store.append(build.build_id, log_entry(message, level, step))

    def _output(self, build: Build, step: str, lines: list[str]) -> None:
        self.store.add_output(build.build_id, step, lines)

    def _finish(self, build: Build, status: str, reason: dict | None = None) -> None:
        build.status, build.reason, build.finished_at = status, reason, time.time()
        self.store.put(build)

    async def _run(self, build: Build, spec: dict[str, Any]) -> None:
        from ..orchestrator import CreateRequest, OrchestratorError

        t0 = time.monotonic()
        limits = self.manager.limits
        try:
            base = await self._base(build, spec)
            self._log(build, f"FROM {spec.get('fromImage') or spec.get('fromTemplate')}"
                             f" (template {base.template_id})", step="base")
            try:
                record = await self.manager.create(CreateRequest(
                    template=base.template_id, timeout=min(BUILD_SANDBOX_TTL,
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
            state = _initial_state(base)
            steps = spec.get("steps") or []
            for i, step in enumerate(steps, 1):
                await self._step(build, record, state, step, str(i), len(steps))
            await self._finalize(build, record, state, spec)
            manifest = await self.manager.snapshot(record.sandbox_id)
            build.snapshot_id = manifest.snapshot_id
            self.store.put(build)
            await self._publish(build, record, state, spec)
            self._log(build, f"Template {build.template_id} ({', '.join(build.names)}) is ready "
                             f"in {time.monotonic() - t0:.1f}s", step="finalize")
            self._finish(build, READY)
        except asyncio.CancelledError:
            self._log(build, "the build was cancelled", "error")
            self._finish(build, ERROR, {"message": "the build was cancelled"})
            raise
        except Exception as exc:
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

    async def _base(self, build: Build, spec: dict[str, Any]) -> Template:
        name = spec.get("fromTemplate")
        if not name:
            image = spec["fromImage"]
            repo = image.split("@")[0].rsplit(":", 1)[0] if ":" in image.split("/")[-1] \
                else image.split("@")[0]
            # As docker does with its local images: a template of this node named
            # like the image (``FROM py`` after ``aenv pull ... --name py``) is used.
            name = BASE_IMAGES.get(repo.removeprefix("docker.io/")) or \
                self._local_template(image) or \
                await self._pull(build, image, spec.get("fromImageRegistry"),
                                 bool(spec.get("force")))
        try:
            return self.registry.get(name)
        except TemplateNotFound:
            raise StepFailed(f"base template '{name}' not found", "base") from None

    def _local_template(self, image: str) -> str:
        if "/" in image or "@" in image:
            return ""
        try:
            return self.registry.get(image.removesuffix(":latest")).template_id
        except TemplateNotFound:
            return ""

    async def _pull(self, build: Build, image: str, registry: dict | None,
                    force: bool) -> str:
        """The image as a template of its own (``img-<hash of the reference>``), pulled
        unless already there; the built template shares its layers."""
        from ..images import ImageError

        name = "img-" + hashlib.sha256(image.encode()).hexdigest()[:16]
        credentials = None
        if registry:
            if registry.get("type", "registry") != "registry":
                raise StepFailed(f"image '{image}': {registry.get('type')} registry "
                                 "credentials are not supported; use username/password", "base")
            credentials = {"username": registry.get("username", ""),
                           "password": registry.get("password", "")}
        with contextlib.suppress(TemplateNotFound):
            existing = self.registry.get(name)
            if existing.image is not None and existing.image.source == image and not force:
                self._log(build, f"Image {image} is cached", step="base")
                return name
        self._log(build, f"Pulling {image}", step="base")
        seen: set[str] = set()

        def progress(event: dict) -> None:
            status = str(event.get("status", ""))
            if status and status not in seen and status != "done":
                seen.add(status)
                self._log(build, f"{image}: {status}", step="base")

        cancel = threading.Event()
        try:
            await asyncio.to_thread(self.manager.image_cache.pull, image, name, credentials,
                                    progress=progress, cancel=cancel)
        except asyncio.CancelledError:
            cancel.set()
            raise
        except ImageError as exc:
            raise StepFailed(f"pulling image '{image}' failed: {exc}", "base") from exc
        return name

    async def _step(self, build: Build, record, state: BuildState, step: dict, name: str,
                    total: int) -> None:
        kind, args = step["type"], [str(a) for a in step.get("args") or []]
        self._log(build, f"[{name}/{total}] {kind} {' '.join(args)}".rstrip(), step=name)
        if kind == "ENV":
            if len(args) % 2:
                raise StepFailed(f"step {name}: ENV needs key/value pairs", name)
            await self._env(build, record, state, args, name)
        elif kind == "WORKDIR":
            path = args[0] if args else ""
            path = path if path.startswith("/") else os.path.join(state.workdir or "/", path)
            q = shlex.quote(path)
            await self._shell(build, record, state, name, "root",
                              f"[ -d {q} ] || {{ mkdir -p {q} && chown {shlex.quote(state.user)}"
                              f" {q}; }}", "WORKDIR")
            state.workdir = path
        elif kind == "USER":
            user = args[0] if args else ""
            if not user:
                raise StepFailed(f"step {name}: USER needs a user name", name)
            u = shlex.quote(user.split(":")[0])
            await self._shell(build, record, state, name, "root",
                              f"id -u {u} >/dev/null 2>&1 || useradd -m {u}", "USER")
            state.user = user.split(":")[0]
        elif kind == "RUN":
            if not args:
                raise StepFailed(f"step {name}: RUN needs a command", name)
            user = args[1] if len(args) > 1 and args[1] else state.user
            await self._shell(build, record, state, name, user, args[0], "RUN")
        elif kind == "COPY":
            await self._copy(build, record, state, step, args, name)

    async def _env(self, build: Build, record, state: BuildState, args: list[str],
                   step: str) -> None:
        """ENV, as Docker does it: ``$VAR`` / ``${VAR}`` in values are what the build's
        shells see before this step (so ``PATH=/opt/bin:$PATH`` works)."""
        pairs = list(zip(args[::2], args[1::2], strict=True))
        if any("$" in value for _, value in pairs):
            current = await self._capture(record, state, "env -0")
            seen = dict(kv.split("=", 1) for kv in current.split("\0") if "=" in kv)
            pairs = [(k, expand(v, seen)) for k, v in pairs]
        state.envs.update(pairs)
        if any(k == "PATH" for k, _ in pairs):
            # Login shells (commands run as `bash -l -c`) reset PATH in /etc/profile;
            # the profile.d scripts it then reads set it back.
            line = f"export PATH={shlex.quote(state.envs['PATH'])}"
            await self._shell(build, record, state, step, "root",
                              f"[ ! -d /etc/profile.d ] || printf '%s\\n' {shlex.quote(line)} "
                              f"> /etc/profile.d/00-aenv-template-path.sh", "ENV")

    async def _capture(self, record, state: BuildState, command: str) -> str:
        out: list[bytes] = []
        size = 0

        def keep(stream: str, data: bytes) -> None:
            nonlocal size
            if stream == "stdout" and size < MAX_CAPTURE:
                out.append(data[:MAX_CAPTURE - size])
                size += len(out[-1])

        code = await self.manager.envd.run_logged(
            record.slot_address, record.envd_token, command, keep,
            user=state.user, cwd=state.workdir, envs=state.envs)
        if code != 0:
            raise StepFailed(f"reading the build's environment failed ({code})", "base")
        return b"".join(out).decode(errors="replace")

    async def _shell(self, build: Build, record, state: BuildState, step: str, user: str,
                     command: str, what: str) -> None:
        lines = LineLog(lambda texts: self._output(build, step, texts),
                        lambda: self.store.keeps_output(build.build_id))
        code = await self.manager.envd.run_logged(
            record.slot_address, record.envd_token, command, lines.feed, user=user,
            cwd=state.workdir, envs=state.envs)
        lines.flush()
        if code != 0:
            tail = "\n".join(lines.tail)
            raise StepFailed(f"step {step} ({what}) failed with exit code {code}: {command}"
                             + (f"\n{tail}" if tail else ""), step)

    async def _copy(self, build: Build, record, state: BuildState, step: dict,
                    args: list[str], name: str) -> None:
        if len(args) < 2:
            raise StepFailed(f"step {name}: COPY needs a source and a destination", name)
        src, dest = args[0], args[1]
        owner = (args[2] if len(args) > 2 and args[2] else state.user)
        mode = args[3] if len(args) > 3 and args[3] else ""
        archive = self.file_path(step.get("filesHash", ""))
        if archive is None:
            raise StepFailed(f"step {name}: the files of COPY {src} are gone", name)
        os.utime(archive)
        if not dest.startswith("/"):
            dest = os.path.join(state.workdir or "/home/" + state.user, dest)
        inside = f"/tmp/.aenv-build-{step['filesHash'][:16]}"
        await self._put_file(record, archive, inside + ".tar")
        with open(archive, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        script = copy_script(inside, gz, src, dest, owner, mode)
        await self._shell(build, record, state, name, "root", script, "COPY")

    async def _put_file(self, record, source: Path, path: str) -> None:
        async def chunks():
            with open(source, "rb") as f:
                while data := await asyncio.to_thread(f.read, 1 << 20):
                    yield data

        url = f"http://{record.slot_address}:49983/files"
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=600.0),
                                     trust_env=False) as http:
            r = await http.post(url, params={"path": path, "username": "root"},
                                content=chunks(),
                                headers={"X-Access-Token": record.envd_token,
                                         "Content-Type": "application/octet-stream"})
        if r.status_code >= 300:
            raise StepFailed(f"copying the build context into the sandbox failed: "
                             f"HTTP {r.status_code} {r.text[:200]}", "base")

    async def _finalize(self, build: Build, record, state: BuildState,
                        spec: dict[str, Any]) -> None:
        envd = self.manager.envd
        # The envd state is in the snapshot: sandboxes of the template start with
        # these env vars, user and working directory.
        await envd.init(record.slot_address, record.envd_token, state.envs,
                        default_user=state.user, default_workdir=state.workdir,
                        current_token=record.envd_token)
        start_cmd, ready_cmd = spec.get("startCmd") or "", spec.get("readyCmd") or ""
        if start_cmd:
            self._log(build, f"Starting: {start_cmd}", step="finalize")
            await envd.start(record.slot_address, record.envd_token, start_cmd,
                             user=state.user, cwd=state.workdir, envs=state.envs)
        if not ready_cmd:
            return
        self._log(build, f"Waiting for the ready check: {ready_cmd}", step="finalize")
        end = time.monotonic() + self.ready_timeout_s
        delay = 0.1
        while True:
            code = await envd.run(record.slot_address, record.envd_token, ready_cmd,
                                  user=state.user, deadline_s=30)
            if code == 0:
                self._log(build, "Ready check passed", step="finalize")
                return
            if time.monotonic() > end:
                raise StepFailed(f"the ready check did not pass within "
                                 f"{self.ready_timeout_s:.0f}s: {ready_cmd}", "finalize")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _publish(self, build: Build, record, state: BuildState,
                       spec: dict[str, Any]) -> None:
        """Write template.json atomically; the build it replaces loses its snapshot."""
        base = self.registry.get(record.template_id)
        base_meta = self._meta(record.template_id)
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
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".template.json.{build.build_id}"
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, directory / "template.json")
        if previous is not None and previous.snapshot_id != build.snapshot_id:
            await self._delete_snapshot(previous.snapshot_id)


    def _meta(self, template_id: str) -> dict:
        for directory in self.registry.dirs:
            with contextlib.suppress(OSError, ValueError):
                return json.loads((directory / template_id / "template.json").read_text())
        return {}


STEPS = ("RUN", "COPY", "ENV", "WORKDIR", "USER")


def _initial_state(base: Template) -> BuildState:
    """What a build starts from: a built template's defaults, an image's config, or
    the built-in templates' ``user``."""
    if base.snapshot_id or base.image is None:
        return BuildState(user=base.default_user or "user", workdir=base.default_workdir,
                          envs=dict(base.envs))
    envs = dict(e.split("=", 1) for e in base.image.env if "=" in e)
    return BuildState(user=base.image.user.split(":")[0] or "root",
                      workdir=base.image.workdir, envs=envs)
