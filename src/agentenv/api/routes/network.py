"""A sandbox's network settings: E2B's egress policy (create-time and ``PUT .../network``)
and whether its ports are public."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import Field

from ...network import EgressPolicy, PolicyError, parse_policy
from ...orchestrator import BadRequest, SandboxManager
from ...web.hosts import BadMask, check_mask_host
from ..models import _Body

router = APIRouter()


class NetworkUpdate(_Body):
    """``PUT /sandboxes/{id}/network``: replaces the whole egress configuration
    (fields left out are cleared, as E2B does)."""

    allow_out: list[str] | None = Field(default=None, alias="allowOut")
    deny_out: list[str] | None = Field(default=None, alias="denyOut")
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers")
    allow_internet_access: bool | None = Field(default=None, alias="allowInternetAccess")


def policy_of(network: dict[str, Any] | None, allow_internet_access: bool | None
              ) -> EgressPolicy | None:
    """The egress policy a create request asks for (None: fully open, the default)."""
    network = network or {}
    try:
        policy = parse_policy(network.get("allowOut"), network.get("denyOut"),
                              network.get("dnsServers"), allow_internet_access)
    except PolicyError as exc:
        raise BadRequest(f"network: {exc}") from exc
    return None if policy.is_open else policy


def public_traffic(network: dict[str, Any] | None) -> bool:
    value = (network or {}).get("allowPublicTraffic")
    if value is not None and not isinstance(value, bool):
        raise BadRequest("network.allowPublicTraffic must be a boolean")
    return value is not False


def mask_request_host(network: dict[str, Any] | None) -> str:
    """E2B's network.maskRequestHost, checked: the Host header a sandbox's ports see."""
    value = (network or {}).get("maskRequestHost")
    if value is None or value == "":
        return ""
    try:
        return check_mask_host(value)
    except BadMask as exc:
        raise BadRequest(f"network.maskRequestHost is not valid: {exc}") from exc


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, body: NetworkUpdate, request: Request) -> Response:
    mgr: SandboxManager = request.app.state.manager
    try:
        policy = parse_policy(body.allow_out, body.deny_out, body.dns_servers,
                              body.allow_internet_access)
    except PolicyError as exc:
        raise BadRequest(f"network: {exc}") from exc
    await mgr.set_network(sandbox_id, policy)
    return Response(status_code=204)
