"""What the scheduler and the gateway share: the cluster's errors."""

from __future__ import annotations

from ..orchestrator import OrchestratorError


class ClusterError(OrchestratorError):
    """An error answered as ``{"code": status, "message": ...}`` (api.errors does that)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

