"""Small ASGI building blocks for envd's plain HTTP endpoints (no framework, to keep
envd's memory small): an error that becomes a JSON reply, response senders, request
body readers and a header lookup."""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_BODY = 1 << 20


class HTTPError(Exception):
    """Ends a request with this status and a JSON ``{code, message}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def send_response(send, status: int, body: bytes = b"",
                        content_type: str | None = None,
                        extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type:
        headers.append((b"content-type", content_type.encode()))
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, obj: Any) -> None:
    await send_response(send, status, json.dumps(obj).encode(), "application/json")


async def send_error(send, status: int, message: str) -> None:
    await send_json(send, status, {"code": status, "message": message})


async def body_chunks(receive):
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected")
        chunk = msg.get("body", b"")
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            return


async def read_small_body(receive, limit: int = MAX_JSON_BODY) -> bytes:
    buf = bytearray()
    async for chunk in body_chunks(receive):
        buf += chunk
        if len(buf) > limit:
            raise HTTPError(413, "request body too large")
    return bytes(buf)


def header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None
