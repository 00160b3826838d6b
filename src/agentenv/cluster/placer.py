"""Placements (a gateway's, and a scheduler's when asked): ``placement.place``'s rules
over a view of the nodes a moment old, each pick's room then reserved atomically in Redis.

Reading every node from Redis for every placement made a create's cost grow with the
cluster (four reads per node per create). The view is read at most every
``refresh_s`` (one read of every node, four MGETs, shared by the placements made
meanwhile) and counts this placer's own picks as it makes them. What it cannot
see (another placer's picks, room freed since) is settled by ``reserve_room``: a
node found full in Redis is marked full in the view and the next best one is tried.
A placement that finds no room in a view older than ``MIN_FRESH_S`` reads the nodes
again before it is refused. Where reading the nodes is slow (over ``SLOW_READ_S``: a
large cluster), a view older than ``refresh_s`` but at most ``MAX_STALE_S`` is placed
from while it is read again behind the placement; where it is cheap, the view is
read first, so a small cluster's placements see what its last heartbeats said (an
image a node now holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import time

from .node_registry import NodeStatus, Registry
from .placement import PlacementRequest, eligible, rank

log = logging.getLogger(__name__)
# How old a view may be before a placement reads the nodes again.
REFRESH_S = 0.2
# A placement refused from a view older than this reads the nodes again first.
MIN_FRESH_S = 0.05
# A view older than REFRESH_S, up to this, is placed from while it is read again.
MAX_STALE_S = 2.0
# Reads slower than this (1,000 nodes: ~40 ms) are made behind placements from the
# older view; faster ones (a few nodes: ~1 ms) before them.
SLOW_READ_S = 0.02
# Kinds of request (template, runtime) ranked per view at most; past it, ranked anew.
MAX_KINDS = 256


class Ranked:
    """The nodes of a view eligible for one kind of request, best first (``rank``): a
    heap, so a pick costs O(log nodes), not a pass over every node (10 ms at 1,000).

    Picks only add load within a view, so a node's rank only worsens: an entry is
    checked when it comes to the top, and put back with its rank now if that changed
    (another kind's pick, a reservation Redis refused); a node no longer eligible
    (full) is dropped. ``placement.place`` gives the same picks, by a pass each."""

    def __init__(self, nodes: list[NodeStatus], req: PlacementRequest) -> None:
        self.req = dataclasses.replace(req, exclude=[], count=1)
        self.heap = [(rank(n, self.req), i, n) for i, n in enumerate(nodes)
                     if eligible(n, self.req)]
        heapq.heapify(self.heap)

    def pick(self, exclude: list[str]) -> NodeStatus | None:
        """The best node not in ``exclude``, counted (``reserved`` + 1) as ``place``
        counts a pick; None when none is eligible."""
        aside = []
        found = None
        while self.heap:
            was, i, node = heapq.heappop(self.heap)
            if not eligible(node, self.req):
                continue
            now = rank(node, self.req)
            if now != was:
                heapq.heappush(self.heap, (now, i, node))
            elif node.node_id in exclude:
                aside.append((was, i, node))
            else:
                node.reserved += 1
                heapq.heappush(self.heap, (rank(node, self.req), i, node))
                found = node
                break
        for entry in aside:
            heapq.heappush(self.heap, entry)
        return found


class Placer:
    def __init__(self, registry: Registry, node_ttl_ms: int,
                 refresh_s: float = REFRESH_S) -> None:
        self.registry = registry
        self.node_ttl_ms = node_ttl_ms
        self.refresh_s = refresh_s
        self._nodes: list[NodeStatus] = []
        self._ranked: dict[tuple[str, str, str, str], Ranked] = {}
        self._read_at = float("-inf")
        self._read_cost_s = 0.0  # how long the last read of the nodes took
        self._lock = asyncio.Lock()
        self._behind: asyncio.Task[None] | None = None

    async def _view(self, max_age_s: float) -> list[NodeStatus]:
        age = time.monotonic() - self._read_at
        if max_age_s == self.refresh_s and age <= MAX_STALE_S and self._nodes \
                and self._read_cost_s > SLOW_READ_S:
            # Old but usable (each pick's room is settled in Redis): read again behind
            # this placement, not in its way (a thousand nodes' read and ranking took
            # 50-150 ms of a create's latency here).
            if age > max_age_s and (self._behind is None or self._behind.done()):
                self._behind = asyncio.create_task(self._read_behind(max_age_s))
            return self._nodes
        return await self._read(max_age_s)

    async def _read(self, max_age_s: float) -> list[NodeStatus]:
        async with self._lock:  # placements waiting here share the read under way
            if time.monotonic() - self._read_at > max_age_s:
                started = time.monotonic()
                self._nodes = await self.registry.nodes()
                self._ranked = {}
                self._read_at = started
                self._read_cost_s = time.monotonic() - started
            return self._nodes

    async def _read_behind(self, max_age_s: float) -> None:
        try:
            await self._read(max_age_s)
        except Exception:  # the next placement reads again (inline past MAX_STALE_S)
            log.exception("reading the nodes behind placements failed")

    async def close(self) -> None:
        if self._behind is not None:
            self._behind.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._behind

    def _ranking(self, req: PlacementRequest) -> Ranked:
        kind = (req.template, req.snapshot, req.runtime_kind, req.runtime_version)
        ranked = self._ranked.get(kind)
        if ranked is None:
            if len(self._ranked) >= MAX_KINDS:
                self._ranked = {}
            ranked = self._ranked[kind] = Ranked(self._nodes, req)
        return ranked

    async def place(self, req: PlacementRequest) -> list[tuple[NodeStatus, str]]:
        """Up to ``req.count`` nodes, each with the heartbeat number its room was
        reserved under (fewer when the cluster is full)."""
        picks: list[tuple[NodeStatus, str]] = []
        for max_age_s in (self.refresh_s, MIN_FRESH_S):
            await self._view(max_age_s)
            while len(picks) < req.count:
                # Looked up again after an await: the view may have been read anew.
                node = self._ranking(req).pick(req.exclude)
                if node is None:
                    break
                beat = await self.registry.reserve_room(node.node_id, self.node_ttl_ms)
                if beat is None:  # full as Redis counts it: full in this view too
                    node.reserved = max(node.reserved,
                                        node.capacity - node.load + node.released)
                    continue
                picks.append((node, beat))
            if picks:
                break
        return picks
