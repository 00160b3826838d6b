"""The scheduler's placements: ``placement.place`` over a view of the nodes a moment
old, each pick's room then reserved atomically in Redis.

Reading every node from Redis for every placement made a create's cost grow with the
cluster (four reads per node per create). The view is read at most every
``refresh_s`` (one read of every node, four MGETs, shared by the placements made
meanwhile) and counts this scheduler's own picks as it makes them. What it cannot
see (another scheduler's picks, room freed since) is settled by ``reserve_room``: a
node found full in Redis is marked full in the view and the next best one is tried.
A placement that finds no room in a view older than ``MIN_FRESH_S`` reads the nodes
again before it is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from .node_registry import NodeStatus, Registry
from .placement import PlacementRequest, place

# How old a view may be before a placement reads the nodes again.
REFRESH_S = 0.2
# A placement refused from a view older than this reads the nodes again first.
MIN_FRESH_S = 0.05


class Placer:
    def __init__(self, registry: Registry, node_ttl_ms: int,
                 refresh_s: float = REFRESH_S) -> None:
        self.registry = registry
        self.node_ttl_ms = node_ttl_ms
        self.refresh_s = refresh_s
        self._nodes: list[NodeStatus] = []
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def _view(self, max_age_s: float) -> list[NodeStatus]:
        async with self._lock:  # placements waiting here share the read under way
            if time.monotonic() - self._read_at > max_age_s:
                started = time.monotonic()
                self._nodes = await self.registry.nodes()
                self._read_at = started
            return self._nodes

    async def place(self, req: PlacementRequest) -> list[tuple[NodeStatus, str]]:
        """Up to ``req.count`` nodes, each with the heartbeat number its room was
        reserved under (fewer when the cluster is full)."""
        picks: list[tuple[NodeStatus, str]] = []
        for max_age_s in (self.refresh_s, MIN_FRESH_S):
            nodes = await self._view(max_age_s)
            one = dataclasses.replace(req, count=1)
            while len(picks) < req.count:
                found = place(nodes, one)  # counts the pick in the view (reserved + 1)
                if not found:
                    break
                node = found[0]
                beat = await self.registry.reserve_room(node.node_id, self.node_ttl_ms)
                if beat is None:  # full as Redis counts it: full in this view too
                    node.reserved = max(node.reserved,
                                        node.capacity - node.load + node.released)
                    continue
                picks.append((node, beat))
            if picks:
                break
        return picks
