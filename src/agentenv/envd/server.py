"""envd's ASGI application: Connect RPC services plus E2B's plain HTTP endpoints.

A bare ASGI callable (no framework) to keep envd's memory small:
  GET /health, GET|POST /files, POST /init, GET /envs, GET /metrics, and the
  ``process.Process`` / ``filesystem.Filesystem`` Connect services.
Every request except /health needs ``X-Access-Token`` once a token is set
(/files also accepts E2B's signed-URL parameters instead).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import time
import zlib
from typing import Any
from urllib.parse import parse_qsl, quote

from .state import PathError, State, User, UserError, resolve_path
from .userfs import METADATA_XATTR_PREFIX, Refused, UserFS, WorkerGone, user_key

log = logging.getLogger("agentenv.envd")

FILE_CHUNK = 256 * 1024
MAX_JSON_BODY = 1 << 20
# Multipart uploads: header bytes of one part, and file parts of one upload
# without a path (the SDK's write_files); an upload with a path takes one.
MAX_PART_HEADERS = 16 * 1024
MAX_UPLOAD_PARTS = 10_000
MAX_BOUNDARY = 200
PROCESS_PREFIX = "/process.Process/"
FILESYSTEM_PREFIX = "/filesystem.Filesystem/"
SERVER_STREAMS = frozenset({"/filesystem.Filesystem/WatchDir", "/process.Process/Start",
                            "/process.Process/Connect"})


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# -- small ASGI helpers ------------------------------------------------------------------
async def _send_response(send, status: int, body: bytes = b"",
                         content_type: str | None = None,
                         extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type:
        headers.append((b"content-type", content_type.encode()))
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send, status: int, obj: Any) -> None:
    await _send_response(send, status, json.dumps(obj).encode(), "application/json")


async def _send_error(send, status: int, message: str) -> None:
    await _send_json(send, status, {"code": status, "message": message})


async def _body_chunks(receive):
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected")
        chunk = msg.get("body", b"")
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            return


async def _read_small_body(receive) -> bytes:
    buf = bytearray()
    async for chunk in _body_chunks(receive):
        buf += chunk
        if len(buf) > MAX_JSON_BODY:
            raise HTTPError(413, "request body too large")
    return bytes(buf)


async def _until_disconnect(app, scope, receive, send) -> None:
    """Run a server-streaming RPC, cancelling it when the client goes away.

    A stream that waits for something to send (a watcher without events, a quiet
    process) never learns on its own that its client left: sends to a gone client
    are dropped, so it would hold its watcher slot, inotify instance or output
    subscription forever. Once the request body is in, the only message left for
    ``receive`` is ``http.disconnect``: wait for it beside the app.
    """
    body_done = asyncio.Event()
    gone = asyncio.Event()

    async def app_receive():
        if body_done.is_set():
            await gone.wait()
            return {"type": "http.disconnect"}
        msg = await receive()
        if msg["type"] == "http.disconnect":
            gone.set()
        elif not msg.get("more_body", False):
            body_done.set()
        return msg

    task = asyncio.ensure_future(app(scope, app_receive, send))

    async def watch() -> None:
        await body_done.wait()
        if (await receive())["type"] == "http.disconnect":
            gone.set()
            if not task.done():
                task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await task
    except asyncio.CancelledError:
        if not gone.is_set():
            raise
    finally:
        watcher.cancel()


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


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


def file_signature(path: str, operation: str, username: str, token: str,
                   expiration: int | None) -> str:
    """E2B's v1 signature for /files URLs (matches ``e2b.sandbox.signature``)."""
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


