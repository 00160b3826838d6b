"""Sandbox records and states, lifecycle, TTL, and restart reconciliation."""

from .models import (
    BadRequest,
    CapacityExceeded,
    Conflict,
    NotFound,
    OrchestratorError,
    SandboxRecord,
    SandboxState,
    StorageFull,
)
from .sandboxes import CreateRequest, SandboxManager
from .store import SandboxStore

__all__ = [
    "BadRequest", "CapacityExceeded", "Conflict", "CreateRequest", "NotFound",
    "OrchestratorError", "SandboxManager", "SandboxRecord", "SandboxState", "SandboxStore",
    "StorageFull",
]
