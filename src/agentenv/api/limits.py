"""Refuses oversized API bodies before they are read whole, and bodies that
arrive too slowly (a client trickling bytes would hold its request forever).

Only API routes are limited here; proxied sandbox traffic (file uploads) streams
through untouched.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """An HTTPException, so framework body parsing re-raises it as a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds {limit} bytes")


class BodyTooSlow(HTTPException):
    def __init__(self, seconds: float):
        super().__init__(408, f"request body not received within {seconds:.0f} seconds")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _too_large(send, self.max_bytes)
            return
        seen = 0
        response_started = False
        body_done = False
        deadline = (time.monotonic() + self.body_timeout) if self.body_timeout else None

        async def limited_receive() -> Message:
            nonlocal seen, body_done
            if deadline is None or body_done:
                message = await receive()
            else:
                # The whole body, not each chunk, has the deadline.
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        message = await receive()
                except TimeoutError:
                    raise BodyTooSlow(self.body_timeout or 0) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await _too_large(send, self.max_bytes)
        except BodyTooSlow as exc:
            if not response_started:
                await _refuse(send, 408, str(exc.detail))


async def _too_large(send: Send, limit: int) -> None:
    await _refuse(send, 413, f"request body exceeds {limit} bytes")


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps({"code": status, "message": message}).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body})
