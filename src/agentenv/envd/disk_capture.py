"""Filesystem-only pauses, inside the sandbox (E2B's ``memory: false``).

The node keeps a sandbox's files without its memory in three steps, all as root:

  GET  /aenv/fs/list     every entry of the sandbox's own filesystems (/ and /tmp) as
                         JSON lines ``[path, kind, mode, uid, gid, size, mtime_ns, target]``;
                         the node compares them with the template's rootfs;
  POST /aenv/fs/export   JSON lines of paths in, a tar stream of those entries out;

and on the boot that resumes it:

  POST /aenv/fs/prune    JSON lines of the paths the sandbox had: everything else goes
                         (what the user deleted, what the fresh boot made anew);
  POST /aenv/fs/import   a tar stream, extracted over the root with owners and modes.

Nothing here leaves the sandbox: the node stores the bytes without reading them, and
an import writes only inside the sandbox that asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import stat
import threading
from typing import IO, TYPE_CHECKING

from .asgi import HTTPError, body_chunks, read_small_body, send_response
from .fs_walk import NOT_THE_SANDBOXS, walk

if TYPE_CHECKING:
    import tarfile

PREFIX = "/aenv/fs/"
MAX_PATHS_BODY = 256 << 20
CHUNK = 1 << 20


def other_mounts() -> set[str]:
    """Mount points other than the sandbox's own filesystems (the root layer and /tmp):
    /etc/resolv.conf, /dev/shm, the bundle... (st_dev cannot tell: gVisor's overlay
    gives the lower layer's entries devices of their own)."""
    mounts = set(NOT_THE_SANDBOXS)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1:
                # Octal escapes (\040 for a space) as the kernel writes them.
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
                mounts.add(point)
    mounts.discard("/")
    mounts.discard("/tmp")
    return mounts


class _Exact(io.RawIOBase):
    """A file read as exactly ``size`` bytes: zeros past an early end, nothing past
    ``size`` (a file written while it is archived keeps the tar well formed)."""

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.f = f
        self.left = size

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n) if n else b""
        data += bytes(n - len(data))
        self.left -= n
        return data


def export_tar(paths: list[str], out: IO[bytes]) -> None:
    """A tar stream of ``paths`` (each entry alone: directories without their contents)."""
    import tarfile  # here: only pauses need it, and it costs every idle envd ~0.4 MB

    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in paths:
            try:
                info = tar.gettarinfo(path)
            except OSError:
                continue  # gone since the listing
            if info is None:
                continue
            if info.isreg():
                try:
                    with open(path, "rb") as f:
                        tar.addfile(info, _Exact(f, info.size))
                except OSError:
                    continue
            else:
                tar.addfile(info)


def _clear_way(target: str, member: tarfile.TarInfo) -> None:
    """Nothing of another kind (or a link) where the member goes: a file must never be
    written through a symlink the fresh boot has at its path."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        if not member.isdir():
            shutil.rmtree(target)
    elif not (member.isreg() and stat.S_ISREG(st.st_mode)):
        os.unlink(target)


def import_tar(src: IO[bytes]) -> int:
    """Extract a tar stream made by export_tar over /, owners and modes kept."""
    import tarfile

    count = 0
    with tarfile.open(fileobj=src, mode="r|") as tar:
        for member in tar:
            name = "/" + member.name.lstrip("/")
            if member.islnk() or member.ischr() or member.isblk() or ".." in name.split("/"):
                continue
            parent = os.path.dirname(name)
            if not os.path.isdir(parent) or os.path.islink(parent):
                continue
            _clear_way(name, member)
            tar.extract(member, "/", set_attrs=True, numeric_owner=True,
                        filter="fully_trusted")
            count += 1
    return count


def prune(keep: set[str], skip: set[str]) -> int:
    """Remove every entry (but ``skip``) that is not in ``keep``; return how many."""
    removed = 0
    for path, entry in walk("/", skip):
        if path in keep:
            continue
        with contextlib.suppress(OSError):
            if entry[0] == "d":
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed += 1
    return removed


def _paths(data: bytes) -> list[str]:
    paths = []
    for line in data.splitlines():
        if line.strip():
            path = json.loads(line)
            if not isinstance(path, str) or not path.startswith("/"):
                raise HTTPError(400, "each line must be an absolute path as a JSON string")
            paths.append(path)
    return paths


class _Pipe:
    """Bytes between a worker thread and the event loop, with back-pressure."""

    def __init__(self) -> None:
        r, w = os.pipe()
        self.reader = os.fdopen(r, "rb", buffering=0)
        self.writer = os.fdopen(w, "wb", buffering=CHUNK)

    def close(self) -> None:
        for f in (self.reader, self.writer):
            with contextlib.suppress(OSError):
                f.close()


class DiskCapture:
    async def __call__(self, scope, receive, send) -> None:
        op = scope["path"][len(PREFIX):]
        method = scope["method"]
        if (op, method) == ("list", "GET"):
            await self._list(send)
        elif (op, method) == ("export", "POST"):
            await self._export(receive, send)
        elif (op, method) == ("prune", "POST"):
            body = await read_small_body(receive, MAX_PATHS_BODY)
            keep = set(await asyncio.to_thread(_paths, body))
            removed = await asyncio.to_thread(prune, keep, other_mounts())
            await send_response(send, 200, json.dumps({"removed": removed}).encode(),
                                "application/json")
        elif (op, method) == ("import", "POST"):
            await self._import(receive, send)
        else:
            raise HTTPError(404, f"{method} {scope['path']} not found")

    async def _list(self, send) -> None:
        pipe = _Pipe()

        def produce() -> None:
            try:
                for path, entry in walk("/", other_mounts()):
                    pipe.writer.write(json.dumps([path, *entry]).encode() + b"\n")
            finally:
                with contextlib.suppress(OSError):
                    pipe.writer.close()

        await self._stream(send, pipe, produce, "application/jsonl")

    async def _export(self, receive, send) -> None:
        paths = await asyncio.to_thread(_paths, await read_small_body(receive, MAX_PATHS_BODY))
        pipe = _Pipe()

        def produce() -> None:
            try:
                export_tar(paths, pipe.writer)
            finally:
                with contextlib.suppress(OSError):
                    pipe.writer.close()

        await self._stream(send, pipe, produce, "application/x-tar")

    @staticmethod
    async def _stream(send, pipe: _Pipe, produce, content_type: str) -> None:
        worker = threading.Thread(target=produce, daemon=True, name="disk-capture")
        worker.start()
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", content_type.encode())]})
            while True:
                chunk = await asyncio.to_thread(pipe.reader.read, CHUNK)
                if not chunk:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            pipe.close()  # a producer still writing gets EPIPE and ends
            await asyncio.to_thread(worker.join)

    async def _import(self, receive, send) -> None:
        pipe = _Pipe()
        result: dict = {}

        def consume() -> None:
            try:
                result["count"] = import_tar(pipe.reader)
            except Exception as exc:  # reported below; the stream is drained regardless
                result["error"] = exc
                with contextlib.suppress(OSError):
                    while pipe.reader.read(CHUNK):
                        pass

        worker = threading.Thread(target=consume, daemon=True, name="disk-import")
        worker.start()
        try:
            async for chunk in body_chunks(receive):
                await asyncio.to_thread(pipe.writer.write, chunk)
            await asyncio.to_thread(pipe.writer.close)
            await asyncio.to_thread(worker.join)
        finally:
            pipe.close()
        if "error" in result:
            raise HTTPError(500, f"extracting the sandbox's files failed: {result['error']}")
        await send_response(send, 200, json.dumps({"extracted": result["count"]}).encode(),
                            "application/json")
