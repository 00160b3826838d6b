"""`aenv gateway`: the node API (E2B-compatible) in front of a cluster of nodes.

- Creates go to the node the gateway picks from its own view of the nodes, as a
  scheduler would (``placer``; retried elsewhere if that node is full or unreachable).
- Every sandbox-scoped request, and proxied envd/port traffic (``E2b-Sandbox-Id``
  headers or ``<port>-<id>.<domain>`` Host; HTTP streams and WebSockets), goes to
  the node that owns the sandbox (``sbx:<id>`` in Redis, kept by this gateway on
  create and by nodes' heartbeats).
- A sandbox whose node is down (lost) is adopted by another node from its committed
  pause snapshot (a running one's last pause), then the request proceeds there; one
  without: 410 with a message naming the node.
- Listing merges every up node, with the gateway's own stable cursor, and the lost
  sandboxes (``lost``).
- Fork keeps children on the source node while it has room (a local fork is the
  fast path); otherwise the source is snapshotted and children are created from
  that snapshot on the nodes the scheduler picks.

This module wires the gateway's app together; its routes are in ``routes/`` (one
module per resource), ``routing`` finds and talks to the nodes, ``gateway_proxy``
relays sandbox traffic.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp

from .. import __version__
from .. import metrics as prometheus
from ..web.console import ConsoleSessions, console_router
from ..web.errors import install_error_handlers
from ..web.keys import require_api_key
from .gateway_creates import Creates
from .gateway_proxy import GatewayProxy
from .gateway_runs import GatewayRuns
from .node_registry import Registry
from .quotas import KeyQuotas
from .routes import GatewayServices, fork, listing, passthrough, relay, runs, sandboxes, terminal
from .routing import Gateway

__all__ = ["Gateway", "GatewayProxy", "create_gateway_app"]


def create_gateway_app(redis_url: str, scheduler_url: str, api_key: str,
                       domain: str = "localhost", queue_timeout_s: float = 30.0,
                       node_ttl_ms: int = 5000, key_max_sandboxes: int = 0,
                       key_quotas: dict[str, Any] | None = None) -> ASGIApp:
    """``key_max_sandboxes`` (0: none) and ``key_quotas`` (per key ID overrides, as a
    node's config has them) are quotas of running sandboxes across the cluster.
    ``scheduler_url`` is taken and not used: the gateway places creates itself, over
    Redis (the schedulers record the nodes' heartbeats and sweep)."""
    registry = Registry(redis_url)
    gw = Gateway(registry, api_key, node_ttl_ms)
    holder: dict[str, GatewayProxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.ping()
        unregister = prometheus.register(prometheus.HostCollector())
        try:
            yield
        finally:
            unregister()
            await holder["proxy"].close()
            await gw.close()
            await registry.close()

    # /openapi.json goes on to a node like any other path: its document, for key holders.
    app = FastAPI(title="agentenv gateway", version=__version__, lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.state.api_key = api_key
    app.state.gateway = gw
    app.state.services = GatewayServices(
        gw=gw, registry=registry,
        creates=Creates(gw, registry, queue_timeout_s, node_ttl_ms, relay),
        runs=GatewayRuns(gw, registry), api_key=api_key, node_ttl_ms=node_ttl_ms,
        quotas=KeyQuotas(registry, key_max_sandboxes, key_quotas))
    install_error_handlers(app)
    # The first route whose path matches wins: a fork and /sandboxes/metrics before a
    # sandbox's own routes, and the catch-all (passthrough) last.
    app.include_router(prometheus.metrics_router(require_api_key))
    app.include_router(runs.router)
    app.include_router(console_router())  # the web console
    app.include_router(terminal.router)
    app.include_router(fork.router)
    app.include_router(sandboxes.router)
    app.include_router(listing.router)
    app.include_router(passthrough.router)

    proxy = GatewayProxy(prometheus.RequestCounter(ConsoleSessions(app, app.state)), gw, domain)
    holder["proxy"] = proxy
    return proxy
