"""E2B's plain HTTP ``/files`` endpoint: download, and upload (raw, gzip, multipart).

Every file is opened by a file worker (see userfs): by default a root one that
chowns what it creates to the requesting user, as E2B's envd does; in the strict
mode the user's own, so the kernel checks the path, symlinks included, with the
user's rights. The bytes then stream here. Requests are authorized by the caller
(access token) or by E2B's signed-URL parameters (``signature_ok``).
"""

from __future__ import annotations

import errno
import hmac
import os
import time
import zlib
from typing import Any
from urllib.parse import quote

from . import file_metadata
from .asgi import HTTPError, body_chunks, header, send_json
from .protocol import file_signature
from .state import PathError, State, User, UserError, resolve_path
from .userfs import UserFS, fs_key, owner
from .userfs_protocol import Refused, WorkerGone

FILE_CHUNK = 256 * 1024
# A file that reports no size (procfs, sysfs: st_size 0) is read to its end, up to
# this much, before answering: its length is known only then.
MAX_UNSIZED = 16 * 1024 * 1024
# Multipart uploads: header bytes of one part, and file parts of one upload
# without a path (the SDK's write_files); an upload with a path takes one.
MAX_PART_HEADERS = 16 * 1024
MAX_UPLOAD_PARTS = 10_000
MAX_BOUNDARY = 200


