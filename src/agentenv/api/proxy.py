"""Reverse proxy from the node to ports inside sandboxes (HTTP, streaming, WebSocket).

A request is for a sandbox when it carries ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port``
headers, or when its Host is ``<port>-<sandboxID>.<domain>``. Everything else
goes on to the API. Bodies stream both ways; nothing is buffered whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import time
from typing import Protocol

import httpx
import websockets
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..envd.protocol import ENVD_PORT, SANDBOX_KEEPALIVE_S
from ..errors import AgentenvError
from ..metrics import FIRST_COMMAND
from ..orchestrator import Conflict, NotFound, SandboxRecord, SandboxState
from ..web import (
    DROP_REQUEST,
    BadTarget,
    client_host,
    connect_websocket,
    forwarded_headers,
    relay_client,
    relay_http,
    relay_websocket,
    send_error,
    upstream_url,
)
from ..web.console import without_session
from ..web.hosts import upstream_host
from ..web.routing import SandboxRouting
from . import envd_gate

log = logging.getLogger(__name__)
# envd's Connect route that starts a command (the e2b SDK's commands.run).
START_PATH = "/process.Process/Start"

# Besides what no relay forwards: the credentials that are for the node, not the sandbox.
_DROP_REQUEST = DROP_REQUEST | {"x-api-key", "e2b-traffic-access-token"}

TRAFFIC_HEADER = "e2b-traffic-access-token"
ENVD_TOKEN_HEADER = "x-access-token"
SANDBOX_CONNECT_S = 20.0  # connecting to a sandbox port (the relay's default is 5 s)


class Sandboxes(Protocol):
    """What the proxy asks of the node's sandbox manager."""

    def get(self, sandbox_id: str) -> SandboxRecord: ...

    def endpoint(self, sandbox_id: str, port: int) -> tuple[str, int]: ...

    async def ensure_running(self, sandbox_id: str) -> SandboxRecord: ...

    def awake(self, sandbox_id: str) -> contextlib.AbstractContextManager[None]: ...


