"""Diffs of a sandbox's files: snapshot against sandbox, snapshot against snapshot, and
a snapshot against itself, through the API and `aenv diff`; the sandboxes a diff
restores snapshots into are gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
from e2b import Sandbox

from agentenv.testing import Node

HOME = "/home/user"


def paths(result: dict, key: str) -> set[str]:
    return {item["path"] for item in result[key]}


def test_diff_snapshots_and_a_sandbox(node: Node, api: httpx.Client, tmp_path) -> None:
    before = {s["sandboxID"] for s in api.get("/sandboxes").json()}
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.files.write(f"{HOME}/keep.txt", "one\nsame\n")
        sbx.files.write(f"{HOME}/gone.txt", "bye\n")
        first = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots").json()["snapshotID"]

        sbx.files.write(f"{HOME}/keep.txt", "two\nsame\n")
        sbx.commands.run(f"rm {HOME}/gone.txt && head -c 3000 /dev/urandom > {HOME}/bin.dat")
        sbx.files.write(f"{HOME}/new.txt", "hello\n")

        r = api.post(f"/snapshots/{first}/diff/{sbx.sandbox_id}", params={"text": "true"},
                    timeout=180)
        assert r.status_code == 200, r.text
        live = r.json()
        assert {f"{HOME}/new.txt", f"{HOME}/bin.dat"} <= paths(live, "added")
        assert paths(live, "removed") == {f"{HOME}/gone.txt"}
        assert f"{HOME}/keep.txt" in paths(live, "changed")
        keep = live["diffs"][f"{HOME}/keep.txt"]
        assert "-one\n" in keep and "+two\n" in keep and " same\n" in keep
        assert "+hello\n" in live["diffs"][f"{HOME}/new.txt"]
        assert "-bye\n" in live["diffs"][f"{HOME}/gone.txt"]
        assert f"{HOME}/bin.dat" not in live["diffs"]  # not text

        second = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots").json()["snapshotID"]
        stored = api.post(f"/snapshots/{first}/diff/{second}", timeout=180).json()
        for key in ("added", "removed", "changed"):
            assert paths(stored, key) == paths(live, key), key
        same = api.post(f"/snapshots/{second}/diff/{second}", timeout=180).json()
        assert same["added"] == same["removed"] == same["changed"] == []

        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(AENV_CONFIG_DIR=str(tmp_path), AENV_API_URL=node.url,
                   AENV_API_KEY=node.api_key, COLUMNS="200")
        out = subprocess.run([sys.executable, "-m", "agentenv.cli.main", "diff", first,
                              sbx.sandbox_id[:8], "--text"], env=env, capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert f"+ {HOME}/new.txt" in lines and f"- {HOME}/gone.txt" in lines
        assert f"~ {HOME}/keep.txt" in lines and "+two" in lines
    finally:
        sbx.kill()
    r = api.post(f"/snapshots/nosuchsnapshot/diff/{first}")
    assert r.status_code == 404 and "nosuchsnapshot" in r.json()["message"]
    # The sandboxes the diffs restored snapshots into are gone.
    assert {s["sandboxID"] for s in api.get("/sandboxes").json()} == before
