"""A kill -9 of the server, then a restart: running sandboxes are adopted, nothing leaks."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from e2b import Sandbox

from agentenv.config import Config
from agentenv.snapshot import SnapshotStore, open_repository
from agentenv.testing import Node, leaks
from sandbox_helpers import COUNTER, counting

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


def test_kill9_while_paused_in_memory_loses_nothing(tmp_path, monkeypatch) -> None:
    """A pause answers once the sandbox is frozen; its capture follows. A node killed
    right after the answers, then restarted, still has both sandboxes: one resumes at
    once (thawed, or restored if captured and evicted), one after its idle eviction
    (from disk), each with its process and files."""
    node = Node(tmp_path / "home", PREFIX, CIDR, AENV_RESIDENT_PAUSE_IDLE_S="4")
    node.start()
    try:
        for k, v in node.e2b_env().items():
            monkeypatch.setenv(k, v)
        boxes = [Sandbox.create("base", timeout=300) for _ in range(2)]
        for i, sbx in enumerate(boxes):
            sbx.files.write("/home/user/mark.txt", f"box {i}")
            sbx.commands.run(COUNTER, background=True, timeout=0)
            assert counting(sbx)
        for sbx in boxes:
            sbx.pause()
        node.kill9()  # right after the answers: their captures may not have begun

        node.start()
        with node.client() as api:
            states = {s["sandboxID"]: s["state"] for s in api.get(
                "/v2/sandboxes", params={"state": "paused"}).json()}
            assert states == {b.sandbox_id: "paused" for b in boxes}
            first, second = boxes
            Sandbox.connect(first.sandbox_id)
            assert counting(first) and first.files.read("/home/user/mark.txt") == "box 0"

            # The other is evicted once idle (its frozen runtime gone, its capture kept).
            deadline = time.time() + 60
            while second.sandbox_id in _runsc_ids(node):
                assert time.time() < deadline, "the idle paused sandbox was not evicted"
                time.sleep(0.5)
            Sandbox.connect(second.sandbox_id)
            assert counting(second) and second.files.read("/home/user/mark.txt") == "box 1"
            for sbx in boxes:
                sbx.kill()
    finally:
        node.stop()
    assert leaks(PREFIX, node.home) == []


def _runsc_ids(node: Node) -> list[str]:
    return subprocess.run(["runsc", f"--root={node.home}/run/runsc", "list", "-quiet"],
                          capture_output=True, text=True).stdout.split()


def test_resumed_before_its_pause_committed_then_kill9(tmp_path, monkeypatch) -> None:
    """Pauses to disk (no resident tier) answer once captured; a resume right after
    restores from hard links to the capture while its commit goes on, and a second
    pause's commit waits for the first. A node killed -9 then commits that pause after
    its restart (the sandbox runs on), and a kill leaves no snapshot behind."""
    node = Node(tmp_path / "home", PREFIX, CIDR, AENV_RESIDENT_PAUSE="0")
    node.start()
    store = SnapshotStore(open_repository(Config(home=node.home).snapshot_repository()),
                          cache_dir=tmp_path / "cache", staging_dir=tmp_path / "staging")
    staging = node.home / "snapshots-staging"
    try:
        for k, v in node.e2b_env().items():
            monkeypatch.setenv(k, v)
        sbx = Sandbox.create("base", timeout=300)
        sbx.files.write("/home/user/mark.txt", "kept")
        sbx.commands.run(COUNTER, background=True, timeout=0)
        assert counting(sbx)
        earlier: set[str] = set()
        for i in range(2):
            # 64 MiB new to the repository each time: the commit goes on for a while.
            sbx.commands.run(f"head -c 67108864 /dev/urandom > /home/user/big{i}.bin")
            _until_committed(staging)  # the first pause is in ``earlier``
            earlier = set(_pauses(store, sbx.sandbox_id))
            offset = node.log_path.stat().st_size
            sbx.pause()
            Sandbox.connect(sbx.sandbox_id)
            assert f"resuming {sbx.sandbox_id} from its capture while its commit goes on" \
                in node.log_path.read_text(errors="replace")[offset:]
            if i == 0:
                assert counting(sbx) and sbx.files.read("/home/user/mark.txt") == "kept"
                assert not list(staging.glob("*.restore-*"))  # its hard links are gone
        node.kill9()  # at once: the second pause's commit is still going on

        node.start()
        assert counting(sbx) and sbx.commands.run(
            "cat /home/user/big*.bin | wc -c").stdout.strip() == str(2 * 67108864)
        _until_committed(staging)
        assert set(_pauses(store, sbx.sandbox_id)) - earlier, \
            "the pause of the resumed sandbox was not committed"
        sbx.kill()
        assert store.list(sbx.sandbox_id) == []  # its last pause went with it
    finally:
        node.stop()
    assert leaks(PREFIX, node.home) == []


def _pauses(store: SnapshotStore, sandbox_id: str) -> list[str]:
    return [m.snapshot_id for m in store.list(sandbox_id) if m.metadata.get("kind") == "pause"]


def _until_committed(staging: Path) -> None:
    """Until no pause is pending in the node's staging (at most 60 s)."""
    deadline = time.time() + 60
    while list(staging.glob("*.meta.json")):
        assert time.time() < deadline, "a pause commit did not land"
        time.sleep(0.2)


STARTER = """
import sys, time
from pathlib import Path
from agentenv.testing import Node
node = Node(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
node.start()
with node.client() as api:
    created = api.post("/sandboxes", json={"templateID": "base"})
    assert created.status_code == 201, created.text
print(node.proc.pid, created.json()["sandboxID"], flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running, not a zombie (its new parent may not be quick to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_starter_killed_takes_its_node_and_sandboxes_with_it(tmp_path: Path) -> None:
    """A test or benchmark killed with its shell (no cleanup of its own runs) left its
    node serving, and the node its sandboxes, until someone noticed: a node started by
    agentenv.testing stops, gracefully, when the process that started it ends."""
    home, prefix = tmp_path / "home", "aek"
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(home), prefix, "10.14.0.0/16"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        node_pid, sandbox_id = starter.stdout.readline().split()
        assert Path(f"/proc/{node_pid}").exists() and sandbox_id
    finally:
        starter.kill()
        starter.wait()
    end = time.monotonic() + 60
    while alive(int(node_pid)):
        assert time.monotonic() < end, "the node outlived its starter by a minute"
        time.sleep(0.2)
    log = (home / "server.log").read_text()
    assert "that started this server ended: stopping" in log
    assert leaks(prefix, home) == []
