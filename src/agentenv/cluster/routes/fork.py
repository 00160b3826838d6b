"""Fork through the gateway: children stay on the source node while it has room (a
local fork is the fast path); otherwise the source is snapshotted and children are
created from that snapshot on the nodes the gateway picks. The children count under
the caller key's quota across the cluster (``quotas``): all of them fit, or the fork
waits for room up to the queue time, then 429."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request, Response

from ...web.keys import caller, require_api_key
from ..common import ClusterError, NodeStatus
from ..routing import error_message, listed_item
from . import GatewayServices, relay, services

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork(sandbox_id: str, request: Request) -> Response:
    svc = services(request)
    body = await request.body()
    try:
        spec = json.loads(body or b"{}")
        count = int(spec.get("count", 1))
    except (ValueError, TypeError, AttributeError):
        raise ClusterError(400, "invalid request: count must be an integer") from None
    _, source = await svc.gw.owner(sandbox_id)
    if not 1 <= count <= 16:  # the node's 400
        return relay(await svc.gw.forward(request, source.url, body=body))
    # The children count under the caller key's quota across the cluster, as creates do.
    owner = caller(request)
    tokens = await svc.quotas.admit_many(
        owner, count, time.monotonic() + svc.creates.queue_timeout_s, request.is_disconnected)
    made: list[str] = []
    try:
        if source.capacity - source.effective_load >= count:
            answer = relay(await svc.gw.forward(request, source.url, body=body))
            local = True
        else:
            answer = await _fork_across(svc, sandbox_id, source, count, spec.get("timeout"))
            local = False
        made = _children(answer)
        for sid, token in zip(made, tokens, strict=False):
            if local:  # a child across nodes was recorded as it was made
                await svc.registry.set_sandbox(sid, source.node_id, "running")
            await svc.quotas.made(owner, token, sid)
    finally:
        for token in tokens[len(made):]:
            await svc.quotas.unclaim(owner, token)
    return answer


def _children(answer: Response) -> list[str]:
    """The sandboxes a fork's answer names (its children that were made)."""
    if answer.status_code != 201:
        return []
    try:
        results = json.loads(bytes(answer.body))
    except ValueError:
        return []
    return [str(c["sandbox"]["sandboxID"]) for c in results
            if isinstance(c, dict) and isinstance(c.get("sandbox"), dict)
            and c["sandbox"].get("sandboxID")] if isinstance(results, list) else []


async def _fork_across(svc: GatewayServices, sandbox_id: str, source: NodeStatus, count: int,
                       ttl: int | None) -> Response:
    gw, api_key = svc.gw, svc.api_key
    r = await gw.http.post(f"{source.url}/sandboxes/{sandbox_id}/snapshots", json={},
                           headers={"X-API-Key": api_key})
    if r.status_code != 201:
        return relay(r)
    snapshot = r.json()["snapshotID"]
    error: ClusterError | None = None
    try:
        picks = await gw.place(snapshot=snapshot, count=count,
                               runtime=(source.runtime_kind, source.runtime_version))
    except ClusterError as exc:
        picks, error = [], exc

    async def child(pick: dict[str, str]) -> dict[str, Any]:
        payload: dict[str, Any] = {"templateID": snapshot}
        if ttl is not None:
            payload["timeout"] = ttl
        try:
            c = await gw.http.post(f"{pick['url']}/sandboxes", json=payload,
                                   headers={"X-API-Key": api_key})
        except httpx.HTTPError as exc:
            return {"error": {"code": 502, "message": f"node {pick['nodeID']}: {exc}"}}
        if c.status_code != 201:
            return {"error": {"code": c.status_code, "message": error_message(c)}}
        created = c.json()
        await svc.registry.set_sandbox(created["sandboxID"], pick["nodeID"], "running",
                                       item=listed_item(c))
        return {"sandbox": created}

    try:
        results = list(await asyncio.gather(*(child(p) for p in picks)))
    finally:
        # The children stand on their own once restored: the snapshot can go.
        with contextlib.suppress(httpx.HTTPError):
            await gw.http.delete(f"{source.url}/snapshots/{snapshot}",
                                 headers={"X-API-Key": api_key})
    short = count - len(results)
    if short:
        message = str(error) if error else "no node has room for this child"
        results += [{"error": {"code": 503, "message": message}}] * short
    return Response(json.dumps(results), status_code=201, media_type="application/json")
