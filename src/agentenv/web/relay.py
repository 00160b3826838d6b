"""Relaying one HTTP request or WebSocket to an upstream: the node's sandbox proxy and
the gateway's proxy both use this, so the rules that keep a relay safe live once.

Safety rules:
- The upstream URL is built from parts (scheme, host, port, the request's own
  path and query as bytes); the client's request-target never becomes part of the
  authority. A target that is not origin-form (``/path?query``) is refused: before
  this rule, ``GET @127.0.0.1:18081/x`` turned a sandbox address into userinfo and
  the node fetched from its own loopback.
- Hop-by-hop headers (RFC 9110 7.6.1) and the routing headers are never forwarded:
  a request sent on to the node's own address must not be routed again. The
  client's ``Host`` is not copied along with the rest; a proxy sets the Host the
  upstream sees explicitly (``web.hosts``: E2B passes the client's own on).
- Bodies stream both ways; nothing is buffered whole. A client that hangs up
  mid-response closes the upstream request too.
- An upstream that dies mid-response (a sandbox killed while a command streams)
  ends a Connect stream with an end-of-stream error frame (``unavailable``) and a
  well-formed body, so the SDK reads an error it maps, not a chunk cut short. Any
  other body is cut off, so the client cannot take it for complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import ssl
from collections.abc import AsyncIterator, Iterable

import httpx
import websockets
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

log = logging.getLogger(__name__)

SANDBOX_ID_HEADER = "e2b-sandbox-id"
SANDBOX_PORT_HEADER = "e2b-sandbox-port"
ROUTING_HEADERS = frozenset({SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER})

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade",
})
# What a relay never passes on to its upstream: the hop's own headers, the client's
# Host (the upstream's is set from the URL) and the routing headers.
DROP_REQUEST = HOP_BY_HOP | ROUTING_HEADERS | {"host"}
# Content-Length is dropped too: the relayed body is streamed (chunked) again.
DROP_RESPONSE = HOP_BY_HOP | {"content-length"}


class BadTarget(ValueError):
    """The request-target cannot be relayed (not origin-form)."""


def origin_form(scope: Scope) -> bytes:
    """The request's path and query exactly as the client sent them, as bytes.

    Only origin-form targets (``/path`` with an optional ``?query``) are relayed;
    absolute-form (``http://host/x``), authority-form and ``*`` are refused.
    """
    raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
    if not raw_path.startswith(b"/") or any(c < 0x21 or c == 0x7F for c in raw_path):
        raise BadTarget("the request-target must be a path starting with '/'")
    query = scope.get("query_string") or b""
    return raw_path + b"?" + query if query else raw_path


def upstream_url(scheme: str, host: str, port: int | None, scope: Scope) -> httpx.URL:
    """The upstream URL for this request, built from parts (never a string join)."""
    try:
        return httpx.URL(scheme=scheme, host=host, port=port, raw_path=origin_form(scope))
    except httpx.InvalidURL as exc:  # e.g. a '#' in the path
        raise BadTarget(f"the request-target is not a valid path: {exc}") from None


@functools.cache
def shared_tls() -> ssl.SSLContext:
    """One verifying TLS context for every client the servers make. httpx builds a new
    one per client unless given one, loading the CA bundle: about 35 ms of CPU on the
    event loop for each sandbox's first proxied request (16 at once after a fork)."""
    return httpx.create_ssl_context()


def relay_client(limits: httpx.Limits | None = None, connect_s: float = 5.0
                 ) -> httpx.AsyncClient:
    """A client for relaying: no proxy from the environment, no redirects followed, and
    none of httpx's own default headers (User-Agent, Accept, ...): the upstream sees
    the client's headers only."""
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(connect=connect_s, read=None, write=None, pool=10.0),
        limits=limits or httpx.Limits(), trust_env=False, follow_redirects=False,
        verify=shared_tls(),
    )
    client.headers.clear()
    return client


def forwarded_headers(scope: Scope, drop: Iterable[str] = DROP_REQUEST
                      ) -> list[tuple[bytes, bytes]]:
    """The client's headers less those a relay must not pass on."""
    dropped = frozenset(drop)
    return [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in dropped]


def has_body(scope: Scope) -> bool:
    names = {k.lower() for k, _ in scope["headers"]}
    return b"content-length" in names or b"transfer-encoding" in names


async def request_body(receive: Receive, done: asyncio.Event) -> AsyncIterator[bytes]:
    """The client's request body as it arrives; ``done`` is set once it has been read."""
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


class ConnectFrames:
    """Where a relayed Connect stream's envelopes (flags byte, 4-byte length, message)
    begin and end, so an upstream that dies can be followed by an end-of-stream frame.

    Only whole envelopes are passed on; the part of one still arriving is held back,
    up to ``HOLD`` bytes (a bigger one streams on, and the stream is then known to be
    mid-envelope until it is through)."""

    HOLD = 1 << 20
    END_STREAM = 0x02

    def __init__(self) -> None:
        self.pending = bytearray()
        self.passing = 0  # bytes of a big envelope still to pass on unheld
        self.ended = False  # the upstream's own end-of-stream frame went by

    def feed(self, chunk: bytes) -> bytes:
        """What of the upstream's bytes so far can go on to the client now."""
        out = bytearray()
        view = memoryview(chunk)
        if self.passing:
            n = min(self.passing, len(view))
            out += view[:n]
            view = view[n:]
            self.passing -= n
        self.pending += view
        pos = 0
        while len(self.pending) - pos >= 5:
            size = 5 + int.from_bytes(self.pending[pos + 1:pos + 5], "big")
            if len(self.pending) - pos < size:
                break
            self.ended |= bool(self.pending[pos] & self.END_STREAM)
            pos += size
        out += self.pending[:pos]
        del self.pending[:pos]
        if len(self.pending) > self.HOLD:
            self.ended |= bool(self.pending[0] & self.END_STREAM)
            self.passing = 5 + int.from_bytes(self.pending[1:5], "big") - len(self.pending)
            out += self.pending
            self.pending.clear()
        return bytes(out)

    def end_with_error(self, code: str, message: str) -> bytes | None:
        """The end-of-stream frame carrying the error, or None when the stream cannot
        take one (ended already, or cut inside an envelope already passed on)."""
        if self.ended or self.passing:
            return None
        self.pending.clear()  # a partial envelope, never passed on
        self.ended = True
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        return bytes([self.END_STREAM]) + len(body).to_bytes(4, "big") + body


