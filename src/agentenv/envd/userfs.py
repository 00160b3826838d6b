"""File operations performed as the requesting user, in per-user worker processes.

envd runs as root in one asyncio process. Doing a file operation there as root
ignores the user a request names: a symlink the user planted in their home
(``~/report.txt -> /root/secret.txt``) would be followed with root's rights.
Changing envd's own credentials is no answer either (they are the whole
process's, shared by every concurrent request and thread).

So every file operation runs in a *worker*: a process forked from envd that,
before touching anything, closes every inherited descriptor but its socket and
drops to the user's groups, gid and uid (``setgroups``/``setresgid``/
``setresuid``). The kernel then checks each path exactly as for the user's own
commands, symlinks included, and whatever the worker creates belongs to the user.
Files to stream (``/files`` GET and POST) and inotify instances are opened in the
worker and handed back over the socket (``SCM_RIGHTS``): the bytes then flow in
envd's event loop with no copy through the worker.

Workers are forked lazily by a *zygote*, a small process envd forks at start-up
before its heavy imports (a copy of the full envd would cost twice the memory),
one per set of credentials at first, up to ``WORKERS_PER_USER`` when requests
overlap (a slow ``rm -r`` must not stall the user's other operations). They are
reused while busy (a round trip costs ~0.3 ms under gVisor, a new worker a few
ms) and exit after ``WORKER_IDLE_S`` idle. At most ``MAX_WORKERS`` live at once;
beyond that the least recently used idle one is retired. A worker that dies (a
process of the same user may kill it) is replaced; one whose request was
abandoned (client gone) is killed, so the socket never carries a stale reply.

The protocol is one JSON message per ``SOCK_SEQPACKET`` datagram, each at most
``MAX_FRAME`` bytes (long listings come as several ``more`` frames), parsed in
the event loop only in such bounded pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import grp
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import stat as st
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("agentenv.envd")

METADATA_XATTR_PREFIX = "user.e2b."
MAX_FRAME = 256 * 1024          # one datagram on a worker socket
BATCH_BYTES = 64 * 1024         # list entries per reply frame
MAX_METADATA_BYTES = 16 * 1024  # per entry, in an entry's info
MAX_FDS = 4                     # descriptors attached to one message
WORKERS_PER_USER = 2
MAX_WORKERS = 8
# A worker idle this long exits (each costs ~14 MB of sandbox memory under gVisor;
# a new one is forked from the zygote in a few ms).
WORKER_IDLE_S = 30.0
# ListDir: depth is clamped, and a listing of more entries than this is refused
# (RESOURCE_EXHAUSTED) instead of building a response of unbounded size.
MAX_LIST_DEPTH = 64
MAX_LIST_ENTRIES = 100_000
# Directories one recursive watcher may watch (inotify watches are kernel memory).
MAX_WATCH_DIRS = 8192

_IN_MASK = 0x2 | 0x4 | 0x40 | 0x80 | 0x100 | 0x200  # as filesystem._MASK


class WorkerGone(Exception):
    """The worker died or broke the protocol; the operation's outcome is unknown."""


