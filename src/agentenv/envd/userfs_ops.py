"""What a file worker does, as its user: the operations and the loop serving them.

Runs in a forked worker that has already dropped to the user's credentials (see
userfs_fork), so the kernel checks every path as for the user's own commands; the
default mode's quick operations also run in envd itself, as root (``LocalOps``, see
userfs).
Each operation returns a result and any descriptors (open files, an inotify
instance) to hand back to envd over the socket.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import pwd
import shutil
import socket
import stat as st
from typing import Any

from .userfs_protocol import (
    BATCH_BYTES,
    MAX_FDS,
    MAX_FRAME,
    MAX_LIST_DEPTH,
    MAX_LIST_ENTRIES,
    MAX_METADATA_BYTES,
    MAX_WATCH_DIRS,
    METADATA_XATTR_PREFIX,
    Refused,
)

_IN_MASK = 0x2 | 0x4 | 0x40 | 0x80 | 0x100 | 0x200  # as filesystem._MASK


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


def _ensure_dirs(path: str, owner: list[int] | None) -> None:
    """Every missing directory of ``path`` made (0755) and, with ``owner``, chowned to
    it, top down: E2B's ``permissions.EnsureDirs`` (internal/permissions/path.go). An
    existing directory is left as it is; a component that is a file is ENOTDIR."""
    parts = [p for p in path.split("/") if p]
    cur = ""
    for part in parts:
        cur += "/" + part
        try:
            info = os.stat(cur)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(cur, 0o755)
            if owner is not None:  # even if another made it meanwhile (E2B does too)
                os.chown(cur, owner[0], owner[1], follow_symlinks=False)
            continue
        if not st.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", cur)


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


class WorkerServer:
    """A worker's request loop: one request at a time, one reply (after any
    ``more`` frames) for each."""

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

    def op_root(self, req, fds):
        """Into the root whose descriptor envd sent, as envd's root moved there (a files
        layer, layers.py): nothing of the old one stays reachable (the worker holds no
        other descriptor, and its working directory is the new root). Root's workers
        alone may (CAP_SYS_CHROOT); a user's gets EPERM and is forked anew."""
        if len(fds) != 1:
            raise OSError(errno.EBADF, "no root descriptor")
        os.fchdir(fds[0])
        os.chroot(".")
        os.chdir("/")
        return None, ()

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
        _ensure_dirs(path, req.get("owner"))
        return _entry(path, _Names()), ()

    def op_move(self, req, fds):
        src, dst = req["src"], req["dst"]
        try:
            os.lstat(src)
        except FileNotFoundError:
            raise Refused("no_source") from None
        _ensure_dirs(os.path.dirname(dst), req.get("owner"))
        try:
            os.rename(src, dst)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            shutil.move(src, dst)
        return _entry(dst, _Names()), ()

    def op_remove(self, req, fds):
        """Remove a file, a link or a whole tree; a path that is not there is already
        removed (as E2B's envd answers, like ``rm -rf``)."""
        path = req["path"]
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        return None, ()

    def op_list(self, req: dict[str, Any], fds: list[int]) -> tuple[list[dict], tuple[()]]:
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
        """E2B's ``processFile`` (internal/api/upload.go): the parents ensured, an
        existing file chowned to ``owner`` first, then opened (O_TRUNC) and, if new,
        chowned. So a write into a watched directory reports CREATE, CHMOD, WRITE
        (or CHMOD, WRITE over an existing file), as E2B's watcher does. Without
        ``owner`` (strict mode: this worker is the user) a new file is chowned to
        the worker's own ids, which changes nothing but keeps those events."""
        path = req["path"]
        who = req.get("owner")
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        _ensure_dirs(os.path.dirname(path), who)
        existed = os.path.lexists(path)
        if existed and who is not None:
            os.chown(path, who[0], who[1])
        # O_NONBLOCK: a FIFO planted at the path fails (ENXIO) instead of hanging.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise Refused("not_regular") from None
            raise
        try:
            if not st.S_ISREG(os.fstat(fd).st_mode):
                raise Refused("not_regular")
            if not existed:  # (strict: the owner set to itself, the group left alone)
                os.fchown(fd, *(who or (os.geteuid(), -1)))
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



class LocalOps(WorkerServer):
    """The operations envd does in its own process (userfs.LOCAL_OPS, the default
    mode's quick ones): none of them sends a frame before its result."""

    def __init__(self, libc) -> None:  # no socket: the result is returned, not sent
        self.libc = libc

    def send(self, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
        raise RuntimeError("an operation done in envd sent a frame")
