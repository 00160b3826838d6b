"""The gateway's listings: every up node's sandboxes, page by page, merged with the
lost ones (``lost``), under the gateway's own stable cursor."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from datetime import datetime
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request, Response

from ...sandbox_api import parse_states
from ...web.keys import require_api_key
from ..common import ClusterError, NodeStatus
from ..lost import lost_items
from ..routing import error_message
from . import services

log = logging.getLogger("agentenv.cluster.gateway")
router = APIRouter(dependencies=[Depends(require_api_key)])
MAX_PAGE = 100


def _started(item: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(item.get("startedAt", "1970-01-01T00:00:00+00:00"))
                                  .replace("Z", "+00:00"))


def _order(desc: bool) -> str:
    return "desc" if desc else "asc"


def _cursor(item: dict[str, Any], desc: bool) -> str:
    raw = json.dumps([item["startedAt"], item["sandboxID"], _order(desc)]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(token: str, desc: bool) -> tuple[datetime, str]:
    """The cursor of a page listed in the same order (replayed in the other order it
    would hand out again what was seen: refused, as E2B and the nodes do)."""
    try:
        started, sid, order = json.loads(
            base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        cursor = _started({"startedAt": started}), str(sid)
    except (ValueError, TypeError, binascii.Error):
        raise ClusterError(400, "invalid nextToken") from None
    if order != _order(desc):
        raise ClusterError(400, f"invalid nextToken: it was issued for order={order}, "
                                f"not order={_order(desc)}")
    return cursor


async def _gather(request: Request, path: str, params: dict[str, Any]
                  ) -> list[dict[str, Any]]:
    gw = services(request).gw

    async def one(node: NodeStatus) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        query = dict(params)
        while True:
            try:
                r = await gw.forward(request, node.url, body=b"", path=path, params=query)
            except httpx.HTTPError as exc:
                log.warning("listing node %s failed: %s", node.node_id, exc)
                return out
            if r.status_code != 200:
                raise ClusterError(r.status_code, error_message(r))
            out += r.json()
            token = r.headers.get("x-next-token")
            if not token:
                return out
            query["nextToken"] = token

    lists = await asyncio.gather(*(one(n) for n in await gw.up_nodes()))
    return [item for sub in lists for item in sub]


@router.get("/sandboxes")
async def list_v1(request: Request) -> list[dict[str, Any]]:
    items = await _gather(request, "/sandboxes", dict(request.query_params))
    # Lost ones that can be resumed (as paused: they were running when lost).
    items += await lost_items(services(request).registry, states=frozenset({"paused"}),
                              metadata=request.query_params.get("metadata"))
    return sorted(items, key=lambda i: (_started(i), i["sandboxID"]), reverse=True)


@router.get("/v2/sandboxes")
async def list_v2(request: Request, response: Response) -> list[dict[str, Any]]:
    params = {k: v for k, v in request.query_params.multi_items()
              if k not in ("limit", "nextToken")}
    if request.query_params.getlist("state"):
        params["state"] = ",".join(request.query_params.getlist("state"))
    raw_limit = request.query_params.get("limit")
    limit = int(raw_limit) if raw_limit and raw_limit.isdigit() else MAX_PAGE
    if not 1 <= limit <= MAX_PAGE:
        raise ClusterError(400, f"limit must be between 1 and {MAX_PAGE}")
    desc = request.query_params.get("order") != "asc"  # E2B: newest first by default
    params["limit"] = str(MAX_PAGE)
    found = await _gather(request, "/v2/sandboxes", params)
    query = request.query_params
    found += await lost_items(
        services(request).registry, states=parse_states(query.getlist("state")),
        metadata=query.get("metadata"), template=query.get("template"),
        started_after=query.get("startedAfter"), started_before=query.get("startedBefore"))
    items = sorted(found, key=lambda i: (_started(i), i["sandboxID"]), reverse=desc)
    token = request.query_params.get("nextToken")
    if token:
        cursor = _decode_cursor(token, desc)
        items = [i for i in items if ((_started(i), i["sandboxID"]) < cursor if desc
                                      else (_started(i), i["sandboxID"]) > cursor)]
    page = items[:limit]
    if len(items) > limit and page:
        response.headers["x-next-token"] = _cursor(page[-1], desc)
    return page
