"""The records of simulated nodes (sim_nodes.py): how they behave, their sandboxes, and
each node's state as its heartbeat reports it."""

from __future__ import annotations

import asyncio
import random
import secrets
import string
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..cluster.beats import Beats
from ..cluster.common import NodeStatus, SandboxEntry

Answer = tuple[int, Any, dict[str, str]]
_ID_ALPHABET = string.ascii_lowercase + string.digits
ENVD_VERSION = "0.6.4"


@dataclass
class Behaviour:
    """How every simulated node behaves."""

    capacity: int = 100
    heartbeat_s: float = 1.0
    latency_s: float = 0.0  # added to every answer of the node API
    create_s: float = 0.0  # a create's own time on the node (a boot or a restore)
    failure_rate: float = 0.0  # share of creates answered 500
    templates: tuple[str, ...] = ("base",)
    # Sandboxes each node holds from its start (running; metadata ``job``: one of
    # ``JOBS``), as a node of a fleet already at work would: listings at scale.
    preload: int = 0


JOBS = 100


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat().replace("+00:00", "Z")


def new_id(prefix: str = "") -> str:
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


@dataclass
class SimSandbox:
    sandbox_id: str
    template_id: str
    state: str  # creating, running, paused
    started_at: float
    end_at: float
    metadata: dict[str, str] = field(default_factory=dict)
    snapshot_id: str = ""

    def listed(self) -> dict[str, Any]:
        """As the node lists it (E2B's ListedSandbox)."""
        return {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                "clientID": "sim", "startedAt": iso(self.started_at),
                "endAt": iso(self.end_at), "cpuCount": 1, "memoryMB": 512,
                "diskSizeMB": 1024, "metadata": self.metadata, "state": self.state,
                "envdVersion": ENVD_VERSION}

    def created(self) -> dict[str, Any]:
        """As a create, a resume or a connect answers it (SandboxCreated)."""
        return {"templateID": self.template_id, "sandboxID": self.sandbox_id,
                "clientID": "sim", "envdVersion": ENVD_VERSION,
                "envdAccessToken": "sim-token", "domain": None}


class SimNode:
    """One simulated node: its records, its heartbeats' switch and its API's."""

    def __init__(self, node_id: str, url: str, behaviour: Behaviour) -> None:
        self.node_id = node_id
        self.url = url
        self.behaviour = behaviour
        self.sandboxes: dict[str, SimSandbox] = {}
        self.snapshots: set[str] = set()
        self.heartbeating = True
        self.beats = Beats()  # its heartbeats' session and the beat last applied
        self.beat_count = 0
        # Idempotency-Key -> (the create's body, its answer once it has one): a retry
        # gets the first create's answer (or waits for it), as a real node's does.
        self.keyed: dict[str, tuple[bytes, asyncio.Future[Answer]]] = {}
        now = time.time()
        for k in range(behaviour.preload):
            sbx = SimSandbox(new_id(), "base", "running", now - random.uniform(0, 3600),
                             now + 3600, {"job": f"j{k % JOBS}"})
            self.sandboxes[sbx.sandbox_id] = sbx

    def load(self) -> int:
        """Sandboxes holding room, as the node counts them (a paused one holds none)."""
        return sum(1 for s in self.sandboxes.values() if s.state in ("creating", "running"))

    def status(self) -> NodeStatus:
        entries = [SandboxEntry(sandbox_id=s.sandbox_id, state=s.state,
                                snapshot_id=s.snapshot_id,
                                committed=bool(s.snapshot_id) and s.state != "creating",
                                item=s.listed())
                   for s in self.sandboxes.values() if s.state != "creating"]
        return NodeStatus(node_id=self.node_id, url=self.url,
                          capacity=self.behaviour.capacity, load=self.load(),
                          free_memory_mb=64_000, runtime_kind="gvisor",
                          runtime_version="sim", templates=list(self.behaviour.templates),
                          snapshots=sorted(self.snapshots), sandboxes=entries)
