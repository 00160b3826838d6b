"""Simulated cluster nodes: many in one asyncio process, for testing and measuring the
control plane (gateway, scheduler, Redis) at fleet scale on one machine.

Each simulated node speaks the real cluster protocol and holds no sandbox, only its
records:

- it heartbeats to the scheduler (``POST /nodes/heartbeat``, a real ``NodeStatus``
  with a ``SandboxEntry`` per sandbox and its listing item, whole or as a diff, as a
  real node's ``Beats`` make them) every ``heartbeat_s``, and drops the sandboxes the
  answer tells it to disown;
- it answers the node API the gateway calls, with the node's status codes and body
  shapes: create (201; 503 when full), get, list (v1, and v2 paginated with
  ``x-next-token``), kill, pause, resume, connect, timeout, local fork, snapshots of a
  sandbox (for a fork across nodes) and their deletion, adoption of a paused sandbox
  of a lost node, metrics, signers and runs (none), templates (none), health.

Every simulated node listens on a port of its own on one address, all served by one
uvicorn server; the node a request is for is the port it came to. ``latency_s`` is
added to every answer, ``create_s`` to a create, and ``failure_rate`` of creates answer
500. A node's ``heartbeating`` off is a heartbeat lapse: the scheduler marks it down
after its TTL while it still answers (a slow or cut-off node, as the gateway expects).

Run it in a thread of the caller (``sim_cluster.running``), or as its own process:
``python -m agentenv.testing.sim_nodes --nodes 100 --scheduler-url URL`` (the API key
in ``AENV_SIM_API_KEY``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import resource
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import parse_qs

import httpx
import uvicorn

from ..cluster.beats import send_beat
from ..cluster.common import Failover
from ..sandbox_api import LISTED_HEADER
from .sim_records import Answer, Behaviour, SimNode, SimSandbox, new_id

HEARTBEATS_IN_FLIGHT = 32


def _error(status: int, message: str) -> Answer:
    return status, {"code": status, "message": message}, {}


class SimNodes:
    """``count`` simulated nodes heartbeating to ``scheduler_url``."""

    def __init__(self, count: int, scheduler_url: str, api_key: str,
                 behaviour: Behaviour | None = None, host: str = "127.0.0.1") -> None:
        self.count = count
        self.scheduler_url = scheduler_url
        self.api_key = api_key
        self.behaviour = behaviour or Behaviour()
        self.host = host
        self.nodes: list[SimNode] = []
        self.by_port: dict[int, SimNode] = {}
        # Requests answered, by route ("create", "list", "heartbeat", ...).
        self.requests: Counter[str] = Counter()
        self._sockets: list[socket.socket] = []
        self._server: uvicorn.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._http: httpx.AsyncClient | None = None
        # Heartbeats in flight at once: more wait here, not in the HTTP pool (a pool
        # hundreds of requests wait on, each with its deadline, sent none at 300 nodes).
        self._sending = asyncio.Semaphore(HEARTBEATS_IN_FLIGHT)
        self._routes = self._route_table()

    # -- start / stop ---------------------------------------------------------------

    async def start(self) -> None:
        _raise_fd_limit(self.count * 3 + 256)
        for k in range(1, self.count + 1):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            sock.listen(256)
            sock.setblocking(False)
            port = sock.getsockname()[1]
            node = SimNode(f"sim-{k}", f"http://{self.host}:{port}", self.behaviour)
            self._sockets.append(sock)
            self.nodes.append(node)
            self.by_port[port] = node
        # Stopped within 2 s: the gateway's kept-alive connections would hold it open.
        config = uvicorn.Config(self, lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=30, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._tasks.append(asyncio.create_task(self._server.serve(sockets=self._sockets)))
        # uvicorn says it has started by a flag only, no event to wait on.
        while not self._server.started:
            if self._tasks[0].done():
                self._tasks[0].result()  # it failed to start: its error
            await asyncio.sleep(0.01)
        self._http = httpx.AsyncClient(
            headers={"X-API-Key": self.api_key}, trust_env=False,
            timeout=max(self.behaviour.heartbeat_s, 1.0),
            limits=httpx.Limits(max_connections=HEARTBEATS_IN_FLIGHT,
                                max_keepalive_connections=HEARTBEATS_IN_FLIGHT))
        for node in self.nodes:
            self._tasks.append(asyncio.create_task(self._heartbeats(node)))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
        for sock in self._sockets:
            sock.close()

    async def served(self) -> None:
        """Returns once the server has stopped (uvicorn stops it on SIGTERM or SIGINT)."""
        await self._tasks[0]

    def node(self, node_id: str) -> SimNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    # -- heartbeats -------------------------------------------------------------------

    async def _heartbeats(self, node: SimNode) -> None:
        assert self._http is not None
        schedulers = Failover(self.scheduler_url)
        # Spread over one interval, as nodes started at different times are.
        await asyncio.sleep(random.uniform(0, self.behaviour.heartbeat_s))
        while True:
            if node.heartbeating:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    await self.beat(node, schedulers)
            await asyncio.sleep(self.behaviour.heartbeat_s)

    async def beat(self, node: SimNode, schedulers: Failover | None = None) -> None:
        """One heartbeat of ``node``, as the real node's (``node/heartbeat.py``) sends it."""
        assert self._http is not None
        schedulers = schedulers or Failover(self.scheduler_url)
        async with self._sending:
            answer = await send_beat(self._http, schedulers, node.beats, node.status())
        node.beat_count += 1
        self.requests["heartbeat"] += 1
        for sandbox_id in answer.get("disown", []):
            node.sandboxes.pop(sandbox_id, None)

    # -- the node API -----------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        node = self.by_port.get(scope["server"][1])
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if node is None:
            status, payload, headers = _error(404, "no such node")
        else:
            status, payload, headers = await self._answer(node, scope, body)
        raw = b"" if status == 204 else json.dumps(payload).encode()
        head = [(b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode())]
        head += [(k.encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": raw})

    async def _answer(self, node: SimNode, scope: dict[str, Any], body: bytes) -> Answer:
        headers = dict(scope["headers"])
        if headers.get(b"x-api-key", b"").decode() != self.api_key:
            return _error(401, "invalid API key")
        if self.behaviour.latency_s:
            await asyncio.sleep(self.behaviour.latency_s)
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        parts = path.strip("/").split("/")
        for (m, shape), (name, handler) in self._routes.items():
            if m == method and _matches(shape, parts):
                self.requests[name] += 1
                try:
                    spec = json.loads(body) if body else {}
                except ValueError:
                    return _error(400, "invalid JSON body")
                key = headers.get(b"idempotency-key", b"").decode()
                if name == "create" and key:
                    return await self._once(node, key, body, handler(node, parts, query, spec))
                return await handler(node, parts, query, spec)
        return _error(404, f"{method} {path} is not simulated")

    def _route_table(self) -> dict[tuple[str, tuple[str, ...]],
                                   tuple[str, Callable[..., Coroutine[Any, Any, Answer]]]]:
        """(method, path shape: "*" one segment) -> (name, handler); first match wins."""
        return {
            ("GET", ("health",)): ("health", self._health),
            ("POST", ("sandboxes",)): ("create", self._create),
            ("POST", ("v2", "sandboxes")): ("create", self._create),
            ("GET", ("sandboxes",)): ("list", self._list_v1),
            ("GET", ("v2", "sandboxes")): ("list", self._list_v2),
            ("GET", ("sandboxes", "metrics")): ("metrics", self._metrics),
            ("GET", ("sandboxes", "*")): ("get", self._get),
            ("DELETE", ("sandboxes", "*")): ("kill", self._kill),
            ("POST", ("sandboxes", "*", "pause")): ("pause", self._pause),
            ("POST", ("sandboxes", "*", "resume")): ("resume", self._resume),
            ("POST", ("sandboxes", "*", "connect")): ("connect", self._connect),
            ("POST", ("v2", "sandboxes", "*", "connect")): ("connect", self._connect),
            ("POST", ("sandboxes", "*", "timeout")): ("timeout", self._touch),
            ("POST", ("sandboxes", "*", "refreshes")): ("timeout", self._touch),
            ("POST", ("sandboxes", "*", "fork")): ("fork", self._fork),
            ("POST", ("sandboxes", "*", "snapshots")): ("snapshot", self._snapshot),
            ("DELETE", ("snapshots", "*")): ("snapshot", self._drop_snapshot),
            ("POST", ("cluster", "sandboxes", "*", "adopt")): ("adopt", self._adopt),
            ("GET", ("cluster", "signers")): ("signers", self._none),
            ("GET", ("runs",)): ("runs", self._empty_list),
            ("GET", ("runs", "*")): ("runs", self._none),
            ("GET", ("templates",)): ("templates", self._empty_list),
        }

    async def _once(self, node: SimNode, key: str, body: bytes,
                    create: Coroutine[Any, Any, Answer]) -> Answer:
        """A create under an Idempotency-Key: made once; only a success is kept."""
        if key in node.keyed:
            create.close()  # not made: the first create's answer is this one's
            first_body, first = node.keyed[key]
            if first_body != body:
                return _error(422, "Idempotency-Key was used with another request")
            return await asyncio.shield(first)
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        node.keyed[key] = (body, future)
        try:
            answer = await create
        except BaseException as exc:
            node.keyed.pop(key, None)
            future.set_exception(exc)
            future.exception()  # retrieved: no warning when no retry waits on it
            raise
        if answer[0] != 201:
            node.keyed.pop(key, None)
        future.set_result(answer)
        return answer

    async def _health(self, node: SimNode, parts: list[str], query: dict[str, str],
                      spec: Any) -> Answer:
        return 200, {"status": "ok", "nodeID": node.node_id}, {}

    async def _create(self, node: SimNode, parts: list[str], query: dict[str, str],
                      spec: Any) -> Answer:
        if not isinstance(spec, dict):
            return _error(400, "invalid request: body must be a JSON object")
        if node.load() >= node.behaviour.capacity:
            return _error(503, f"node {node.node_id} is full "
                               f"({node.behaviour.capacity} sandboxes)")
        now = time.time()
        timeout = int(spec.get("timeout") or 300)
        sbx = SimSandbox(new_id(), str(spec.get("templateID") or "base"), "creating", now,
                         now + timeout, dict(spec.get("metadata") or {}))
        node.sandboxes[sbx.sandbox_id] = sbx  # holds its room while it comes up
        if node.behaviour.create_s:
            await asyncio.sleep(node.behaviour.create_s)
        if random.random() < node.behaviour.failure_rate:
            node.sandboxes.pop(sbx.sandbox_id, None)
            return _error(500, "sandbox failed to start: simulated failure")
        if node.sandboxes.get(sbx.sandbox_id) is not sbx:
            return _error(500, "sandbox was removed while it started")
        sbx.state = "running"
        return 201, sbx.created(), {LISTED_HEADER: json.dumps(sbx.listed())}

    def _listed(self, node: SimNode, states: set[str]) -> list[SimSandbox]:
        return [s for s in node.sandboxes.values() if s.state in states]

    async def _list_v1(self, node: SimNode, parts: list[str], query: dict[str, str],
                       spec: Any) -> Answer:
        items = self._listed(node, {"running", "paused"})
        items.sort(key=lambda s: (s.started_at, s.sandbox_id), reverse=True)
        return 200, [s.listed() for s in items], {}

    async def _list_v2(self, node: SimNode, parts: list[str], query: dict[str, str],
                       spec: Any) -> Answer:
        states = {s for s in query.get("state", "running,paused").split(",") if s}
        desc = query.get("order") != "asc"
        items = self._listed(node, states)
        items.sort(key=lambda s: (s.started_at, s.sandbox_id), reverse=desc)
        limit = int(query.get("limit") or 100)
        offset = int(base64.urlsafe_b64decode(query["nextToken"]).decode()) \
            if query.get("nextToken") else 0
        page = items[offset:offset + limit]
        headers = {}
        if offset + limit < len(items):
            headers["x-next-token"] = base64.urlsafe_b64encode(
                str(offset + limit).encode()).decode()
        return 200, [s.listed() for s in page], headers

    async def _metrics(self, node: SimNode, parts: list[str], query: dict[str, str],
                       spec: Any) -> Answer:
        return 200, {"sandboxes": {}}, {}

    def _sandbox(self, node: SimNode, sandbox_id: str) -> SimSandbox | None:
        sbx = node.sandboxes.get(sandbox_id)
        return sbx if sbx is not None and sbx.state != "creating" else None

    async def _get(self, node: SimNode, parts: list[str], query: dict[str, str],
                   spec: Any) -> Answer:
        sbx = self._sandbox(node, parts[1])
        if sbx is None:
            return _error(404, f"sandbox '{parts[1]}' not found")
        return 200, {**sbx.listed(), "envdAccessToken": "sim-token", "domain": None}, {}

    async def _kill(self, node: SimNode, parts: list[str], query: dict[str, str],
                    spec: Any) -> Answer:
        if node.sandboxes.pop(parts[1], None) is None:
            return _error(404, f"sandbox '{parts[1]}' not found")
        return 204, None, {}

    async def _pause(self, node: SimNode, parts: list[str], query: dict[str, str],
                     spec: Any) -> Answer:
        sbx = self._sandbox(node, parts[1])
        if sbx is None:
            return _error(404, f"sandbox '{parts[1]}' not found")
        if sbx.state != "running":
            return _error(409, f"sandbox '{parts[1]}' is {sbx.state}")
        sbx.state, sbx.snapshot_id = "paused", new_id("snap_")
        return 204, None, {}

    async def _resume(self, node: SimNode, parts: list[str], query: dict[str, str],
                      spec: Any) -> Answer:
        sbx = self._sandbox(node, parts[1])
        if sbx is None:
            return _error(404, f"sandbox '{parts[1]}' not found")
        if sbx.state != "paused":
            return _error(409, f"sandbox '{parts[1]}' is {sbx.state}")
        if node.load() >= node.behaviour.capacity:
            return _error(503, f"node {node.node_id} is full")
        sbx.state = "running"
        return 201, sbx.created(), {LISTED_HEADER: json.dumps(sbx.listed())}

    async def _connect(self, node: SimNode, parts: list[str], query: dict[str, str],
                       spec: Any) -> Answer:
        sid = parts[-2]
        sbx = self._sandbox(node, sid)
        if sbx is None:
            return _error(404, f"sandbox '{sid}' not found")
        if sbx.state == "paused":
            return await self._resume(node, ["sandboxes", sid], query, spec)
        return 200, sbx.created(), {}

    async def _touch(self, node: SimNode, parts: list[str], query: dict[str, str],
                     spec: Any) -> Answer:
        if self._sandbox(node, parts[1]) is None:
            return _error(404, f"sandbox '{parts[1]}' not found")
        return 204, None, {}

    async def _fork(self, node: SimNode, parts: list[str], query: dict[str, str],
                    spec: Any) -> Answer:
        source = self._sandbox(node, parts[1])
        if source is None or source.state != "running":
            return _error(404, f"sandbox '{parts[1]}' not found or not running")
        children = []
        for _ in range(int(spec.get("count", 1)) if isinstance(spec, dict) else 1):
            code, answer, _ = await self._create(node, ["sandboxes"], query,
                                                 {"templateID": source.template_id})
            children.append({"sandbox": answer} if code == 201 else {"error": answer})
        return 201, children, {}

    async def _snapshot(self, node: SimNode, parts: list[str], query: dict[str, str],
                        spec: Any) -> Answer:
        if self._sandbox(node, parts[1]) is None:
            return _error(404, f"sandbox '{parts[1]}' not found")
        snapshot = new_id("snap_")
        node.snapshots.add(snapshot)
        return 201, {"snapshotID": snapshot}, {}

    async def _drop_snapshot(self, node: SimNode, parts: list[str], query: dict[str, str],
                             spec: Any) -> Answer:
        node.snapshots.discard(parts[1])
        return 204, None, {}

    async def _adopt(self, node: SimNode, parts: list[str], query: dict[str, str],
                     spec: Any) -> Answer:
        now = time.time()
        sbx = SimSandbox(parts[2], "base", "paused", now, now + 300,
                         snapshot_id=str(spec.get("snapshotID", "")))
        node.sandboxes[sbx.sandbox_id] = sbx
        return 201, {**sbx.listed(), "envdAccessToken": "sim-token", "domain": None}, {}

    async def _none(self, node: SimNode, parts: list[str], query: dict[str, str],
                    spec: Any) -> Answer:
        return _error(404, "not found on this node")

    async def _empty_list(self, node: SimNode, parts: list[str], query: dict[str, str],
                          spec: Any) -> Answer:
        return 200, [], {}


def _matches(shape: tuple[str, ...], parts: list[str]) -> bool:
    return len(shape) == len(parts) and all(s in ("*", p) for s, p in zip(shape, parts,
                                                                          strict=True))


def _raise_fd_limit(wanted: int) -> None:
    """Every simulated node holds a listening socket and its connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(wanted, soft), hard), hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--scheduler-url", required=True)
    parser.add_argument("--capacity", type=int, default=100)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--create-s", type=float, default=0.0)
    parser.add_argument("--failure-rate", type=float, default=0.0)
    parser.add_argument("--preload", type=int, default=0,
                        help="sandboxes each node holds from its start")
    args = parser.parse_args()
    behaviour = Behaviour(capacity=args.capacity, heartbeat_s=args.heartbeat_s,
                          latency_s=args.latency_s, create_s=args.create_s,
                          failure_rate=args.failure_rate, preload=args.preload)
    sim = SimNodes(args.nodes, args.scheduler_url, os.environ["AENV_SIM_API_KEY"], behaviour)

    async def serve() -> None:
        await sim.start()
        print(f"{args.nodes} simulated nodes up", flush=True)
        try:
            await sim.served()  # until SIGTERM or SIGINT ends the server
        finally:
            await sim.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
