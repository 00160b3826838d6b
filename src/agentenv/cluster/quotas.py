"""Cluster-wide quotas: a caller key's running sandboxes counted across every gateway
and node, with Redis as the source of truth.

``key-run:<key ID>`` is a sorted set: the key's running sandboxes (score 0) and its
creates under way (a token each, scored with the time its claim lapses, in ms). A
create, a resume or a connect of a paused sandbox is admitted by one script
(``_ADMIT``: lapsed claims dropped, then a claim if the set holds fewer than the
quota), so gateways side by side never admit past it. The claim becomes the
sandbox's ID when its node answers 201 (``sbx:<id>`` gets ``key``, its caller), and
goes when the create fails. A sandbox leaves the set when it is killed or paused
through a gateway, and when its node's heartbeat no longer lists it (ended on its
own: a timeout) or lists it paused (``Registry.heartbeat``).

A key over its quota waits, as a create waits for a node with room, up to the
gateway's queue time, then is answered 429 with Retry-After. A create under an
Idempotency-Key whose first try reached a node is not admitted again (its sandbox
may exist already: the retry gets it). A gateway killed during a create leaves its
claim until it lapses (``CLAIM_S``); the sandbox it made is counted when its node's
heartbeat lists it running with its key.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from .common import ClusterError
from .node_registry import Registry

# How long a create's claim on its key's quota lasts without an answer (a gateway
# killed mid-create); longer than any create (a pull of a large image included).
CLAIM_S = 600
RETRY_S = 0.5
RETRY_AFTER_S = 5

# Claims for every token in ARGV[4..] if all fit under the quota ARGV[2], else none.
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], 1, ARGV[1])
if redis.call('ZCARD', KEYS[1]) + #ARGV - 3 > tonumber(ARGV[2]) then return 0 end
for i = 4, #ARGV do
  redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[3]), ARGV[i])
end
return 1
"""


class KeyQuotas:
    def __init__(self, registry: Registry, max_sandboxes: int = 0,
                 per_key: dict[str, Any] | None = None) -> None:
        self.registry = registry
        self.max_sandboxes = max_sandboxes
        self.per_key = per_key or {}
        self._admit = registry.redis.register_script(_ADMIT)

    def limit(self, key_id: str) -> int:
        """The key's quota of running sandboxes (0: none)."""
        own = self.per_key.get(key_id) or {}
        return int(own.get("max_sandboxes", self.max_sandboxes))

    def _k(self, key_id: str) -> str:
        return self.registry._k("key-run", key_id)

    async def admit(self, key_id: str, deadline: float, gone: Any = None) -> str:
        """A claim on the key's quota (a token; "" when the key has none), waiting for
        room until ``deadline`` (monotonic), or until ``gone()`` says the caller left;
        then 429."""
        tokens = await self.admit_many(key_id, 1, deadline, gone)
        return tokens[0] if tokens else ""

    async def admit_many(self, key_id: str, count: int, deadline: float, gone: Any = None
                         ) -> list[str]:
        """``count`` claims at once, all or none (a fork's children; [] when the key has
        no quota), waiting as ``admit`` does."""
        limit = self.limit(key_id)
        if limit <= 0:
            return []
        tokens = ["claim-" + secrets.token_hex(8) for _ in range(count)]
        while True:
            now_ms = int(time.time() * 1000)
            if await self._admit(keys=[self._k(key_id)],
                                 args=[now_ms, limit, CLAIM_S * 1000, *tokens]):
                return tokens
            if time.monotonic() >= deadline or (gone is not None and await gone()):
                what = "" if count == 1 else f" (asked for {count} at once)"
                err = ClusterError(429, f"the API key's quota of {limit} running sandboxes "
                                        f"across the cluster is used{what}; retry after the "
                                        "time in Retry-After")
                err.headers = {"Retry-After": str(RETRY_AFTER_S)}
                raise err
            await asyncio.sleep(RETRY_S)

    async def made(self, key_id: str, token: str, sandbox_id: str) -> None:
        """The claim's create made ``sandbox_id``: it is counted as the key's."""
        pipe = self.registry.redis.pipeline()
        if token:
            pipe.zrem(self._k(key_id), token)
        pipe.zadd(self._k(key_id), {sandbox_id: 0})
        pipe.hset(self.registry._k("sbx", sandbox_id), "key", key_id)
        await pipe.execute()

    async def unclaim(self, key_id: str, token: str) -> None:
        if token:
            await self.registry.redis.zrem(self._k(key_id), token)

    async def ended(self, sandbox_id: str, key_id: str | None) -> None:
        """The sandbox stopped running (killed or paused): its key's room again."""
        if key_id:
            await self.registry.redis.zrem(self._k(key_id), sandbox_id)

    async def running(self, key_id: str) -> int:
        """The key's running sandboxes and creates under way, as counted now."""
        now_ms = int(time.time() * 1000)
        await self.registry.redis.zremrangebyscore(self._k(key_id), 1, now_ms)
        return int(await self.registry.redis.zcard(self._k(key_id)))
