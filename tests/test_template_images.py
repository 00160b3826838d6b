"""Creates restore a template's boot image, and a warm pool hands out pre-restored sandboxes."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from agentenv.testing import Node, free_cidr, leaks, sdk_env

PREFIX = f"w{os.getpid() % 4096:03x}"
CIDR = free_cidr(220, 30, os.getpid())


@pytest.fixture(scope="module")
def pool_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = Node(tmp_path_factory.mktemp("pool") / "home", PREFIX, CIDR,
                AENV_WARM_POOL_SIZE="2")
    node.seed_images = False  # its first create boots and captures the image
    node.start()
    with sdk_env(node.e2b_env()):
        yield node
    node.stop()
    assert "node stopped cleanly" in node.log_tail()
    assert leaks(PREFIX, node.home) == []


def how_created(node: Node, sandbox_id: str) -> str:
    match = re.search(rf"created {sandbox_id} in \d+ ms \((from the warm pool|from the "
                      rf"template image|booted)", node.log_path.read_text())
    assert match, f"no create line for {sandbox_id}"
    return match.group(1)


def wait_for_log(node: Node, pattern: str, limit: float = 60) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if re.search(pattern, node.log_path.read_text()):
            return
        time.sleep(0.2)
    raise AssertionError(f"never logged: {pattern}\n{node.log_tail()}")


def test_first_boots_then_pool_then_image(pool_node: Node) -> None:
    with pool_node.client() as api:
        first = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        assert how_created(pool_node, first) == "booted"
        wait_for_log(pool_node, r"template base: image tpl\.base\.\w+ built")
        # The image exists: creates restore it until the pool has filled.
        ids = [first]
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                r = api.post("/sandboxes", json={"templateID": "base",
                                                 "envVars": {"WHO": f"n{len(ids)}"}})
                assert r.status_code == 201, r.text
                ids.append(r.json()["sandboxID"])
                if how_created(pool_node, ids[-1]) == "from the warm pool":
                    break
                time.sleep(1)
            ways = {how_created(pool_node, i) for i in ids}
            assert "from the warm pool" in ways
            assert "from the template image" in ways or len(ids) == 2
            # Every sandbox is its own, whatever way it came: own token, own env,
            # own files, working commands as the default user.
            tokens = set()
            for n, sid in enumerate(ids):
                info = api.get(f"/sandboxes/{sid}").json()
                assert info["state"] == "running"
                tokens.add(info["envdAccessToken"])
                sbx = Sandbox.connect(sid)
                if n:
                    assert sbx.commands.run("echo $WHO").stdout.strip() == f"n{n}"
                assert sbx.commands.run("id -un").stdout.strip() == "user"
                sbx.files.write("/home/user/mine.txt", sid)
            assert len(tokens) == len(ids)
            for sid in ids:
                assert Sandbox.connect(sid).files.read("/home/user/mine.txt") == sid
            # Pooled sandboxes are the node's: not listed until handed out.
            listed = {s["sandboxID"] for s in api.get("/sandboxes").json()}
            assert listed == set(ids)
            # Template images are the node's own too: not among users' snapshots.
            assert api.get("/snapshots").json() == []
        finally:
            for sid in ids:
                api.delete(f"/sandboxes/{sid}")
