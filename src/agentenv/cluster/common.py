"""What the scheduler, the gateway and the nodes share: the cluster's errors, a
node's heartbeat (``NodeStatus``, with its ``SandboxEntry``s), and the schedulers'
addresses. Nothing here talks to Redis: a node imports it without the registry."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import AgentenvError


class ClusterError(AgentenvError):
    """An error answered as ``{"code": status, "message": ...}`` (web.errors does that)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class SandboxEntry:
    sandbox_id: str
    state: str
    # The sandbox's last pause snapshot (a running one keeps it after resuming), and
    # whether it is in the repository: what it can be resumed from if its node is lost.
    snapshot_id: str = ""
    committed: bool = False
    # How the node lists it (E2B's ListedSandbox): the gateway lists a lost sandbox so.
    item: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: that deep-copies the item (most of a heartbeat's cost).
        return {"sandbox_id": self.sandbox_id, "state": self.state,
                "snapshot_id": self.snapshot_id, "committed": self.committed,
                "item": self.item}


@dataclass
class NodeStatus:
    node_id: str
    url: str
    capacity: int
    load: int
    free_memory_mb: int
    runtime_kind: str
    runtime_version: str
    health: str = "ok"
    templates: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    sandboxes: list[SandboxEntry] = field(default_factory=list)
    # Filled in by the registry on read.
    state: str = "up"
    last_seen: float = 0.0
    reserved: int = 0
    released: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NodeStatus:
        data = dict(raw)
        data["sandboxes"] = [SandboxEntry(**s) for s in data.get("sandboxes") or []]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self, sandboxes: bool = True) -> dict[str, Any]:
        """As JSON would have it; the lists and items are shared, not copied."""
        body = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sandboxes"}
        if sandboxes:
            body["sandboxes"] = [s.to_dict() for s in self.sandboxes]
        return body

    @property
    def effective_load(self) -> int:
        return max(self.load + self.reserved - self.released, 0)


def scheduler_urls(value: str) -> list[str]:
    """``scheduler_url`` as given: one URL or several, comma-separated (schedulers are
    stateless over Redis: any one serves; a caller tries the next when one is down)."""
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


class Failover:
    """The schedulers a caller tries in turn, the last that answered first."""

    def __init__(self, value: str) -> None:
        self.urls = scheduler_urls(value) or ["http://127.0.0.1:9090"]
        self._first = 0

    def order(self) -> list[str]:
        return self.urls[self._first:] + self.urls[:self._first]

    def answered(self, url: str) -> None:
        self._first = self.urls.index(url)
