"""The ``filesystem.Filesystem`` Connect service, and entry info shared with /files."""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aenv_envd_protos.filesystem import filesystem_pb as pb
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from .running import resolve_future
from .state import PathError, State, User, UserError, resolve_path
from .userfs import UserFS, fs_key, owner, user_key
from .userfs_protocol import MAX_LIST_DEPTH, MAX_LIST_ENTRIES, MAX_WATCH_DIRS, Refused, WorkerGone

if TYPE_CHECKING:
    from connectrpc.request import RequestContext

log = logging.getLogger("agentenv.envd")

KEEPALIVE_HEADER = "keepalive-ping-interval"
MIN_KEEPALIVE_S = 1.0
MAX_KEEPALIVE_S = 3600.0
MAX_WATCHER_EVENTS = 10_000


# -- entry info ------------------------------------------------------------------------
def _file_type(kind: str) -> int:
    return {"dir": pb.FileType.DIRECTORY, "file": pb.FileType.FILE,
            "symlink": pb.FileType.SYMLINK}.get(kind, pb.FileType.UNSPECIFIED)


def entry_pb(d: dict) -> pb.EntryInfo:
    """EntryInfo from a worker's entry (see userfs_ops._entry)."""
    from protobuf.wkt import Timestamp

    mtime = int(d["mtime"])
    e = pb.EntryInfo(
        name=d["name"], type=_file_type(d["type"]), path=d["path"], size=d["size"],
        mode=d["mode"], permissions=d["perm"], owner=d["owner"], group=d["group"],
        modified_time=Timestamp(seconds=mtime // 1_000_000_000, nanos=mtime % 1_000_000_000),
        is_symlink=d["link"], metadata=d["meta"],
    )
    if d["target"] is not None:
        e.symlink_target = d["target"]
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
    if e.errno in (errno.ENAMETOOLONG, errno.ELOOP, errno.EISDIR, errno.EINVAL):
        return ConnectError(Code.INVALID_ARGUMENT, f"invalid path '{path}': {e.strerror}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ConnectError(Code.RESOURCE_EXHAUSTED,
                            "not enough disk space (the sandbox's disk quota)")
    return ConnectError(Code.INTERNAL, f"{e.strerror or e}: '{path}'")


def _worker_error(path: str) -> ConnectError:
    return ConnectError(Code.UNAVAILABLE,
                        f"the file operation on '{path}' was interrupted (its worker ended)")


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
_HDR = struct.Struct("iIII")
_EVENT_ORDER = ((IN_CREATE | IN_MOVED_TO, pb.EventType.CREATE),
                (IN_MOVED_FROM, pb.EventType.RENAME), (IN_ATTRIB, pb.EventType.CHMOD),
                (IN_MODIFY, pb.EventType.WRITE), (IN_DELETE, pb.EventType.REMOVE))


def same_event(last: pb.FilesystemEvent | None, ev: pb.FilesystemEvent) -> bool:
    """``ev`` repeats ``last`` (not yet delivered): merged into it, as the kernel merges
    an inotify event identical to its queue's last (a file written in several chunks
    is one WRITE, however the reads of the inotify queue fall between them)."""
    if last is None or last.name != ev.name or last.type != ev.type:
        return False
    if ev.entry is not None:
        last.entry = ev.entry  # the newer size and time
    return True
# Watchers (streaming WatchDir and polling CreateWatcher alike) one sandbox may have
# at once: each holds an inotify instance (a descriptor, kernel memory) and a queue.
# One more is refused with RESOURCE_EXHAUSTED until a watcher is stopped, its stream
# ends, or (only when the cap is reached) a polling watcher not polled for
# WATCHER_IDLE_S is expired to make room.
MAX_WATCHERS = 128
WATCHER_IDLE_S = 600.0


class Watcher:
    """An inotify watch of a directory (optionally recursive) delivering FilesystemEvents.

    The inotify instance and every watch in it are made by a file worker (root's by
    default, the user's in the strict mode: then only directories the user may read
    are watched); the entry info of events is looked up by the same worker. Events
    are processed in order, under one lock, by the reading task or by ``flush``.
    """

    def __init__(self, userfs: UserFS, key: tuple, root: str, fd: int, wds: dict[int, str],
                 recursive: bool, include_entry: bool, on_event) -> None:
        self.userfs = userfs
        self.key = key
        self.root = root
        self.fd = fd
        self.wds = wds
        self.recursive = recursive
        self.include_entry = include_entry
        self.on_event = on_event
        self.polled = time.monotonic()
        self._lock = asyncio.Lock()  # one reader at a time: events stay in order
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run())

    @classmethod
    async def start(cls, userfs: UserFS, key: tuple, root: str, recursive: bool,
                    include_entry: bool, on_event) -> Watcher:
        pairs: list = []
        result, fds = await userfs.call(key, "watch", path=root, recursive=recursive,
                                        on_more=pairs.extend)
        pairs.extend(result)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(errno.EIO, "no inotify descriptor from the file worker")
        return cls(userfs, key, root, fds[0], {int(wd): p for wd, p in pairs},
                   recursive, include_entry, on_event)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            self._loop.remove_reader(fd)
            self._task.cancel()
            os.close(fd)

    async def _readable(self) -> None:
        fd = self.fd
        fut = self._loop.create_future()
        self._loop.add_reader(fd, resolve_future, fut)
        try:
            await fut
        finally:
            if self.fd == fd:  # else close() removed it (and the number may be reused)
                self._loop.remove_reader(fd)

    async def _run(self) -> None:
        try:
            while self.fd >= 0:
                await self._readable()
                await self.flush()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a worker gone etc.: the watch ends, envd does not
            log.warning("watcher of %s stopped: %r", self.root, e)

    async def flush(self) -> None:
        """Process every event the kernel holds for this watch now. A poll calls it
        first: an operation's events are queued by the time its reply is sent (a
        write's CREATE, CHMOD and WRITE), so the poll that follows gets them all."""
        async with self._lock:
            while self.fd >= 0:
                try:
                    buf = os.read(self.fd, 64 * 1024)
                except BlockingIOError:
                    return
                await self._process(buf)

    async def _process(self, buf: bytes) -> None:
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
            if (mask & IN_CREATE and mask & IN_ISDIR and self.recursive
                    and len(self.wds) < MAX_WATCH_DIRS):
                new, _ = await self.userfs.call(self.key, "add_watch", fds=(self.fd,),
                                                path=full)
                if new >= 0:
                    self.wds[new] = full
            # One record may carry several operations: each is an event, in the order
            # E2B's watcher sends them (services/filesystem/watch.go).
            entry = None
            for bits, etype in _EVENT_ORDER:
                if not mask & bits:
                    continue
                ev = pb.FilesystemEvent(name=os.path.relpath(full, self.root), type=etype)
                if self.include_entry and etype not in (pb.EventType.REMOVE,
                                                         pb.EventType.RENAME):
                    if entry is None:
                        entry, _ = await self.userfs.call(self.key, "entry", path=full)
                    if entry is not None:
                        ev.entry = entry_pb(entry)
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