def is_connect_stream(content_type: str) -> bool:
    """A Connect streaming response (``application/connect+json``, ``+proto``)."""
    return content_type.strip().lower().startswith("application/connect+")


async def send_response_body(upstream: httpx.Response, send: Send,
                             frames: ConnectFrames | None = None) -> None:
    async for chunk in upstream.aiter_raw():
        if frames is not None:
            chunk = frames.feed(chunk)
            if not chunk:
                continue
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def client_gone(receive: Receive, body_read: asyncio.Event) -> None:
    """Returns once the client has gone away (waits for the body to be read first)."""
    await body_read.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


def client_host(scope: Scope) -> str | None:
    """The request's Host header, as sent."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"),
                None)


async def send_error(scope: Scope, send: Send, status: int, message: str,
                     sandbox_id: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """An error as the API shapes it (``{"code", "message"}``, and ``sandboxId`` as E2B's
    proxy adds it when one is named); a WebSocket is closed."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1011, "reason": message[:120]})
        return
    error: dict[str, object] = {"code": status, "message": message}
    if sandbox_id is not None:
        error["sandboxId"] = sandbox_id
    body = json.dumps(error).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            *((k.encode("latin-1"), v.encode("latin-1"))
                              for k, v in (headers or {}).items())]})
    await send({"type": "http.response.body", "body": body})


async def relay_http(client: httpx.AsyncClient, scope: Scope, receive: Receive, send: Send,
                     url: httpx.URL, headers: list[tuple[bytes, bytes]],
                     upstream_name: str = "the upstream") -> None:
    """Send the request upstream and stream the answer back. Errors before the answer
    starts raise ``httpx.HTTPError`` for the caller to word; after, the answer ends
    early: a Connect stream with an ``unavailable`` error naming ``upstream_name``
    (the SDKs then probe the sandbox's health to tell killed from unreachable), any
    other body cut off."""
    body_read = asyncio.Event()  # from then on, receive() only reports a hang-up
    streamed = has_body(scope)
    if not streamed:
        body_read.set()
    request = client.build_request(
        scope["method"], url, headers=headers,
        content=request_body(receive, body_read) if streamed else None,
    )
    upstream = await client.send(request, stream=True)
    frames = ConnectFrames() if is_connect_stream(
        upstream.headers.get("content-type", "")) else None
    try:
        await send({
            "type": "http.response.start",
            "status": upstream.status_code,
            "headers": [(k, v) for k, v in upstream.headers.raw
                        if k.decode("latin-1").lower() not in DROP_RESPONSE],
        })
        # A client that hangs up mid-stream closes the upstream request too, so the
        # upstream sees it (e.g. a code execution the SDK gave up on stops).
        relay = asyncio.ensure_future(send_response_body(upstream, send, frames))
        hangup = asyncio.ensure_future(client_gone(receive, body_read))
        await asyncio.wait({relay, hangup}, return_when=asyncio.FIRST_COMPLETED)
        hangup.cancel()
        if not relay.done():
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay
            return
        relay.result()
    except httpx.HTTPError as exc:
        # The response has started: all that can be done is to end it early.
        log.info("relay from %s ended early: %s", url.host, exc)
        frame = frames.end_with_error(
            "unavailable", f"the connection to {upstream_name} ended before the stream "
                           "completed") if frames is not None else None
        if frame is not None:
            await send({"type": "http.response.body", "body": frame, "more_body": False})
    finally:
        await upstream.aclose()


# What a Host header may hold to become a WebSocket URI's authority (no userinfo, path).
_WS_HOST = re.compile(r"[A-Za-z0-9._~-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


async def connect_websocket(url: httpx.URL, host: str | None,
                            headers: Iterable[tuple[str, str]] = (),
                            subprotocols: list[str] | None = None,
                            open_timeout: float = 10) -> ClientConnection:
    """Open the upstream WebSocket at ``url`` with ``host`` as its Host header: the
    handshake's URI names ``host`` while the connection dials ``url``'s address."""
    uri = str(url)
    if host and _WS_HOST.fullmatch(host):
        authority = f"{url.scheme}://{url.netloc.decode('ascii')}"
        uri = f"{url.scheme}://{host}{uri[len(authority):]}"
    port = url.port or (443 if url.scheme == "wss" else 80)
    return await ws_connect(uri, host=url.host, port=port, additional_headers=list(headers),
                            subprotocols=subprotocols,  # type: ignore[arg-type]
                            open_timeout=open_timeout, max_size=None, proxy=None)


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
