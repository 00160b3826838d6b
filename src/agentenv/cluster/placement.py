"""Which node gets new work: filter by health, capacity and runtime; prefer a warm cache.

Pure functions over node statuses, so the rules read (and are tested) in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .node_registry import NodeStatus

# A node with less free memory than this takes no new sandbox.
MIN_FREE_MEMORY_MB = 256


@dataclass
class PlacementRequest:
    template: str = ""
    snapshot: str = ""
    runtime_kind: str = ""
    runtime_version: str = ""
    exclude: list[str] = field(default_factory=list)
    count: int = 1


def eligible(node: NodeStatus, req: PlacementRequest) -> bool:
    return (
        node.state == "up"
        and node.health == "ok"
        and node.node_id not in req.exclude
        and node.effective_load < node.capacity
        and node.free_memory_mb >= MIN_FREE_MEMORY_MB
        and (not req.runtime_kind or node.runtime_kind == req.runtime_kind)
        and (not req.runtime_version or node.runtime_version == req.runtime_version)
    )


def _cached(node: NodeStatus, req: PlacementRequest) -> bool:
    if req.snapshot and req.snapshot in node.snapshots:
        return True
    return bool(req.template) and req.template in node.templates


def rank(node: NodeStatus, req: PlacementRequest) -> tuple:
    """Sort key, best first: the cache holds what the work needs, then least loaded."""
    return (not _cached(node, req), node.effective_load / max(node.capacity, 1),
            node.effective_load, node.node_id)


def place(nodes: list[NodeStatus], req: PlacementRequest) -> list[NodeStatus]:
    """One node per requested item (``count``), each pick counted before the next;
    fewer than ``count`` when the cluster is full."""
    picks: list[NodeStatus] = []
    for _ in range(req.count):
        candidates = [n for n in nodes if eligible(n, req)]
        if not candidates:
            break
        best = min(candidates, key=lambda n: rank(n, req))
        best.reserved += 1
        picks.append(best)
    return picks
