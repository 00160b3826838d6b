"""A kill -9 of the server, then a restart: running sandboxes are adopted, nothing leaks."""

from __future__ import annotations

import sqlite3
import subprocess

from e2b import Sandbox

from agentenv.testing import Node, leaks

PREFIX = "aec"
CIDR = "10.13.0.0/16"


def test_kill9_then_restart_adopts_and_cleans(tmp_path, monkeypatch) -> None:
    node = Node(tmp_path / "home", PREFIX, CIDR)
    node.start()
    try:
        for k, v in node.e2b_env().items():
            monkeypatch.setenv(k, v)
        with node.client() as api:
            kept = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            orphan = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            Sandbox.connect(kept).commands.run("echo before > /tmp/state")

        node.kill9()
        # Simulate a crash between starting a sandbox and recording it: the
        # record of `orphan` is gone, its runsc sandbox and slot are not.
        with sqlite3.connect(node.home / "db") as db:
            db.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (orphan,))
        # A leftover network namespace of ours that no record explains.
        subprocess.run(["ip", "netns", "add", f"{PREFIX}-s250"], check=True)

        node.start()
        with node.client() as api:
            ids = [s["sandboxID"] for s in api.get("/sandboxes").json()]
            assert ids == [kept]
            assert api.get(f"/sandboxes/{orphan}").status_code == 404
            sbx = Sandbox.connect(kept)
            assert sbx.commands.run("cat /tmp/state").stdout == "before\n"
            netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"{PREFIX}-s250" not in netns
            runsc = subprocess.run(
                ["runsc", f"--root={node.home}/run/runsc", "list", "-quiet"],
                capture_output=True, text=True,
            ).stdout.split()
            assert runsc == [kept]
    finally:
        node.stop()
    assert leaks(PREFIX, node.home) == []
