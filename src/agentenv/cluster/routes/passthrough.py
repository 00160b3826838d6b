"""The gateway's health, and every route that is no sandbox's or run's: templates and
snapshots are the same on every node, but for a template's builds and own routes,
which go to the node it was created on."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request, Response

from ... import __version__
from ...web.errors import error_response
from ...web.keys import require_api_key
from ..common import ClusterError
from ..gateway_templates import home_node, remember
from . import relay, services

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    nodes = await services(request).registry.nodes()
    return {"status": "ok", "version": __version__,
            "nodes": {n.node_id: n.state for n in nodes}}


@router.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PATCH", "PUT"],
                  dependencies=[Depends(require_api_key)])
async def anywhere(path: str, request: Request) -> Response:
    """Everything else (templates, snapshots) is the same on every node, but for
    a template's builds and own routes: the node it was created on."""
    svc = services(request)
    home = await home_node(svc.registry, request.url.path)
    nodes = [home] if home else sorted(await svc.gw.up_nodes(), key=lambda n: n.effective_load)
    if not nodes:
        return error_response(503, "no node is up")
    try:
        r = await svc.gw.forward(request, nodes[0].url)
    except httpx.HTTPError as exc:
        raise ClusterError(502, f"node {nodes[0].node_id} did not answer: {exc}") from exc
    await remember(svc.registry, request.method, request.url.path, nodes[0], r)
    return relay(r)
