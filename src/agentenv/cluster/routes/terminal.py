"""The web console's terminal through the gateway: relayed to the sandbox's node, which
bridges it to the sandbox."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, WebSocket

from ...sandbox_api import NotFound
from ...web import connect_websocket, relay_websocket
from ...web.keys import key_matches
from ..common import ClusterError
from ..routing import SANDBOX_ID
from . import services

router = APIRouter()


@router.websocket("/ui/sandboxes/{sandbox_id}/terminal")
async def terminal(ws: WebSocket, sandbox_id: str) -> None:
    """The console's terminal, relayed to the sandbox's node (which bridges it)."""
    svc = services(ws)
    if not key_matches(ws.headers.get("x-api-key"), svc.api_key):
        await ws.close(code=4401, reason="log in at /ui/login first")
        return
    if not SANDBOX_ID.fullmatch(sandbox_id):
        await ws.close(code=4404, reason="not a sandbox ID")
        return
    try:
        _, node = await svc.gw.owner(sandbox_id)
        url = httpx.URL(node.url).copy_with(
            scheme="wss" if node.url.startswith("https") else "ws",
            path=f"/ui/sandboxes/{sandbox_id}/terminal", query=ws.url.query.encode())
        upstream = await connect_websocket(url, None, [("X-API-Key", svc.api_key)])
    except (ClusterError, NotFound) as exc:
        await ws.close(code=4404, reason=str(exc)[:120])
        return
    except Exception as exc:  # the node refused or did not answer
        await ws.close(code=1011, reason=f"the sandbox's node: {exc}"[:120])
        return
    await ws.accept()
    await relay_websocket(ws.receive, ws.send, upstream)
