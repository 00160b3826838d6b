"""Sandbox records, their states, and the errors the orchestrator raises."""

from __future__ import annotations

import enum
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Any

# The lifecycle errors live where the gateway can import them without the node.
from ..sandbox_api import BadRequest as BadRequest
from ..sandbox_api import CapacityExceeded as CapacityExceeded
from ..sandbox_api import Conflict
from ..sandbox_api import NotFound as NotFound
from ..sandbox_api import OrchestratorError as OrchestratorError


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSED = "paused"
    # Its runtime ended without being asked (the host's OOM killer, a crash): it holds
    # nothing any more; the record stays, with the reason, until deleted or expired.
    ERROR = "error"
    KILLED = "killed"


# Which transitions exist; anything else is a 409.
TRANSITIONS: dict[SandboxState, set[SandboxState]] = {
    SandboxState.CREATING: {SandboxState.RUNNING, SandboxState.KILLED},
    SandboxState.RUNNING: {SandboxState.PAUSED, SandboxState.ERROR, SandboxState.KILLED},
    # A resident paused sandbox whose frozen runtime ended before its capture: ERROR.
    SandboxState.PAUSED: {SandboxState.RUNNING, SandboxState.ERROR, SandboxState.KILLED},
    SandboxState.ERROR: {SandboxState.KILLED},
    SandboxState.KILLED: set(),
}


_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    """20 characters of [a-z0-9] (~103 bits): unguessable, URL- and DNS-label-safe."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    alias: str
    state: SandboxState
    node_id: str
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    started_at: float
    end_at: float
    auto_pause: bool = False
    # What a timeout's pause keeps: memory and files, or (False) the files only.
    auto_pause_memory: bool = True
    internet: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    envd_token: str = ""
    slot_index: int = 0
    slot_address: str = ""
    # The snapshot a paused sandbox resumes from (its latest pause).
    snapshot_id: str = ""
    # Egress policy as E2B spells it ({"allowOut": [...], "denyOut": [...]}); {} = open.
    network: dict[str, Any] = field(default_factory=dict)
    # Set when the sandbox's ports are private (E2B allowPublicTraffic=false): the
    # proxy then wants it in the e2b-traffic-access-token header.
    traffic_token: str = ""
    # Why the sandbox is in ERROR ("was killed: out of memory: ...", "exited: ...").
    error: str = ""
    # E2B's autoResume: while paused, a request to one of its ports through the proxy
    # resumes it, for resume_timeout seconds (the create's timeout, as E2B does).
    auto_resume: bool = False
    resume_timeout: int = 0
    # E2B's network.maskRequestHost: the Host its ports see ("${PORT}" replaced); ""
    # = the client's own Host.
    mask_request_host: str = ""
    # Who made it (the API key's ID: per-key quotas count it) and the run that owns
    # it ("" for none: runs.py ends it with the run).
    owner: str = ""
    run_id: str = ""
    # When its create arrived (and maybe waited for room: admission.py), when its
    # runtime started (or was restored), and when it was ready (running); epoch
    # seconds, 0 unknown. ``started_at`` is when it was placed (its record made).
    queued_at: float = 0.0
    booted_at: float = 0.0
    ready_at: float = 0.0
    # What it came from, for snapshot lineage: "template:<id>", "snapshot:<id>" (a
    # create from it) or "sandbox:<id>" (a fork child's source). A reset leaves it:
    # a reset is an event in the sandbox's history (``resets``), not a new parent (the
    # snapshot reset to is often of this very sandbox: its child, not its parent).
    origin: str = ""
    # Its resets, oldest first, the last MAX_RESETS: {"snapshotID": ..., "at": epoch s}.
    resets: list[dict[str, Any]] = field(default_factory=list)

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) >= self.end_at

    def public_metadata(self) -> dict[str, Any]:
        return dict(self.metadata)


MAX_RESETS = 16


def not_running(record: SandboxRecord) -> Conflict:
    """The error for a call that needs the sandbox running (the proxy answers it
    as a 502 "The sandbox X is not running: ...")."""
    if record.state is SandboxState.ERROR or record.error:
        return Conflict(f"sandbox '{record.sandbox_id}' {record.error or 'ended'}")
    return Conflict(f"sandbox '{record.sandbox_id}' is {record.state}")
