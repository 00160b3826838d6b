"""Reverse proxy from the node to ports inside sandboxes (HTTP, streaming, WebSocket).

A request is for a sandbox when it carries ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port``
headers, or when its Host is ``<port>-<sandboxID>.<domain>``. Everything else
goes on to the API. Bodies stream both ways; nothing is buffered whole.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable

import httpx
import websockets
from starlette.types import ASGIApp, Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect

from ..envd.protocol import ENVD_PORT
from ..orchestrator import Conflict, NotFound
from ..web import (
    DROP_REQUEST,
    BadTarget,
    forwarded_headers,
    relay_client,
    relay_http,
    relay_websocket,
    send_error,
    upstream_url,
)
from ..web.routing import SandboxRouting

log = logging.getLogger(__name__)

# Besides what no relay forwards: the credentials that are for the node, not the sandbox.
_DROP_REQUEST = DROP_REQUEST | {"x-api-key", "e2b-traffic-access-token"}

Resolver = Callable[[str, int], tuple[str, int]]
# A sandbox's traffic access token ("" when its ports are public).
TrafficToken = Callable[[str], str]
TRAFFIC_HEADER = "e2b-traffic-access-token"


class SandboxProxy:
    def __init__(self, app: ASGIApp, resolve: Resolver, domain: str,
                 traffic_token: TrafficToken | None = None):
        self.app = app
        self.resolve = resolve
        self.traffic_token = traffic_token
        self.routing = SandboxRouting(domain)
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
            address, port = self.resolve(sandbox_id, port)
        except NotFound:
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} was not found")
            return
        except Conflict as exc:
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} is not running: {exc}")
            return
        if not self._traffic_allowed(scope, sandbox_id, port):
            await send_error(scope, send, 403, f"sandbox {sandbox_id}: port {port} is private; "
                             f"send the sandbox's traffic access token in the {TRAFFIC_HEADER} "
                             "header")
            return
        try:
            url = upstream_url("ws" if scope["type"] == "websocket" else "http",
                               address, port, scope)
        except BadTarget as exc:
            await send_error(scope, send, 400, str(exc))
            return
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, url, port)
        else:
            await self._http(scope, receive, send, sandbox_id, url)

    def _traffic_allowed(self, scope: Scope, sandbox_id: str, port: int) -> bool:
        # envd checks its own access token; the traffic token is for user ports.
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
            client = relay_client()
            self._clients[sandbox_id] = client
        return client

    async def _http(self, scope: Scope, receive: Receive, send: Send,
                    sandbox_id: str, url: httpx.URL) -> None:
        headers = forwarded_headers(scope, _DROP_REQUEST)
        try:
            await relay_http(self._client(sandbox_id), scope, receive, send, url, headers,
                             f"sandbox {sandbox_id}")
        except httpx.ConnectError:
            await send_error(scope, send, 502,
                             f"The sandbox {sandbox_id} is running but port is not open: "
                             f"{url.port}")
        except httpx.HTTPError as exc:
            # Rare and worth seeing: the cause is in the exception's type.
            log.warning("proxy to port %s of %s failed: %r", url.port, sandbox_id, exc)
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} did not answer: {exc}")

    async def _websocket(self, scope: Scope, receive: Receive, send: Send,
                         url: httpx.URL, port: int) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        subprotocols = scope.get("subprotocols") or None
        try:
            upstream = await ws_connect(str(url), subprotocols=subprotocols, open_timeout=5,
                                        max_size=None, proxy=None)
        except (OSError, websockets.InvalidHandshake, TimeoutError):
            await send({"type": "websocket.close", "code": 1011,
                        "reason": f"port is not open: {port}"})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        await relay_websocket(receive, send, upstream)
