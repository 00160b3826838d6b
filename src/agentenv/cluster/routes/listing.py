"""The gateway's listings, from Redis (``sandbox_index``): no node is asked, and a page
of ``GET /v2/sandboxes`` costs O(limit) whatever the number of nodes or sandboxes.

Paging follows E2B's API: ``limit`` clamped to 1..100 (100 by default), newest first
unless ``order=asc``, IDs ascending among equal start times, ``x-next-token`` on a page
only when more follow (the token: base64url of ``<RFC 3339 start>__<ID>``, with
``__asc`` for ascending pages); a token that is not one, or one of the other order,
is answered 400. Sandboxes of lost nodes (``lost``) are merged in their place.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from ...sandbox_api import BadRequest, parse_metadata, parse_states
from ...web.keys import require_api_key
from ..lost import lost_items
from ..node_registry import NodeStatus, Registry
from ..sandbox_index import (
    CHUNK,
    MAX_PAIR_CHARS,
    MAX_SCAN,
    Query,
    bounded_metadata,
    clamp_limit,
    decode_token,
    encode_token,
    micros,
    pair_hash,
    walk,
)
from . import services

router = APIRouter(dependencies=[Depends(require_api_key)])
Found = tuple[int, str, dict[str, Any]]


async def _index_of(registry: Registry, q: Query) -> str | None:
    """The index a query reads (None: only lost sandboxes can match)."""
    keys = registry.index
    pairs = [keys.pair(pair_hash(k, v)) for k, v in q.metadata.items()
             if len(k) + len(v) <= MAX_PAIR_CHARS]
    if pairs:  # the rarest pair's
        pipe = registry.redis.pipeline(transaction=False)
        for key in pairs:
            pipe.zcard(key)
        sizes = await pipe.execute()
        return min(zip(sizes, pairs, strict=True))[1]
    indexed = q.states - {"lost"}
    if not indexed:
        return None
    return keys.state(next(iter(indexed))) if len(indexed) == 1 else keys.all


async def _scan(registry: Registry, q: Query, want: int, cap: int | None
                ) -> tuple[list[Found], tuple[int, str] | None, set[str]]:
    """Up to ``want`` sandboxes of up nodes matching ``q``, in its order, after its
    cursor; when ``cap`` candidates were read first, where the reading stopped; and the
    nodes met that are down (their heartbeat's TTL lapsed: ``lost`` lists theirs)."""
    index = await _index_of(registry, q)
    down: set[str] = set()
    if index is None:
        return [], None, down
    alive: dict[str, bool] = {}
    out: list[Found] = []
    read = 0
    async for rows in walk(registry.redis, index, q, chunk=min(CHUNK, max(want * 2, 16))):
        pipe = registry.redis.pipeline(transaction=False)
        for _, sid in rows:
            pipe.hmget(registry._k("sbx", sid), "node", "state", "item")
        entries = await pipe.execute()
        new = sorted({e[0] for e in entries if e[0] and e[0] not in alive})
        if new:
            for node, up in zip(new, await registry.redis.mget(
                    [registry._k("alive", n) for n in new]), strict=True):
                alive[node] = bool(up)
        for (us, sid), (node, state, raw) in zip(rows, entries, strict=True):
            read += 1
            if node and not alive[node]:
                down.add(node)
            elif node and raw and q.in_range(us):
                try:
                    item = json.loads(raw)
                except ValueError:
                    item = None
                if isinstance(item, dict) and q.matches(item, state):
                    item["state"] = state
                    out.append((us, sid, item))
                    if len(out) >= want:
                        return out, None, down
            if cap is not None and read >= cap:
                return out, (us, sid), down
    return out, None, down


async def _down(registry: Registry, q: Query, met: set[str]) -> list[NodeStatus]:
    """The down nodes whose sandboxes a listing shows as lost: those the sweeper marked,
    and those a listing met since (every node's, for ``state=lost`` alone: no index
    was read)."""
    if not q.states - {"lost"}:
        return [n for n in await registry.nodes() if n.state == "down"]
    down = await registry.down_nodes()
    for node_id in sorted(met - {n.node_id for n in down}):
        node = await registry.node(node_id)
        if node is not None and node.state == "down":
            down.append(node)
    return down


def _query(request: Request, states: frozenset[str], desc: bool) -> Query:
    query = request.query_params
    raw_meta = query.get("metadata")
    template = query.get("template") or None
    if template and len(template) > 256:
        raise BadRequest("template longer than 256 characters")
    if len(query.getlist("state")) > 8:
        raise BadRequest("state given more than 8 times")
    bounds = []
    for name in ("startedAfter", "startedBefore"):
        raw = query.get(name)
        us = micros(raw) if raw else None
        if raw and us is None:
            raise BadRequest(f"invalid {name} {raw[:64]!r}: expected an RFC 3339 time")
        bounds.append(us)
    return Query(states=states,
                 metadata=bounded_metadata(parse_metadata(raw_meta), raw_meta),
                 template=template, after_us=bounds[0], before_us=bounds[1], desc=desc)


def _json(items: list[dict[str, Any]], headers: dict[str, str] | None = None) -> Response:
    """Items already JSON-shaped (as the nodes reported them): encoded once, not walked
    again by the framework's encoder (most of a page's CPU)."""
    return Response(json.dumps(items, separators=(",", ":")), media_type="application/json",
                    headers=headers)


@router.get("/sandboxes")
async def list_v1(request: Request) -> Response:
    """Every running sandbox (E2B's first listing: no paging), and the lost ones that can
    be resumed (as paused); O(sandboxes listed)."""
    registry = services(request).registry
    q = _query(request, frozenset({"running"}), desc=True)
    found: list[Found] = []
    met: set[str] = set()
    while True:
        page, _, down = await _scan(registry, q, MAX_SCAN, None)
        found += page
        met |= down
        if len(page) < MAX_SCAN:
            break
        q.cursor = page[-1][:2]
    q.cursor, q.states = None, frozenset({"paused"})
    found += await lost_items(registry, q, await _down(registry, q, met))
    found.sort(key=lambda f: (-f[0], f[1]))
    return _json([item for _, _, item in found])


@router.get("/v2/sandboxes")
async def list_v2(request: Request) -> Response:
    registry = services(request).registry
    query = request.query_params
    order = query.get("order")
    if order not in (None, "", "asc", "desc"):
        raise BadRequest(f"invalid order {order[:20]!r}: expected 'asc' or 'desc'")
    desc = order != "asc"  # E2B: newest first by default
    limit = clamp_limit(query.get("limit"))
    q = _query(request, parse_states(query.getlist("state")), desc)
    token = query.get("nextToken")
    if token:
        q.cursor = decode_token(token, desc)
    found, stopped, met = await _scan(registry, q, limit + 1, MAX_SCAN)
    lost = [f for f in await lost_items(registry, q, await _down(registry, q, met))
            if q.after_cursor(f[0], f[1])
            and (stopped is None or q.order_key(f[0], f[1]) <= q.order_key(*stopped))]
    found = sorted(found + lost, key=lambda f: q.order_key(f[0], f[1]))
    page = found[:limit]
    headers = {}
    if len(found) > limit:
        headers["x-next-token"] = encode_token(page[-1][0], page[-1][1], desc)
    elif stopped is not None:  # read as many as a page may: the next one goes on
        headers["x-next-token"] = encode_token(*stopped, desc)
    return _json([item for _, _, item in page], headers)
