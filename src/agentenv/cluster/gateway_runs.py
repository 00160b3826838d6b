"""The gateway's runs: a run lives on the node it was made on (the least loaded one),
and everything of it goes there: its routes, and the creates that join it
(``X-Aenv-Run`` or metadata ``aenv.run``), which skip the scheduler. Which node holds
a run is kept in Redis (``run:<id>``), else asked of every up node once. The routes
are in ``routes/runs.py``."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
from fastapi import Request

from .common import ClusterError
from .node_registry import NodeStatus, Registry
from .routing import Gateway

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

    async def create_in_run(self, request: Request, run_id: str, body: bytes
                            ) -> tuple[httpx.Response, NodeStatus]:
        """A create that joins a run, on the run's node."""
        node = await self.node_of(run_id)
        if node is None:
            raise ClusterError(400, f"run '{run_id[:80]}' is unknown or has ended; create a "
                                    "run (POST /runs) and pass its runID")
        return await self.forward(request, node, body), node

    async def forward(self, request: Request, node: NodeStatus,
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
