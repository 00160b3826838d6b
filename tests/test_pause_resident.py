"""Two-tier pauses through the official e2b SDK: a pause freezes the sandbox and
answers, its capture follows; a resume while it is resident is a thaw, one after
its eviction (POST /sandboxes/{id}/evict, or its idle time) a restore. Either way
its processes and files are as they were."""

from __future__ import annotations

import subprocess

import httpx
from e2b import Sandbox

from agentenv.testing import Node
from sandbox_helpers import COUNTER, counting


def _frozen(node: Node) -> list[str]:
    """Sandboxes with a runtime on the node (running or frozen)."""
    return subprocess.run(["runsc", f"--root={node.home}/run/runsc", "list", "-quiet"],
                          capture_output=True, text=True).stdout.split()


def test_resident_pause_thaws_and_an_evicted_one_restores(node: Node, api: httpx.Client
                                                          ) -> None:
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        sbx.commands.run(COUNTER, background=True, timeout=0)
        assert counting(sbx)
        sbx.pause()
        assert sbx.get_info().state.value == "paused"
        assert sbx.sandbox_id in _frozen(node)  # resident: still in memory, frozen
        Sandbox.connect(sbx.sandbox_id)
        assert counting(sbx) and sbx.files.read("/home/user/kept.txt") == "kept"

        sbx.pause()
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/evict").status_code == 204
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/evict").status_code == 204  # again
        assert sbx.sandbox_id not in _frozen(node)  # memory and slot freed
        assert sbx.get_info().state.value == "paused"
        Sandbox.connect(sbx.sandbox_id)  # from its capture
        assert counting(sbx) and sbx.files.read("/home/user/kept.txt") == "kept"

        r = api.post(f"/sandboxes/{sbx.sandbox_id}/evict")
        assert r.status_code == 409 and "running" in r.json()["message"]
        assert api.post("/sandboxes/nosuchsandbox0000000/evict").status_code == 404
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in _frozen(node)


def test_killing_a_resident_paused_sandbox_frees_it(node: Node, api: httpx.Client) -> None:
    sbx = Sandbox.create("base", timeout=300)
    sbx.pause()
    assert sbx.sandbox_id in _frozen(node)
    sbx.kill()
    assert sbx.sandbox_id not in _frozen(node)
    assert api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404
    assert api.get("/snapshots", params={"sandboxID": sbx.sandbox_id}).json() == []
