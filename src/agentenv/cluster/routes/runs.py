"""The gateway's run routes: a run is made on the least loaded node, and everything of
it goes to that node (``GatewayRuns`` finds it)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request, Response

from ...sandbox_api import NotFound
from ...web.keys import require_api_key
from ..common import ClusterError, NodeStatus
from ..routing import error_message
from . import relay, services

log = logging.getLogger("agentenv.cluster.gateway_runs")
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/runs")
async def create_run(request: Request) -> Response:
    svc = services(request)
    nodes = sorted(await svc.gw.up_nodes(), key=lambda n: n.effective_load)
    if not nodes:
        raise ClusterError(503, "no node is up")
    r = await svc.runs.forward(request, nodes[0])
    if r.status_code == 201:
        await svc.registry.set_run(r.json()["runID"], nodes[0].node_id)
    return relay(r)


@router.get("/runs")
async def list_runs(request: Request) -> list[dict[str, Any]]:
    gw = services(request).gw

    async def one(node: NodeStatus) -> list[dict[str, Any]]:
        try:
            r = await gw.forward(request, node.url, body=b"")
        except httpx.HTTPError as exc:
            log.warning("listing runs of node %s failed: %s", node.node_id, exc)
            return []
        if r.status_code != 200:
            raise ClusterError(r.status_code, error_message(r))
        return list(r.json())

    lists = await asyncio.gather(*(one(n) for n in await gw.up_nodes()))
    return [run for sub in lists for run in sub]


@router.api_route("/runs/{run_id}", methods=["GET", "DELETE"])
@router.api_route("/runs/{run_id}/{rest:path}", methods=["GET", "POST"])
async def run_scoped(run_id: str, request: Request) -> Response:
    svc = services(request)
    node = await svc.runs.node_of(run_id)
    if node is None:
        raise NotFound(f"run '{run_id[:80]}' not found (unknown, or ended)")
    r = await svc.runs.forward(request, node)
    if request.method == "DELETE" and r.status_code in (204, 404):
        await svc.registry.forget_run(run_id)
    return relay(r)
