"""`aenv scheduler`: nodes register and heartbeat here; it answers where new work goes.

State is in Redis (registry.py), so the scheduler itself can restart at will. A
sweeper marks a node down once its heartbeat key expires; a down node gets no
placements until it heartbeats again (then it is up: it rejoins by itself).

This module wires the app and runs the sweeper; the routes are ``routes/scheduler.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from .. import __version__, metrics
from ..web.errors import install_error_handlers, serve_openapi
from ..web.keys import require_api_key
from .node_registry import NodeStatus, Registry
from .placer import Placer
from .routes import scheduler as routes

log = logging.getLogger(__name__)


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
    app.state.registry = registry
    app.state.node_ttl_ms = node_ttl_ms
    app.state.placer = Placer(registry, node_ttl_ms)
    install_error_handlers(app)
    serve_openapi(app, require_api_key)
    app.include_router(metrics.metrics_router(require_api_key))
    app.add_middleware(metrics.RequestCounter)
    app.include_router(routes.router)
    return app
