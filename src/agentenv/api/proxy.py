"""Reverse proxy from the node to ports inside sandboxes (HTTP, streaming, WebSocket).

A request is for a sandbox when it carries ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port``
headers, or when its Host is ``<port>-<sandboxID>.<domain>``. Everything else
goes on to the API. Bodies stream both ways; nothing is buffered whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Callable

import httpx
import websockets
from starlette.types import ASGIApp, Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect

from ..orchestrator import Conflict, NotFound

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and the routing/auth headers the sandbox must not see.
_DROP_REQUEST = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "x-api-key", "e2b-traffic-access-token",
}
_DROP_RESPONSE = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length",
}

Resolver = Callable[[str, int], tuple[str, int]]
# A sandbox's traffic access token ("" when its ports are public).
TrafficToken = Callable[[str], str]
TRAFFIC_HEADER = "e2b-traffic-access-token"
ENVD_PORT = 49983  # envd checks its own access token; the traffic token is for user ports


class SandboxProxy:
    def __init__(self, app: ASGIApp, resolve: Resolver, domain: str,
                 traffic_token: TrafficToken | None = None):
        self.app = app
        self.resolve = resolve
        self.traffic_token = traffic_token
        self._host_re = re.compile(
            r"^(?P<port>\d{1,5})-(?P<sid>[a-z0-9]+)\." + re.escape(domain.lower()) + r"(:\d+)?$"
        )
        self._clients: dict[str, httpx.AsyncClient] = {}

    def forget(self, sandbox_id: str) -> None:
        """Drop pooled connections of a sandbox that is gone (its slot will be reused)."""
        client = self._clients.pop(sandbox_id, None)
        if client is not None:
            asyncio.get_running_loop().create_task(client.aclose())

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    def _target(self, scope: Scope) -> tuple[str, int] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        sid = headers.get("e2b-sandbox-id")
        if sid:
            port = headers.get("e2b-sandbox-port", "")
            return sid, int(port) if port.isdigit() else -1
        match = self._host_re.match(headers.get("host", "").lower())
        if match:
            return match["sid"], int(match["port"])
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        target = self._target(scope)
        if target is None:
            await self.app(scope, receive, send)
            return
        sandbox_id, port = target
        if not 0 < port < 65536:
            await _reply(scope, send, 400, f"invalid sandbox port for sandbox {sandbox_id}")
            return
        try:
            address, port = self.resolve(sandbox_id, port)
        except NotFound:
            await _reply(scope, send, 502, f"The sandbox {sandbox_id} was not found")
            return
        except Conflict as exc:
            await _reply(scope, send, 502, f"The sandbox {sandbox_id} is not running: {exc}")
            return
        if not self._traffic_allowed(scope, sandbox_id, port):
            await _reply(scope, send, 403, f"sandbox {sandbox_id}: port {port} is private; send "
                         f"the sandbox's traffic access token in the {TRAFFIC_HEADER} header")
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, sandbox_id, address, port)
        else:
            await self._http(scope, receive, send, sandbox_id, address, port)

    def _traffic_allowed(self, scope: Scope, sandbox_id: str, port: int) -> bool:
        if self.traffic_token is None or port == ENVD_PORT:
            return True
        try:
            expected = self.traffic_token(sandbox_id)
        except (NotFound, Conflict):
            return False
        if not expected:
            return True
        given = next((v for k, v in scope["headers"]
                      if k.decode("latin-1").lower() == TRAFFIC_HEADER), b"")
        return bool(given) and hmac.compare_digest(given, expected.encode())

    def _client(self, sandbox_id: str) -> httpx.AsyncClient:
        client = self._clients.get(sandbox_id)
        if client is None:
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=10.0),
                trust_env=False, follow_redirects=False,
            )
            self._clients[sandbox_id] = client
        return client

    async def _http(self, scope: Scope, receive: Receive, send: Send,
                    sandbox_id: str, address: str, port: int) -> None:
        url = _upstream_url("http", scope, address, port)
        headers = [
            (k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in _DROP_REQUEST
        ]
        headers.append((b"host", f"{address}:{port}".encode()))
        names = {k.lower() for k, _ in scope["headers"]}
        has_body = b"content-length" in names or b"transfer-encoding" in names
        client = self._client(sandbox_id)
        body_read = asyncio.Event()  # from then on, receive() only reports a hang-up
        if not has_body:
            body_read.set()
        request = client.build_request(
            scope["method"], url, headers=headers,
            content=_body(receive, body_read) if has_body else None,
        )
        try:
            upstream = await client.send(request, stream=True)
        except httpx.ConnectError:
            await _reply(scope, send, 502,
                         f"The sandbox {sandbox_id} is running but port is not open: {port}")
            return
        except httpx.HTTPError as exc:
            # Rare and worth seeing: the cause is in the exception's type.
            log.warning("proxy to port %d of %s failed: %r", port, sandbox_id, exc)
            await _reply(scope, send, 502, f"The sandbox {sandbox_id} did not answer: {exc}")
            return
        try:
            await send({
                "type": "http.response.start",
                "status": upstream.status_code,
                "headers": [(k, v) for k, v in upstream.headers.raw
                            if k.decode("latin-1").lower() not in _DROP_RESPONSE],
            })
            # A client that hangs up mid-stream closes the upstream request too, so
            # the sandbox sees it (e.g. a code execution the SDK gave up on stops).
            relay = asyncio.ensure_future(_relay(upstream, send))
            hangup = asyncio.ensure_future(_hung_up(receive, body_read))
            await asyncio.wait({relay, hangup}, return_when=asyncio.FIRST_COMPLETED)
            hangup.cancel()
            if not relay.done():
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
                return
            relay.result()
        except httpx.HTTPError as exc:
            # The response has started: all we can do is end it early.
            log.info("proxy stream from %s:%d ended early: %s", sandbox_id, port, exc)
        finally:
            await upstream.aclose()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send,
                         sandbox_id: str, address: str, port: int) -> None:
        url = _upstream_url("ws", scope, address, port)
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        subprotocols = scope.get("subprotocols") or None
        try:
            upstream = await ws_connect(url, subprotocols=subprotocols, open_timeout=5,
                                        max_size=None, proxy=None)
        except (OSError, websockets.InvalidHandshake, TimeoutError):
            await send({"type": "websocket.close", "code": 1011,
                        "reason": f"port is not open: {port}"})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        await relay_websocket(receive, send, upstream)


async def relay_websocket(receive: Receive, send: Send, upstream) -> None:
    """Carry an accepted client WebSocket and its upstream both ways until either ends."""

    async def client_to_upstream() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                await upstream.close()
                return
            if msg.get("bytes") is not None:
                await upstream.send(msg["bytes"])
            elif msg.get("text") is not None:
                await upstream.send(msg["text"])

    async def upstream_to_client() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in upstream:
                key = "bytes" if isinstance(data, bytes) else "text"
                await send({"type": "websocket.send", key: data})
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": upstream.close_code or 1000})

    tasks = [asyncio.create_task(client_to_upstream()),
             asyncio.create_task(upstream_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await upstream.close()


def _upstream_url(scheme: str, scope: Scope, address: str, port: int) -> str:
    """The request's own path and query, on the sandbox's address."""
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = scope.get("query_string") or b""
    return f"{scheme}://{address}:{port}{path}" + (f"?{query.decode('latin-1')}" if query else "")


async def _body(receive: Receive, done: asyncio.Event) -> AsyncIterator[bytes]:
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return
    finally:
        done.set()


async def _relay(upstream: httpx.Response, send: Send) -> None:
    async for chunk in upstream.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _hung_up(receive: Receive, body_read: asyncio.Event) -> None:
    """Returns once the client has gone away (waits for the body to be read first)."""
    await body_read.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(scope: Scope, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1011, "reason": message[:120]})
        return
    body = json.dumps({"code": status, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
