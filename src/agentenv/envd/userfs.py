"""File operations performed in forked workers: envd's side, a pool of workers.

Two modes (``State.file_access``, set by /init from the template or the node,
docs/security.md):

- ``root``, the default, as E2B's envd does it: envd runs as root and so do its
  file operations; whatever an operation creates for a user (a file, each missing
  parent directory, mode 0755) is chowned to that user, and an upload over an
  existing file first chowns it to the user (e2b-dev/infra packages/envd:
  ``permissions.EnsureDirs`` in internal/permissions/path.go, ``processFile`` in
  internal/api/upload.go, ``MakeDir`` and ``Move`` in internal/services/filesystem).
  Inside a sandbox whose user has passwordless sudo nothing else protects more.
- ``user``, strict: the operation runs with the request's user's uid, gid and
  groups, so the kernel checks each path exactly as for the user's own commands,
  symlinks included (``~/report.txt -> /root/secret.txt`` is refused), and root's
  files stay root's. For templates whose user has no sudo.

Either way an operation runs in a *worker*: a process forked for one set of
credentials that drops to them before touching anything (userfs_fork) and
performs the operations (userfs_ops); changing envd's own credentials is no
answer (they are the whole process's, shared by every concurrent request). Files
to stream (``/files`` GET and POST) and inotify instances are opened in the
worker and handed back over the socket (``SCM_RIGHTS``, see userfs_protocol):
the bytes then flow in envd's event loop with no copy through the worker.

This module is envd's side: workers are forked lazily, one per set of
credentials at first, up to ``WORKERS_PER_USER`` when requests overlap (a slow
``rm -r`` must not stall the user's other operations). They are reused while
busy (a round trip costs ~0.3 ms under gVisor, a new worker a few ms) and exit
after ``WORKER_IDLE_S`` idle. At most ``MAX_WORKERS`` live at once; beyond that
the least recently used idle one is retired. A worker that dies (a process of
the same user may kill it) is replaced; one whose request was abandoned (client
gone) is killed, so the socket never carries a stale reply.

When envd's root moves (a files layer pushed or reset, layers.py) a worker works
in the old root until it follows: no worker is handed out while the root moves,
and each idle root worker (the default mode's) is then sent a descriptor of the
new root and ``chroot``s into it before it serves anything else; the reset's kill
pass spares them. Ending and re-forking a copy of envd cost most of a files
reset's CPU; following costs one round trip. A worker of the strict mode has
dropped to its user's credentials and cannot chroot: it is ended and forked anew.

In the default mode the quick operations (``LOCAL_OPS``: opening a file to read or
write, a stat, a mkdir) skip the worker: envd is root already and does them in its
own process, on its event loop, as E2B's envd does in the request's goroutine. Each
is a few system calls, bounded by the path's length, and a FIFO or device fails
rather than blocks (O_NONBLOCK). The step after a think gap is why (issue 27): an
idle worker exits after ``WORKER_IDLE_S``, and forking the next one (a copy of envd)
made a file write after a gap ~250 ms under load, against ~30 ms. What may run long
(a recursive remove, a listing, a watch, a move across filesystems) stays in a
worker, so it never stalls envd's other requests. None runs while envd's root moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

from .layers import stat_of
from .userfs_fork import fork_worker, load_libc
from .userfs_ops import LocalOps
from .userfs_protocol import MAX_FDS, MAX_FRAME, Refused, WorkerGone

WORKERS_PER_USER = 2
MAX_WORKERS = 8
# A worker idle this long exits (a copy-on-write fork of envd: it costs the pages
# written while it lives; a new one is forked in a few ms).
WORKER_IDLE_S = 30.0
# Done by envd itself in the default mode (root's): bounded, and never blocking.
LOCAL_OPS = frozenset({"open_read", "open_write", "stat", "entry", "mkdir"})


class Worker:
    """envd's handle on one worker process: sends it requests, reads its replies, kills it."""

    def __init__(self, key: tuple[int, int, tuple[int, ...]], generation: int = 0) -> None:
        self.key = key
        self.generation = generation  # UserFS.generation when forked (its root's)
        parent, pid, self.parent = fork_worker(key)
        parent.setblocking(False)
        self.sock = parent
        self.pid = pid
        # With its pid, what a reset's kill pass spares (a pid alone might be another
        # process's by then, were the worker killed by a command).
        self.start = (stat_of(pid) or (-1, ""))[0]
        self.alive = True
        self.dropped = False  # no longer counted in the pool
        self.used = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None

    def kill(self) -> None:
        """Close the socket (an idle worker then exits) and kill the worker (one
        busy with an abandoned request), if that pid is still our worker's."""
        if self.alive:
            self.alive = False
            self.sock.close()
            try:
                with open(f"/proc/{self.pid}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return  # gone already
            if ppid == self.parent:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)

    async def _wait(self, fd: int, writer: bool) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        (loop.add_writer if writer else loop.add_reader)(fd, ready)
        try:
            await fut
        finally:
            (loop.remove_writer if writer else loop.remove_reader)(fd)

    async def send(self, obj: Any, fds: tuple[int, ...] = ()) -> None:
        data = json.dumps(obj).encode("utf-8", "surrogateescape")
        while True:
            try:
                if fds:
                    socket.send_fds(self.sock, [data], list(fds))
                else:
                    self.sock.send(data)
                return
            except BlockingIOError:
                await self._wait(self.sock.fileno(), True)
            except OSError as e:
                raise WorkerGone(f"file worker gone: {e}") from None

    async def recv(self) -> tuple[Any, list[int]]:
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, MAX_FRAME, MAX_FDS)
            except BlockingIOError:
                await self._wait(self.sock.fileno(), False)
                continue
            except OSError as e:
                raise WorkerGone(f"file worker gone: {e}") from None
            for fd in fds:  # as envd's own: never inherited by a command it starts
                os.set_inheritable(fd, False)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or not data:
                for fd in fds:
                    os.close(fd)
                raise WorkerGone("file worker ended" if not data else "oversized reply")
            try:
                return json.loads(data), fds
            except ValueError:
                for fd in fds:
                    os.close(fd)
                raise WorkerGone("malformed reply from a file worker") from None


