"""`aenv gateway`: the node API (E2B-compatible) in front of a cluster of nodes.

- Creates go to the node the scheduler picks (retried elsewhere if that node is
  full or unreachable).
- Every sandbox-scoped request, and proxied envd/port traffic (``E2b-Sandbox-Id``
  headers or ``<port>-<id>.<domain>`` Host; HTTP streams and WebSockets), goes to
  the node that owns the sandbox (``sbx:<id>`` in Redis, kept by this gateway on
  create and by nodes' heartbeats).
- A paused sandbox whose node is down is adopted by another node from its
  committed pause snapshot, then the request proceeds there. A running sandbox
  on a down node is lost: 410 with a message naming the node.
- Listing merges every up node, with the gateway's own stable cursor.
- Fork keeps children on the source node while it has room (a local fork is the
  fast path); otherwise the source is snapshotted and children are created from
  that snapshot on the nodes the scheduler picks.
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
from urllib.parse import parse_qsl

import httpx
import websockets
from fastapi import Depends, FastAPI, Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send
from websockets.asyncio.client import connect as ws_connect

from .. import __version__
from ..api.errors import error_response, install_error_handlers
from ..envd.protocol import ENVD_PORT
from ..orchestrator import NotFound
from ..web import (
    SANDBOX_ID_HEADER,
    SANDBOX_PORT_HEADER,
    BadTarget,
    forwarded_headers,
    relay_client,
    relay_http,
    relay_websocket,
    send_error,
    upstream_url,
)
from ..web.keys import require_api_key
from ..web.routing import SandboxRouting
from .common import ClusterError
from .registry import NodeStatus, Registry

log = logging.getLogger(__name__)
MAX_PAGE = 100
# What a sandbox ID can be (new_sandbox_id); anything else is never asked of nodes.
SANDBOX_ID = re.compile(r"[a-z0-9]{1,64}")
# Headers that belong to one hop, or that httpx sets itself.
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
        "te", "trailer"}


class Gateway:
    def __init__(self, registry: Registry, scheduler_url: str, api_key: str) -> None:
        self.registry = registry
        self.scheduler = scheduler_url.rstrip("/")
        self.api_key = api_key
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=3.0, read=600.0, write=60.0, pool=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            trust_env=False,
        )

    async def close(self) -> None:
        await self.http.aclose()

    # -- the scheduler ------------------------------------------------------------

    async def place(self, *, template: str = "", snapshot: str = "", count: int = 1,
                    exclude: list[str] | None = None, runtime: tuple[str, str] = ("", "")
                    ) -> list[dict[str, str]]:
        body = {"template": template, "snapshot": snapshot, "count": count,
                "exclude": exclude or [], "runtimeKind": runtime[0],
                "runtimeVersion": runtime[1]}
        try:
            r = await self.http.post(f"{self.scheduler}/placements", json=body,
                                     headers={"X-API-Key": self.api_key})
        except httpx.HTTPError as exc:
            raise ClusterError(503, f"scheduler unreachable: {exc}") from exc
        if r.status_code != 200:
            raise ClusterError(r.status_code, _message(r))
        return r.json()["nodes"]

    async def up_nodes(self) -> list[NodeStatus]:
        return [n for n in await self.registry.nodes() if n.state == "up"]

    # -- forwarding ---------------------------------------------------------------

    async def forward(self, request: Request, node_url: str, body: bytes | None = None,
                      path: str | None = None, params: Any = None) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["x-api-key"] = self.api_key
        content = body if body is not None else await request.body()
        # The node's URL is the scheduler's; the path is the client's, as it sent it
        # (raw: decoding first would let %2F or %3F change which route it names).
        raw_path = path.encode() if path is not None else request.scope["raw_path"]
        try:
            url = httpx.URL(node_url).copy_with(raw_path=raw_path)
        except httpx.InvalidURL as exc:
            raise ClusterError(400, f"invalid request path: {exc}") from None
        return await self.http.request(
            request.method, url,
            params=params if params is not None else request.query_params,
            headers=headers, content=content or None,
        )

    async def owner(self, sandbox_id: str) -> tuple[dict[str, str], NodeStatus]:
        """The sandbox's entry and its node; a paused sandbox of a down node is first
        adopted by another node; a running one there is reported lost (410)."""
        found = await self.registry.route(sandbox_id) or await self._find(sandbox_id)
        if found is None:
            raise NotFound(f"sandbox '{sandbox_id}' not found")
        entry, node = found
        if node is not None and node.state == "up":
            return entry, node
        if entry.get("state") == "paused" and entry.get("committed") == "1":
            return await self._adopt(sandbox_id, entry, node)
        hint = (f"; its last committed snapshot {entry['snapshot']} can be started with "
                f"templateID={entry['snapshot']}" if entry.get("snapshot") else "")
        raise ClusterError(410, f"sandbox '{sandbox_id}' was {entry.get('state', 'running')} on "
                                f"node {entry['node']}, which is down: its running state is "
                                f"lost{hint}")

    async def _find(self, sandbox_id: str
                    ) -> tuple[dict[str, str], NodeStatus | None] | None:
        """A sandbox no heartbeat told of yet (made on a node directly, or just
        after a node restarted): every up node is asked, and the owner recorded."""
        if not SANDBOX_ID.fullmatch(sandbox_id):
            return None

        async def ask(node: NodeStatus) -> str | None:
            try:
                r = await self.http.get(f"{node.url}/sandboxes/{sandbox_id}",
                                        headers={"X-API-Key": self.api_key})
            except httpx.HTTPError:
                return None
            return r.json().get("state") if r.status_code == 200 else None

        nodes = await self.up_nodes()
        for node, state in zip(nodes, await asyncio.gather(*(ask(n) for n in nodes)),
                               strict=True):
            if state:
                await self.registry.set_sandbox(sandbox_id, node.node_id, state)
                return await self.registry.route(sandbox_id)
        return None

    async def signer(self, query: str) -> str | None:
        """The sandbox that signed a ``/files`` URL: every up node is asked (each
        knows only its own sandboxes' envd tokens)."""
        params = dict(parse_qsl(query, keep_blank_values=True))
        params["operation"] = params.pop("_operation", "read")

        async def ask(node: NodeStatus) -> str | None:
            try:
                r = await self.http.get(f"{node.url}/cluster/signers", params=params,
                                        headers={"X-API-Key": self.api_key})
            except httpx.HTTPError:
                return None
            return r.json().get("sandboxID") if r.status_code == 200 else None

        found = await asyncio.gather(*(ask(n) for n in await self.up_nodes()))
        return next((sid for sid in found if sid), None)

    async def _adopt(self, sandbox_id: str, entry: dict[str, str], dead: NodeStatus | None
                     ) -> tuple[dict[str, str], NodeStatus]:
        runtime = (dead.runtime_kind, dead.runtime_version) if dead else ("", "")
        exclude = [entry["node"]]
        for _ in range(3):
            pick = (await self.place(snapshot=entry["snapshot"], exclude=exclude,
                                     runtime=runtime))[0]
            try:
                r = await self.http.post(
                    f"{pick['url']}/cluster/sandboxes/{sandbox_id}/adopt",
                    json={"snapshotID": entry["snapshot"]}, headers={"X-API-Key": self.api_key})
            except httpx.HTTPError:
                exclude.append(pick["nodeID"])
                continue
            if r.status_code != 201:
                raise ClusterError(r.status_code, _message(r))
            log.info("sandbox %s (paused on down node %s) adopted by node %s", sandbox_id,
                     entry["node"], pick["nodeID"])
            await self.registry.set_sandbox(sandbox_id, pick["nodeID"], "paused",
                                            entry["snapshot"], True)
            node = await self.registry.node(pick["nodeID"])
            assert node is not None
            return await self.registry.sandbox(sandbox_id) or entry, node
        raise ClusterError(503, f"no node could take over paused sandbox '{sandbox_id}'")


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message") or r.text)
    except ValueError:
        return r.text or f"HTTP {r.status_code}"


def _relay(r: httpx.Response) -> Response:
    headers = {k: v for k, v in r.headers.items()
               if k.lower() in ("content-type", "x-next-token", "location")}
    return Response(r.content, status_code=r.status_code, headers=headers)


def _started(item: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(item.get("startedAt", "1970-01-01T00:00:00+00:00"))
                                  .replace("Z", "+00:00"))


def _cursor(item: dict[str, Any]) -> str:
    raw = json.dumps([item["startedAt"], item["sandboxID"]]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(token: str) -> tuple[datetime, str]:
    try:
        started, sid = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return _started({"startedAt": started}), str(sid)
    except (ValueError, TypeError, binascii.Error):
        raise ClusterError(400, "invalid nextToken") from None


class GatewayProxy:
    """Sandbox traffic (HTTP streams and WebSockets) relayed to the node that owns the
    sandbox, as ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers (a Host-routed
    request is rewritten to them); the node's own proxy takes it from there, so
    every header it checks (access and traffic tokens) goes through untouched."""

    def __init__(self, app: ASGIApp, gateway: Gateway, domain: str) -> None:
        self.app = app
        self.gateway = gateway
        self.routing = SandboxRouting(domain)
        self._http = relay_client(
            httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def close(self) -> None:
        await self._http.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            target = (self.routing.target(scope) if scope["type"] in ("http", "websocket")
                      else None)
        except BadTarget as exc:
            await send_error(scope, send, 400, str(exc))
            return
        if target is None and scope["type"] == "http" and scope["path"] == "/files":
            query = (scope.get("query_string") or b"").decode("latin-1")
            if "signature=" in query:  # a signed URL names its sandbox by signature only
                operation = "read" if scope["method"] == "GET" else "write"
                sid = await self.gateway.signer(f"{query}&_operation={operation}")
                if sid is None:
                    await send_error(scope, send, 401, "the file URL's signature matches no "
                                     "running sandbox (or it is for the other operation)")
                    return
                target = (sid, ENVD_PORT)
        if target is None:
            await self.app(scope, receive, send)
            return
        sandbox_id, port = target
        scheme = "ws" if scope["type"] == "websocket" else "http"
        try:
            # Checked before the owner is looked up: a bad target costs no Redis call.
            upstream_url(scheme, "node", None, scope)
            _, node = await self.gateway.owner(sandbox_id)
        except BadTarget as exc:
            await send_error(scope, send, 400, str(exc))
            return
        except NotFound:
            await send_error(scope, send, 502, f"The sandbox {sandbox_id} was not found")
            return
        except ClusterError as exc:
            await send_error(scope, send, 502, str(exc))
            return
        headers = forwarded_headers(scope)
        headers += [(SANDBOX_ID_HEADER.encode(), sandbox_id.encode()),
                    (SANDBOX_PORT_HEADER.encode(), str(port).encode())]
        node_url = httpx.URL(node.url)
        url = upstream_url(scheme, node_url.host, node_url.port, scope)
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send, url, headers)
            return
        try:
            await relay_http(self._http, scope, receive, send, url, headers)
        except httpx.HTTPError as exc:
            await send_error(scope, send, 502, f"node {node.node_id} did not answer: {exc}")

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, url: httpx.URL,
                         headers: list[tuple[bytes, bytes]]) -> None:
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        skip = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                "sec-websocket-protocol"}
        extra = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers
                 if k.decode("latin-1").lower() not in skip]
        try:
            upstream = await ws_connect(str(url), additional_headers=extra,
                                        subprotocols=scope.get("subprotocols") or None,
                                        open_timeout=10, max_size=None, proxy=None)
        except websockets.InvalidStatus as exc:
            await send({"type": "websocket.close", "code": 1011,
                        "reason": f"node refused: HTTP {exc.response.status_code}"})
            return
        except (OSError, websockets.InvalidHandshake, TimeoutError) as exc:
            await send({"type": "websocket.close", "code": 1011, "reason": str(exc)[:120]})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        await relay_websocket(receive, send, upstream)