class _FileSink:
    """One destination file of an upload, opened by the user's file worker (so the
    kernel checks the path, symlinks included, with the user's rights and a new file
    belongs to the user), then written here as it streams in."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    async def open(cls, userfs: UserFS, user: User, path: str) -> _FileSink:
        try:
            _, fds = await userfs.call(user_key(user), "open_write", path=path)
        except IsADirectoryError:
            raise HTTPError(400, f"path '{path}' is a directory") from None
        except OSError as e:
            raise _io_error(e, path) from None
        except Refused:
            raise HTTPError(400, f"path '{path}' is not a regular file") from None
        except WorkerGone:
            raise HTTPError(503, f"writing '{path}' was interrupted (its worker ended)") from None
        return cls(path, fds[0])

    def write(self, data: bytes | memoryview) -> None:
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as e:
            self.close()
            raise _io_error(e, self.path) from None

    def set_metadata(self, metadata: dict[str, str]) -> None:
        for k, v in metadata.items():
            try:  # on the open file, not the path (which may since point elsewhere)
                os.setxattr(self.fd, METADATA_XATTR_PREFIX + k, v.encode())
            except OSError as e:
                raise HTTPError(500, f"cannot store metadata on '{self.path}': "
                                     f"{e.strerror}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class EnvdApp:
    def __init__(self, state: State, process_app, filesystem_app,
                 userfs: UserFS | None = None) -> None:
        self.state = state
        self.process_app = process_app
        self.filesystem_app = filesystem_app
        self.userfs = userfs or UserFS()
        self._cpu_prev: tuple[int, int] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        method = scope["method"]
        if path == "/health":
            await _send_response(send, 204)
            return
        authed = self.state.token_ok(_header(scope, b"x-access-token"))
        if path.startswith(PROCESS_PREFIX) or path.startswith(FILESYSTEM_PREFIX):
            if not authed:
                await _send_json(send, 401, {"code": "unauthenticated",
                                             "message": "invalid or missing access token"})
                return
            app = self.process_app if path.startswith(PROCESS_PREFIX) else self.filesystem_app
            if path in SERVER_STREAMS:
                await _until_disconnect(app, scope, receive, send)
            else:
                await app(scope, receive, send)
            return
        try:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                                   keep_blank_values=True))
            if path == "/files":
                if method not in ("GET", "POST"):
                    raise HTTPError(405, "method not allowed")
                if not authed and not self._signature_ok(
                        query, "read" if method == "GET" else "write"):
                    raise HTTPError(401, "invalid or missing access token or signature")
                if method == "GET":
                    await self._download(scope, query, send)
                else:
                    await self._upload(scope, query, receive, send, signed=not authed)
                return
            if not authed:
                raise HTTPError(401, "invalid or missing access token")
            if path == "/init" and method == "POST":
                await self._init(receive, send)
            elif path == "/envs" and method == "GET":
                await _send_json(send, 200, self.state.env_vars)
            elif path == "/metrics" and method == "GET":
                await _send_json(send, 200, self._metrics())
            else:
                raise HTTPError(404, f"{method} {path} not found")
        except HTTPError as e:
            await _send_error(send, e.status, e.message)

    # -- auth -----------------------------------------------------------------------
    def _signature_ok(self, query: dict[str, str], operation: str) -> bool:
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
                return False
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

    # -- /files ---------------------------------------------------------------------
    async def _download(self, scope, query: dict[str, str], send) -> None:
        user = self._user(query)
        path = self._resolve(query.get("path", ""), user)
        try:
            _, fds = await self.userfs.call(user_key(user), "open_read", path=path)
        except IsADirectoryError:
            raise HTTPError(400, f"path '{path}' is a directory") from None
        except OSError as e:
            raise _io_error(e, path) from None
        except Refused:
            raise HTTPError(400, f"path '{path}' is not a regular file") from None
        except WorkerGone:
            raise HTTPError(503, f"reading '{path}' was interrupted (its worker ended)") from None
        fd = fds[0]
        try:
            size = os.fstat(fd).st_size
            name = quote(os.path.basename(path))
            headers = [
                (b"content-type", b"application/octet-stream"),
                (b"content-disposition", f"attachment; filename*=UTF-8''{name}".encode()),
                (b"content-length", str(size).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
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

    async def _upload(self, scope, query: dict[str, str], receive, send,
                      signed: bool = False) -> None:
        user = self._user(query)
        if signed and not query.get("path"):
            raise HTTPError(400, "a signed upload URL must name the file's path")
        ctype = _header(scope, b"content-type") or ""
        encoding = (_header(scope, b"content-encoding") or "").strip().lower()
        if encoding not in ("", "identity", "gzip"):
            raise HTTPError(400, f"unsupported content-encoding '{encoding}'")
        body = _body_chunks(receive)
        if encoding == "gzip":
            body = _gunzip(body)
        metadata = {k[len("x-metadata-"):]: v.decode("latin-1")
                    for k, v in ((k.decode("latin-1").lower(), v)
                                 for k, v in scope.get("headers", ()))
                    if k.startswith("x-metadata-")}
        if ctype.lower().startswith("multipart/form-data"):
            paths = await self._upload_multipart(ctype, query, user, body, metadata)
        else:
            if not query.get("path"):
                raise HTTPError(400, "the 'path' query parameter is required for raw uploads")
            path = self._resolve(query["path"], user)
            sink = await _FileSink.open(self.userfs, user, path)
            try:
                async for chunk in body:
                    sink.write(chunk)
                sink.set_metadata(metadata)
            finally:
                sink.close()
            paths = [path]
        out = []
        for p in paths:
            item: dict[str, Any] = {"name": os.path.basename(p), "type": "file", "path": p}
            if metadata:
                item["metadata"] = metadata
            out.append(item)
        await _send_json(send, 200, out)

    async def _upload_multipart(self, ctype: str, query: dict[str, str], user: User,
                                body, metadata: dict[str, str]) -> list[str]:
        """Write a multipart upload's file parts.

        With ``path`` in the query (always, for a signed URL) the body must hold
        exactly one file part, written to that path: a part's own filename never
        picks the destination then. Without it (the SDK's multi-file write) each
        part goes to its filename, resolved against the user's home. Either way
        every file is opened by the user's worker, as the user.
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
            if filename is None:
                return  # a non-file form field: ignored
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
                    sink = await _FileSink.open(self.userfs, user, arg)
                    written.append(arg)
                elif kind == "data":
                    if sink is not None:
                        sink.write(arg)
                elif sink is not None:
                    sink.set_metadata(metadata)
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
        return written

    # -- /init ------------------------------------------------------------------------
    async def _init(self, receive, send) -> None:
        raw = await _read_small_body(receive)
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise HTTPError(400, "body is not valid JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "body must be a JSON object")
        env_vars = body.get("envVars")
        if env_vars is not None:
            if not isinstance(env_vars, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
                raise HTTPError(400, "envVars must map strings to strings")
            self.state.env_vars.update(env_vars)
        for key, attr in (("accessToken", "access_token"), ("defaultUser", "default_user"),
                          ("defaultWorkdir", "default_workdir")):
            value = body.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise HTTPError(400, f"{key} must be a string")
            if value:
                setattr(self.state, attr, value)
        log.info("init: %d env vars, token %s, default user %s", len(env_vars or {}),
                 "set" if self.state.access_token else "unset", self.state.default_user)
        await _send_response(send, 204)

    # -- /metrics ---------------------------------------------------------------------
    def _metrics(self) -> dict[str, Any]:
        mem: dict[str, int] = {}
        with contextlib.suppress(OSError), open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                parts = v.split()
                if parts:
                    mem[k] = int(parts[0]) * 1024
        total = mem.get("MemTotal", 0)
        avail = mem.get("MemAvailable", mem.get("MemFree", 0))
        cpu_pct = 0.0
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
            busy_total = (sum(fields), idle)
            if self._cpu_prev is not None:
                dt = busy_total[0] - self._cpu_prev[0]
                di = busy_total[1] - self._cpu_prev[1]
                if dt > 0:
                    cpu_pct = round(100.0 * (dt - di) / dt, 2)
            self._cpu_prev = busy_total
        try:
            vfs = os.statvfs("/")
            disk_total = vfs.f_blocks * vfs.f_frsize
            disk_used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        except OSError:
            disk_total = disk_used = 0
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": cpu_pct,
            "mem_total": total,
            "mem_used": max(0, total - avail),
            "mem_cache": mem.get("Cached", 0),
            "disk_used": disk_used,
            "disk_total": disk_total,
        }


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


def build_app(state: State):
    """The ASGI app with both Connect services mounted (imports the protos)."""
    from aenv_envd_protos.filesystem.filesystem_connect import FilesystemASGIApplication
    from aenv_envd_protos.process.process_connect import ProcessASGIApplication

    from .filesystem import FilesystemService
    from .process import ProcessService, Registry

    registry = Registry()
    userfs = UserFS()
    app = EnvdApp(state, ProcessASGIApplication(ProcessService(state, registry, userfs)),
                  FilesystemASGIApplication(FilesystemService(state, userfs)), userfs)
    app.registry = registry  # type: ignore[attr-defined]
    return app