def user_key(user) -> tuple[int, int, tuple[int, ...]]:
    """A ``state.User``'s own credentials (uid, gid, groups)."""
    return UserFS.key(user.uid, user.gid, user.name)


ROOT_KEY = (0, 0, (0,))


def fs_key(state, user) -> tuple[int, int, tuple[int, ...]]:
    """The credentials a file operation for ``user`` runs with: root's by default, as
    in E2B's envd (which runs as root and chowns what it creates to the user, see
    ``owner``); the user's own in the strict mode (``state.file_access == "user"``)."""
    return user_key(user) if state.file_access == "user" else ROOT_KEY


def owner(user) -> list[int]:
    """Who a created file or directory is given to: the request's user (uid, gid)."""
    return [user.uid, user.gid]


class UserFS:
    """Runs file operations as a given user in that user's workers."""

    def __init__(self) -> None:
        self.idle: dict[tuple, list[Worker]] = {}
        self.count: dict[tuple, int] = {}
        self.total = 0
        self._waiters: list[asyncio.Future] = []
        self._clock = 0.0
        # Bumped when envd's root starts and ends moving (layers.py): a worker of an
        # older generation works in an old root and serves nothing until it follows.
        self.generation = 0
        self.moving = False  # no worker is handed out meanwhile
        self._tasks: set[asyncio.Task] = set()
        # envd runs as root (in a sandbox, always): the default mode's quick operations
        # are its own (LOCAL_OPS); its operation table is made at the first.
        self.local = os.geteuid() == 0
        self._ops: LocalOps | None = None

    @staticmethod
    def key(uid: int, gid: int, name: str) -> tuple[int, int, tuple[int, ...]]:
        try:
            groups = os.getgrouplist(name, gid)
        except OSError:
            groups = [gid]
        return uid, gid, tuple(sorted(set(groups)))

    async def _acquire(self, key: tuple) -> Worker:
        while True:
            idle = self.idle.get(key) if not self.moving else None
            while idle:
                w = idle.pop()
                if w.idle_timer is not None:
                    w.idle_timer.cancel()
                    w.idle_timer = None
                if w.alive and w.generation != self.generation:
                    await self._follow(w)
                if w.alive and w.generation == self.generation:
                    return w
                self._drop(w)
                if self.moving:
                    break
            if not self.moving and self.count.get(key, 0) < WORKERS_PER_USER:
                if self.total >= MAX_WORKERS:
                    self._retire_lru()
                if self.total < MAX_WORKERS:
                    w = Worker(key, self.generation)
                    self.count[key] = self.count.get(key, 0) + 1
                    self.total += 1
                    return w
            # every worker this user may have, or every worker at all, is busy
            await self._next_wake()

    async def _next_wake(self) -> None:
        """Until the pool next changes (``_wake``: a worker released, the root moved)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)

    def _retire_lru(self) -> None:
        best = None
        for ws in self.idle.values():
            for w in ws:
                if best is None or w.used < best.used:
                    best = w
        if best is not None:
            self.idle[best.key].remove(best)
            self._drop(best)

    def _expire(self, w: Worker) -> None:
        w.idle_timer = None
        idle = self.idle.get(w.key, [])
        if w in idle:
            idle.remove(w)
            self._drop(w)

    def _drop(self, w: Worker) -> None:
        if w.idle_timer is not None:
            w.idle_timer.cancel()
            w.idle_timer = None
        w.kill()
        if not w.dropped:
            w.dropped = True
            self.count[w.key] -= 1
            self.total -= 1

    def _release(self, w: Worker, ok: bool) -> None:
        if ok and w.alive and (w.generation == self.generation or w.key[0] == 0):
            self._clock += 1
            w.used = self._clock
            self.idle.setdefault(w.key, []).append(w)
            w.idle_timer = asyncio.get_running_loop().call_later(
                WORKER_IDLE_S, self._expire, w)
        else:
            self._drop(w)
        self._wake()

    def _wake(self) -> None:
        for fut in self._waiters:  # wake them all: each re-checks its own user's pool
            if not fut.done():
                fut.set_result(None)

    async def _follow(self, w: Worker) -> None:
        """An idle worker of an older generation into envd's root as it is now (it
        then has the current generation), or left as it was: then it is dropped."""
        if w.key[0] != 0 or self.moving:
            return  # only root may chroot; the strict mode's worker is forked anew
        generation = self.generation
        root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        try:
            await w.send({"op": "root"}, (root,))
            reply, got = await w.recv()
        except WorkerGone:
            return
        except BaseException:  # cancelled: its reply may be on the way, never read
            self._drop(w)
            self._wake()
            raise
        finally:
            os.close(root)
        for fd in got:
            os.close(fd)
        if "ok" in reply and generation == self.generation:
            w.generation = generation

    async def call(self, key: tuple, op: str, *, fds: tuple[int, ...] = (),
                   on_more: Callable[[list], None] | None = None, **args: Any
                   ) -> tuple[Any, list[int]]:
        """Run ``op`` as ``key``'s user; returns (result, descriptors handed back).

        Raises OSError (as the user got it), Refused, or WorkerGone.
        """
        req = {"op": op, **args}
        if op in LOCAL_OPS and key == ROOT_KEY and self.local:
            return await self._local(req, fds)
        for attempt in (0, 1):
            w = await self._acquire(key)
            ok = False
            sent = False
            try:
                await w.send(req, fds)
                sent = True
                while True:
                    reply, got = await w.recv()
                    if "more" in reply:
                        for fd in got:
                            os.close(fd)
                        if on_more is not None:
                            on_more(reply["more"])
                        continue
                    ok = True
                    break
            except WorkerGone:
                if not sent and attempt == 0:
                    continue  # died while idle (e.g. killed by the user): a fresh one
                raise
            finally:
                self._release(w, ok)
            if "ok" in reply:
                return reply["ok"], got
            for fd in got:
                os.close(fd)
            if "err" in reply:
                num, msg, fname = reply["err"]
                raise OSError(num, msg, fname) if fname else OSError(num, msg)
            if "refused" in reply:
                raise Refused(*reply["refused"])
            raise WorkerGone("malformed reply from a file worker")
        raise WorkerGone("no file worker")  # pragma: no cover

    async def _local(self, req: dict[str, Any], fds: tuple[int, ...]
                     ) -> tuple[Any, list[int]]:
        """``req`` done in envd's own process (see the module's doc), once envd's root
        has stopped moving; the result as a worker's reply would carry it."""
        while self.moving:
            await self._next_wake()
        if self._ops is None:
            self._ops = LocalOps(load_libc())
        try:
            result, got = getattr(self._ops, "op_" + req["op"])(req, list(fds))
        except (OSError, Refused):
            raise
        except Exception as e:  # a bug: the error a worker would have reported
            raise OSError(errno.EIO, f"{type(e).__name__}: {e}") from None
        # The reply's shape exactly (lists, not tuples), as callers get from a worker.
        return json.loads(json.dumps(result)), list(got)

    def close(self) -> None:
        """Every idle worker ended and out of the counts (envd goes dormant); a busy
        one is dropped when its operation ends."""
        for ws in self.idle.values():
            for w in ws:
                self._drop(w)
        self.idle.clear()

    def root_moving(self) -> set[tuple[int, int]]:
        """envd's root is about to move (layers.py): no worker is handed out until it
        has. The idle workers, as (pid, start time): they follow it and so are not to
        be killed (a busy one is working in the old root: the reset ends it)."""
        self.generation += 1
        self.moving = True
        for ws in self.idle.values():
            for w in [w for w in ws if w.key[0] != 0 or not w.alive]:
                ws.remove(w)  # a user's worker cannot follow (nor chroot)
                self._drop(w)
        return {(w.pid, w.start) for ws in self.idle.values() for w in ws}

    def root_moved(self) -> None:
        """envd's root has moved (or stayed, a move having failed): every idle worker
        follows it now (the old root's files go when the last one has), or is ended."""
        self.generation += 1
        self.moving = False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.close()
            return
        if any(self.idle.values()):
            task = loop.create_task(self._follow_idle())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._wake()

    async def _follow_idle(self) -> None:
        for ws in list(self.idle.values()):
            for w in [w for w in ws if w.generation != self.generation]:
                if self.moving or w not in ws:
                    continue
                ws.remove(w)
                if w.idle_timer is not None:
                    w.idle_timer.cancel()
                    w.idle_timer = None
                await self._follow(w)
                self._release(w, w.generation == self.generation)
