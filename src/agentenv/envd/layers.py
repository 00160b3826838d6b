"""Files layers: a sandbox's files back to a snapshot's in a few milliseconds, no restore.

A filesystem reset (issue 28, ``POST /sandboxes/{id}/reset`` with ``mode:
filesystem``) is for tasks whose state is their files. The first such reset to a
snapshot is a full one (the node restores the snapshot), after which the node asks
envd to *push* a layer tagged with the snapshot's ID: an overlay whose lower layer is
the files as they are now and whose upper layer is a fresh tmpfs, with envd's root
(``chroot``) moved into it. Everything envd starts from then on (commands, file
operations, sudo) sees that overlay and writes into its upper layer. The next reset
to the same snapshot *resets* the layer: every process started since the push is
killed, the upper layer is dropped and a fresh one mounted, and envd's root moves
into it. The processes that ran when the layer was pushed (those of the snapshot:
services the template started) keep running, with their memory as it is now; their
writes go to the lower layer and so survive resets. A reset to a snapshot deeper in
the stack (one restored, then layered again) drops the layers above it.

What a layer covers: the root, and ``/tmp`` (its own tmpfs, so its own overlay).
``/proc``, ``/dev`` (with ``/dev/shm``), ``/sys`` and envd's bundle are the real
ones, bound in.

envd itself gave up CAP_SYS_ADMIN at start-up (bootid.py), so the mounts are made by
``layer-keeper`` (layer_keeper.c), a libc-free helper it started before that and
talks to over a socket pair (``KEEPER_FD``); envd leaves its layer through a
descriptor of the real root it opened at boot (``ROOT_FD``). Both live at fixed
numbers and are inheritable, so that they survive envd's dormancy (an exec of the
stub and back); commands never get them (envd's spawns close every other descriptor,
and its file workers close all they inherit).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("envd")

KEEPER_NAME = "layer-keeper"
KEEPER_FD = 1000
# The keeper's bounds on one request (layer_keeper.c's MAX_OPS and MAX_REQUEST).
KEEPER_MAX_OPS = 32
KEEPER_MAX_REQUEST = 8192
ROOT_FD = 1001
LAYERS_DIR = "/.aenv-layers"
MAX_DEPTH = 4
TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
KILL_DEADLINE_S = 10.0
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 1, 2, 4, 4096, 16384
_MNT_DETACH = 2
# Mounts under the root that a layer overlays (their files are reset with the root's);
# every other one is bound in as it is.
OVERLAID = ("/tmp",)


class Workers(Protocol):
    """envd's file workers (userfs.UserFS), told when its root moves: none is handed
    out meanwhile, and the idle ones (which ``root_moving`` gives as (pid, start time),
    to be spared by a reset's kill pass) then follow it."""

    def root_moving(self) -> set[tuple[int, int]]: ...

    def root_moved(self) -> None: ...


class LayerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Level:
    tag: str
    # The processes that ran when the layer was pushed, as (pid, start time): they are
    # kept by a reset; anything else is a process of the layer's and is killed.
    base: list[tuple[int, int]] = field(default_factory=list)
    resets: int = 0


def keeper_path() -> Path:
    import sys

    return Path(sys.prefix).parent / "bin" / KEEPER_NAME  # PYTHONHOME is <bundle>/python


def start_keeper() -> int | None:
    """At boot, as pid 1 and while CAP_SYS_ADMIN is still held (bootid.prepare): start
    the keeper and open the real root's descriptor. The keeper's pid, or None when the
    bundle has none (no compiler when it was built): then no filesystem resets here."""
    helper = keeper_path()
    if not os.access(helper, os.X_OK):
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.posix_spawn(str(helper), [KEEPER_NAME], {},
                             file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)])
    except OSError as e:
        log.warning("layers: %s not started: %s", KEEPER_NAME, e)
        return None
    finally:
        theirs.close()
    os.dup2(ours.detach(), KEEPER_FD)  # inheritable: it outlives a dormancy exec
    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    os.dup2(root, ROOT_FD)
    os.close(root)
    return pid


def stat_of(pid: int) -> tuple[int, str] | None:
    """(start time, state) of a process, from /proc/PID/stat; None once it is gone."""
    try:  # three system calls (open() would make six), each dear under gVisor
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            fields = os.read(fd, 4096).rsplit(b")", 1)[1].split()
        finally:
            os.close(fd)
        return int(fields[19]), fields[0].decode()
    except (OSError, IndexError, ValueError):
        return None


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def processes() -> dict[int, tuple[int, str]]:
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = stat_of(int(name))
            if st is not None:
                found[int(name)] = st
    return found


