"""What the scheduler and the gateway share: the cluster's errors."""

from __future__ import annotations

from ..errors import AgentenvError


class ClusterError(AgentenvError):
    """An error answered as ``{"code": status, "message": ...}`` (web.errors does that)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

