"""The gateway's sandbox routes: creates (placed by the scheduler, or on a run's node),
metrics across nodes, and every sandbox-scoped request, sent to the sandbox's node
with the room it frees or takes counted between heartbeats."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import httpx
from fastapi import APIRouter, Depends, Request, Response

from ...sandbox_api import NotFound
from ...web.keys import caller, require_api_key
from ..common import ClusterError
from ..gateway_creates import cached_as, valid_key
from ..gateway_runs import parse_body, run_of
from ..routing import listed_item
from . import GatewayServices, relay, services

router = APIRouter(dependencies=[Depends(require_api_key)])
# How long a kill waits for a node past its heartbeat TTL (it may be dead).
LATE_NODE_TIMEOUT = httpx.Timeout(10.0, connect=3.0)


@router.post("/sandboxes")
@router.post("/v2/sandboxes")
async def create(request: Request) -> Response:
    svc = services(request)
    body = await request.body()
    parsed = parse_body(body)
    run_id = run_of(request, parsed)
    owner = caller(request)
    counted = svc.quotas.limit(owner) > 0
    token = ""
    if counted:  # the key's quota across the cluster (a retry of a create sent is in it)
        key = request.headers.get("idempotency-key", "")
        if not (valid_key(key) and await svc.creates.keyed.node_of(key)):
            token = await svc.quotas.admit(
                owner, time.monotonic() + svc.creates.queue_timeout_s, request.is_disconnected)
    made = ""
    try:
        if run_id:  # on the run's node, which queues it if it must
            r, node = await svc.runs.create_in_run(request, run_id, body)
            if r.status_code == 201:
                made = r.json()["sandboxID"]
                await svc.registry.set_sandbox(made, node.node_id, "running",
                                               item=listed_item(r))
            answer = relay(r)
        else:
            # Placed where the template's (or image's) cache is warm, if a node has room.
            answer = await svc.creates.create(request, body, cached_as(parsed))
            if answer.status_code == 201:
                made = json.loads(bytes(answer.body))["sandboxID"]
        if made and counted:
            await svc.quotas.made(owner, token, made)
    finally:
        if not (made and counted):
            await svc.quotas.unclaim(owner, token)
    return answer


@router.get("/sandboxes/metrics")
async def metrics(request: Request, sandbox_ids: str = "") -> dict[str, Any]:
    gw = services(request).gw
    ids = [s for s in dict.fromkeys(x.strip() for x in sandbox_ids.split(",")) if s]
    if not ids:
        raise ClusterError(400, "sandbox_ids must name at least one sandbox")
    by_node: dict[str, list[str]] = {}
    urls: dict[str, str] = {}
    for sid in ids:
        with contextlib.suppress(NotFound, ClusterError):
            _, node = await gw.owner(sid)
            by_node.setdefault(node.node_id, []).append(sid)
            urls[node.node_id] = node.url
    out: dict[str, Any] = {}
    for nid, sids in by_node.items():
        r = await gw.forward(request, urls[nid], body=b"",
                             params={"sandbox_ids": ",".join(sids)})
        if r.status_code == 200:
            out.update(r.json().get("sandboxes", {}))
    return {"sandboxes": out}


async def _kill_on_late_node(svc: GatewayServices, sandbox_id: str) -> Response | None:
    """The answer of the down node's kill when it gave one other than done or
    not found; None when it killed the sandbox, had none, or did not answer."""
    found = await svc.registry.route(sandbox_id)
    if found is None or found[1] is None:
        return None
    try:
        r = await svc.gw.http.delete(f"{found[1].url}/sandboxes/{sandbox_id}",
                                     headers={"X-API-Key": svc.api_key},
                                     timeout=LATE_NODE_TIMEOUT)
    except httpx.HTTPError:
        return None
    return None if r.status_code in (204, 404) else relay(r)


@router.api_route("/sandboxes/{sandbox_id}", methods=["GET", "DELETE"])
@router.api_route("/sandboxes/{sandbox_id}/{rest:path}", methods=["GET", "POST", "DELETE"])
@router.api_route("/v2/sandboxes/{sandbox_id}/{rest:path}", methods=["GET", "POST"])
async def sandbox_scoped(sandbox_id: str, request: Request) -> Response:
    svc = services(request)
    registry, node_ttl_ms = svc.registry, svc.node_ttl_ms
    try:
        entry, node = await svc.gw.owner(sandbox_id)
    except ClusterError as exc:
        if request.method == "DELETE" and exc.status == 410:
            # A node past its heartbeat TTL may only be slow (a loaded machine):
            # it is asked to kill all the same, else it keeps the sandbox running.
            late = await _kill_on_late_node(svc, sandbox_id)
            if late is not None:
                return late
            lost = await registry.sandbox(sandbox_id) or {}
            await svc.quotas.ended(sandbox_id, lost.get("key"))
            await registry.forget_sandbox(sandbox_id)  # nothing is left to kill
            return Response(status_code=204)
        raise
    whole = request.url.path.rstrip("/").endswith(sandbox_id)
    action = request.url.path.rsplit("/", 1)[-1]
    # A paused sandbox resumed runs again: its caller's quota admits it first.
    owner = caller(request)
    wakes = request.method == "POST" and action in ("resume", "connect") \
        and entry.get("state") == "paused" and svc.quotas.limit(owner) > 0
    token = await svc.quotas.admit(owner, time.monotonic() + svc.creates.queue_timeout_s,
                                   request.is_disconnected) if wakes else ""
    try:
        r = await svc.gw.forward(request, node.url)
    except httpx.HTTPError as exc:
        await svc.quotas.unclaim(owner, token)
        raise ClusterError(502, f"node {node.node_id} of sandbox '{sandbox_id}' did not "
                                f"answer: {exc}") from exc
    if wakes and r.status_code in (200, 201):
        await svc.quotas.made(owner, token, sandbox_id)
    else:
        await svc.quotas.unclaim(owner, token)
    if (request.method == "DELETE" and whole and r.status_code in (204, 404)) or \
            (action == "pause" and r.status_code in (200, 204)):
        await svc.quotas.ended(sandbox_id, entry.get("key"))
    if request.method == "DELETE" and r.status_code in (204, 404) and whole:
        await registry.forget_sandbox(sandbox_id)
        if r.status_code == 204 and entry.get("state") != "paused":
            await registry.free(node.node_id, sandbox_id, node_ttl_ms)
    elif r.status_code in (200, 201, 204):
        state = {"pause": "paused", "resume": "running", "connect": "running"}.get(action)
        # The gateway counts what frees or takes a slot between heartbeats.
        if state == "paused" and entry.get("state") != "paused":
            await registry.free(node.node_id, sandbox_id, node_ttl_ms)
        elif state == "running" and entry.get("state") == "paused":
            await registry.take(node.node_id, sandbox_id, node_ttl_ms)
        if state:
            await registry.set_sandbox(sandbox_id, node.node_id, state,
                                       entry.get("snapshot", ""), False)
    return relay(r)
