"""Sandbox traffic through the gateway: envd and port requests relayed to the owning node."""

from __future__ import annotations

import httpx
import websockets
from starlette.types import ASGIApp, Receive, Scope, Send

from ..envd.protocol import ENVD_PORT
from ..sandbox_api import NotFound
from ..web import (
    SANDBOX_ID_HEADER,
    SANDBOX_PORT_HEADER,
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
from ..web.routing import SandboxRouting
from .common import ClusterError
from .routing import Gateway


class GatewayProxy:
    """Sandbox traffic (HTTP streams and WebSockets) relayed to the node that owns the
    sandbox, as ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers (a Host-routed
    request is rewritten to them); the node's own proxy takes it from there, so
    every header it checks (access and traffic tokens) goes through untouched."""

    def __init__(self, app: ASGIApp, gateway: Gateway, domain: str) -> None:
        self.app = app
        self.gateway = gateway
        self.routing = SandboxRouting(domain)
        self._http = relay_client(
            httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def close(self) -> None:
        await self._http.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            target = (self.routing.target(scope) if scope["type"] in ("http", "websocket")
                      else None)
        except BadTarget as exc:
            await send_error(scope, send, 400, str(exc))
            return
        if target is None and scope["type"] == "http" and scope["path"] == "/files":
            query = (scope.get("query_string") or b"").decode("latin-1")
            if "signature=" in query:  # a signed URL names its sandbox by signature only
                operation = "read" if scope["method"] == "GET" else "write"
                sid = await self.gateway.signer(f"{query}&_operation={operation}")
                if sid is None:
                    await send_error(scope, send, 401, "the file URL's signature matches no "
                                     "running sandbox (or it is for the other operation)")
                    return
                target = (sid, ENVD_PORT)
        if target is None:
            await self.app(scope, receive, send)
            return
        sandbox_id, port = target
        scheme = "ws" if scope["type"] == "websocket" else "http"
        try:
            # Checked before the owner is looked up: a bad target costs no Redis call.
            upstream_url(scheme, "node", None, scope)
            _, node = await self.gateway.owner(sandbox_id)
        except BadTarget as exc:
            await send_error(scope, send, 400, str(exc))
            return
        except NotFound:
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} was not found")
            return
        except ClusterError as exc:
            await send_error(scope, send, 502, str(exc))
            return
        # The client's Host goes on to the node: its proxy hands it to the sandbox (E2B).
        host = client_host(scope)
        headers = forwarded_headers(scope)
        if host:
            headers.append((b"host", host.encode("latin-1")))
        headers += [(SANDBOX_ID_HEADER.encode(), sandbox_id.encode()),
                    (SANDBOX_PORT_HEADER.encode(), str(port).encode())]
        node_url = httpx.URL(node.url)
        url = upstream_url(scheme, node_url.host, node_url.port, scope)
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, url, headers, host)
            return
        try:
            await relay_http(self._http, scope, receive, send, url, headers,
                             f"node {node.node_id}")
        except httpx.HTTPError as exc:
            await send_error(scope, send, 502, f"node {node.node_id} did not answer: {exc}")

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, url: httpx.URL,
                         headers: list[tuple[bytes, bytes]], host: str | None) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        skip = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                "sec-websocket-protocol", "host"}
        extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                 if k.decode("latin-1").lower() not in skip]
        try:
            upstream = await connect_websocket(url, host, extra,
                                               subprotocols=scope.get("subprotocols") or None,
                                               open_timeout=10)
        except websockets.InvalidStatus as exc:
            await send({"type": "websocket.close", "code": 1011,
                        "reason": f"node refused: HTTP {exc.response.status_code}"})
            return
        except (OSError, websockets.InvalidHandshake, TimeoutError) as exc:
            await send({"type": "websocket.close", "code": 1011, "reason": str(exc)[:120]})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        await relay_websocket(receive, send, upstream)
