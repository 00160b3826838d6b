"""envd's ASGI application: Connect RPC services plus E2B's plain HTTP endpoints.

A bare ASGI callable (no framework) to keep envd's memory small:
  GET /health, GET|POST /files, POST /init, GET /envs, GET /metrics,
  GET /aenv/dormancy (dormancy.py: how often envd slept, for how long), POST
  /aenv/dormancy (the node asks envd to sleep: 202, or 409 with why not), GET|POST
  /aenv/layer (files layers of filesystem resets, layers.py), and the
  ``process.Process`` / ``filesystem.Filesystem`` Connect services.
Every request except /health needs ``X-Access-Token`` once a token is set
(/files also accepts E2B's signed-URL parameters instead). This module routes
requests and answers /health, /init, /envs and /metrics; /files is files_http's,
/aenv/fs/* (filesystem-only pauses) disk_capture's, /aenv/commands (durable
commands) durable's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from typing import Any
from urllib.parse import parse_qsl

from .asgi import HTTPError, header, read_small_body, send_error, send_json, send_response
from .bootid import canonical, set_boot_id
from .disk_capture import PREFIX as DISK_PREFIX
from .disk_capture import DiskCapture
from .durable import PREFIX as COMMANDS_PREFIX
from .durable import CommandsEndpoint, DurableBook
from .files_http import FilesEndpoint
from .layers import LAYERS, LayerError
from .state import FILE_ACCESS_MODES, State
from .userfs import UserFS

log = logging.getLogger("agentenv.envd")

PROCESS_PREFIX = "/process.Process/"
FILESYSTEM_PREFIX = "/filesystem.Filesystem/"
DORMANCY_PATH = "/aenv/dormancy"
LAYER_PATH = "/aenv/layer"
SERVER_STREAMS = frozenset({"/filesystem.Filesystem/WatchDir", "/process.Process/Start",
                            "/process.Process/Connect"})


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


class EnvdApp:
    """The ASGI callable: authenticates and routes every request."""

    def __init__(self, state: State, process_app, filesystem_app,
                 userfs: UserFS | None = None, durable: DurableBook | None = None) -> None:
        self.state = state
        self.process_app = process_app
        self.filesystem_app = filesystem_app
        self.userfs = userfs or UserFS()
        self.files = FilesEndpoint(state, self.userfs)
        self.disk = DiskCapture()
        self.commands = CommandsEndpoint(durable or DurableBook())
        self._cpu_prev: tuple[int, int] | None = None
        self.registry: Any = None  # running.Registry (build_app)
        # Dormancy (dormancy.py): the delay, and the wakes and sleep this boot so far.
        self.dormant_after_s = 0.0
        self.wakes = 0
        self.dormant_s = 0.0
        self.dormancy: Any = None  # the watch (dormancy.Dormancy), when envd can sleep

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
            await send_response(send, 204)
            return
        authed = self.state.token_ok(header(scope, b"x-access-token"))
        if path.startswith(PROCESS_PREFIX) or path.startswith(FILESYSTEM_PREFIX):
            if not authed:
                await send_json(send, 401, {"code": "unauthenticated",
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
                if not authed and not self.files.signature_ok(
                        query, "read" if method == "GET" else "write"):
                    raise HTTPError(401, "invalid or missing access token or signature")
                if method == "GET":
                    await self.files.download(scope, query, send)
                else:
                    await self.files.upload(scope, query, receive, send, signed=not authed)
                return
            if not authed:
                raise HTTPError(401, "invalid or missing access token")
            if path.startswith(DISK_PREFIX):
                await self.disk(scope, receive, send)
            elif path == COMMANDS_PREFIX or path.startswith(COMMANDS_PREFIX + "/"):
                await self.commands(method, path, query, send)
            elif path == "/init" and method == "POST":
                await self._init(receive, send)
            elif path == "/envs" and method == "GET":
                await send_json(send, 200, self.state.env_vars)
            elif path == "/metrics" and method == "GET":
                await send_json(send, 200, self._metrics())
            elif path == DORMANCY_PATH and method == "GET":
                await send_json(send, 200, {"dormantAfterS": self.dormant_after_s,
                                            "wakes": self.wakes,
                                            "dormantS": round(self.dormant_s, 1)})
            elif path == DORMANCY_PATH and method == "POST":
                await self._ask_dormancy(send)
            elif path == LAYER_PATH and method == "GET":
                await send_json(send, 200, LAYERS.describe())
            elif path == LAYER_PATH and method == "POST":
                await self._layer(receive, send)
            else:
                raise HTTPError(404, f"{method} {path} not found")
        except HTTPError as e:
            await send_error(send, e.status, e.message)

    async def _ask_dormancy(self, send) -> None:
        """The node needs this envd's memory: sleep once idle (dormancy.Dormancy.ask)."""
        if self.dormancy is None:
            raise HTTPError(501, "envd cannot go dormant here (no stub, or not init)")
        why = self.dormancy.ask()
        if why is not None:
            raise HTTPError(409, f"envd stays awake: {why}")
        await send_json(send, 202, {"dormant": "soon"})

    # -- /aenv/layer (layers.py) -------------------------------------------------------
    async def _layer(self, receive, send) -> None:
        """``{"op": "push" | "reset", "tag": snapshot ID}``: a files layer pushed over
        the files as they are, or the one tagged reset (its processes killed)."""
        raw = await read_small_body(receive, 4096)
        try:
            body = json.loads(raw)
        except ValueError:
            raise HTTPError(400, "body is not valid JSON") from None
        if not isinstance(body, dict) or body.get("op") not in ("push", "reset"):
            raise HTTPError(400, 'body must be {"op": "push" or "reset", "tag": ...}')
        tag = body.get("tag")
        if not isinstance(tag, str):
            raise HTTPError(400, "tag must be a string (a snapshot ID)")
        try:
            if body["op"] == "push":
                done = await LAYERS.push(tag, self.userfs)
            else:
                done = await LAYERS.reset(tag, self.userfs, self.registry.reap)
        except LayerError as e:
            raise HTTPError(e.status, str(e)) from None
        except OSError as e:
            raise HTTPError(500, f"files layer: {e}") from None
        await send_json(send, 200, done)

    # -- /init ------------------------------------------------------------------------
    async def _init(self, receive, send) -> None:
        raw = await read_small_body(receive)
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise HTTPError(400, "body is not valid JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "body must be a JSON object")
        # A new boot (a created sandbox) names its boot ID; a fork or a resume none.
        boot_id = body.get("bootID")
        if boot_id is not None:
            try:
                boot_id = canonical(boot_id)
            except ValueError as e:
                raise HTTPError(400, str(e)) from None
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
        access = body.get("fileAccess")
        if access is not None:
            if access not in FILE_ACCESS_MODES:
                raise HTTPError(400, f"fileAccess must be one of {', '.join(FILE_ACCESS_MODES)}")
            self.state.file_access = access
        if boot_id is not None:
            try:
                set_boot_id(boot_id)
            except OSError as e:
                log.warning("init: boot ID not set: %s", e)
        log.info("init: %d env vars, token %s, default user %s, file access %s",
                 len(env_vars or {}), "set" if self.state.access_token else "unset",
                 self.state.default_user, self.state.file_access)
        await send_response(send, 204)

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


def build_app(state: State):
    """The ASGI app with both Connect services mounted (imports the protos)."""
    from aenv_envd_protos.filesystem.filesystem_connect import FilesystemASGIApplication
    from aenv_envd_protos.process.process_connect import ProcessASGIApplication

    from .filesystem import FilesystemService
    from .process import ProcessService
    from .running import Registry

    registry = Registry()
    userfs = UserFS()
    files = FilesystemService(state, userfs)
    app = EnvdApp(state, ProcessASGIApplication(ProcessService(state, registry, userfs)),
                  FilesystemASGIApplication(files), userfs, registry.durable)
    app.registry = registry
    app.filesystem_service = files  # type: ignore[attr-defined]
    return app