class Refused(Exception):
    """The worker refused the operation for a reason that is not an OSError."""

    def __init__(self, reason: str, detail: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


# ======================================================================================
# The worker side: runs in the forked child, as the user.
# ======================================================================================
class _Names:
    """uid/gid -> name, cached for one request (worker-side)."""

    def __init__(self) -> None:
        self.users: dict[int, str] = {}
        self.groups: dict[int, str] = {}

    def user(self, uid: int) -> str:
        if uid not in self.users:
            try:
                self.users[uid] = pwd.getpwuid(uid).pw_name
            except (KeyError, OSError):
                self.users[uid] = str(uid)
        return self.users[uid]

    def group(self, gid: int) -> str:
        if gid not in self.groups:
            try:
                self.groups[gid] = grp.getgrgid(gid).gr_name
            except (KeyError, OSError):
                self.groups[gid] = str(gid)
        return self.groups[gid]


def _metadata(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    used = 0
    for n in names:
        if not n.startswith(METADATA_XATTR_PREFIX):
            continue
        with contextlib.suppress(OSError, UnicodeDecodeError):
            v = os.getxattr(path, n, follow_symlinks=False).decode()
            k = n[len(METADATA_XATTR_PREFIX):]
            used += len(k) + len(v)
            if used > MAX_METADATA_BYTES:
                break
            out[k] = v
    return out


def _kind(mode: int) -> str:
    if st.S_ISDIR(mode):
        return "dir"
    if st.S_ISREG(mode):
        return "file"
    return ""


def _entry(path: str, names: _Names) -> dict[str, Any]:
    """An entry's info (lstat; a symlink reports its target's type), as the user sees it."""
    lst = os.lstat(path)
    info = lst
    is_link = st.S_ISLNK(lst.st_mode)
    target = None
    if is_link:
        target = os.path.realpath(path)
        try:
            info = os.stat(path)
            kind = _kind(info.st_mode)
        except OSError:  # dangling, or a target the user may not see
            kind = "symlink"
    else:
        kind = _kind(lst.st_mode)
    return {
        "name": os.path.basename(path) or path, "type": kind, "path": path,
        "size": info.st_size, "mode": st.S_IMODE(info.st_mode),
        "perm": st.filemode(info.st_mode), "owner": names.user(lst.st_uid),
        "group": names.group(lst.st_gid), "mtime": lst.st_mtime_ns, "link": is_link,
        "target": target, "meta": _metadata(path),
    }


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _add_watch(libc, fd: int, path: str) -> int:
    import ctypes

    # Linux wants read permission on what is watched; gVisor does not check it. So
    # open the directory (that checks it, as the user) and watch what was opened,
    # through /proc: a path swapped meanwhile for a link elsewhere changes nothing.
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        target = f"/proc/self/fd/{dfd}"
        if not os.path.exists(target):  # no /proc: the path, as checked just now
            target = path
        wd = libc.inotify_add_watch(fd, os.fsencode(target), _IN_MASK)
    finally:
        os.close(dfd)
    if wd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return wd


class _Worker:
    def __init__(self, sock: socket.socket, libc) -> None:
        self.sock = sock
        self.libc = libc

    def send(self, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode("utf-8", "surrogateescape")
        if len(data) > MAX_FRAME:
            raise OSError(errno.EMSGSIZE, "reply too large")
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.sendall(data)

    def serve(self) -> None:
        while True:
            try:
                data, fds, _flags, _ = socket.recv_fds(self.sock, MAX_FRAME, MAX_FDS)
            except InterruptedError:
                continue
            if not data:
                return  # envd closed our socket
            try:
                req = json.loads(data)
                op = getattr(self, "op_" + req["op"])
                result, out_fds = op(req, fds)
                try:
                    self.send({"ok": result}, out_fds)
                finally:
                    for fd in out_fds:
                        os.close(fd)
            except OSError as e:
                self.send({"err": [e.errno or errno.EIO, e.strerror or str(e),
                                   e.filename if isinstance(e.filename, str) else None]})
            except Refused as e:
                self.send({"refused": [e.reason, e.detail]})
            except Exception as e:  # a bug: report it, keep serving
                self.send({"err": [errno.EIO, f"{type(e).__name__}: {e}", None]})
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    # -- operations (each returns (result, fds to hand back)) -------------------------
    def op_ping(self, req, fds):
        return os.getuid(), ()

    def op_stat(self, req, fds):
        return _entry(req["path"], _Names()), ()

    def op_entry(self, req, fds):  # an entry for a watch event: None when gone/unreadable
        try:
            return _entry(req["path"], _Names()), ()
        except OSError:
            return None, ()

    def op_mkdir(self, req, fds):
        path = req["path"]
        if os.path.lexists(path):
            raise Refused("exists", "dir" if os.path.isdir(path) else "other")
        os.makedirs(path, 0o755, exist_ok=True)
        return _entry(path, _Names()), ()

    def op_move(self, req, fds):
        src, dst = req["src"], req["dst"]
        try:
            os.lstat(src)
        except FileNotFoundError:
            raise Refused("no_source") from None
        os.makedirs(os.path.dirname(dst) or "/", 0o755, exist_ok=True)
        try:
            os.rename(src, dst)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            shutil.move(src, dst)
        return _entry(dst, _Names()), ()

    def op_remove(self, req, fds):
        path = req["path"]
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return None, ()

    def op_list(self, req, fds):
        root = req["path"]
        depth = max(1, min(int(req["depth"]), MAX_LIST_DEPTH))
        real = os.path.realpath(root)
        if not os.path.isdir(real):
            if not os.path.exists(real):
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", root)
            raise Refused("not_dir")
        names = _Names()
        batch: list[dict] = []
        size = 0
        count = 0

        def walk(d: str, left: int) -> None:
            nonlocal size, count
            with os.scandir(d) as it:
                children = sorted(it, key=lambda e: e.name)
            for c in children:
                try:
                    e = _entry(c.path, names)
                except OSError:
                    continue  # vanished meanwhile
                count += 1
                if count > MAX_LIST_ENTRIES:
                    raise Refused("too_many", MAX_LIST_ENTRIES)
                batch.append(e)
                size += len(e["path"]) * 2 + 200 + sum(len(k) + len(v) for k, v in
                                                       e["meta"].items())
                if size >= BATCH_BYTES:
                    self.send({"more": batch})
                    batch.clear()
                    size = 0
                if left > 1 and c.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        walk(c.path, left - 1)

        walk(real, depth)
        return batch, ()

    def op_open_read(self, req, fds):
        fd = os.open(req["path"], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if st.S_ISDIR(info.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", req["path"])
            if not st.S_ISREG(info.st_mode):
                raise Refused("not_regular")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return {"size": info.st_size}, (fd,)

    def op_open_write(self, req, fds):
        path = req["path"]
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        os.makedirs(os.path.dirname(path) or "/", 0o755, exist_ok=True)
        # O_NONBLOCK: a FIFO planted at the path fails (ENXIO) instead of hanging.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise Refused("not_regular") from None
            raise
        try:
            if not st.S_ISREG(os.fstat(fd).st_mode):
                raise Refused("not_regular")
            os.ftruncate(fd, 0)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return None, (fd,)

    def op_watch(self, req, fds):
        import ctypes

        root = req["path"]
        if not os.path.isdir(root):
            if not os.path.exists(root):
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", root)
            raise Refused("not_dir")
        fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        try:
            wds = [[_add_watch(self.libc, fd, root), root]]
            size = 0
            if req.get("recursive"):
                for dirpath, dirnames, _ in os.walk(root):
                    for d in dirnames:
                        full = os.path.join(dirpath, d)
                        try:
                            wd = _add_watch(self.libc, fd, full)
                        except OSError:
                            continue
                        wds.append([wd, full])
                        size += len(full) + 16
                        if len(wds) > MAX_WATCH_DIRS:
                            raise Refused("too_many", MAX_WATCH_DIRS)
                        if size >= BATCH_BYTES:
                            self.send({"more": wds})
                            wds = []
                            size = 0
        except BaseException:
            os.close(fd)
            raise
        return wds, (fd,)

    def op_add_watch(self, req, fds):
        if len(fds) != 1:
            raise OSError(errno.EBADF, "no inotify descriptor")
        try:
            return _add_watch(self.libc, fds[0], req["path"]), ()
        except OSError:
            return -1, ()

    def op_cwd_ok(self, req, fds):  # may the user start a process in this directory?
        path = req["path"]
        return os.path.isdir(path) and os.access(path, os.X_OK), ()


def _child_main(sock: socket.socket, uid: int, gid: int, groups: list[int]) -> None:
    """The forked worker: never returns (os._exit), never touches envd's loop."""
    code = 0
    try:
        # No cyclic GC here: a collected leftover of envd's (a socket object) would
        # close a descriptor number this worker may by then use for something else.
        gc.disable()
        keep = sock.fileno()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                    signal.SIGUSR1, signal.SIGQUIT):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        # Every descriptor of envd's (listener, client connections, pipes of
        # commands) closes here: holding one would keep a connection open.
        _close_all_but(keep)
        # Everything to import, before the user may no longer read envd's files.
        libc = _libc()
        if os.geteuid() == 0:
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        elif os.geteuid() != uid:
            raise PermissionError(errno.EPERM, "envd is not root")
        with contextlib.suppress(Exception):  # not ptrace-able by the user's processes
            libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
        os.chdir("/")
        _Worker(sock, libc).serve()
    except BaseException as e:  # the child must never unwind into envd
        with contextlib.suppress(Exception):
            print(f"envd file worker (uid {uid}) failed: {e!r}", file=sys.stderr, flush=True)
        code = 1
    finally:
        os._exit(code)


def _close_all_but(*keep: int) -> None:
    try:
        open_fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        open_fds = list(range(3, 1024))
    for fd in open_fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _zygote_main(sock: socket.socket) -> None:
    """The zygote: forks workers on envd's request and hands envd their sockets.

    It is forked from envd at start-up, before the heavy imports (protobuf,
    connectrpc, uvicorn), so every worker is a copy of a small process, not of
    envd's whole heap. Never returns.
    """
    code = 0
    try:
        gc.disable()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                    signal.SIGQUIT):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
        _close_all_but(sock.fileno())
        _libc()  # loaded here once, inherited by every worker
        while True:
            try:
                data = sock.recv(1024)
            except InterruptedError:
                continue
            if not data:
                return  # envd is gone
            try:
                req = json.loads(data)
                uid, gid = int(req["uid"]), int(req["gid"])
                groups = [int(g) for g in req["groups"]]
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                _tune(mine)
                _tune(theirs)
                pid = os.fork()
                if pid == 0:
                    _child_main(mine, uid, gid, groups)
                mine.close()
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [theirs.fileno()])
                theirs.close()
            except Exception as e:
                sock.send(json.dumps({"err": repr(e)}).encode())
    except BaseException as e:  # the zygote must never unwind into envd
        with contextlib.suppress(Exception):
            print(f"envd file worker zygote failed: {e!r}", file=sys.stderr, flush=True)
        code = 1
    finally:
        os._exit(code)


def _tune(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_FRAME)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 * MAX_FRAME)


_zygote: socket.socket | None = None
_zygote_pid = 0


def start_zygote() -> None:
    """Fork the zygote (call early in envd's start-up, as root, from the main thread)."""
    global _zygote, _zygote_pid
    if _zygote is not None:
        return
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the zygote
        _zygote_main(child)
    child.close()
    parent.settimeout(10)
    _zygote, _zygote_pid = parent, pid


def _from_zygote(key: tuple) -> tuple[socket.socket, int] | None:
    """A new worker's socket and pid from the zygote; None without a (working) one."""
    global _zygote
    if _zygote is None:
        return None
    uid, gid, groups = key
    try:
        _zygote.send(json.dumps({"uid": uid, "gid": gid, "groups": list(groups)}).encode())
        data, fds, _flags, _ = socket.recv_fds(_zygote, 1024, 1)
        reply = json.loads(data) if data else {"err": "the zygote ended"}
        if "pid" not in reply or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(errno.EIO, str(reply.get("err")))
    except (OSError, ValueError) as e:
        log.warning("file worker zygote unusable (%r): forking workers from envd", e)
        with contextlib.suppress(OSError):
            _zygote.close()
        _zygote = None
        return None
    os.set_inheritable(fds[0], False)
    return socket.socket(fileno=fds[0]), int(reply["pid"])


# ======================================================================================
# The envd side.
# ======================================================================================
class Worker:
    def __init__(self, key: tuple[int, int, tuple[int, ...]]) -> None:
        uid, gid, groups = key
        self.key = key
        made = _from_zygote(key)
        if made is not None:
            parent, pid = made
            self.parent = _zygote_pid
        else:  # no zygote (envd not started by __main__): a copy of envd itself
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            _tune(parent)
            _tune(child)
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                _child_main(child, uid, gid, list(groups))
            child.close()
            self.parent = os.getpid()
        parent.setblocking(False)
        self.sock = parent
        self.pid = pid
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
    """The credentials a ``state.User``'s file operations run with (uid, gid, groups)."""
    return UserFS.key(user.uid, user.gid, user.name)


class UserFS:
    """Runs file operations as a given user in that user's workers."""

    def __init__(self) -> None:
        self.idle: dict[tuple, list[Worker]] = {}
        self.count: dict[tuple, int] = {}
        self.total = 0
        self._waiters: list[asyncio.Future] = []
        self._clock = 0.0

    @staticmethod
    def key(uid: int, gid: int, name: str) -> tuple[int, int, tuple[int, ...]]:
        try:
            groups = os.getgrouplist(name, gid)
        except OSError:
            groups = [gid]
        return uid, gid, tuple(sorted(set(groups)))

    async def _acquire(self, key: tuple) -> Worker:
        while True:
            idle = self.idle.get(key)
            while idle:
                w = idle.pop()
                if w.idle_timer is not None:
                    w.idle_timer.cancel()
                    w.idle_timer = None
                if w.alive:
                    return w
                self._drop(w)
            if self.count.get(key, 0) < WORKERS_PER_USER:
                if self.total >= MAX_WORKERS:
                    self._retire_lru()
                if self.total < MAX_WORKERS:
                    w = Worker(key)
                    self.count[key] = self.count.get(key, 0) + 1
                    self.total += 1
                    return w
            # every worker this user may have, or every worker at all, is busy
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
        if ok and w.alive:
            self._clock += 1
            w.used = self._clock
            self.idle.setdefault(w.key, []).append(w)
            w.idle_timer = asyncio.get_running_loop().call_later(
                WORKER_IDLE_S, self._expire, w)
        else:
            self._drop(w)
        for fut in self._waiters:  # wake them all: each re-checks its own user's pool
            if not fut.done():
                fut.set_result(None)

    async def call(self, key: tuple, op: str, *, fds: tuple[int, ...] = (),
                   on_more: Callable[[list], None] | None = None, **args: Any
                   ) -> tuple[Any, list[int]]:
        """Run ``op`` as ``key``'s user; returns (result, descriptors handed back).

        Raises OSError (as the user got it), Refused, or WorkerGone.
        """
        req = {"op": op, **args}
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

    def close(self) -> None:
        for ws in self.idle.values():
            for w in ws:
                w.kill()
        self.idle.clear()
