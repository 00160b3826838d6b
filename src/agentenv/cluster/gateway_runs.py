"""The gateway's runs: a run lives on the node it was made on (the least loaded one),
and everything of it goes there: its routes, and the creates that join it
(``X-Aenv-Run`` or metadata ``aenv.run``), which skip the scheduler. Which node holds
a run is kept in Redis (``run:<id>``), else asked of every up node once."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response

from ..sandbox_api import NotFound
from .common import ClusterError
from .node_registry import NodeStatus, Registry
from .routing import Gateway, error_message

log = logging.getLogger(__name__)
RUN_ID = re.compile(r"run_[a-z0-9]{20}")
RUN_HEADER, RUN_METADATA = "x-aenv-run", "aenv.run"


def run_of(request: Request, body: Any) -> str:
    """The run a create names (header or metadata; "" none)."""
    header = request.headers.get(RUN_HEADER, "").strip()
    meta = body.get("metadata") if isinstance(body, dict) else None
    value = meta.get(RUN_METADATA, "") if isinstance(meta, dict) else ""
    return header or (value.strip() if isinstance(value, str) else "")


class GatewayRuns:
    def __init__(self, gw: Gateway, registry: Registry) -> None:
        self.gw, self.registry = gw, registry

    async def node_of(self, run_id: str) -> NodeStatus | None:
        """The up node that holds ``run_id`` (None: no up node does)."""
        if not RUN_ID.fullmatch(run_id):
            return None
        up = await self.gw.up_nodes()
        known = await self.registry.run_node(run_id)
        for node in up:
            if node.node_id == known:
                return node

        async def ask(node: NodeStatus) -> bool:
            try:
                r = await self.gw.http.get(f"{node.url}/runs/{run_id}",
                                           headers={"X-API-Key": self.gw.api_key})
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        for node, has in zip(up, await asyncio.gather(*(ask(n) for n in up)), strict=True):
            if has:
                await self.registry.set_run(run_id, node.node_id)
                return node
        return None

    def install(self, app: FastAPI, auth: list, relay: Any) -> None:
        @app.post("/runs", dependencies=auth)
        async def create_run(request: Request) -> Response:
            nodes = sorted(await self.gw.up_nodes(), key=lambda n: n.effective_load)
            if not nodes:
                raise ClusterError(503, "no node is up")
            r = await self._forward(request, nodes[0])
            if r.status_code == 201:
                await self.registry.set_run(r.json()["runID"], nodes[0].node_id)
            return relay(r)

        @app.get("/runs", dependencies=auth)
        async def list_runs(request: Request) -> list[dict[str, Any]]:
            async def one(node: NodeStatus) -> list[dict[str, Any]]:
                try:
                    r = await self.gw.forward(request, node.url, body=b"")
                except httpx.HTTPError as exc:
                    log.warning("listing runs of node %s failed: %s", node.node_id, exc)
                    return []
                if r.status_code != 200:
                    raise ClusterError(r.status_code, error_message(r))
                return list(r.json())

            lists = await asyncio.gather(*(one(n) for n in await self.gw.up_nodes()))
            return [run for sub in lists for run in sub]

        @app.api_route("/runs/{run_id}", methods=["GET", "DELETE"], dependencies=auth)
        @app.api_route("/runs/{run_id}/{rest:path}", methods=["GET", "POST"],
                       dependencies=auth)
        async def run_scoped(run_id: str, request: Request) -> Response:
            node = await self.node_of(run_id)
            if node is None:
                raise NotFound(f"run '{run_id[:80]}' not found (unknown, or ended)")
            r = await self._forward(request, node)
            if request.method == "DELETE" and r.status_code in (204, 404):
                await self.registry.forget_run(run_id)
            return relay(r)

    async def create_in_run(self, request: Request, run_id: str, body: bytes
                            ) -> tuple[httpx.Response, NodeStatus]:
        """A create that joins a run, on the run's node."""
        node = await self.node_of(run_id)
        if node is None:
            raise ClusterError(400, f"run '{run_id[:80]}' is unknown or has ended; create a "
                                    "run (POST /runs) and pass its runID")
        return await self._forward(request, node, body), node

    async def _forward(self, request: Request, node: NodeStatus,
                       body: bytes | None = None) -> httpx.Response:
        try:
            return await self.gw.forward(request, node.url, body=body)
        except httpx.HTTPError as exc:
            raise ClusterError(502, f"node {node.node_id} did not answer: {exc}") from exc


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ClusterError(400, "invalid request: body must be a JSON object")
    return parsed
