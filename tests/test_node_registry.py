"""The cluster registry against a real redis-server: a burst of requests larger than
its connection pool waits for connections instead of failing (a gateway answering a
burst of 200 creates asks Redis ~200 times at once)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agentenv.cluster.node_registry import REDIS_MAX_CONNECTIONS, Registry
from agentenv.testing import start_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, port = start_redis(lambda port: [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no"], tmp_path_factory.mktemp("redis") / "redis.log")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_burst_beyond_the_pool_waits_for_connections(redis_url: str) -> None:
    count = 3 * REDIS_MAX_CONNECTIONS + 50

    async def burst() -> list[dict[str, str] | None]:
        registry = Registry(redis_url)
        try:
            await asyncio.gather(*(registry.set_sandbox(f"s{i}", "node-1", "running")
                                   for i in range(count)))
            return await asyncio.gather(*(registry.sandbox(f"s{i}") for i in range(count)))
        finally:
            await registry.close()

    got = asyncio.run(burst())
    assert all(e is not None and e["node"] == "node-1" for e in got), got[:3]
