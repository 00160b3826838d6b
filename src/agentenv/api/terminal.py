"""The web console's terminal: a WebSocket (``/ui/sandboxes/{id}/terminal``) bridged by
the node to a login shell on a PTY of envd's inside the sandbox.

Binary messages carry the keyboard's bytes in and the terminal's bytes out; a text
message ``{"type": "resize", "cols": c, "rows": r}`` resizes it. One shell per
socket: it is killed when the socket closes, and the socket closes when it ends.
Everything is bounded: message sizes, the size of the terminal, terminals at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from ..envd.protocol import ENVD_PORT
from ..orchestrator import OrchestratorError, SandboxManager
from ..orchestrator.envd_client import EnvdUnavailable
from ..web.keys import key_matches

router = APIRouter()
MAX_INPUT = 64 << 10  # one message of keystrokes (a paste)
MAX_CONTROL = 1024
MAX_COLS, MAX_ROWS = 500, 200
MAX_TERMINALS = 32  # on this node at once
_open: set[WebSocket] = set()


def _size(raw: Any, default: int, most: int) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        return default
    return min(max(value, 1), most)


def _authorized(ws: WebSocket) -> bool:
    given = ws.headers.get("x-api-key")
    keys = getattr(ws.app.state, "api_keys", None)
    return keys.matches(given) if keys is not None else key_matches(given, ws.app.state.api_key)


@router.websocket("/ui/sandboxes/{sandbox_id}/terminal")
async def terminal(ws: WebSocket, sandbox_id: str) -> None:
    if not _authorized(ws):  # the key, or a console session (web.console)
        await ws.close(code=4401, reason="log in at /ui/login first")
        return
    manager: SandboxManager = ws.app.state.manager
    try:
        address, _ = manager.endpoint(sandbox_id, ENVD_PORT)
        token = manager.get(sandbox_id).envd_token
    except OrchestratorError as exc:
        await ws.close(code=4404, reason=str(exc)[:120])
        return
    if len(_open) >= MAX_TERMINALS:
        await ws.close(code=4429, reason=f"{MAX_TERMINALS} terminals are open on this node")
        return
    cols = _size(ws.query_params.get("cols"), 80, MAX_COLS)
    rows = _size(ws.query_params.get("rows"), 24, MAX_ROWS)
    await ws.accept()
    _open.add(ws)
    try:
        async with manager.envd.pty(address, token, cols, rows) as (pid, output):
            await _bridge(ws, manager, address, token, pid, output)
    except (EnvdUnavailable, httpx.HTTPError) as exc:
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await ws.close(code=1011, reason=f"the sandbox's terminal failed: {exc}"[:120])
    finally:
        _open.discard(ws)


async def _bridge(ws: WebSocket, manager: SandboxManager, address: str, token: str,
                  pid: int, output: Any) -> None:
    async def out() -> None:
        async for data in output:
            await ws.send_bytes(data)
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await ws.close(code=1000, reason="the shell ended")

    async def into() -> None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data, text = message.get("bytes"), message.get("text")
            if data is not None:
                if len(data) > MAX_INPUT:
                    await ws.close(code=1009, reason=f"input over {MAX_INPUT} bytes")
                    return
                await manager.envd.pty_input(address, token, pid, data)
            elif text is not None:
                await _control(text)

    async def _control(text: str) -> None:
        if len(text) > MAX_CONTROL:
            return
        with contextlib.suppress(ValueError, AttributeError):
            msg = json.loads(text)
            if msg.get("type") == "resize":
                await manager.envd.pty_resize(
                    address, token, pid, _size(msg.get("cols"), 80, MAX_COLS),
                    _size(msg.get("rows"), 24, MAX_ROWS))

    tasks = [asyncio.create_task(out()), asyncio.create_task(into())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = task.exception()
            if exc is not None and not isinstance(exc, WebSocketDisconnect | RuntimeError):
                raise exc
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