def keepalive_seconds(ctx: RequestContext) -> float | None:
    """The client's keepalive-ping-interval, clamped (none when absent or invalid)."""
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    try:
        v = float(raw) if raw else 0.0
    except ValueError:
        return None
    if not math.isfinite(v) or v <= 0:
        return None
    return min(max(v, MIN_KEEPALIVE_S), MAX_KEEPALIVE_S)


class FilesystemService:
    """Implements ``aenv_envd_protos.filesystem.filesystem_connect.Filesystem``.

    Every operation runs in a file worker for the request's user (see userfs): as
    root, creating for the user, by default (E2B's envd); with the user's own uid,
    gid and groups in the strict mode.
    """

    def __init__(self, state: State, userfs: UserFS | None = None) -> None:
        self.state = state
        self.userfs = userfs or UserFS()
        self.watchers: dict[str, tuple[Watcher, list]] = {}
        self.streams = 0  # WatchDir streams open

    def _owner(self, user: User) -> dict:
        """What an operation that creates is told to chown to (root mode only)."""
        return {"owner": owner(user)} if self.state.file_access == "root" else {}

    async def _call(self, user: User, op: str, path: str, **args):
        """Run ``op`` for ``user``; OSErrors come back as the Connect errors E2B sends."""
        try:
            return await self.userfs.call(fs_key(self.state, user), op, path=path, **args)
        except OSError as e:
            raise _oserror(e, path) from None
        except WorkerGone:
            raise _worker_error(path) from None

    async def stat(self, request: pb.StatRequest, ctx: RequestContext) -> pb.StatResponse:
        user = _request_user(self.state, ctx)
        path = _path(request.path, user)
        entry, _ = await self._call(user, "stat", path)
        return pb.StatResponse(entry=entry_pb(entry))

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext
                       ) -> pb.MakeDirResponse:
        user = _request_user(self.state, ctx)
        path = _path(request.path, user)
        try:
            entry, _ = await self._call(user, "mkdir", path, **self._owner(user))
        except Refused as e:
            if e.detail == "dir":
                raise ConnectError(Code.ALREADY_EXISTS,
                                   f"directory '{path}' already exists") from None
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"path '{path}' already exists and is not a directory") from None
        return pb.MakeDirResponse(entry=entry_pb(entry))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext) -> pb.MoveResponse:
        user = _request_user(self.state, ctx)
        src = _path(request.source, user)
        dst = _path(request.destination, user)
        try:
            entry, _ = await self.userfs.call(fs_key(self.state, user), "move", src=src,
                                              dst=dst, **self._owner(user))
        except Refused:
            raise ConnectError(Code.NOT_FOUND, f"source '{src}' does not exist") from None
        except OSError as e:
            raise _oserror(e, dst) from None
        except WorkerGone:
            raise _worker_error(dst) from None
        return pb.MoveResponse(entry=entry_pb(entry))

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext
                       ) -> pb.ListDirResponse:
        user = _request_user(self.state, ctx)
        root = _path(request.path, user, allow_empty=True)
        depth = max(1, min(request.depth, MAX_LIST_DEPTH))
        entries: list[pb.EntryInfo] = []

        def more(batch: list) -> None:
            entries.extend(entry_pb(d) for d in batch)

        try:
            last, _ = await self._call(user, "list", root, depth=depth, on_more=more)
        except Refused as e:
            if e.reason == "too_many":
                raise ConnectError(
                    Code.RESOURCE_EXHAUSTED,
                    f"'{root}' holds more than {MAX_LIST_ENTRIES} entries down to depth "
                    f"{depth}: list it with a smaller depth") from None
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"path '{root}' is not a directory") from None
        more(last)
        return pb.ListDirResponse(entries=entries)

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext) -> pb.RemoveResponse:
        user = _request_user(self.state, ctx)
        path = _path(request.path, user)
        await self._call(user, "remove", path)
        return pb.RemoveResponse()

    # -- watchers -------------------------------------------------------------------
    def _slots_used(self) -> int:
        return len(self.watchers) + self.streams

    def _claim_slot(self) -> None:
        """Raise RESOURCE_EXHAUSTED if no watcher slot is free (after expiring idle ones)."""
        if self._slots_used() < MAX_WATCHERS:
            return
        cutoff = time.monotonic() - WATCHER_IDLE_S
        for wid, (w, _) in list(self.watchers.items()):
            if w.polled < cutoff:
                w.close()
                del self.watchers[wid]
        if self._slots_used() >= MAX_WATCHERS:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED,
                f"too many watchers: a sandbox may have {MAX_WATCHERS} at once; "
                "stop one (WatchHandle.stop) before starting another")

    async def _watch(self, raw: str, recursive: bool, include_entry: bool,
                     ctx: RequestContext, on_event) -> Watcher:
        user = _request_user(self.state, ctx)
        path = _path(raw, user)
        try:
            return await Watcher.start(self.userfs, fs_key(self.state, user), path, recursive,
                                       include_entry, on_event)
        except Refused as e:
            if e.reason == "too_many":
                raise ConnectError(
                    Code.RESOURCE_EXHAUSTED,
                    f"'{path}' holds more than {MAX_WATCH_DIRS} directories: "
                    "watch a smaller tree") from None
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"path '{path}' is not a directory") from None
        except OSError as e:
            raise _oserror(e, path) from None
        except WorkerGone:
            raise _worker_error(path) from None

    async def watch_dir(self, request: pb.WatchDirRequest, ctx: RequestContext
                        ) -> AsyncIterator[pb.WatchDirResponse]:
        self._claim_slot()
        self.streams += 1
        try:
            q: asyncio.Queue = asyncio.Queue()
            overflow: list = []

            last: list = [None]

            def on_event(ev) -> None:
                if not q.empty() and same_event(last[0], ev):
                    return
                last[0] = ev
                if q.qsize() < MAX_WATCHER_EVENTS:
                    q.put_nowait(ev)
                elif not overflow:
                    overflow.append(True)
                    q.put_nowait(None)

            w = await self._watch(request.path, request.recursive, request.include_entry,
                                  ctx, on_event)
            keepalive = keepalive_seconds(ctx)
            try:
                yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))
                while True:
                    try:
                        ev = await asyncio.wait_for(q.get(), keepalive)
                    except TimeoutError:
                        yield pb.WatchDirResponse(
                            event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive()))
                        continue
                    if ev is None:
                        raise ConnectError(
                            Code.RESOURCE_EXHAUSTED,
                            f"the watcher fell {MAX_WATCHER_EVENTS} events behind; "
                            "events were lost")
                    yield pb.WatchDirResponse(event=Oneof("filesystem", ev))
            finally:
                w.close()
        finally:
            self.streams -= 1

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: RequestContext
                             ) -> pb.CreateWatcherResponse:
        events: list = []

        def on_event(ev):
            if events and same_event(events[-1], ev):
                return
            if len(events) < MAX_WATCHER_EVENTS:
                events.append(ev)

        self._claim_slot()
        self.streams += 1  # holds the slot while the watch is being set up
        try:
            w = await self._watch(request.path, request.recursive, request.include_entry,
                                  ctx, on_event)
        finally:
            self.streams -= 1
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
        w, events = self._watcher(request.watcher_id)
        w.polled = time.monotonic()
        try:
            await w.flush()
        except (OSError, WorkerGone) as e:  # what was read stands; the task logs the rest
            log.warning("watcher of %s: %r", w.root, e)
        out = list(events)
        events.clear()
        return pb.GetWatcherEventsResponse(events=out)

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: RequestContext
                             ) -> pb.RemoveWatcherResponse:
        w, _ = self._watcher(request.watcher_id)
        w.close()
        del self.watchers[request.watcher_id]
        return pb.RemoveWatcherResponse()


__all__ = ["MAX_WATCHERS", "FilesystemService", "entry_pb", "user_key"]
