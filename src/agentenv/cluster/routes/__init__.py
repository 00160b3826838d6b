"""The gateway's and the scheduler's routes, one module per resource (as the node's
are in ``api/routes``); ``gateway.py`` and ``scheduler.py`` wire them into their apps.

The gateway's routes find what they use on ``app.state.services`` (``GatewayServices``);
the scheduler's, its registry and node TTL on ``app.state``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from fastapi import Response
from starlette.requests import HTTPConnection

if TYPE_CHECKING:
    from ..gateway_creates import Creates
    from ..gateway_runs import GatewayRuns
    from ..node_registry import Registry
    from ..quotas import KeyQuotas
    from ..routing import Gateway


@dataclass
class GatewayServices:
    """What the gateway's routes use: one of each per gateway app."""

    gw: Gateway
    registry: Registry
    creates: Creates
    runs: GatewayRuns
    api_key: str
    # How long a reservation or release the gateway counts lasts without a heartbeat.
    node_ttl_ms: int
    # Each caller key's running sandboxes across the cluster (cluster-wide quotas).
    quotas: KeyQuotas


def services(conn: HTTPConnection) -> GatewayServices:
    return conn.app.state.services


def relay(r: httpx.Response) -> Response:
    """A node's answer as the gateway's: its body, status and the headers a client reads."""
    headers = {k: v for k, v in r.headers.items()
               if k.lower() in ("content-type", "x-next-token", "location", "retry-after")}
    return Response(r.content, status_code=r.status_code, headers=headers)
