"""What the scheduler and the gateway share: the cluster API key check and errors."""

from __future__ import annotations

from fastapi import Header, HTTPException, Request

from ..api.auth import key_matches
from ..orchestrator import OrchestratorError


class ClusterError(OrchestratorError):
    """An error answered as ``{"code": status, "message": ...}`` (api.errors does that)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def require_api_key(
    request: Request, x_api_key: str | None = Header(default=None, alias="X-API-Key")
) -> None:
    if not key_matches(x_api_key, request.app.state.api_key):
        raise HTTPException(status_code=401, detail="missing or invalid X-API-Key header")
