"""The scheduler's routes: nodes' heartbeats, the registry's nodes and sandboxes, and
placements (``placement.place`` over the nodes as Redis has them)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, Field

from ... import __version__, metrics
from ...web.keys import require_api_key
from ..beats import MAX_HEARTBEAT_BYTES, read_beat
from ..common import ClusterError, NodeStatus
from ..node_registry import Registry
from ..placement import PlacementRequest
from ..placer import Placer

log = logging.getLogger("agentenv.cluster.scheduler")
router = APIRouter()
auth = [Depends(require_api_key)]


class Placement(BaseModel):
    template: str = ""
    snapshot: str = ""
    runtime_kind: str = Field(default="", alias="runtimeKind")
    runtime_version: str = Field(default="", alias="runtimeVersion")
    exclude: list[str] = Field(default_factory=list)
    count: int = Field(default=1, ge=1, le=64)


def _registry(request: Request) -> Registry:
    return request.app.state.registry


def _public(node: NodeStatus) -> dict[str, Any]:
    body = node.to_dict()
    body.pop("sandboxes", None)
    return body


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    try:
        await _registry(request).ping()
    except Exception as exc:
        raise ClusterError(503, f"redis unreachable: {exc}") from exc
    return {"status": "ok", "version": __version__}


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes before it is read whole."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ClusterError(413, f"request body exceeds {limit} bytes")
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise ClusterError(413, f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post("/nodes/heartbeat", dependencies=auth)
async def heartbeat(request: Request) -> dict[str, Any]:
    registry = _registry(request)
    try:
        raw = json.loads(await _bounded_body(request, MAX_HEARTBEAT_BYTES))
    except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser
        raise ClusterError(400, f"invalid heartbeat: {exc}") from exc
    status, beat = read_beat(raw)
    applied = await registry.heartbeat(status, request.app.state.node_ttl_ms, beat)
    if applied.rejoined:
        log.info("node %s is up at %s (%d/%d sandboxes)", status.node_id, status.url,
                 status.load, status.capacity)
    # full: the node sends its next beat whole (a check); applied false: at once (the
    # registry lost track of its beats, or of the node).
    return {"disown": applied.disown, "full": applied.full, "applied": not applied.refused}


@router.get("/nodes", dependencies=auth)
async def nodes(request: Request, snapshot: str | None = None, state: str | None = None
                ) -> list[dict[str, Any]]:
    out = await _registry(request).nodes()
    if snapshot:
        out = [n for n in out if snapshot in n.snapshots]
    if state:
        out = [n for n in out if n.state == state]
    return [_public(n) for n in out]


@router.get("/nodes/{node_id}", dependencies=auth)
async def node(request: Request, node_id: str) -> dict[str, Any]:
    status = await _registry(request).node(node_id)
    if status is None:
        raise ClusterError(404, f"node '{node_id}' is not registered")
    return _public(status)


@router.delete("/nodes/{node_id}", status_code=204, dependencies=auth)
async def forget(request: Request, node_id: str) -> Response:
    await _registry(request).forget_node(node_id)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}", dependencies=auth)
async def sandbox(request: Request, sandbox_id: str) -> dict[str, Any]:
    registry = _registry(request)
    entry = await registry.sandbox(sandbox_id)
    if entry is None:
        raise ClusterError(404, f"sandbox '{sandbox_id}' is on no node")
    return {**entry, "committed": entry.get("committed") == "1",
            "nodeUp": await registry.is_up(entry["node"])}


@router.post("/placements", dependencies=auth)
async def placements(request: Request, body: Placement) -> dict[str, Any]:
    req = PlacementRequest(template=body.template, snapshot=body.snapshot,
                           runtime_kind=body.runtime_kind,
                           runtime_version=body.runtime_version,
                           exclude=body.exclude, count=body.count)
    placer: Placer = request.app.state.placer
    picks = await placer.place(req)
    metrics.PLACEMENTS.labels("placed" if picks else "refused").inc()
    if not picks:
        raise ClusterError(503, "no node can take the sandbox: every node is down, full "
                                "or of another runtime; retry later")
    return {"nodes": [{"nodeID": p.node_id, "url": p.url, "beat": beat}
                      for p, beat in picks]}
