"""The gVisor driver: every sandbox is a runsc sandbox with its own application kernel.

This module alone knows runsc's flags and files. Per sandbox it keeps an OCI
bundle directory (config.json plus logs) under ``<run_dir>/sandboxes/<id>``;
runsc's own state lives in ``<run_dir>/runsc``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ..envd.dormancy import DORMANT_LINE, START_LINE, WOKEN_LINE
from .base import RuntimeFailure, RuntimeSandbox, SandboxSpec
from .cpu_balance import CpuBalancer
from .exits import memory_file_bytes
from .freezer import CgroupFreezer
from .oci import build_spec
from .reaping import alive, become_subreaper, reap, reap_runsc_orphans
from .reclaim import reclaim_frozen
from .watching import Watching

log = logging.getLogger(__name__)

RUNSC = shutil.which("runsc") or "/usr/bin/runsc"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# runsc refuses a networked sandbox when it believes it is in the root netns,
# and it tells by /proc/sys/net existing, which it does in every netns on this
# kernel. A private mount namespace with an empty tmpfs there gets past it.
_MASK_PROC_SYS_NET = 'mount -t tmpfs none /proc/sys/net && exec "$0" "$@"'


class GVisorRuntime(Watching):
    kind = "gvisor"

    def __init__(self, run_dir: Path, cgroup_parent: str = "aenv", platform: str = "systrap"):
        self.run_dir = run_dir
        self.state_dir = run_dir / "runsc"
        self.sandboxes_dir = run_dir / "sandboxes"
        self.cgroup_parent = cgroup_parent
        self.platform = platform
        self._version: str | None = None
        self._cpu = CpuBalancer(cgroup_parent)
        # Idle sandboxes frozen in place (freezer.py); every operation below thaws first.
        self.freezer = CgroupFreezer(cgroup_parent)
        # Called with (sandbox ID, why) when a sandbox's process ends without the
        # node asking (host OOM kill, crash); the orchestrator sets it.
        self.on_exit: Callable[[str, str], None] | None = None
        self._init_watching()
        for d in (self.state_dir, self.sandboxes_dir):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        become_subreaper()

    # -- engine facts ---------------------------------------------------------

    @property
    def version(self) -> str:
        if self._version is None:
            import subprocess

            out = subprocess.run([RUNSC, "--version"], capture_output=True, text=True, check=False)
            first = out.stdout.splitlines()[0] if out.stdout else "unknown"
            self._version = first.removeprefix("runsc version ").strip()
        return self._version

    def _global_flags(self, log_file: Path | None = None) -> builtins.list[str]:
        flags = [
            f"--root={self.state_dir}",
            f"--platform={self.platform}",
            "--network=sandbox",
            # The writable root layer lives in sandbox memory, so it is part of
            # every checkpoint and never touches the shared template.
            "--overlay2=root:memory",
            # Checkpoints drop connected TCP endpoints instead of failing.
            "--net-disconnect-ok",
        ]
        if log_file is not None:
            flags.append(f"--log={log_file}")
        return flags

    def bundle_dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def _cgroups_path(self, sandbox_id: str) -> str:
        return f"/{self.cgroup_parent}/{sandbox_id}"

    # -- running runsc --------------------------------------------------------

    async def _runsc(self, *args: str, check: bool = True, limit: float = 30) -> str:
        proc = await asyncio.create_subprocess_exec(
            RUNSC, *self._global_flags(), *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), limit)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if check and proc.returncode != 0:
            # The whole tail goes to the log: the one line in the error may not say enough.
            log.warning("runsc %s failed (exit %s): %s", args[0], proc.returncode,
                        err[-4096:].decode(errors="replace"))
            raise RuntimeFailure(f"runsc {args[0]} failed: {_last_line(err)}")
        return out.decode()

    async def _runsc_creating(self, bundle: Path, *args: str) -> None:
        """Run a runsc command that creates a sandbox process (run, restore).

        The sandbox inherits this command's stdio for its whole life, so it gets
        files of its own, never the server's pipes.
        """
        log_file = bundle / "runsc.log"
        with open(bundle / "console.log", "ab") as console:
            proc = await asyncio.create_subprocess_exec(
                "unshare", "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", _MASK_PROC_SYS_NET,
                RUNSC, *self._global_flags(log_file), *args,
                stdin=asyncio.subprocess.DEVNULL, stdout=console, stderr=console,
                start_new_session=True,
            )
            try:
                code = await asyncio.wait_for(proc.wait(), 60)
            except asyncio.CancelledError:
                # Killing runsc half-way orphans the sandbox processes it already
                # started; let it finish (the caller then destroys the sandbox whole).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 60)
                raise
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise
        if code != 0:
            why = _tail(log_file) or _tail(bundle / "console.log")
            raise RuntimeFailure(f"runsc {args[0]} failed: {why}")

    # -- Runtime protocol -----------------------------------------------------

    async def start(self, spec: SandboxSpec) -> RuntimeSandbox:
        return await self._create(spec, "run", "--detach")

    async def _create(self, spec: SandboxSpec, *command: str) -> RuntimeSandbox:
        """Write the sandbox's OCI bundle and run a creating runsc command on it;
        on any failure nothing of the sandbox is left."""
        bundle = self.bundle_dir(spec.sandbox_id)
        bundle.mkdir(parents=True, exist_ok=True, mode=0o700)
        config = build_spec(spec, self._cgroups_path(spec.sandbox_id))
        (bundle / "config.json").write_text(json.dumps(config))
        try:
            await self._runsc_creating(bundle, *command, f"--bundle={bundle}", spec.sandbox_id)
        except BaseException:
            await asyncio.shield(self.destroy(spec.sandbox_id))
            raise
        # runsc's exited helpers, reaped in a thread (a /proc scan: 5-30 ms here)
        asyncio.get_running_loop().run_in_executor(None, reap_runsc_orphans)
        pid = self._watch(spec.sandbox_id)
        return RuntimeSandbox(spec.sandbox_id, "running", pid)

    async def checkpoint(self, sandbox_id: str, image_dir: Path, leave_running: bool) -> None:
        """Save the sandbox's whole state (memory, processes, in-memory root layer).

        Without ``leave_running`` the sandbox is gone afterwards (its resources are
        then released by destroy). Connected TCP endpoints are dropped, not saved.
        """
        with self.freezer.awake(sandbox_id):
            await self._checkpoint(sandbox_id, image_dir, leave_running)

    async def _checkpoint(self, sandbox_id: str, image_dir: Path, leave_running: bool) -> None:
        image_dir.mkdir(parents=True, exist_ok=True)
        args = ["checkpoint", f"--image-path={image_dir}", "--compression=none"]
        if leave_running:
            args.append("--leave-running")
            await self._runsc(*args, sandbox_id, limit=300)
        else:
            # The capture stops the sandbox: that exit is the node's own doing.
            self._unwatch(sandbox_id)
            try:
                # runsc waits for the stopped sandbox to be reaped, and we reap it.
                await self._reaping(self._runsc(*args, sandbox_id, limit=300))
            except BaseException:
                self._watch(sandbox_id)  # still running (or its end is reported now)
                raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> RuntimeSandbox:
        """Start a sandbox from a checkpoint; the spec must match the checkpointed one
        but for its ID and network namespace (a new slot)."""
        return await self._create(spec, "restore", "--detach", f"--image-path={image_dir}")

    async def state(self, sandbox_id: str) -> RuntimeSandbox | None:
        try:
            out = await self._runsc("state", sandbox_id)
        except RuntimeFailure:
            return None
        data = json.loads(out)
        return RuntimeSandbox(data["id"], data.get("status", "unknown"), int(data.get("pid") or 0))

    async def destroy(self, sandbox_id: str) -> None:
        self._unwatch(sandbox_id)
        # A frozen task takes its SIGKILL only once thawed.
        with self.freezer.awake(sandbox_id):
            await self._destroy(sandbox_id)
        self.freezer.forget(sandbox_id)

    async def _destroy(self, sandbox_id: str) -> None:
        # Kill and reap the sandbox's processes ourselves: `runsc delete --force`
        # would wait on the host's init to reap them (over a second here).
        await asyncio.to_thread(self._kill_processes, sandbox_id)
        await self._reaping(self._runsc("delete", "--force", sandbox_id, check=False))
        await asyncio.to_thread(self._remove_leftovers, sandbox_id)
        reap_runsc_orphans()

    async def housekeeping(self) -> None:
        reap_runsc_orphans()
        self._pressure.recheck()
        self._hold.recheck()
        try:
            self._cpu.tick()
        except OSError:
            log.exception("re-weighing sandbox CPU shares failed")

    async def _reaping(self, command):
        """Run a runsc command that waits on sandbox processes to go, reaping them
        meanwhile: as subreaper we are their parent, and a zombie never goes."""
        task = asyncio.ensure_future(command)
        try:
            while not task.done():
                # in a thread: a /proc scan every 20 ms would hold the loop most of the time
                await asyncio.to_thread(reap_runsc_orphans)
                await asyncio.wait([task], timeout=0.02)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
            reap_runsc_orphans()

    def _kill_processes(self, sandbox_id: str) -> None:
        # The sandbox's cgroup first: its processes, found without reading their
        # /proc/PID/cmdline, which blocks while a process waits at its memory limit.
        pids = set(_cgroup_pids(self.memory_cgroup(sandbox_id)))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # Then any of its processes not (or no longer) in the cgroup.
        marker = f"{self.sandboxes_dir}/{sandbox_id}/".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            if int(entry) in pids:
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker not in f.read():
                        continue
            except OSError:
                continue
            pids.add(int(entry))
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)
        reap(list(pids), deadline=time.monotonic() + 5)

    def capture_size(self, sandbox_id: str) -> int:
        """The memory file's pages (shmem): an uncompressed capture writes each of them."""
        return memory_file_bytes(self.memory_cgroup(sandbox_id))

    def memory_cgroup(self, sandbox_id: str) -> Path:
        """The sandbox's memory cgroup (v1: runsc puts the sentry, gofer and all in it)."""
        return CGROUP_ROOT / "memory" / self._cgroups_path(sandbox_id).strip("/")

    def _remove_leftovers(self, sandbox_id: str) -> None:
        shutil.rmtree(self.bundle_dir(sandbox_id), ignore_errors=True)
        remove_cgroup(self._cgroups_path(sandbox_id))

    async def pause(self, sandbox_id: str) -> None:
        with self.freezer.awake(sandbox_id):  # runsc's RPC needs a sentry that runs
            await self._runsc("pause", sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        with self.freezer.awake(sandbox_id):
            await self._runsc("resume", sandbox_id)

    # -- idle freezing (freezer.py) ---------------------------------------------------

    def freeze(self, sandbox_id: str) -> bool:
        return self.freezer.freeze(sandbox_id)

    def thaw(self, sandbox_id: str) -> bool:
        return self.freezer.thaw(sandbox_id)

    def frozen_count(self) -> int:
        return self.freezer.frozen_count()

    def is_frozen(self, sandbox_id: str) -> bool:
        return self.freezer.frozen(sandbox_id)

    def reclaim(self, sandbox_id: str) -> tuple[int, int]:
        return reclaim_frozen(self.memory_cgroup(sandbox_id),
                              lambda: self.freezer.frozen(sandbox_id))

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        return self.freezer.cpu_seconds(sandbox_id)

    def envd_dormant(self, sandbox_id: str) -> bool:
        return console_says_dormant(self.bundle_dir(sandbox_id) / "console.log")

    async def list(self) -> dict[str, RuntimeSandbox]:
        out = await self._runsc("list", "--format=json")
        items = json.loads(out) or []
        return {
            i["id"]: RuntimeSandbox(i["id"], i.get("status", "unknown"), int(i.get("pid") or 0))
            for i in items
        }

    async def settle(self, wait_s: float = 120) -> int:
        """Wait for runsc commands of this state directory that a killed node left
        running: a `runsc checkpoint` goes on after its caller died and then stops
        the sandbox, so the sandbox's state is known only once it is done. Those
        still running after ``wait_s`` seconds are killed."""
        # Sandboxes a previous node process froze answer nothing until thawed.
        thawed = await asyncio.to_thread(self.freezer.thaw_all)
        if thawed:
            log.info("thawed %d sandboxes a previous node process froze", thawed)
        pids = await asyncio.to_thread(self._orphan_commands)
        end = time.monotonic() + wait_s
        waiting = set(pids)
        while waiting and time.monotonic() < end:
            await asyncio.sleep(0.05)
            reap_runsc_orphans()
            waiting = {p for p in waiting if alive(p)}
        for pid in waiting:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if pids:
            log.info("waited for %d runsc commands left by a previous node process "
                     "(%d killed)", len(pids), len(waiting))
        return len(pids)

    def _orphan_commands(self) -> builtins.list[int]:
        """runsc CLI processes (not sandboxes or gofers, whose argv[0] differs) on our root."""
        root = f"--root={self.state_dir}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv and os.path.basename(argv[0]) == b"runsc" and root in argv:
                found.append(int(entry))
        return found

    async def reconcile(self, keep: set[str]) -> builtins.list[str]:
        """Remove runsc sandboxes, bundle dirs and cgroups of sandboxes not in ``keep``."""
        removed = []
        for sandbox_id, sandbox in (await self.list()).items():
            if sandbox_id not in keep or sandbox.state == "stopped":
                await self.destroy(sandbox_id)
                removed.append(sandbox_id)
        for leftover in self.sandboxes_dir.iterdir():
            if leftover.name not in keep:
                await self.destroy(leftover.name)
                if leftover.name not in removed:
                    removed.append(leftover.name)
        await asyncio.to_thread(self._remove_stray_cgroups, keep)
        for sandbox_id in keep:  # adopted after a restart: watched from now on
            if sandbox_id not in removed and not self._exits.watching(sandbox_id):
                self._watch(sandbox_id)
        return removed

    def _remove_stray_cgroups(self, keep: set[str]) -> None:
        for parent in CGROUP_ROOT.glob(f"*/{self.cgroup_parent}"):
            for child in parent.iterdir():
                if child.is_dir() and child.name not in keep:
                    remove_cgroup(f"/{self.cgroup_parent}/{child.name}")
            if not keep:
                with contextlib.suppress(OSError):
                    parent.rmdir()


def remove_cgroup(path: str) -> None:
    """Remove a cgroup from every v1 hierarchy (or the v2 one). Idempotent."""
    rel = path.strip("/")
    for candidate in [CGROUP_ROOT / rel, *CGROUP_ROOT.glob(f"*/{rel}")]:
        if candidate.is_dir():
            with contextlib.suppress(OSError):
                os.rmdir(candidate)



def _last_line(err: bytes) -> str:
    """runsc's error, not the Go stack trace a panic may end its output with; a full
    disk is always named, whichever line said it."""
    text = err.decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    messages = [ln for ln in lines
                if not ln[0].isspace() and ".go:" not in ln and not ln.startswith("goroutine")]
    line = messages[-1] if messages else (lines[-1] if lines else "no output")
    if "no space left on device" in text and "no space left" not in line:
        line += " (no space left on device)"
    return line


def console_says_dormant(console: Path, tail: int = 8192) -> bool:
    """envd's last word in a sandbox's console log is that it went dormant (it prints
    that right before it executes envd-stub, and a line when it starts again)."""
    try:
        with open(console, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail))
            text = f.read()
    except OSError:
        return False
    asleep = text.rfind(DORMANT_LINE.encode())
    return asleep >= 0 and asleep > max(text.rfind(WOKEN_LINE.encode()),
                                        text.rfind(START_LINE.encode()))


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " | ".join(ln for ln in text.splitlines()[-lines:] if ln.strip())


def _cgroup_pids(cgroup: Path) -> list[int]:
    try:
        return [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []
