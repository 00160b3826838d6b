"""A node at capacity queues creates for its queue time, then answers a clear 429 with
Retry-After (the e2b SDK's RateLimitException), keeps serving and leaks nothing."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import RateLimitException, Sandbox

from agentenv.testing import Node, leaks, sdk_env


def test_capacity_queues_then_is_a_clear_429(tmp_path: Path) -> None:
    prefix = f"c{os.getpid() % 4096:03x}"
    node = Node(tmp_path / "home", prefix, f"10.{120 + os.getpid() % 20}.0.0/16",
                AENV_MAX_SANDBOXES="1", AENV_TEMPLATE_SNAPSHOTS="false",
                AENV_ADMISSION_QUEUE_TIMEOUT_S="0.5")
    node.start()
    try:
        with node.client() as api:
            first = api.post("/sandboxes", json={"templateID": "base"})
            assert first.status_code == 201, first.text
            # A burst beyond capacity: each waits its queue time, then a 429.
            with ThreadPoolExecutor(4) as pool:
                burst = list(pool.map(lambda _: api.post("/sandboxes",
                                                         json={"templateID": "base"}),
                                      range(4)))
            for full in burst:
                assert full.status_code == 429, full.text
                assert full.json()["code"] == 429 and "capacity" in full.json()["message"]
                assert 1 <= int(full.headers["Retry-After"]) <= 60
            with sdk_env(node.e2b_env()), pytest.raises(RateLimitException):
                Sandbox.create(template="base", request_timeout=2)
            assert api.get("/cluster/status").json()["admission"]["refused"] >= 5
            scraped = api.get("/metrics").text  # what an operator's Prometheus sees
            refused = [ln for ln in scraped.splitlines() if ln.startswith(
                'aenv_create_refusals_total{reason="queue_timeout"}')]
            assert refused and float(refused[0].split()[-1]) >= 5, scraped[-2000:]
            # A fork's children are admitted as creates are (issue 29): no room for its
            # first child within the queue time is a 429 for the fork, the source untouched.
            fork = api.post(f"/sandboxes/{first.json()['sandboxID']}/fork", json={"count": 1})
            assert fork.status_code == 429 and "capacity" in fork.json()["message"], fork.text
            assert 1 <= int(fork.headers["Retry-After"]) <= 60
            # A batch takes its turn per sandbox: none found room within the queue time.
            batch = api.post("/sandboxes/batch", json={"templateID": "base", "count": 2})
            assert batch.status_code == 201
            assert [c["error"]["code"] for c in batch.json()] == [429, 429]
            assert httpx.get(node.url + "/health").status_code == 200
            assert [s["sandboxID"] for s in api.get("/sandboxes").json()] == \
                [first.json()["sandboxID"]]
            # Room again once one is gone.
            assert api.delete(f"/sandboxes/{first.json()['sandboxID']}").status_code == 204
            again = api.post("/sandboxes", json={"templateID": "base"})
            assert again.status_code == 201, again.text
    finally:
        node.stop()
    assert leaks(prefix, node.home) == []


def test_a_warm_pool_gives_its_room_to_a_waiting_create(tmp_path: Path) -> None:
    """The warm pool never takes capacity users need: at capacity with a pooled sandbox,
    a create is served (the pooled sandbox gives up its room) instead of waiting out its
    queue time for a 429."""
    prefix = f"w{os.getpid() % 4096:03x}"
    node = Node(tmp_path / "home", prefix, f"10.{120 + os.getpid() % 20}.0.0/16",
                AENV_MAX_SANDBOXES="2", AENV_WARM_POOL_SIZE="1",
                AENV_ADMISSION_QUEUE_TIMEOUT_S="20")
    node.start()
    try:
        with node.client() as api:
            first = api.post("/sandboxes", json={"templateID": "base"})
            assert first.status_code == 201, first.text
            deadline = time.monotonic() + 60
            while api.get("/cluster/status").json().get("bootImages", {}).get(
                    "pooled", {}).get("base", 0) < 1:
                assert time.monotonic() < deadline, api.get("/cluster/status").json()
                time.sleep(0.2)
            # The node is full: one sandbox and one pooled. Another create still fits.
            t0 = time.monotonic()
            second = api.post("/sandboxes", json={"templateID": "base"})
            assert second.status_code == 201, second.text
            print(f"a create at capacity with a pooled sandbox: {time.monotonic() - t0:.1f} s")
            with sdk_env(node.e2b_env()):
                sbx = Sandbox.connect(second.json()["sandboxID"])
                assert sbx.commands.run("echo ok").stdout == "ok\n"
            assert len(api.get("/sandboxes").json()) == 2
            assert httpx.get(node.url + "/health").status_code == 200
    finally:
        node.stop()
    assert leaks(prefix, node.home) == []
