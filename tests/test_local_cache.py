"""The node-local cache's one budget (local_cache_bytes) over image layers and
materialized snapshots: least recently used first, of either kind; a pinned
template's layers stay; a running sandbox keeps its layers (a live mount), while a
snapshot entry it no longer reads may go and is fetched again from the repository."""

from __future__ import annotations

import os
import re
import tarfile
import time
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from agentenv.testing import Node, leaks, sdk_env
from agentenv.testing.oci_registry import (
    DEFAULT_PATH,
    Entry,
    RegistryServer,
    build_image,
    tar_layer,
)
from agentenv.testing.small_images import tools_layer

PREFIX = f"c{os.getpid() % 4096:03x}"
CIDR = "10.110.0.0/16"
TOP = 8 << 20
GRACE_S = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("local-cache")
    registry = RegistryServer(tmp / "registry").start()
    try:
        tools = tools_layer()
        refs = {}
        for name in ("pin", "a", "b"):
            top = tar_layer([Entry("opt/", type=tarfile.DIRTYPE, mode=0o755),
                             Entry("opt/marker", f"{name}\n".encode()),
                             Entry("opt/blob", os.urandom(TOP))])
            refs[name] = registry.push(f"lc/{name}", "v1", build_image(
                [tools, top], env=[f"PATH={DEFAULT_PATH}"]))
        # The tools layer, two top layers and some room: not a third top layer and a
        # paused sandbox's snapshot as well.
        budget = len(tools) + int(TOP * 2.6)
        node = Node(tmp / "home", PREFIX, CIDR, AENV_LOCAL_CACHE_BYTES=str(budget),
                    AENV_PINNED_TEMPLATES="pinned-one", AENV_CACHE_SNAPSHOT_GRACE_S=str(GRACE_S),
                    AENV_RESIDENT_PAUSE="0", AENV_TEMPLATE_SNAPSHOTS="0")
        node.start()
        with sdk_env(node.e2b_env()):
            yield {"node": node, "refs": refs, "budget": budget}
        node.stop()
    finally:
        registry.stop()
    assert "node stopped cleanly" in node.log_tail(), node.log_tail()
    assert leaks(PREFIX, node.home) == []


def listing(node: Node) -> dict:
    with node.client() as api:
        return api.get("/images").json()


def test_one_budget_lru_over_layers_and_snapshots(world: dict) -> None:
    node, refs = world["node"], world["refs"]
    with node.client() as api:
        for ref, name in ((refs["pin"], "pinned-one"), (refs["a"], "app-a")):
            r = api.post("/images", json={"image": ref, "name": name}, timeout=300)
            assert r.status_code == 200 and '"done"' in r.text, r.text
    sandboxes: list[Sandbox] = []
    try:
        a = Sandbox.create(template="app-a", timeout=300)
        sandboxes.append(a)
        a.commands.run("echo kept-in-memory > /tmp/state")
        a.beta_pause()  # a snapshot: its capture (committed in the background) is cached
        end = time.monotonic() + 60
        while listing(node)["localCache"]["snapshotBytes"] == 0 and time.monotonic() < end:
            time.sleep(0.5)
        assert listing(node)["localCache"]["snapshotBytes"] > 0
        time.sleep(GRACE_S + 1)  # the entry is no longer being read
        # Another image while nothing runs: the least recently used go first, of
        # either kind, while the pinned template's layers stay.
        with node.client() as api:
            r = api.post("/images", json={"image": refs["b"], "name": "app-b"}, timeout=300)
            assert r.status_code == 200 and '"done"' in r.text, r.text
        b = Sandbox.create(template="app-b", timeout=300)
        sandboxes.append(b)
        log = node.log_path.read_text()
        assert re.search(r"node cache: evicted snapshot \S+ \(LRU, over budget\)", log), log[-3000:]
        assert re.search(r"evicted layer", log)
        after = listing(node)
        cached = {i["name"]: i["cachedLayers"] for i in after["images"]}
        assert cached["pinned-one"] == 2, after
        assert after["localCache"]["bytes"] <= world["budget"], after
        # The paused sandbox comes back: its snapshot and layers are fetched again,
        # while the running one (whose layers are a live mount) goes on undisturbed.
        resumed = Sandbox.connect(a.sandbox_id, timeout=300)
        assert resumed.commands.run("cat /tmp/state /opt/marker").stdout.split() == \
            ["kept-in-memory", "a"]
        out = b.commands.run("cat /opt/marker; ls -ln /opt/blob").stdout.split()
        assert out[0] == "b" and str(TOP) in out, out
        assert re.search(r"materialized snapshot \S+: \d+ bytes \([1-9]\d* from the "
                         r"repository\)", node.log_path.read_text())
    finally:
        for sbx in sandboxes:
            sbx.kill()
    cached = {i["name"]: i["cachedLayers"] for i in listing(node)["images"]}
    assert cached["pinned-one"] == 2
