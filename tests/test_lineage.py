"""Snapshot lineage through the API and `aenv snapshot tree`: template -> sandbox ->
snapshot -> a sandbox made from it -> its fork -> the fork's snapshot -> a sandbox
made from that; a sandbox since deleted stays in the tree as `gone`."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import pytest

from agentenv.testing import Node


def snapshot(api: httpx.Client, sid: str, name: str | None = None) -> str:
    r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": name} if name else None)
    assert r.status_code == 201, r.text
    return r.json()["snapshotID"]


def create(api: httpx.Client, template: str) -> str:
    r = api.post("/sandboxes", json={"templateID": template, "timeout": 300})
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"]


def chain(tree: dict) -> list[tuple[str, str]]:
    """The first child at every level, from the top."""
    out = []
    while tree:
        out.append((tree["kind"], tree["id"]))
        tree = tree["children"][0] if tree["children"] else None
    return out


def test_lineage_from_template_to_forks_and_their_snapshots(node: Node, api: httpx.Client,
                                                            tmp_path) -> None:
    made: list[str] = []
    try:
        a = create(api, "base")
        made.append(a)
        setup = f"setup-{uuid.uuid4().hex[:6]}"
        sa = snapshot(api, a, setup)
        b = create(api, sa)
        made.append(b)
        fork = api.post(f"/sandboxes/{b}/fork", json={"count": 1})
        c = fork.json()[0]["sandbox"]["sandboxID"]
        made.append(c)
        sc = snapshot(api, c)
        d = create(api, sc)
        made.append(d)
        assert api.delete(f"/sandboxes/{b}").status_code == 204  # gone, still in the tree

        r = api.get(f"/snapshots/{sc}/lineage")
        assert r.status_code == 200, r.text
        lineage = r.json()
        assert [(n["kind"], n["id"]) for n in lineage["ancestors"]] == [
            ("template", "base"), ("sandbox", a), ("snapshot", sa), ("sandbox", b),
            ("sandbox", c)]
        states = {n["id"]: n.get("state") for n in lineage["ancestors"]}
        assert states[b] == "gone" and states[c] == "running"
        assert chain(lineage["tree"]) == [("snapshot", sc), ("sandbox", d)]

        # By name, from the setup snapshot down: everything made from it.
        down = api.get(f"/snapshots/{setup}/lineage").json()
        assert down["snapshotID"] == sa
        assert chain(down["tree"]) == [("snapshot", sa), ("sandbox", b), ("sandbox", c),
                                       ("snapshot", sc), ("sandbox", d)]
        assert down["tree"]["name"] == setup and down["tree"]["bytes"] > 0

        every = api.get("/lineage").json()["roots"]
        base = next(t for t in every if (t["kind"], t["id"]) == ("template", "base"))
        assert a in {child["id"] for child in base["children"]}

        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(AENV_CONFIG_DIR=str(tmp_path), AENV_API_URL=node.url,
                   AENV_API_KEY=node.api_key, COLUMNS="200")
        out = subprocess.run([sys.executable, "-m", "agentenv.cli.main", "snapshot", "tree",
                              setup], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        order = [next(i for i, ln in enumerate(lines) if ident in ln)
                 for ident in ("template base", a, sa, b, c, sc, d)]
        assert order == sorted(order), out.stdout  # root first, each below its origin
        assert f"sandbox {b} (gone)" in out.stdout and setup in out.stdout
    finally:
        for sid in made:
            api.delete(f"/sandboxes/{sid}")


@pytest.mark.parametrize("ref, status", [("nosuchsnapshot", 404), ("a/../b", 404)])
def test_lineage_of_an_unknown_snapshot(api: httpx.Client, ref: str, status: int) -> None:
    r = api.get(f"/snapshots/{ref}/lineage")
    assert r.status_code == status and r.json()["message"]
