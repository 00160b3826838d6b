"""How the gateway and the scheduler reach Redis: one server, or a primary with
replicas watched by Sentinel (``redis+sentinel://host:port[,host:port...]/<name>``,
``name`` the monitored primary's; an optional ``/<db>`` after it).

Either way a command that meets a dropped connection is retried for a few seconds
(backoff up to 0.5 s), which covers a Sentinel failover (the client asks Sentinel
for the new primary on each new connection).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Connections to Redis a gateway or scheduler holds at most; a burst of requests
# beyond waits up to REDIS_WAIT_S for one (redis-py's default pool fails at once
# past 100: a burst of 200 creates got 500s).
REDIS_MAX_CONNECTIONS = 100
REDIS_WAIT_S = 30.0
# Sentinel's pool cannot wait for a free connection: it may open more.
SENTINEL_MAX_CONNECTIONS = 1000
# ~10 s of retries: Sentinel notices a dead primary after its down-after time, then
# promotes a replica.
RETRIES = 24
SCHEME = "redis+sentinel"


class _Rediscovering(SentinelManagedConnection):
    """Asks Sentinel where the primary is on every reconnect: redis-py reconnects a
    dropped connection inside a command's retries to the address it had (the dead
    primary), so a failover was seen only once every retry had failed."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()
        await super().send_packed_command(command, check_health)


def _retry() -> dict[str, Any]:
    return {"retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError]}


def connect(url: str) -> Any:
    """A client answering str (decode_responses; redis-py's types cannot say so, hence
    Any) for a ``redis://`` or ``redis+sentinel://`` URL."""
    if not url.startswith(SCHEME + "://"):
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=REDIS_MAX_CONNECTIONS, timeout=REDIS_WAIT_S,
            decode_responses=True, **_retry())
        return redis.Redis.from_pool(pool)
    parts = urlsplit(url)
    hosts = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis_url: {hostport!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("redis_url: expected redis+sentinel://host:port[,...]/<name>[/<db>]")
    password = parts.password
    sentinel = Sentinel(hosts, socket_timeout=2.0, socket_connect_timeout=2.0)
    return sentinel.master_for(
        path[0], db=int(path[1]) if len(path) == 2 else 0, password=password,
        decode_responses=True, max_connections=SENTINEL_MAX_CONNECTIONS,
        socket_connect_timeout=2.0, connection_class=_Rediscovering, **_retry())


async def pipelined(client: Any, queue: Callable[[Any], list[Any]]) -> list[Any]:
    """The answers of the commands ``queue`` puts on a pipeline, in one round trip."""
    pipe = client.pipeline(transaction=False)
    if not queue(pipe):
        return []
    return list(await pipe.execute())
