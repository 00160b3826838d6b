"""A node at capacity refuses new sandboxes with a clear 503 and keeps serving."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from agentenv.testing import Node, leaks


def test_capacity_is_a_clear_503(tmp_path: Path) -> None:
    prefix = f"c{os.getpid() % 4096:03x}"
    node = Node(tmp_path / "home", prefix, f"10.{120 + os.getpid() % 20}.0.0/16",
                AENV_MAX_SANDBOXES="1", AENV_TEMPLATE_SNAPSHOTS="false")
    node.start()
    try:
        with node.client() as api:
            first = api.post("/sandboxes", json={"templateID": "base"})
            assert first.status_code == 201, first.text
            full = api.post("/sandboxes", json={"templateID": "base"})
            assert full.status_code == 503
            assert full.json()["code"] == 503 and "capacity" in full.json()["message"]
            fork = api.post(f"/sandboxes/{first.json()['sandboxID']}/fork", json={"count": 1})
            assert fork.status_code == 201
            assert fork.json()[0]["error"]["code"] == 503
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