class SandboxProxy:
    def __init__(self, app: ASGIApp, sandboxes: Sandboxes, domain: str):
        self.app = app
        self.sandboxes = sandboxes
        self.routing = SandboxRouting(domain)
        self._clients: dict[str, httpx.AsyncClient] = {}
        # Requests in flight on each pooled client (a client closes once it has none).
        self._in_flight: dict[httpx.AsyncClient, int] = {}
        # Sandboxes whose first command has been timed (aenv_first_command_seconds).
        self._commanded: set[str] = set()

    def forget(self, sandbox_id: str) -> None:
        """Drop pooled connections of a sandbox that is gone (its slot will be reused)."""
        self._commanded.discard(sandbox_id)
        client = self._clients.pop(sandbox_id, None)
        if client is not None:
            asyncio.get_running_loop().create_task(client.aclose())

    async def release_idle(self, sandbox_id: str) -> None:
        """Close the idle connections kept to a sandbox before its state is captured.

        A capture holds the sandbox side of every open connection; a copy restored
        from it (a fork, a snapshot's sandbox, a resume in another slot) holds them
        half-open to a peer that is not there, and under gVisor such a copy's server
        was seen to stop accepting connections (the code-interpreter's, 1 restore in
        3). Requests still in flight keep their client until they end.
        """
        client = self._clients.pop(sandbox_id, None)
        if client is not None and not self._in_flight.get(client):
            await client.aclose()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            target = self.routing.target(scope)
        except BadTarget as exc:
            await send_error(scope, send, 400, str(exc))
            return
        if target is None:
            await self.app(scope, receive, send)
            return
        sandbox_id, port = target
        try:
            record = self.sandboxes.get(sandbox_id)
        except NotFound:
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} was not found",
                             sandbox_id)
            return
        if not self._traffic_allowed(scope, record, port):
            await send_error(scope, send, 403, f"sandbox {sandbox_id}: port {port} is private; "
                             f"send the sandbox's traffic access token in the {TRAFFIC_HEADER} "
                             "header", sandbox_id)
            return
        # Only a request envd could accept may thaw or wake it (envd_gate.py).
        if port == ENVD_PORT and record.state is SandboxState.RUNNING and \
                not envd_gate.may_wake(scope, record):
            await envd_gate.answer_without_waking(scope, send, record)
            return
        if record.state is SandboxState.PAUSED and not await self._resumed(
                scope, send, record, port):
            return
        try:
            address, port = self.sandboxes.endpoint(sandbox_id, port)
        except NotFound:
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} was not found",
                             sandbox_id)
            return
        except Conflict as exc:
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} is not running: {exc}",
                             sandbox_id)
            return
        # The console's session is the node's, like the key: never the sandbox's.
        scope = {**scope, "headers": without_session(scope["headers"])}
        try:
            url = upstream_url("ws" if scope["type"] == "websocket" else "http",
                               address, port, scope)
        except BadTarget as exc:
            await send_error(scope, send, 400, str(exc))
            return
        host, forwarded = upstream_host(client_host(scope), record.mask_request_host, port,
                                        ENVD_PORT)
        # A frozen idle sandbox is thawed, and stays so while the request or stream lasts.
        with self.sandboxes.awake(sandbox_id):
            await self._relay(scope, receive, send, record, sandbox_id, url, port, host,
                              forwarded)

    async def _relay(self, scope: Scope, receive: Receive, send: Send, record: SandboxRecord,
                     sandbox_id: str, url: httpx.URL, port: int, host: str | None,
                     forwarded: str | None) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, url, port, host,
                                  [("X-Forwarded-Host", forwarded)] if forwarded else [])
        else:
            headers = forwarded_headers(scope, _DROP_REQUEST | (
                {"x-forwarded-host"} if record.mask_request_host else set()))
            if host:
                headers.append((b"host", host.encode("latin-1")))
            if forwarded:
                headers.append((b"x-forwarded-host", forwarded.encode("latin-1")))
            if port == ENVD_PORT and scope.get("path") == START_PATH \
                    and sandbox_id not in self._commanded:
                send = self._first_command(sandbox_id, send)
            await self._http(scope, receive, send, sandbox_id, url, headers)

    def _first_command(self, sandbox_id: str, send: Send) -> Send:
        """``send`` that times a sandbox's first command until envd answered its start."""
        t0 = time.perf_counter()

        async def timing(message: Message) -> None:
            if message["type"] == "http.response.start" and sandbox_id not in self._commanded:
                self._commanded.add(sandbox_id)
                if message["status"] == 200:
                    FIRST_COMMAND.observe(time.perf_counter() - t0)
            await send(message)

        return timing

    async def _resumed(self, scope: Scope, send: Send, record: SandboxRecord, port: int
                       ) -> bool:
        """A paused sandbox: resumed when created with auto-resume (E2B's resume on
        traffic; envd's port needs envd's token for that), else the answer E2B's proxy
        gives for a sandbox it cannot reach (502, not found). False: answered."""
        sid = record.sandbox_id
        if not record.auto_resume:
            await send_error(scope, send, 502, f"The sandbox {sid} was not found: it is paused "
                             "(resume it, or create it with lifecycle auto_resume)", sid)
            return False
        if port == ENVD_PORT and not _header_matches(scope, ENVD_TOKEN_HEADER,
                                                     record.envd_token):
            await send_error(scope, send, 403, "This sandbox can't be resumed with the "
                             "credentials provided. Check your access token and try again.", sid)
            return False
        try:
            await self.sandboxes.ensure_running(sid)
        except NotFound as exc:  # killed meanwhile, or its snapshot is gone
            try:
                self.sandboxes.get(sid)
            except NotFound:
                await send_error(scope, send, 502, f"The sandbox {sid} was not found", sid)
                return False
            await send_error(scope, send, 502,
                             f"The sandbox {sid} is paused and could not be resumed: {exc}", sid)
            return False
        except Conflict as exc:
            await send_error(scope, send, 502, f"The sandbox {sid} is not running: {exc}", sid)
            return False
        except AgentenvError as exc:
            status = exc.status if exc.status in (429, 503, 507) else 502
            await send_error(scope, send, status,
                             f"The sandbox {sid} is paused and could not be resumed: {exc}", sid,
                             getattr(exc, "headers", None))  # a 429's Retry-After
            return False
        except Exception as exc:  # the node goes on serving; the cause goes to the log
            log.exception("resume of %s on traffic failed", sid)
            await send_error(scope, send, 502,
                             f"The sandbox {sid} is paused and could not be resumed: {exc}", sid)
            return False
        return True

    def _killed(self, sandbox_id: str) -> bool:
        """The sandbox is gone or being killed (the SDK's /health probe after a cut
        stream must read "was not found" to say the sandbox was killed)."""
        try:
            self.sandboxes.endpoint(sandbox_id, ENVD_PORT)
        except NotFound:
            return True
        except Conflict:
            return False
        return False

    def _traffic_allowed(self, scope: Scope, record: SandboxRecord, port: int) -> bool:
        # envd checks its own access token; the traffic token is for user ports.
        if port == ENVD_PORT or not record.traffic_token:
            return True
        return _header_matches(scope, TRAFFIC_HEADER, record.traffic_token)

    def _client(self, sandbox_id: str) -> httpx.AsyncClient:
        client = self._clients.get(sandbox_id)
        if client is None:
            # A closed port answers at once (a reset); a sandbox just thawed on a
            # saturated host may take seconds to answer its first SYN.
            client = relay_client(httpx.Limits(keepalive_expiry=SANDBOX_KEEPALIVE_S),
                                  connect_s=SANDBOX_CONNECT_S)
            self._clients[sandbox_id] = client
        return client

    async def _http(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str,
                    url: httpx.URL, headers: list[tuple[bytes, bytes]]) -> None:
        client = self._client(sandbox_id)
        self._in_flight[client] = self._in_flight.get(client, 0) + 1
        try:
            await relay_http(client, scope, receive, send, url, headers,
                             f"sandbox {sandbox_id}")
        except httpx.HTTPError as exc:
            if self._killed(sandbox_id):  # cut by a kill: say so, as for any later request
                await send_error(scope, send, 502, f"The sandbox {sandbox_id} was not found",
                                 sandbox_id)
                return
            if isinstance(exc, httpx.ConnectError):
                # Usually nothing listens; the cause (refused, unreachable, reset) says
                # when it is the network instead (a forked child was seen answering,
                # then refusing under load: tests/test_fork.py).
                log.info("proxy to port %s of %s at %s: %s", url.port, sandbox_id, url.host,
                         connect_cause(exc))
                await send_error(scope, send, 502, f"The sandbox {sandbox_id} is running but "
                                                   f"port is not open: {url.port}")
                return
            # Rare and worth seeing: the cause is in the exception's type.
            log.warning("proxy to port %s of %s failed: %r", url.port, sandbox_id, exc)
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} did not answer: "
                                               f"{type(exc).__name__} {exc}".rstrip())
        finally:
            left = self._in_flight.pop(client) - 1
            if left:
                self._in_flight[client] = left
            elif self._clients.get(sandbox_id) is not client:  # released or forgotten
                await client.aclose()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send,
                         url: httpx.URL, port: int, host: str | None,
                         headers: list[tuple[str, str]]) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        subprotocols = scope.get("subprotocols") or None
        try:
            upstream = await connect_websocket(url, host, headers, subprotocols=subprotocols,
                                               open_timeout=5)
        except (OSError, websockets.InvalidHandshake, TimeoutError):
            await send({"type": "websocket.close", "code": 1011,
                        "reason": f"port is not open: {port}"})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        await relay_websocket(receive, send, upstream)


def connect_cause(exc: BaseException) -> str:
    """What a failed connect met, from the innermost OSError under ``exc`` (httpx wraps
    anyio's "All connection attempts failed", which wraps the socket's own error):
    "ECONNREFUSED (...)", "EHOSTUNREACH (...)", ..., else the exception's repr."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return f"{errno.errorcode.get(err.errno, err.errno)} ({err.strerror})"
        if isinstance(err, BaseExceptionGroup):
            todo.extend(err.exceptions)
        todo.extend(e for e in (err.__cause__, err.__context__) if e is not None)
    return repr(exc)


def _header_matches(scope: Scope, name: str, expected: str) -> bool:
    given = next((v for k, v in scope["headers"] if k.decode("latin-1").lower() == name), b"")
    return bool(given) and bool(expected) and hmac.compare_digest(given, expected.encode())
