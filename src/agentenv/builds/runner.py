"""Running a build's steps (RUN, COPY, ENV, WORKDIR, USER) and its start command
and ready check in the build sandbox, through envd, logging to the build's log."""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from ..templates import Template
from .context_files import ContextFiles
from .errors import StepFailed
from .steps import LineLog, copy_script, expand
from .store import Build, BuildStore, log_entry

if TYPE_CHECKING:
    from ..orchestrator import SandboxManager

STEPS = ("RUN", "COPY", "ENV", "WORKDIR", "USER")
MAX_CAPTURE = 4 << 20  # bytes of a command's output the builder reads for itself (env -0)


@dataclass
class BuildState:
    """What the steps so far have set, carried into later steps and the template."""

    user: str = "user"
    workdir: str = ""
    envs: dict[str, str] = field(default_factory=dict)


def initial_state(base: Template) -> BuildState:
    """What a build starts from: a built template's defaults, an image's config, or
    the built-in templates' ``user``."""
    if base.snapshot_id or base.image is None:
        return BuildState(user=base.default_user or "user", workdir=base.default_workdir,
                          envs=dict(base.envs))
    envs = dict(e.split("=", 1) for e in base.image.env if "=" in e)
    return BuildState(user=base.image.user.split(":")[0] or "root",
                      workdir=base.image.workdir, envs=envs)


