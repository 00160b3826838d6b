"""Sandboxes of lost nodes in the gateway's listings.

A node past its heartbeat TTL is down and no node lists its sandboxes any more; the
gateway lists them from what the node last reported (``sbx:<id>`` in Redis):

- one that can be taken over (its last pause snapshot is committed to the shared
  repository) as ``paused``, the state E2B's SDKs know (they refuse other states),
  which a connect or resume takes over on another node, from that snapshot;
- one that cannot as ``lost``, only when asked for by name (``state=lost``).

Both carry ``lost``: the node, when it was last heard of, the state it reported, and
the snapshot it resumes from (null when none). The SDKs keep unknown fields.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from ..sandbox_api import LISTED_STATES, parse_metadata
from .node_registry import Registry
from .routing import resumable

LISTED = frozenset(LISTED_STATES)


def _started(item: dict[str, Any]) -> datetime | None:
    try:
        return datetime.fromisoformat(str(item.get("startedAt")).replace("Z", "+00:00"))
    except ValueError:
        return None


def _time(raw: str | None) -> datetime | None:
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None  # the nodes answered 400 for it already


async def lost_items(registry: Registry, *, states: frozenset[str] = LISTED,
                     metadata: str | None = None, template: str | None = None,
                     started_after: str | None = None, started_before: str | None = None
                     ) -> list[dict[str, Any]]:
    """The lost sandboxes a listing with these filters shows."""
    wanted = parse_metadata(metadata)
    after, before = _time(started_after), _time(started_before)
    out = []
    for entry, node in await registry.lost():
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
        started = _started(item)
        meta = item.get("metadata") or {}
        if state not in states or any(meta.get(k) != v for k, v in wanted.items()) \
                or (template and template not in (item.get("templateID"), item.get("alias"))) \
                or (after and started and started < after) \
                or (before and started and started > before):
            continue
        item["state"] = state
        item["lost"] = {
            "nodeID": node.node_id,
            "lastSeen": datetime.fromtimestamp(node.last_seen, tz=UTC).isoformat()
            if node.last_seen else None,
            "wasState": entry.get("state"),
            "snapshotID": entry.get("snapshot") if can_resume else None,
        }
        out.append(item)
    return out
