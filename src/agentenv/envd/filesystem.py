"""The ``filesystem.Filesystem`` Connect service, and entry info shared with /files."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import os
import pwd
import shutil
import stat as st
import struct
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aenv_envd_protos.filesystem import filesystem_pb as pb
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from .state import PathError, State, User, UserError, chown, makedirs_owned, resolve_path

if TYPE_CHECKING:
    from connectrpc.request import RequestContext

METADATA_XATTR_PREFIX = "user.e2b."
KEEPALIVE_HEADER = "keepalive-ping-interval"
MAX_WATCHER_EVENTS = 10_000


# -- entry info ------------------------------------------------------------------------
def _name_of(table, key: int) -> str:
    try:
        return (table.getpwuid(key).pw_name if table is pwd else table.getgrgid(key).gr_name)
    except (KeyError, OSError):
        return str(key)


def read_metadata(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for n in names:
        if n.startswith(METADATA_XATTR_PREFIX):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                out[n[len(METADATA_XATTR_PREFIX):]] = os.getxattr(
                    path, n, follow_symlinks=False).decode()
    return out


def _file_type(mode: int) -> int:
    if st.S_ISDIR(mode):
        return pb.FileType.DIRECTORY
    if st.S_ISREG(mode):
        return pb.FileType.FILE
    return pb.FileType.UNSPECIFIED


def entry_info(path: str) -> pb.EntryInfo:
    """EntryInfo of ``path`` (lstat; a symlink reports its target's type)."""
    lst = os.lstat(path)
    info = lst
    is_link = st.S_ISLNK(lst.st_mode)
    target = None
    if is_link:
        target = os.path.realpath(path)
        try:
            info = os.stat(path)
            ftype = _file_type(info.st_mode)
        except OSError:  # dangling link
            ftype = pb.FileType.SYMLINK
    else:
        ftype = _file_type(lst.st_mode)
    from protobuf.wkt import Timestamp

    e = pb.EntryInfo(
        name=os.path.basename(path) or path,
        type=ftype,
        path=path,
        size=info.st_size,
        mode=st.S_IMODE(info.st_mode),
        permissions=st.filemode(info.st_mode),
        owner=_name_of(pwd, lst.st_uid),
        group=_name_of(grp, lst.st_gid),
        modified_time=Timestamp(seconds=int(lst.st_mtime), nanos=lst.st_mtime_ns % 1_000_000_000),
        is_symlink=is_link,
        metadata=read_metadata(path),
    )
    if target is not None:
        e.symlink_target = target
    return e


def _oserror(e: OSError, path: str) -> ConnectError:
    if e.errno == errno.ENOENT:
        return ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
    if e.errno == errno.EEXIST:
        return ConnectError(Code.ALREADY_EXISTS, f"path '{path}' already exists")
    if e.errno in (errno.EACCES, errno.EPERM):
        return ConnectError(Code.PERMISSION_DENIED, f"permission denied: '{path}'")
    if e.errno == errno.ENOTDIR:
        return ConnectError(Code.INVALID_ARGUMENT, f"a component of '{path}' is not a directory")
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ConnectError(Code.RESOURCE_EXHAUSTED,
                            "not enough disk space (the sandbox's disk quota)")
    return ConnectError(Code.INTERNAL, f"{e.strerror or e}: '{path}'")


# -- inotify ---------------------------------------------------------------------------
IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_IGNORED = 0x8000
IN_ISDIR = 0x40000000
IN_Q_OVERFLOW = 0x4000
_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_HDR = struct.Struct("iIII")
_libc = None


def _inotify():
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


class Watcher:
    """inotify watch of a directory (optionally recursive) delivering FilesystemEvents."""

    def __init__(self, root: str, recursive: bool, include_entry: bool, on_event) -> None:
        import ctypes

        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.on_event = on_event
        libc = _inotify()
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd = fd
        self.wds: dict[int, str] = {}
        self._loop = asyncio.get_running_loop()
        try:
            self._add(root)
            if recursive:
                for dirpath, dirnames, _ in os.walk(root):
                    for d in dirnames:
                        self._add(os.path.join(dirpath, d))
        except BaseException:
            os.close(fd)
            raise
        self._loop.add_reader(fd, self._on_readable)

    def _add(self, path: str) -> None:
        import ctypes

        wd = _inotify().inotify_add_watch(self.fd, os.fsencode(path), _MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if path == self.root:
                raise OSError(err, os.strerror(err), path)
            return
        self.wds[wd] = path

    def close(self) -> None:
        if self.fd >= 0:
            self._loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1

    def _on_readable(self) -> None:
        try:
            buf = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return
        off = 0
        while off + _HDR.size <= len(buf):
            wd, mask, _cookie, ln = _HDR.unpack_from(buf, off)
            name = buf[off + _HDR.size: off + _HDR.size + ln].rstrip(b"\0").decode(
                "utf-8", "surrogateescape")
            off += _HDR.size + ln
            if mask & IN_IGNORED:
                self.wds.pop(wd, None)
                continue
            base = self.wds.get(wd)
            if base is None or not name:
                continue
            full = os.path.join(base, name)
            if mask & IN_CREATE and mask & IN_ISDIR and self.recursive:
                self._add(full)
            if mask & (IN_CREATE | IN_MOVED_TO):
                etype = pb.EventType.CREATE
            elif mask & IN_MODIFY:
                etype = pb.EventType.WRITE
            elif mask & IN_DELETE:
                etype = pb.EventType.REMOVE
            elif mask & IN_MOVED_FROM:
                etype = pb.EventType.RENAME
            elif mask & IN_ATTRIB:
                etype = pb.EventType.CHMOD
            else:
                continue
            ev = pb.FilesystemEvent(name=os.path.relpath(full, self.root), type=etype)
            if self.include_entry and etype not in (pb.EventType.REMOVE, pb.EventType.RENAME):
                with contextlib.suppress(OSError):
                    ev.entry = entry_info(full)
            self.on_event(ev)


def _request_user(state: State, ctx: RequestContext) -> User:
    try:
        return state.user_from_authorization(ctx.request_headers.get("authorization"))
    except UserError as e:
        raise ConnectError(Code.UNAUTHENTICATED, str(e)) from None


def _path(raw: str, user: User, *, allow_empty: bool = False) -> str:
    try:
        return resolve_path(raw, user, allow_empty=allow_empty)
    except PathError as e:
        raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None


class FilesystemService:
    """Implements ``aenv_envd_protos.filesystem.filesystem_connect.Filesystem``."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.watchers: dict[str, tuple[Watcher, list]] = {}

    async def stat(self, request: pb.StatRequest, ctx: RequestContext) -> pb.StatResponse:
        user = _request_user(self.state, ctx)
        path = _path(request.path, user)
        try:
            return pb.StatResponse(entry=entry_info(path))
        except OSError as e:
            raise _oserror(e, path) from None

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext
                       ) -> pb.MakeDirResponse:
        user = _request_user(self.state, ctx)
        path = _path(request.path, user)
        if os.path.lexists(path):
            if os.path.isdir(path):
                raise ConnectError(Code.ALREADY_EXISTS, f"directory '{path}' already exists")
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"path '{path}' already exists and is not a directory")
        try:
            makedirs_owned(path, user)
            return pb.MakeDirResponse(entry=entry_info(path))
        except OSError as e:
            raise _oserror(e, path) from None

    async def move(self, request: pb.MoveRequest, ctx: RequestContext) -> pb.MoveResponse:
        user = _request_user(self.state, ctx)
        src = _path(request.source, user)
        dst = _path(request.destination, user)
        if not os.path.lexists(src):
            raise ConnectError(Code.NOT_FOUND, f"source '{src}' does not exist")
        try:
            makedirs_owned(os.path.dirname(dst), user)
            os.rename(src, dst)
            return pb.MoveResponse(entry=entry_info(dst))
        except OSError as e:
            if e.errno == errno.EXDEV:
                try:
                    shutil.move(src, dst)
                    return pb.MoveResponse(entry=entry_info(dst))
                except OSError as e2:
                    raise _oserror(e2, dst) from None
            raise _oserror(e, dst) from None

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext
                       ) -> pb.ListDirResponse:
        user = _request_user(self.state, ctx)
        root = _path(request.path, user, allow_empty=True)
        depth = max(1, request.depth)
        try:
            real = os.path.realpath(root)
            if not os.path.isdir(real):
                if not os.path.exists(real):
                    raise ConnectError(Code.NOT_FOUND, f"path '{root}' does not exist")
                raise ConnectError(Code.INVALID_ARGUMENT, f"path '{root}' is not a directory")
            entries: list[pb.EntryInfo] = []
            self._walk(real, depth, entries)
        except OSError as e:
            raise _oserror(e, root) from None
        return pb.ListDirResponse(entries=entries)

    def _walk(self, d: str, depth: int, out: list) -> None:
        with os.scandir(d) as it:
            children = sorted(it, key=lambda e: e.name)
        for c in children:
            try:
                out.append(entry_info(c.path))
            except OSError:
                continue  # vanished meanwhile
            if depth > 1 and c.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    self._walk(c.path, depth - 1, out)

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext) -> pb.RemoveResponse:
        user = _request_user(self.state, ctx)
        path = _path(request.path, user)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as e:
            raise _oserror(e, path) from None
        return pb.RemoveResponse()

    def _watch(self, raw: str, recursive: bool, include_entry: bool, ctx: RequestContext,
               on_event) -> Watcher:
        user = _request_user(self.state, ctx)
        path = _path(raw, user)
        if not os.path.exists(path):
            raise ConnectError(Code.NOT_FOUND, f"path '{path}' does not exist")
        if not os.path.isdir(path):
            raise ConnectError(Code.INVALID_ARGUMENT, f"path '{path}' is not a directory")
        try:
            return Watcher(path, recursive, include_entry, on_event)
        except OSError as e:
            raise _oserror(e, path) from None

    async def watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext
                        ) -> AsyncIterator[pb.WatchDirResponse]:
        q: asyncio.Queue = asyncio.Queue()
        w = self._watch(request.path, request.recursive, request.include_entry, ctx,
                        q.put_nowait)
        raw = ctx.request_headers.get(KEEPALIVE_HEADER)
        try:
            keepalive = float(raw) if raw else None
        except ValueError:
            keepalive = None
        try:
            yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), keepalive or None)
                except TimeoutError:
                    yield pb.WatchDirResponse(
                        event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive()))
                    continue
                yield pb.WatchDirResponse(event=Oneof("filesystem", ev))
        finally:
            w.close()

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: RequestContext
                             ) -> pb.CreateWatcherResponse:
        events: list = []

        def on_event(ev):
            if len(events) < MAX_WATCHER_EVENTS:
                events.append(ev)

        w = self._watch(request.path, request.recursive, request.include_entry, ctx, on_event)
        wid = uuid.uuid4().hex
        self.watchers[wid] = (w, events)
        return pb.CreateWatcherResponse(watcher_id=wid)

    def _watcher(self, wid: str):
        try:
            return self.watchers[wid]
        except KeyError:
            raise ConnectError(Code.NOT_FOUND, f"watcher '{wid}' not found") from None

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest,
                                 ctx: RequestContext) -> pb.GetWatcherEventsResponse:
        _, events = self._watcher(request.watcher_id)
        out = list(events)
        events.clear()
        return pb.GetWatcherEventsResponse(events=out)

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: RequestContext
                             ) -> pb.RemoveWatcherResponse:
        w, _ = self._watcher(request.watcher_id)
        w.close()
        del self.watchers[request.watcher_id]
        return pb.RemoveWatcherResponse()


def set_metadata(path: str, metadata: dict[str, str]) -> None:
    for k, v in metadata.items():
        os.setxattr(path, METADATA_XATTR_PREFIX + k, v.encode(), follow_symlinks=False)


__all__ = ["FilesystemService", "chown", "entry_info", "set_metadata"]
