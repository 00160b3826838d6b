"""`aenv scheduler`: nodes register and heartbeat here; it answers where new work goes.

State is in Redis (registry.py), so the scheduler itself can restart at will. A
sweeper marks a node down once its heartbeat key expires; a down node gets no
placements until it heartbeats again (then it is up: it rejoins by itself).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from pydantic import BaseModel, Field

from .. import __version__, metrics
from ..web.errors import install_error_handlers, serve_openapi
from ..web.keys import require_api_key
from .common import ClusterError
from .node_registry import NodeStatus, Registry
from .placement import PlacementRequest, place

log = logging.getLogger(__name__)


class Placement(BaseModel):
    template: str = ""
    snapshot: str = ""
    runtime_kind: str = Field(default="", alias="runtimeKind")
    runtime_version: str = Field(default="", alias="runtimeVersion")
    exclude: list[str] = Field(default_factory=list)
    count: int = Field(default=1, ge=1, le=64)


def _public(node: NodeStatus) -> dict[str, Any]:
    body = node.to_dict()
    body.pop("sandboxes", None)
    return body


def _export(nodes: list[NodeStatus]) -> None:
    """The cluster as the registry last said: nodes by state, load and room of those up."""
    states = collections.Counter(n.state for n in nodes)
    for state in ("up", "down", *states):
        metrics.CLUSTER_NODES.labels(state).set(states.get(state, 0))
    up = [n for n in nodes if n.state == "up"]
    metrics.CLUSTER_SANDBOXES.set(sum(n.load for n in up))
    metrics.CLUSTER_CAPACITY.set(sum(n.capacity for n in up))


def create_scheduler_app(redis_url: str, api_key: str, node_ttl_ms: int = 5000) -> FastAPI:
    registry = Registry(redis_url)

    async def sweep() -> None:
        while True:
            await asyncio.sleep(max(node_ttl_ms / 4000, 0.1))
            try:
                nodes = await registry.nodes()
                for node in nodes:
                    if node.state == "down" and await registry.mark_down(node.node_id):
                        log.warning("node %s marked down: no heartbeat for %d ms",
                                    node.node_id, node_ttl_ms)
                _export(nodes)
            except Exception:
                log.exception("node sweep failed")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.ping()
        task = asyncio.create_task(sweep(), name="sweep")
        unregister = metrics.register(metrics.HostCollector())
        try:
            yield
        finally:
            unregister()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await registry.close()

    app = FastAPI(title="agentenv scheduler", version=__version__, lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.state.api_key = api_key
    install_error_handlers(app)
    serve_openapi(app, require_api_key)
    auth = [Depends(require_api_key)]
    app.include_router(metrics.metrics_router(require_api_key))
    app.add_middleware(metrics.RequestCounter)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        try:
            await registry.ping()
        except Exception as exc:
            raise ClusterError(503, f"redis unreachable: {exc}") from exc
        return {"status": "ok", "version": __version__}

    @app.post("/nodes/heartbeat", dependencies=auth)
    async def heartbeat(request: Request) -> dict[str, Any]:
        try:
            status = NodeStatus.from_dict(await request.json())
        except (TypeError, ValueError) as exc:
            raise ClusterError(400, f"invalid heartbeat: {exc}") from exc
        was = await registry.node(status.node_id)
        disown = await registry.heartbeat(status, node_ttl_ms)
        if was is None or was.state == "down":
            log.info("node %s is up at %s (%d/%d sandboxes)", status.node_id, status.url,
                     status.load, status.capacity)
        return {"disown": disown}

    @app.get("/nodes", dependencies=auth)
    async def nodes(snapshot: str | None = None, state: str | None = None
                    ) -> list[dict[str, Any]]:
        out = await registry.nodes()
        if snapshot:
            out = [n for n in out if snapshot in n.snapshots]
        if state:
            out = [n for n in out if n.state == state]
        return [_public(n) for n in out]

    @app.get("/nodes/{node_id}", dependencies=auth)
    async def node(node_id: str) -> dict[str, Any]:
        status = await registry.node(node_id)
        if status is None:
            raise ClusterError(404, f"node '{node_id}' is not registered")
        return _public(status)

    @app.delete("/nodes/{node_id}", status_code=204, dependencies=auth)
    async def forget(node_id: str) -> Response:
        await registry.forget_node(node_id)
        return Response(status_code=204)

    @app.get("/sandboxes/{sandbox_id}", dependencies=auth)
    async def sandbox(sandbox_id: str) -> dict[str, Any]:
        entry = await registry.sandbox(sandbox_id)
        if entry is None:
            raise ClusterError(404, f"sandbox '{sandbox_id}' is on no node")
        return {**entry, "committed": entry.get("committed") == "1",
                "nodeUp": await registry.is_up(entry["node"])}

    @app.post("/placements", dependencies=auth)
    async def placements(body: Placement) -> dict[str, Any]:
        req = PlacementRequest(template=body.template, snapshot=body.snapshot,
                               runtime_kind=body.runtime_kind,
                               runtime_version=body.runtime_version,
                               exclude=body.exclude, count=body.count)
        picks = place(await registry.nodes(), req)
        metrics.PLACEMENTS.labels("placed" if picks else "refused").inc()
        if not picks:
            raise ClusterError(503, "no node can take the sandbox: every node is down, full "
                                    "or of another runtime; retry later")
        beats = [await registry.reserve(pick.node_id, node_ttl_ms) for pick in picks]
        return {"nodes": [{"nodeID": p.node_id, "url": p.url, "beat": beat}
                          for p, beat in zip(picks, beats, strict=True)]}

    return app
