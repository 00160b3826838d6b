"""Sandboxes of lost nodes in the gateway's listings.

A node past its heartbeat TTL is down and no node lists its sandboxes any more; the
gateway lists them from what the node last reported (``sbx:<id>`` in Redis):

- one that can be taken over (its last pause snapshot is committed to the shared
  repository) as ``paused``, the state E2B's SDKs know (they refuse other states),
  which a connect or resume takes over on another node, from that snapshot;
- one that cannot as ``lost``, only when asked for by name (``state=lost``).

Both carry ``lost``: the node, when it was last heard of, the state it reported, and
the snapshot it resumes from (null when none). The SDKs keep unknown fields.

A node is lost once the scheduler's sweeper marked it down (within a quarter of its TTL
after its last heartbeat's lapsed); until then its sandboxes are listed as it last
reported them. A heartbeat brings them back as they are.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from .node_registry import NodeStatus, Registry
from .routing import resumable
from .sandbox_index import Query, micros


async def lost_items(registry: Registry, q: Query, down: list[NodeStatus] | None = None
                     ) -> list[tuple[int, str, dict[str, Any]]]:
    """The lost sandboxes a listing with this query shows (its filters, not its cursor),
    each with its start time (µs) and ID."""
    out = []
    for entry, node in await registry.lost(down):
        if entry.get("state") not in ("running", "paused"):
            continue
        try:
            item = json.loads(entry.get("item") or "{}")
        except ValueError:
            continue
        if not isinstance(item, dict) or not item.get("sandboxID"):
            continue  # reported by a node that did not send its listing
        can_resume = resumable(entry)
        state = "paused" if can_resume else "lost"
        us = micros(item.get("startedAt"))
        if us is None or not q.in_range(us) or not q.matches(item, state):
            continue
        item["state"] = state
        item["lost"] = {
            "nodeID": node.node_id,
            "lastSeen": datetime.fromtimestamp(node.last_seen, tz=UTC).isoformat()
            if node.last_seen else None,
            "wasState": entry.get("state"),
            "snapshotID": entry.get("snapshot") if can_resume else None,
        }
        out.append((us, str(item["sandboxID"]), item))
    return out