def _mounts_under_root() -> tuple[list[str], str]:
    """Mount points just below the real root's (envd's root must be the real one), and
    the ``size=`` option of /tmp's tmpfs ("" if none): the sandbox's budget for written
    files (runtime/oci.py tmp_mount), which each layer's tmpfs gets too."""
    by_id: dict[str, tuple[str, str]] = {}
    tmp_size = ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5:
                by_id[parts[0]] = (parts[1], parts[4].replace("\\040", " "))
            if len(parts) >= 5 and parts[4] == "/tmp" and " - " in line:
                supers = line.split(" - ", 1)[1].split()
                options = supers[2].split(",") if len(supers) >= 3 else []
                tmp_size = next((o for o in options if o.startswith("size=")), "")
    root_ids = {mid for mid, (_, point) in by_id.items() if point == "/"}
    tops = {point for parent, point in by_id.values()
            if parent in root_ids and point != "/" and not point.startswith(LAYERS_DIR)}
    return sorted(tops), tmp_size


class Layers:
    """envd's stack of files layers (one per snapshot it resets to in filesystem mode)."""

    def __init__(self) -> None:
        self.keeper_pid: int | None = None
        self.levels: list[Level] = []
        self.binds: list[str] = []  # mount points bound into every layer
        self.size = ""  # each layer's tmpfs size option (/tmp's: the written-files budget)
        self._lock = asyncio.Lock()

    # -- state across dormancy -----------------------------------------------------
    def saved(self) -> dict[str, Any]:
        return {"keeper": self.keeper_pid, "binds": self.binds, "size": self.size,
                "levels": [[lv.tag, lv.base, lv.resets] for lv in self.levels]}

    def restore(self, saved: Any) -> None:
        if not isinstance(saved, dict):
            return
        with contextlib.suppress(TypeError, ValueError):
            self.keeper_pid = int(saved["keeper"]) if saved.get("keeper") else None
            self.binds = [str(b) for b in saved.get("binds") or []]
            self.size = str(saved.get("size") or "")
            self.levels = [Level(str(tag), [(int(p), int(s)) for p, s in base], int(resets))
                           for tag, base, resets in saved.get("levels") or []]

    def why_not(self) -> str | None:
        """Why this envd cannot layer, or None."""
        if self.keeper_pid is None:
            return "envd has no layer keeper here (not the sandbox's init, or an old bundle)"
        if stat_of(self.keeper_pid) is None:
            return "the layer keeper has ended (a command killed it)"
        try:
            os.fstat(KEEPER_FD)
            os.fstat(ROOT_FD)
        except OSError:
            return "the layer keeper's descriptors are gone"
        return None

    def describe(self) -> dict[str, Any]:
        return {"supported": self.why_not() is None, "why": self.why_not(),
                "levels": [{"tag": lv.tag, "resets": lv.resets} for lv in self.levels]}

    # -- the two operations ----------------------------------------------------------
    async def push(self, tag: str, workers: Workers) -> dict[str, Any]:
        """A new layer over the files as they are, envd's root moved into it."""
        self._check(tag)
        async with self._lock:
            if len(self.levels) >= MAX_DEPTH:
                raise LayerError(409, f"already {MAX_DEPTH} layers deep: reset in memory mode")
            t0 = time.perf_counter()
            level = Level(tag, [(pid, st[0]) for pid, st in processes().items()
                                if st[1] != "Z"])
            workers.root_moving()
            try:
                self._to_real_root()
                try:
                    if not self.levels:
                        self.binds, self.size = _mounts_under_root()
                        os.makedirs(LAYERS_DIR, mode=0o700, exist_ok=True)
                    self._build(len(self.levels) + 1)
                except BaseException:
                    self._enter(len(self.levels))
                    raise
                self.levels.append(level)
                self._enter(len(self.levels))
            finally:
                workers.root_moved()
            ms = (time.perf_counter() - t0) * 1000
            log.info("layers: pushed layer %d for %s in %.1f ms", len(self.levels), tag, ms)
            return {"depth": len(self.levels), "killed": 0, "ms": round(ms, 2)}

    async def reset(self, tag: str, workers: Workers,
                    reap: Callable[[], None]) -> dict[str, Any]:
        """The layer tagged ``tag`` back to empty: the processes started since it was
        pushed killed (envd's idle file workers spared: they follow the root), the
        layers above it dropped. 409 when no layer has the tag."""
        self._check(tag)
        async with self._lock:
            depth = next((i + 1 for i in range(len(self.levels) - 1, -1, -1)
                          if self.levels[i].tag == tag), None)
            if depth is None:
                raise LayerError(409, f"no files layer for '{tag}' in this sandbox")
            t0 = time.perf_counter()
            level = self.levels[depth - 1]
            followers = workers.root_moving()
            try:
                killed = await self._kill_since(level.base, reap, followers)
                t_kill = time.perf_counter()
                self._to_real_root()
                try:
                    # One request drops the layers from the top down to this one and
                    # mounts its fresh tmpfs, a second mounts the rest.
                    self._build(depth, drop=len(self.levels))
                    del self.levels[depth:]
                except BaseException:
                    # The layer is gone: envd stays on the one below (the files as they
                    # were when it was pushed, plus what its own processes wrote since).
                    del self.levels[depth - 1:]
                    self._enter(len(self.levels))
                    raise
                level.resets += 1
                self._enter(depth)
            finally:
                workers.root_moved()
            ms = (time.perf_counter() - t0) * 1000
            log.info("layers: layer %d (%s) reset in %.1f ms, %d processes killed",
                     depth, tag, ms, killed)
            return {"depth": depth, "killed": killed, "ms": round(ms, 2),
                    "kill_ms": round((t_kill - t0) * 1000, 2)}

    def written_bytes(self) -> int | None:
        """Bytes in files the sandbox wrote, for envd's disk guard (oom.py), while envd
        is in a layer (None when it is not): the real root layer and /tmp, and each
        layer's tmpfs, each filesystem once (from inside, / and /tmp are overlays
        whose sizes say nothing of their lower layers)."""
        if not self.levels:
            return None
        seen: set[int] = set()
        total = 0
        places = [".", "tmp", *(f"{LAYERS_DIR[1:]}/{d}" for d in range(1, len(self.levels) + 1))]
        for place in places:
            try:
                fd = os.open(place, os.O_RDONLY | os.O_DIRECTORY, dir_fd=ROOT_FD)
            except OSError:
                continue
            try:
                dev = os.fstat(fd).st_dev
                if dev not in seen:
                    seen.add(dev)
                    st = os.fstatvfs(fd)
                    total += (st.f_blocks - st.f_bfree) * st.f_frsize
            except OSError:
                pass
            finally:
                os.close(fd)
        return total

    # -- mechanics -------------------------------------------------------------------
    def _check(self, tag: str) -> None:
        if not isinstance(tag, str) or not TAG.match(tag):
            raise LayerError(400, "tag must be 1-128 letters, digits or ._:- (a snapshot ID)")
        why = self.why_not()
        if why is not None:
            raise LayerError(501, why)

    async def _kill_since(self, base: list[tuple[int, int]], reap: Callable[[], None],
                          spare: set[tuple[int, int]]) -> int:
        """SIGKILL every process not in ``base`` (nor envd, the keeper, nor ``spare``:
        envd's idle file workers, which follow the root) until none
        is left. One scan of /proc reads every process; the ones killed are then
        watched alone (reaped, as envd is init) until each has ended; then /proc is
        listed again and only the processes new since are read: one a victim forked
        before it died is caught so, and killed in turn. Once every victim has ended
        none can fork, so a listing with nothing new in it is the end."""
        keep = {*base, *spare}
        spared = {os.getpid(), self.keeper_pid}
        seen: set[int] = set()  # every pid read in this pass
        killed: set[tuple[int, int]] = set()
        deadline = time.monotonic() + KILL_DEADLINE_S
        pids = _pids()
        while True:
            victims = []
            for pid in pids - seen:
                seen.add(pid)
                st = stat_of(pid)
                if st is not None and pid not in spared and (pid, st[0]) not in keep \
                        and st[1] != "Z":
                    victims.append((pid, st[0]))
            if not victims:
                return len(killed)
            if time.monotonic() > deadline:  # forks as fast as it is killed
                raise LayerError(500, f"{len(victims)} processes would not end")
            for pid, _ in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(victims)
            await self._ended(victims, reap, deadline)
            pids = _pids()

    @staticmethod
    async def _ended(victims: list[tuple[int, int]], reap: Callable[[], None],
                     deadline: float) -> None:
        """Until every one of ``victims`` (killed) has ended: gone, or a zombie."""
        pending = dict(victims)
        wait = 0.0
        while True:
            reap()
            for pid, start in list(pending.items()):
                st = stat_of(pid)
                if st is None or st[0] != start or st[1] == "Z":
                    del pending[pid]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise LayerError(500, f"{len(pending)} processes would not end")
            await asyncio.sleep(wait)
            wait = min(0.002, wait * 2 or 0.0002)

    def _to_real_root(self) -> None:
        os.fchdir(ROOT_FD)
        os.chroot(".")
        os.chdir("/")

    def _enter(self, depth: int) -> None:
        """envd's root into layer ``depth`` (0: the real root, where it is)."""
        if depth:
            os.chroot(f"{LAYERS_DIR}/{depth}/m")
            os.chdir("/")

    def _keeper(self, ops: list[tuple[str | int, ...]], may_fail: int = 0) -> None:
        """Operations done by the keeper, as few requests as its bounds allow (one for a
        layer's mounts; layer_keeper.c), in order: the first ``may_fail`` of them may
        fail (an unmount of what a failed build never mounted), the rest then going
        on from the next one; any other failure raises, the operations after it undone
        by no one and not done."""
        encoded = [str(op[0]).encode() + b"".join(str(f).encode() + b"\0" for f in op[1:])
                   for op in ops]
        at = 0
        while at < len(ops):
            n, size = 0, 0
            while at + n < len(ops) and n < KEEPER_MAX_OPS and \
                    size + len(encoded[at + n]) <= KEEPER_MAX_REQUEST:
                size += len(encoded[at + n])
                n += 1
            if n == 0:
                raise LayerError(500, f"layer keeper: {ops[at][0]} {ops[at][1]}: too long")
            os.write(KEEPER_FD, b"".join(encoded[at:at + n]))
            answer = os.read(KEEPER_FD, 8)
            done, err = struct.unpack("ii", answer) if len(answer) == 8 else (0, errno.EIO)
            if not err:
                at += n
            elif 0 <= done < n and at + done < may_fail:
                at += done + 1  # that one may fail: on with the next
            else:
                op = ops[at + min(max(done, 0), n - 1)]
                raise LayerError(500, f"layer keeper: {op[0]} {op[1]}: {os.strerror(err)}")

    @staticmethod
    def _mount(source: str, target: str, fstype: str, flags: int,
               data: str = "") -> tuple[str | int, ...]:
        return ("M", source, target, fstype, flags, data)

    @staticmethod
    def _unmounts(depth: int) -> list[tuple[str | int, ...]]:
        top = f"{LAYERS_DIR}/{depth}"
        return [("U", target, _MNT_DETACH) for target in (f"{top}/m", top)]

    def _drop(self, depth: int) -> None:
        with contextlib.suppress(LayerError):
            self._keeper(self._unmounts(depth), may_fail=2)

    def _build(self, depth: int, drop: int = 0) -> None:
        """Layer ``depth``'s mounts (envd in the real root): a tmpfs holding the upper
        layers, the root's overlay over the layer below, then the other mounts; two
        requests to the keeper. ``drop``: layers above ``depth - 1`` to drop first, in
        the first request (a reset: from the top down to ``depth`` itself)."""
        top = f"{LAYERS_DIR}/{depth}"
        below = f"{LAYERS_DIR}/{depth - 1}/m" if depth > 1 else None
        os.makedirs(top, mode=0o700, exist_ok=True)
        unmounts = [u for d in range(drop, depth - 1, -1) for u in self._unmounts(d)] \
            if drop else []
        self._keeper([*unmounts, self._mount(
            "tmpfs", top, "tmpfs", _MS_NOSUID | _MS_NODEV,
            ",".join(o for o in ("mode=0700", self.size) if o))], may_fail=len(unmounts))
        try:
            overlaid = [p for p in self.binds if p in OVERLAID]
            for name in ("u", "w", "m", *(f"u{i}" for i in range(len(overlaid))),
                         *(f"w{i}" for i in range(len(overlaid)))):
                os.mkdir(f"{top}/{name}", 0o755)
            lower = below if below is not None else self._real_root_bind()
            mounts = [self._overlay(lower, f"{top}/u", f"{top}/w", f"{top}/m")]
            for point in self.binds:
                target = f"{top}/m{point}"
                if point in OVERLAID:
                    i = overlaid.index(point)
                    source = f"{below}{point}" if below is not None else \
                        self._real_bind(point, "t")
                    mounts.append(self._overlay(source, f"{top}/u{i}", f"{top}/w{i}", target))
                else:
                    mounts.append(self._mount(point, target, "", _MS_BIND | _MS_REC))
            self._keeper(mounts)
        except BaseException:
            self._drop(depth)
            raise

    def _overlay(self, lower: str, upper: str, work: str,
                 target: str) -> tuple[str | int, ...]:
        # The upper directory's root takes the lower's mode and owner (a user's /tmp
        # stays 1777), as overlayfs does for a copied-up directory.
        st = os.stat(lower)
        os.chmod(upper, st.st_mode & 0o7777)
        os.chown(upper, st.st_uid, st.st_gid)
        return self._mount("overlay", target, "overlay", 0,
                           f"lowerdir={lower},upperdir={upper},workdir={work}")

    def _real_root_bind(self) -> str:
        return self._real_bind("/", "r")

    def _real_bind(self, point: str, name: str) -> str:
        """A plain (not recursive) bind of a real mount: an overlay's lower layer is
        then its files alone, not the mounts under it."""
        path = f"{LAYERS_DIR}/base-{name}{point.replace('/', '_')}"
        if not os.path.ismount(path):
            os.makedirs(path, mode=0o755, exist_ok=True)
            self._keeper([self._mount(point, path, "", _MS_BIND)])
        return path


LAYERS = Layers()
