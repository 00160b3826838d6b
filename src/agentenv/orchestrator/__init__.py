"""Sandbox records and states, their lifecycle (one launch path), TTL, pause and
resume, fork, and restart reconciliation."""

from .manager import SandboxManager
from .models import (
    BadRequest,
    CapacityExceeded,
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
)
from .requests import CreateRequest
from .store import SandboxStore

__all__ = [
    "BadRequest", "CapacityExceeded", "Conflict", "CreateRequest", "NotFound",
    "OrchestratorError", "SandboxManager", "SandboxRecord", "SandboxState", "SandboxStore",
]