def create_gateway_app(redis_url: str, scheduler_url: str, api_key: str,
                       domain: str = "localhost") -> ASGIApp:
    registry = Registry(redis_url)
    gw = Gateway(registry, scheduler_url, api_key)
    holder: dict[str, GatewayProxy] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.ping()
        try:
            yield
        finally:
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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        nodes = await registry.nodes()
        return {"status": "ok", "version": __version__,
                "nodes": {n.node_id: n.state for n in nodes}}

    @app.post("/sandboxes", dependencies=auth)
    @app.post("/v2/sandboxes", dependencies=auth)
    async def create(request: Request) -> Response:
        body = await request.body()
        try:
            template = str(json.loads(body or b"{}").get("templateID") or "")
        except (ValueError, AttributeError):
            raise ClusterError(400, "invalid request: body must be a JSON object") from None
        exclude: list[str] = []
        last: httpx.Response | None = None
        for _ in range(3):
            try:
                pick = (await gw.place(template=template, snapshot=template,
                                       exclude=exclude))[0]
            except ClusterError:
                if last is not None:
                    return _relay(last)
                raise
            try:
                r = await gw.forward(request, pick["url"], body=body)
            except httpx.HTTPError as exc:
                log.warning("create on node %s failed: %s", pick["nodeID"], exc)
                exclude.append(pick["nodeID"])
                continue
            if r.status_code == 503:  # full after all: the next best node
                exclude.append(pick["nodeID"])
                last = r
                continue
            if r.status_code == 201:
                await registry.set_sandbox(r.json()["sandboxID"], pick["nodeID"], "running")
            return _relay(r)
        if last is not None:
            return _relay(last)
        raise ClusterError(503, "no node could create the sandbox; retry later")

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
                    raise ClusterError(r.status_code, _message(r))
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
        return sorted(items, key=lambda i: (_started(i), i["sandboxID"]))

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
        desc = request.query_params.get("order") == "desc"
        params["limit"] = str(MAX_PAGE)
        items = sorted(await _gather(request, "/v2/sandboxes", params),
                       key=lambda i: (_started(i), i["sandboxID"]), reverse=desc)
        token = request.query_params.get("nextToken")
        if token:
            cursor = _decode_cursor(token)
            items = [i for i in items if ((_started(i), i["sandboxID"]) < cursor if desc
                                          else (_started(i), i["sandboxID"]) > cursor)]
        page = items[:limit]
        if len(items) > limit and page:
            response.headers["x-next-token"] = _cursor(page[-1])
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
                return {"error": {"code": c.status_code, "message": _message(c)}}
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
                await registry.forget_sandbox(sandbox_id)  # nothing is left to kill
                return Response(status_code=204)
            raise
        try:
            r = await gw.forward(request, node.url)
        except httpx.HTTPError as exc:
            raise ClusterError(502, f"node {node.node_id} of sandbox '{sandbox_id}' did not "
                                    f"answer: {exc}") from exc
        if request.method == "DELETE" and r.status_code in (204, 404) and \
                request.url.path.rstrip("/").endswith(sandbox_id):
            await registry.forget_sandbox(sandbox_id)
        elif r.status_code in (200, 201, 204):
            state = {"pause": "paused", "resume": "running", "connect": "running"}.get(
                request.url.path.rsplit("/", 1)[-1])
            if state:
                await registry.set_sandbox(sandbox_id, node.node_id, state,
                                           entry.get("snapshot", ""), False)
        return _relay(r)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PATCH", "PUT"],
                   dependencies=auth)
    async def anywhere(path: str, request: Request) -> Response:
        """Everything else (templates, snapshots) is the same on every node."""
        nodes = sorted(await gw.up_nodes(), key=lambda n: n.effective_load)
        if not nodes:
            return error_response(503, "no node is up")
        try:
            return _relay(await gw.forward(request, nodes[0].url))
        except httpx.HTTPError as exc:
            raise ClusterError(502, f"node {nodes[0].node_id} did not answer: {exc}") from exc

    proxy = GatewayProxy(app, gw, domain)
    holder["proxy"] = proxy
    return proxy
