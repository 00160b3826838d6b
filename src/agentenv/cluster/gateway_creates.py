"""The gateway's creates: placed through the scheduler, sent to the node it picks,
and sent on to the next best node when that one is full or unreachable.

A create under an ``Idempotency-Key`` goes where the key went first, through any
gateway: the key's node is kept in Redis (``idem:<sha256 of the key>``) before the
create is sent, so a retry through another gateway (the first killed while the
create was on its way) reaches the same node, whose own idempotency answers it with
the first try's sandbox (or waits for it) instead of making a second one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import Request, Response

from ..sandbox_api import MAX_KEY_CHARS, image_from_template, image_template_name
from .common import ClusterError
from .node_registry import Registry
from .routing import Gateway, listed_item

log = logging.getLogger("agentenv.cluster.gateway")
# Seconds between placements of a create no node had room for.
PLACE_RETRY_S = 0.5
GATEWAY_RETRY_AFTER_S = 5
# How long a key's node is remembered (the nodes keep a key's answer a day).
IDEMPOTENCY_TTL_S = 24 * 3600
# How long a claim of an Idempotency-Key's node waits for a replica to have it, and how
# often the primary's replicas are counted.
REPLICA_WAIT_MS = 500
REPLICAS_READ_S = 5.0
# Forget a key's node only if it is still that node (another try may have moved it).
_DROP = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def too_many(queue_timeout_s: float, why: str) -> ClusterError:
    err = ClusterError(429, f"no node had room for the sandbox within {queue_timeout_s:g}s "
                            f"({why}); retry after the time in Retry-After")
    err.headers = {"Retry-After": str(GATEWAY_RETRY_AFTER_S)}
    return err


def cached_as(body: dict[str, Any]) -> str:
    """The template whose cache a create's node should hold: its ``templateID``, or
    for a create from an image (``image``, or ``templateID: docker://REF``) the image's
    template as every node names it (one pulled with credentials has a name keyed by
    a node's own secret: no node is preferred for it)."""
    template = body.get("templateID")
    image = body.get("image")
    if not isinstance(image, str) or not image.strip():
        image = image_from_template(template) if isinstance(template, str) else None
    if image and image.strip():
        return "" if body.get("imageCredentials") else image_template_name(image.strip())
    return template if isinstance(template, str) else ""


def valid_key(key: str) -> bool:
    """What a node takes as an Idempotency-Key: 1..255 printable ASCII characters."""
    return 0 < len(key) <= MAX_KEY_CHARS and all(" " <= c <= "~" for c in key)


class KeyedNodes:
    """Which node an ``Idempotency-Key``'s create went to (Redis, shared by gateways)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._drop = registry.redis.register_script(_DROP)
        self._replicas_read = (float("-inf"), 0)

    def _k(self, key: str) -> str:
        return self.registry._k("idem", hashlib.sha256(key.encode()).hexdigest())

    async def node_of(self, key: str) -> str | None:
        return await self.registry.redis.get(self._k(key))

    async def claim(self, key: str, node_id: str) -> bool:
        """Whether ``node_id`` is now the key's node (False: another try claimed it).

        When the primary has a replica, the claim is on it before the create is sent
        (``WAIT``, at most ``REPLICA_WAIT_MS``): replication is asynchronous, and a
        Sentinel failover right after a claim the replica never got would send the
        create's retry to another node, making a second sandbox."""
        pipe = self.registry.redis.pipeline(transaction=False)  # WAIT: same connection
        pipe.set(self._k(key), node_id, nx=True, ex=IDEMPOTENCY_TTL_S)
        replicated = await self._replicas() > 0
        if replicated:
            pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS)
        answers = await pipe.execute()
        if replicated and answers[0] and not answers[1]:
            log.warning("Idempotency-Key's node not on a replica within %d ms: a Redis "
                        "failover now could double its create", REPLICA_WAIT_MS)
        return bool(answers[0])

    async def _replicas(self) -> int:
        """The primary's connected replicas, as read at most ``REPLICAS_READ_S`` ago."""
        now = time.monotonic()
        if now - self._replicas_read[0] > REPLICAS_READ_S:
            info = await self.registry.redis.info("replication")
            self._replicas_read = (now, int(info.get("connected_slaves", 0)))
        return self._replicas_read[1]

    async def drop(self, key: str, node_id: str) -> None:
        await self._drop(keys=[self._k(key)], args=[node_id])


class Creates:
    def __init__(self, gw: Gateway, registry: Registry, queue_timeout_s: float,
                 node_ttl_ms: int, relay: Callable[[httpx.Response], Response]) -> None:
        self.gw, self.registry = gw, registry
        self.keyed = KeyedNodes(registry)
        self.queue_timeout_s = queue_timeout_s
        self.node_ttl_ms = node_ttl_ms
        self.relay = relay

    async def _pick(self, template: str, exclude: list[str], key: str
                    ) -> dict[str, str] | None:
        """The node for the create: the key's, else the scheduler's pick (claimed for
        the key); None when another try claimed the key meanwhile (look again)."""
        if key:
            held = await self.keyed.node_of(key)
            node = await self.registry.node(held) if held else None
            if node is not None and node.state == "up" and node.node_id not in exclude:
                return {"nodeID": node.node_id, "url": node.url, "beat": "", "held": "1"}
            if held:  # its node is down or was full: the key starts over elsewhere
                await self.keyed.drop(key, held)
        pick = (await self.gw.place(template=template, snapshot=template, exclude=exclude))[0]
        if key and not await self.keyed.claim(key, pick["nodeID"]):
            await self._unplace(pick)
            return None
        return pick

    async def _unplace(self, pick: dict[str, str]) -> None:
        """No sandbox came of a placement: its room is the next create's."""
        if not pick.get("held"):
            await self.registry.release(pick["nodeID"], str(pick.get("beat", "")),
                                        self.node_ttl_ms)

    async def create(self, request: Request, body: bytes, template: str) -> Response:
        # No node with room: wait (as a node's admission queue does) for one, up to
        # the queue time, then 429 with Retry-After; a full node's 503/429 sends the
        # create to the next best node.
        key = request.headers.get("idempotency-key", "")
        if not valid_key(key):
            key = ""  # the node answers it with its 400; nothing of it goes to Redis
        deadline = time.monotonic() + self.queue_timeout_s
        exclude: list[str] = []
        last: httpx.Response | None = None
        while True:
            try:
                pick = await self._pick(template, exclude, key)
            except ClusterError as exc:
                if exc.status != 503:
                    raise
                if time.monotonic() < deadline and not await request.is_disconnected():
                    await asyncio.sleep(PLACE_RETRY_S)
                    exclude = []
                    continue
                if last is not None:
                    return self.relay(last)
                raise too_many(self.queue_timeout_s, str(exc)) from None
            if pick is None:
                continue
            try:
                r = await self.gw.forward(request, pick["url"], body=body)
            except httpx.HTTPError as exc:
                log.warning("create on node %s failed: %s", pick["nodeID"], exc)
                lost_answer = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                if key and lost_answer and time.monotonic() < deadline:
                    # The node may have made it: the key's retry there gets it.
                    await asyncio.sleep(PLACE_RETRY_S)
                    continue
                if key:
                    await self.keyed.drop(key, pick["nodeID"])
                exclude.append(pick["nodeID"])
                continue
            if r.status_code == 201:
                await self.registry.set_sandbox(r.json()["sandboxID"], pick["nodeID"],
                                                "running", item=listed_item(r))
                return self.relay(r)
            await self._unplace(pick)
            if r.status_code in (429, 503):  # full after all: the next best node
                if key:
                    await self.keyed.drop(key, pick["nodeID"])
                exclude.append(pick["nodeID"])
                last = r
                continue
            return self.relay(r)