def _io_error(e: OSError, path: str) -> HTTPError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return HTTPError(507, "not enough disk space (the sandbox's disk quota)")
    if e.errno == errno.ENOENT:
        return HTTPError(404, f"path '{path}' does not exist")
    if e.errno in (errno.EISDIR, errno.ENOTDIR, errno.EINVAL, errno.ENAMETOOLONG):
        return HTTPError(400, f"invalid path '{path}': {e.strerror}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return HTTPError(403, f"permission denied: '{path}'")
    return HTTPError(500, f"{e.strerror or e}: '{path}'")


async def open_as_user(userfs: UserFS, state: State, user: User, op: str, path: str) -> int:
    """A descriptor of ``path`` opened for ``user`` by a file worker (``op``: open_read
    or open_write; see userfs.fs_key), or the HTTP error a client is told."""
    args: dict[str, Any] = {}
    if op == "open_write" and state.file_access == "root":
        args["owner"] = owner(user)
    try:
        _, fds = await userfs.call(fs_key(state, user), op, path=path, **args)
    except IsADirectoryError:
        raise HTTPError(400, f"path '{path}' is a directory") from None
    except OSError as e:
        raise _io_error(e, path) from None
    except Refused:
        raise HTTPError(400, f"path '{path}' is not a regular file") from None
    except WorkerGone:
        verb = "reading" if op == "open_read" else "writing"
        raise HTTPError(503, f"{verb} '{path}' was interrupted (its worker ended)") from None
    return fds[0]


class _FileSink:
    """One destination file of an upload, opened by a file worker (a new file
    belongs to the user either way, see userfs), then written here as it streams in."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    async def open(cls, userfs: UserFS, state: State, user: User, path: str) -> _FileSink:
        return cls(path, await open_as_user(userfs, state, user, "open_write", path))

    def write(self, data: bytes | memoryview) -> None:
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as e:
            self.close()
            raise _io_error(e, self.path) from None

    def set_metadata(self, metadata: dict[str, str]) -> dict[str, str]:
        # On the open file, not the path (which may since point elsewhere).
        return file_metadata.replace(self.fd, self.path, metadata)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1



class FilesEndpoint:
    """``GET /files`` (download) and ``POST /files`` (upload), as the named user."""

    def __init__(self, state: State, userfs: UserFS) -> None:
        self.state = state
        self.userfs = userfs

    # -- auth and paths -------------------------------------------------------------
    def signature_ok(self, query: dict[str, str], operation: str) -> bool:
        token = self.state.access_token
        sig = query.get("signature")
        if not token or not sig:
            return False
        exp_raw = query.get("signature_expiration")
        expiration = None
        if exp_raw:
            try:
                expiration = int(exp_raw)
            except ValueError:
                return False
            if expiration < time.time():
                # Said as E2B's envd says it (the SDKs show the message).
                raise HTTPError(401, "signature is already expired")
        expected = file_signature(query.get("path", ""), operation, query.get("username", ""),
                                  token, expiration)
        return hmac.compare_digest(sig.encode(), expected.encode())

    def _user(self, query: dict[str, str]) -> User:
        try:
            return self.state.resolve_user(query.get("username") or None)
        except UserError as e:
            raise HTTPError(401, str(e)) from None

    @staticmethod
    def _resolve(raw: str, user: User) -> str:
        try:
            return resolve_path(raw, user)
        except PathError as e:
            raise HTTPError(400, str(e)) from None

    # -- transfers ------------------------------------------------------------------
    async def download(self, scope, query: dict[str, str], send) -> None:
        user = self._user(query)
        path = self._resolve(query.get("path", ""), user)
        fd = await open_as_user(self.userfs, self.state, user, "open_read", path)
        try:
            size = os.fstat(fd).st_size
            whole = b"" if size else _read_unsized(fd, path)
            name = quote(os.path.basename(path))
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"content-disposition", f"attachment; filename*=UTF-8''{name}".encode()),
                (b"content-length", str(size or len(whole)).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            if whole:
                await send({"type": "http.response.body", "body": whole})
                return
            remaining = size
            while remaining > 0:
                chunk = os.read(fd, min(FILE_CHUNK, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if remaining > 0:  # shrank meanwhile: the promised length cannot be kept
                raise RuntimeError(f"'{path}' shrank while being downloaded")
            await send({"type": "http.response.body", "body": b""})
        finally:
            os.close(fd)

    async def upload(self, scope, query: dict[str, str], receive, send,
                     signed: bool = False) -> None:
        user = self._user(query)
        if signed and not query.get("path"):
            raise HTTPError(400, "a signed upload URL must name the file's path")
        ctype = header(scope, b"content-type") or ""
        encoding = (header(scope, b"content-encoding") or "").strip().lower()
        if encoding not in ("", "identity", "gzip"):
            raise HTTPError(400, f"unsupported content-encoding '{encoding}'")
        body = body_chunks(receive)
        if encoding == "gzip":
            body = _gunzip(body)
        metadata = file_metadata.from_headers(scope.get("headers", ()))
        # path -> the metadata it now holds, in the order written
        kept: dict[str, dict[str, str]] = {}
        if ctype.lower().startswith("multipart/form-data"):
            await self._upload_multipart(ctype, query, user, body, metadata, kept)
        else:
            if not query.get("path"):
                raise HTTPError(400, "the 'path' query parameter is required for raw uploads")
            path = self._resolve(query["path"], user)
            sink = await _FileSink.open(self.userfs, self.state, user, path)
            try:
                async for chunk in body:
                    sink.write(chunk)
                kept[path] = sink.set_metadata(metadata)
            finally:
                sink.close()
        out = []
        for p, meta in kept.items():
            item: dict[str, Any] = {"name": os.path.basename(p), "type": "file", "path": p}
            if meta:
                item["metadata"] = meta
            out.append(item)
        await send_json(send, 200, out)

    async def _upload_multipart(self, ctype: str, query: dict[str, str], user: User,
                                body, metadata: dict[str, str],
                                kept: dict[str, dict[str, str]]) -> None:
        """Write a multipart upload's file parts.

        With ``path`` in the query (always, for a signed URL) the body must hold
        exactly one file part, written to that path: a part's own filename never
        picks the destination then. Without it (the SDK's multi-file write) each
        part goes to its filename, resolved against the user's home. Either way
        every file is opened for the user as ``open_as_user`` says.
        """
        from python_multipart.multipart import MultipartParser, parse_options_header

        _, params = parse_options_header(ctype)
        boundary = params.get(b"boundary")
        if not boundary:
            raise HTTPError(400, "multipart body without boundary")
        if len(boundary) > MAX_BOUNDARY:
            raise HTTPError(400, "multipart boundary too long")
        query_path = self._resolve(query["path"], user) if query.get("path") else None
        written: list[str] = []
        # The parser's callbacks are synchronous; opening a file is not (the user's
        # worker does it). So callbacks queue actions, run in order after each chunk.
        actions: list[tuple[str, Any]] = []
        cur: dict[str, Any] = {"field": b"", "value": b"", "headers": {}, "size": 0,
                               "file": False}

        def on_part_begin():
            cur["headers"] = {}
            cur["size"] = 0
            cur["file"] = False

        def grow(n: int) -> None:
            cur["size"] += n
            if cur["size"] > MAX_PART_HEADERS:
                raise HTTPError(400, f"multipart part headers exceed {MAX_PART_HEADERS} bytes")

        def on_header_field(data, start, end):
            grow(end - start)
            cur["field"] += data[start:end]

        def on_header_value(data, start, end):
            grow(end - start)
            cur["value"] += data[start:end]

        def on_header_end():
            cur["headers"][cur["field"].lower()] = cur["value"]
            cur["field"] = b""
            cur["value"] = b""

        def on_headers_finished():
            disp = cur["headers"].get(b"content-disposition", b"")
            _, opts = parse_options_header(disp)
            filename = opts.get(b"filename")
            # A file part has a filename, or is the form field "file" (E2B's envd takes
            # one without a filename when the path parameter names the file).
            if filename is None and opts.get(b"name") != b"file":
                return  # another form field: ignored
            if filename is None and query_path is None:
                raise HTTPError(400, "a file part without a filename needs the path parameter")
            cur["file"] = True
            files = sum(1 for a in actions if a[0] == "open") + len(written)
            if query_path is not None:
                if files >= 1:
                    raise HTTPError(400, "an upload to a given path (every signed upload "
                                         "URL) takes exactly one file part")
                actions.append(("open", query_path))
                return
            if files >= MAX_UPLOAD_PARTS:
                raise HTTPError(400, f"more than {MAX_UPLOAD_PARTS} files in one upload")
            try:
                raw = filename.decode("utf-8")
            except UnicodeDecodeError:
                raise HTTPError(400, "a part's filename is not valid UTF-8") from None
            actions.append(("open", self._resolve(raw, user)))

        def on_part_data(data, start, end):
            if cur["file"]:
                actions.append(("data", bytes(data[start:end])))

        def on_part_end():
            if cur["file"]:
                actions.append(("close", None))
                cur["file"] = False

        parser = MultipartParser(boundary, {
            "on_part_begin": on_part_begin, "on_part_data": on_part_data,
            "on_part_end": on_part_end, "on_header_field": on_header_field,
            "on_header_value": on_header_value, "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
        })
        sink: _FileSink | None = None

        async def run_actions() -> None:
            nonlocal sink
            for kind, arg in actions:
                if kind == "open":
                    sink = await _FileSink.open(self.userfs, self.state, user, arg)
                    written.append(arg)
                elif kind == "data":
                    if sink is not None:
                        sink.write(arg)
                elif sink is not None:
                    kept[sink.path] = sink.set_metadata(metadata)
                    sink.close()
                    sink = None
            actions.clear()

        try:
            async for chunk in body:
                try:
                    parser.write(chunk)
                finally:
                    await run_actions()  # what was parsed before any error
            parser.finalize()
            await run_actions()
        except HTTPError:
            raise
        except Exception as e:
            raise HTTPError(400, f"malformed multipart body: {e}") from None
        finally:
            if sink is not None:
                sink.close()
        if not written:
            raise HTTPError(400, "no file in the multipart body")


def _read_unsized(fd: int, path: str) -> bytes:
    """All of a file whose size says nothing (procfs reports 0 for content it makes
    on read), bounded by MAX_UNSIZED: an endless one (/dev/zero) is refused."""
    parts: list[bytes] = []
    got = 0
    while chunk := os.read(fd, min(FILE_CHUNK, MAX_UNSIZED + 1 - got)):
        parts.append(chunk)
        got += len(chunk)
        if got > MAX_UNSIZED:
            raise HTTPError(413, f"'{path}' reports no size and has more than "
                                 f"{MAX_UNSIZED} bytes")
    return b"".join(parts)


async def _gunzip(chunks):
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for c in chunks:
            out = d.decompress(c, FILE_CHUNK)
            while out:
                yield out
                out = d.decompress(d.unconsumed_tail, FILE_CHUNK) if d.unconsumed_tail else b""
        tail = d.flush()
        if tail:
            yield tail
    except zlib.error as e:
        raise HTTPError(400, f"invalid gzip body: {e}") from None