class StepRunner:
    """One build's steps in its sandbox ``record``; ``state`` is updated as they run."""

    def __init__(self, manager: SandboxManager, store: BuildStore, files: ContextFiles,
                 build: Build, record: Any, state: BuildState, ready_timeout_s: float):
        self.manager = manager
        self.store = store
        self.files = files
        self.build = build
        self.record = record
        self.state = state
        self.ready_timeout_s = ready_timeout_s

    def _log(self, message: str, level: str = "info", step: str = "") -> None:
        self.store.append(self.build.build_id, log_entry(message, level, step))

    def _output(self, step: str, lines: list[str]) -> None:
        self.store.add_output(self.build.build_id, step, lines)

    async def step(self, step: dict, name: str, total: int) -> None:
        """Run step number ``name`` of ``total``."""
        state = self.state
        kind, args = step["type"], [str(a) for a in step.get("args") or []]
        self._log(f"[{name}/{total}] {kind} {' '.join(args)}".rstrip(), step=name)
        if kind == "ENV":
            if len(args) % 2:
                raise StepFailed(f"step {name}: ENV needs key/value pairs", name)
            await self._env(args, name)
        elif kind == "WORKDIR":
            path = args[0] if args else ""
            path = path if path.startswith("/") else os.path.join(state.workdir or "/", path)
            q = shlex.quote(path)
            await self._shell(name, "root",
                              f"[ -d {q} ] || {{ mkdir -p {q} && chown {shlex.quote(state.user)}"
                              f" {q}; }}", "WORKDIR")
            state.workdir = path
        elif kind == "USER":
            user = args[0] if args else ""
            if not user:
                raise StepFailed(f"step {name}: USER needs a user name", name)
            u = shlex.quote(user.split(":")[0])
            await self._shell(name, "root",
                              f"id -u {u} >/dev/null 2>&1 || useradd -m {u}", "USER")
            state.user = user.split(":")[0]
        elif kind == "RUN":
            if not args:
                raise StepFailed(f"step {name}: RUN needs a command", name)
            user = args[1] if len(args) > 1 and args[1] else state.user
            await self._shell(name, user, args[0], "RUN")
        elif kind == "COPY":
            await self._copy(step, args, name)

    async def _env(self, args: list[str], step: str) -> None:
        """ENV, as Docker does it: ``$VAR`` / ``${VAR}`` in values are what the build's
        shells see before this step (so ``PATH=/opt/bin:$PATH`` works)."""
        state = self.state
        pairs = list(zip(args[::2], args[1::2], strict=True))
        if any("$" in value for _, value in pairs):
            current = await self._capture("env -0")
            seen = dict(kv.split("=", 1) for kv in current.split("\0") if "=" in kv)
            pairs = [(k, expand(v, seen)) for k, v in pairs]
        state.envs.update(pairs)
        if any(k == "PATH" for k, _ in pairs):
            # Login shells (commands run as `bash -l -c`) reset PATH in /etc/profile;
            # the profile.d scripts it then reads set it back.
            line = f"export PATH={shlex.quote(state.envs['PATH'])}"
            await self._shell(step, "root",
                              f"[ ! -d /etc/profile.d ] || printf '%s\\n' {shlex.quote(line)} "
                              f"> /etc/profile.d/00-aenv-template-path.sh", "ENV")

    async def _capture(self, command: str) -> str:
        """The stdout of ``command`` (at most MAX_CAPTURE bytes), not logged."""
        out: list[bytes] = []
        size = 0

        def keep(stream: str, data: bytes) -> None:
            nonlocal size
            if stream == "stdout" and size < MAX_CAPTURE:
                out.append(data[:MAX_CAPTURE - size])
                size += len(out[-1])

        record, state = self.record, self.state
        code = await self.manager.envd.run_logged(
            record.slot_address, record.envd_token, command, keep,
            user=state.user, cwd=state.workdir, envs=state.envs)
        if code != 0:
            raise StepFailed(f"reading the build's environment failed ({code})", "base")
        return b"".join(out).decode(errors="replace")

    async def _shell(self, step: str, user: str, command: str, what: str) -> None:
        """Run ``command`` as ``user``, its output logged as the step's lines."""
        record, state, build_id = self.record, self.state, self.build.build_id
        lines = LineLog(lambda texts: self._output(step, texts),
                        lambda: self.store.keeps_output(build_id))
        code = await self.manager.envd.run_logged(
            record.slot_address, record.envd_token, command, lines.feed, user=user,
            cwd=state.workdir, envs=state.envs)
        lines.flush()
        if code != 0:
            tail = "\n".join(lines.tail)
            raise StepFailed(f"step {step} ({what}) failed with exit code {code}: {command}"
                             + (f"\n{tail}" if tail else ""), step)

    async def _copy(self, step: dict, args: list[str], name: str) -> None:
        state = self.state
        if len(args) < 2:
            raise StepFailed(f"step {name}: COPY needs a source and a destination", name)
        src, dest = args[0], args[1]
        owner = (args[2] if len(args) > 2 and args[2] else state.user)
        mode = args[3] if len(args) > 3 and args[3] else ""
        archive = self.files.path(step.get("filesHash", ""))
        if archive is None:
            raise StepFailed(f"step {name}: the files of COPY {src} are gone", name)
        os.utime(archive)
        if not dest.startswith("/"):
            dest = os.path.join(state.workdir or "/home/" + state.user, dest)
        inside = f"/tmp/.aenv-build-{step['filesHash'][:16]}"
        await self._put_file(archive, inside + ".tar")
        with open(archive, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        script = copy_script(inside, gz, src, dest, owner, mode)
        await self._shell(name, "root", script, "COPY")

    async def _put_file(self, source: Path, path: str) -> None:
        """Upload ``source`` to ``path`` in the sandbox through envd's files API."""
        record = self.record

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

    async def finalize(self, spec: dict[str, Any]) -> None:
        """Set envd's defaults from the state, start the start command and wait for
        the ready check to pass."""
        record, state = self.record, self.state
        envd = self.manager.envd
        # The envd state is in the snapshot: sandboxes of the template start with
        # these env vars, user and working directory.
        await envd.init(record.slot_address, record.envd_token, state.envs,
                        default_user=state.user, default_workdir=state.workdir,
                        current_token=record.envd_token)
        start_cmd, ready_cmd = spec.get("startCmd") or "", spec.get("readyCmd") or ""
        if start_cmd:
            self._log(f"Starting: {start_cmd}", step="finalize")
            await envd.start(record.slot_address, record.envd_token, start_cmd,
                             user=state.user, cwd=state.workdir, envs=state.envs)
        if not ready_cmd:
            return
        self._log(f"Waiting for the ready check: {ready_cmd}", step="finalize")
        end = time.monotonic() + self.ready_timeout_s
        delay = 0.1
        while True:
            code = await envd.run(record.slot_address, record.envd_token, ready_cmd,
                                  user=state.user, deadline_s=30)
            if code == 0:
                self._log("Ready check passed", step="finalize")
                return
            if time.monotonic() > end:
                raise StepFailed(f"the ready check did not pass within "
                                 f"{self.ready_timeout_s:.0f}s: {ready_cmd}", "finalize")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
