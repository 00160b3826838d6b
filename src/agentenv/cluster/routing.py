"""The gateway's view of the cluster: which node a request goes to, and sending it there.

Placement (from the gateway's own view of the nodes: ``placer``), forwarding a
request to a node, finding the node that owns a sandbox (asking every node when Redis
does not know it yet), the signer of a ``/files`` URL, and adoption of a paused
sandbox whose node is down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any
from urllib.parse import parse_qsl

import httpx
from fastapi import Request

from .. import metrics
from ..sandbox_api import LISTED_HEADER, NotFound
from .common import ClusterError
from .node_registry import NodeStatus, Registry
from .placement import PlacementRequest
from .placer import Placer

# The gateway's logger: these are its decisions, wherever the code lives.
log = logging.getLogger("agentenv.cluster.gateway")
# What a sandbox ID can be (new_sandbox_id); anything else is never asked of nodes.
SANDBOX_ID = re.compile(r"[a-z0-9]{1,64}")
# Headers that belong to one hop, or that httpx sets itself.
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
        "te", "trailer"}


class Gateway:
    """The gateway's client of the scheduler and the nodes (one shared HTTP pool)."""

    def __init__(self, registry: Registry, api_key: str, node_ttl_ms: int = 5000) -> None:
        self.registry = registry
        self.api_key = api_key
        # Placements are made here, from this gateway's own view of the nodes (a hop
        # to a scheduler cost more than the placement: placer.py reserves each pick's
        # room atomically in Redis, so gateways and schedulers side by side never
        # overfill a node).
        self.placer = Placer(registry, node_ttl_ms)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=3.0, read=600.0, write=60.0, pool=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
            trust_env=False,
        )

    async def close(self) -> None:
        await self.placer.close()
        await self.http.aclose()

    # -- placement ----------------------------------------------------------------

    async def place(self, *, template: str = "", snapshot: str = "", count: int = 1,
                    exclude: list[str] | None = None, runtime: tuple[str, str] = ("", "")
                    ) -> list[dict[str, str]]:
        req = PlacementRequest(template=template, snapshot=snapshot, count=count,
                               exclude=exclude or [], runtime_kind=runtime[0],
                               runtime_version=runtime[1])
        picks = await self.placer.place(req)
        metrics.PLACEMENTS.labels("placed" if picks else "refused").inc()
        if not picks:
            raise ClusterError(503, "no node can take the sandbox: every node is down, full "
                                    "or of another runtime; retry later")
        return [{"nodeID": p.node_id, "url": p.url, "beat": beat} for p, beat in picks]

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
        if resumable(entry):
            return await self._adopt(sandbox_id, entry, node)
        raise ClusterError(410, f"sandbox '{sandbox_id}' was {entry.get('state', 'running')} on "
                                f"node {entry['node']}, which is down (no heartbeat within its "
                                f"TTL): the sandbox is lost, and it has no committed pause "
                                f"snapshot to be resumed from")

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
                raise ClusterError(r.status_code, error_message(r))
            log.info("sandbox %s (%s on down node %s) adopted by node %s from its pause "
                     "snapshot %s", sandbox_id, entry.get("state"), entry["node"],
                     pick["nodeID"], entry["snapshot"])
            await self.registry.set_sandbox(sandbox_id, pick["nodeID"], "paused",
                                            entry["snapshot"], True)
            node = await self.registry.node(pick["nodeID"])
            assert node is not None
            return await self.registry.sandbox(sandbox_id) or entry, node
        raise ClusterError(503, f"no node could take over paused sandbox '{sandbox_id}'")


def resumable(entry: dict[str, str]) -> bool:
    """Whether a sandbox of a down node can be taken over by another: paused, or
    running (then from its last pause, what it ran since is lost), with that pause
    snapshot committed to the shared repository."""
    return entry.get("state") in ("paused", "running") and entry.get("committed") == "1" \
        and bool(entry.get("snapshot"))


def listed_item(r: httpx.Response) -> dict[str, Any] | None:
    """The sandbox as listings show it, from a node's create answer (``LISTED_HEADER``;
    None from a node that did not send it: its heartbeat indexes it a moment later)."""
    raw = r.headers.get(LISTED_HEADER, "")
    if not raw or len(raw) > 65536:
        return None
    try:
        item = json.loads(raw)
    except ValueError:
        return None
    return item if isinstance(item, dict) else None


def error_message(r: httpx.Response) -> str:
    """The message of a node's or the scheduler's error answer."""
    try:
        return str(r.json().get("message") or r.text)
    except ValueError:
        return r.text or f"HTTP {r.status_code}"
