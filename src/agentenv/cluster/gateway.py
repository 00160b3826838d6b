"""`aenv gateway`: the node API (E2B-compatible) in front of a cluster of nodes.

- Creates go to the node the scheduler picks (retried elsewhere if that node is
  full or unreachable).
- Every sandbox-scoped request, and proxied envd/port traffic (``E2b-Sandbox-Id``
  headers or ``<port>-<id>.<domain>`` Host; HTTP streams and WebSockets), goes to
  the node that owns the sandbox (``sbx:<id>`` in Redis, kept by this gateway on
  create and by nodes' heartbeats).
- A sandbox whose node is down (lost) is adopted by another node from its committed
  pause snapshot (a running one's last pause), then the request proceeds there; one
  without: 410 with a message naming the node.
- Listing merges every up node, with the gateway's own stable cursor, and the lost
  sandboxes (``lost``).
- Fork keeps children on the source node while it has room (a local fork is the
  fast path); otherwise the source is snapshotted and children are created from
  that snapshot on the nodes the scheduler picks.

This module is the gateway's API app; ``routing`` finds and talks to the nodes,
``gateway_proxy`` relays sandbox traffic.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request, Response, WebSocket
from starlette.types import ASGIApp

from .. import __version__
from .. import metrics as prometheus
from ..sandbox_api import NotFound, parse_states
from ..web import connect_websocket, relay_websocket
from ..web.console import ConsoleSessions, console_router
from ..web.errors import error_response, install_error_handlers
from ..web.keys import key_matches, require_api_key
from .common import ClusterError
from .gateway_creates import Creates, cached_as
from .gateway_proxy import GatewayProxy
from .gateway_runs import GatewayRuns, parse_body, run_of
from .gateway_templates import home_node, remember
from .lost import lost_items
from .node_registry import NodeStatus, Registry
from .routing import Gateway, error_message

log = logging.getLogger(__name__)
MAX_PAGE = 100
# How long a kill waits for a node past its heartbeat TTL (it may be dead).
LATE_NODE_TIMEOUT = httpx.Timeout(10.0, connect=3.0)
_SANDBOX_ID = re.compile(r"[a-z0-9]{1,64}")  # new_sandbox_id()'s alphabet


__all__ = ["Gateway", "GatewayProxy", "create_gateway_app"]


def _relay(r: httpx.Response) -> Response:
    headers = {k: v for k, v in r.headers.items()
               if k.lower() in ("content-type", "x-next-token", "location", "retry-after")}
    return Response(r.content, status_code=r.status_code, headers=headers)


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


def create_gateway_app(redis_url: str, scheduler_url: str, api_key: str,
                       domain: str = "localhost", queue_timeout_s: float = 30.0,
                       node_ttl_ms: int = 5000) -> ASGIApp:
    registry = Registry(redis_url)
    gw = Gateway(registry, scheduler_url, api_key)
    holder: dict[str, GatewayProxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.ping()
        unregister = prometheus.register(prometheus.HostCollector())
        try:
            yield
        finally:
            unregister()
            await holder["proxy"].close()
            await gw.close()
            await registry.close()

    # /openapi.json goes on to a node like any other path: its document, for key holders.
    app = FastAPI(title="agentenv gateway", version=__version__, lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)
    app.state.api_key = api_key
    app.state.gateway = gw
    install_error_handlers(app)
    auth = [Depends(require_api_key)]
    app.include_router(prometheus.metrics_router(require_api_key))  # before the catch-all
    runs = GatewayRuns(gw, registry)
    creates = Creates(gw, registry, queue_timeout_s, node_ttl_ms, _relay)
    runs.install(app, auth, _relay)
    app.include_router(console_router())  # the web console, before the catch-all

    @app.websocket("/ui/sandboxes/{sandbox_id}/terminal")
    async def terminal(ws: WebSocket, sandbox_id: str) -> None:
        """The console's terminal, relayed to the sandbox's node (which bridges it)."""
        if not key_matches(ws.headers.get("x-api-key"), api_key):
            await ws.close(code=4401, reason="log in at /ui/login first")
            return
        if not _SANDBOX_ID.fullmatch(sandbox_id):
            await ws.close(code=4404, reason="not a sandbox ID")
            return
        try:
            _, node = await gw.owner(sandbox_id)
            url = httpx.URL(node.url).copy_with(
                scheme="wss" if node.url.startswith("https") else "ws",
                path=f"/ui/sandboxes/{sandbox_id}/terminal", query=ws.url.query.encode())
            upstream = await connect_websocket(url, None, [("X-API-Key", api_key)])
        except (ClusterError, NotFound) as exc:
            await ws.close(code=4404, reason=str(exc)[:120])
            return
        except Exception as exc:  # the node refused or did not answer
            await ws.close(code=1011, reason=f"the sandbox's node: {exc}"[:120])
            return
        await ws.accept()
        await relay_websocket(ws.receive, ws.send, upstream)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        nodes = await registry.nodes()
        return {"status": "ok", "version": __version__,
                "nodes": {n.node_id: n.state for n in nodes}}

    @app.post("/sandboxes", dependencies=auth)
    @app.post("/v2/sandboxes", dependencies=auth)
    async def create(request: Request) -> Response:
        body = await request.body()
        parsed = parse_body(body)
        run_id = run_of(request, parsed)
        if run_id:  # on the run's node, which queues it if it must
            r, node = await runs.create_in_run(request, run_id, body)
            if r.status_code == 201:
                await registry.set_sandbox(r.json()["sandboxID"], node.node_id, "running")
            return _relay(r)
        # Placed where the template's (or image's) cache is warm, if a node has room.
        return await creates.create(request, body, cached_as(parsed))

    async def _gather(request: Request, path: str, params: dict[str, Any]
                      ) -> list[dict[str, Any]]:
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

    @app.get("/sandboxes", dependencies=auth)
    async def list_v1(request: Request) -> list[dict[str, Any]]:
        items = await _gather(request, "/sandboxes", dict(request.query_params))
        # Lost ones that can be resumed (as paused: they were running when lost).
        items += await lost_items(registry, states=frozenset({"paused"}),
                                  metadata=request.query_params.get("metadata"))
        return sorted(items, key=lambda i: (_started(i), i["sandboxID"]), reverse=True)

    @app.get("/v2/sandboxes", dependencies=auth)
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
            registry, states=parse_states(query.getlist("state")),
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

    @app.get("/sandboxes/metrics", dependencies=auth)
    async def metrics(request: Request, sandbox_ids: str = "") -> dict[str, Any]:
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

    @app.post("/sandboxes/{sandbox_id}/fork", dependencies=auth)
    async def fork(sandbox_id: str, request: Request) -> Response:
        body = await request.body()
        try:
            spec = json.loads(body or b"{}")
            count = int(spec.get("count", 1))
        except (ValueError, TypeError, AttributeError):
            raise ClusterError(400, "invalid request: count must be an integer") from None
        _, source = await gw.owner(sandbox_id)
        if source.capacity - source.effective_load >= count or not 1 <= count <= 16:
            return _relay(await gw.forward(request, source.url, body=body))
        return await _fork_across(sandbox_id, source, count, spec.get("timeout"))

    async def _fork_across(sandbox_id: str, source: NodeStatus, count: int,
                           ttl: int | None) -> Response:
        r = await gw.http.post(f"{source.url}/sandboxes/{sandbox_id}/snapshots", json={},
                               headers={"X-API-Key": api_key})
        if r.status_code != 201:
            return _relay(r)
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
            await registry.set_sandbox(created["sandboxID"], pick["nodeID"], "running")
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

    async def _kill_on_late_node(sandbox_id: str) -> Response | None:
        """The answer of the down node's kill when it gave one other than done or
        not found; None when it killed the sandbox, had none, or did not answer."""
        found = await registry.route(sandbox_id)
        if found is None or found[1] is None:
            return None
        try:
            r = await gw.http.delete(f"{found[1].url}/sandboxes/{sandbox_id}",
                                     headers={"X-API-Key": api_key},
                                     timeout=LATE_NODE_TIMEOUT)
        except httpx.HTTPError:
            return None
        return None if r.status_code in (204, 404) else _relay(r)

    @app.api_route("/sandboxes/{sandbox_id}", methods=["GET", "DELETE"], dependencies=auth)
    @app.api_route("/sandboxes/{sandbox_id}/{rest:path}", methods=["GET", "POST", "DELETE"],
                   dependencies=auth)
    @app.api_route("/v2/sandboxes/{sandbox_id}/{rest:path}", methods=["GET", "POST"],
                   dependencies=auth)
    async def sandbox_scoped(sandbox_id: str, request: Request) -> Response:
        try:
            entry, node = await gw.owner(sandbox_id)
        except ClusterError as exc:
            if request.method == "DELETE" and exc.status == 410:
                # A node past its heartbeat TTL may only be slow (a loaded machine):
                # it is asked to kill all the same, else it keeps the sandbox running.
                late = await _kill_on_late_node(sandbox_id)
                if late is not None:
                    return late
                await registry.forget_sandbox(sandbox_id)  # nothing is left to kill
                return Response(status_code=204)
            raise
        whole = request.url.path.rstrip("/").endswith(sandbox_id)
        action = request.url.path.rsplit("/", 1)[-1]
        # Read before the request: a heartbeat that comes meanwhile may count its effect.
        beat = await registry.beat(node.node_id) \
            if (request.method == "DELETE" and whole) or action == "pause" else ""
        try:
            r = await gw.forward(request, node.url)
        except httpx.HTTPError as exc:
            raise ClusterError(502, f"node {node.node_id} of sandbox '{sandbox_id}' did not "
                                    f"answer: {exc}") from exc
        if request.method == "DELETE" and r.status_code in (204, 404) and whole:
            await registry.forget_sandbox(sandbox_id)
            if r.status_code == 204 and entry.get("state") != "paused":
                await registry.release(node.node_id, beat, node_ttl_ms)
        elif r.status_code in (200, 201, 204):
            state = {"pause": "paused", "resume": "running", "connect": "running"}.get(action)
            # The gateway counts what frees or takes a slot between heartbeats.
            if state == "paused" and entry.get("state") != "paused":
                await registry.release(node.node_id, beat, node_ttl_ms)
            elif state == "running" and entry.get("state") == "paused":
                await registry.reserve(node.node_id, node_ttl_ms)
            if state:
                await registry.set_sandbox(sandbox_id, node.node_id, state,
                                           entry.get("snapshot", ""), False)
        return _relay(r)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PATCH", "PUT"],
                   dependencies=auth)
    async def anywhere(path: str, request: Request) -> Response:
        """Everything else (templates, snapshots) is the same on every node, but for
        a template's builds and own routes: the node it was created on."""
        home = await home_node(registry, request.url.path)
        nodes = [home] if home else sorted(await gw.up_nodes(), key=lambda n: n.effective_load)
        if not nodes:
            return error_response(503, "no node is up")
        try:
            r = await gw.forward(request, nodes[0].url)
        except httpx.HTTPError as exc:
            raise ClusterError(502, f"node {nodes[0].node_id} did not answer: {exc}") from exc
        await remember(registry, request.method, request.url.path, nodes[0], r)
        return _relay(r)

    proxy = GatewayProxy(prometheus.RequestCounter(ConsoleSessions(app, app.state)), gw, domain)
    holder["proxy"] = proxy
    return proxy
