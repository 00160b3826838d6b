"""kill -9 of the node in the middle of each long operation, then a restart.

For create, pause, fork and snapshot commit the node is killed at several
moments of the operation (found by watching its database, its staging area and
its runtime state), restarted, and then:

- its state is consistent: every sandbox is running and answers commands, or
  paused and resumes, or is gone with a 404; none is stuck "creating";
- nothing is leaked: runsc containers, cgroups, staging captures and fork
  images are exactly those of the sandboxes it has (at the end, `leaks()` of the
  stopped node is empty: netns, veths, mounts, cgroups, bundles);
- every snapshot committed before the crash is still listed and restorable.

(tests/test_crash.py covers adoption and orphan removal at restart;
tests/test_template_build_restart.py a crash during a template build;
tests/test_snapshot_crash.py a kill mid-commit at the repository level.)
"""

from __future__ import annotations

import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node, leaks, sdk_env

PREFIX = "acs"
CIDR = "10.42.0.0/16"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    server = Node(tmp_path_factory.mktemp("crash") / "home", PREFIX, CIDR)
    server.start()
    # The e2b SDK finds the node through these (the port stays the same across restarts).
    with sdk_env(server.e2b_env()):
        yield server
    if server.proc is None or server.proc.poll() is not None:
        server.start()
    with server.client() as api:
        for s in _listed(api):
            api.delete(f"/sandboxes/{s['sandboxID']}")
    code = server.stop()
    assert code in (0, -15), server.log_tail()
    assert leaks(PREFIX, server.home) == []


# -- watching the node --------------------------------------------------------------

def _db_states(node: Node) -> dict[str, str]:
    try:
        with sqlite3.connect(f"file:{node.home / 'db'}?mode=ro", uri=True, timeout=1) as db:
            return dict(db.execute("SELECT sandbox_id, state FROM sandboxes").fetchall())
    except sqlite3.OperationalError:
        return {}


def _staging(node: Node) -> set[str]:
    d = node.home / "snapshots-staging"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def _runsc(node: Node) -> set[str]:
    out = subprocess.run(["runsc", f"--root={node.home}/run/runsc", "list", "-quiet"],
                         capture_output=True, text=True).stdout
    return set(out.split())


def _cgroups() -> set[str]:
    parent = Path("/sys/fs/cgroup/memory") / PREFIX
    return {p.name for p in parent.iterdir() if p.is_dir()} if parent.is_dir() else set()


def _listed(api: httpx.Client) -> list[dict]:
    r = api.get("/v2/sandboxes", params=[("state", "running"), ("state", "paused")])
    assert r.status_code == 200, r.text
    return r.json()


def _in_background(call: Callable[[], httpx.Response]) -> threading.Thread:
    """Run a request the node will die in the middle of (its error is expected)."""
    def run() -> None:
        try:
            call()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _kill_when(node: Node, seen: Callable[[], bool], delay: float, what: str) -> None:
    end = time.monotonic() + 120
    while not seen():
        assert time.monotonic() < end, f"never saw {what}:\n{node.log_tail()}"
        time.sleep(0.003)
    time.sleep(delay)
    node.kill9()


def _exec(node: Node, api: httpx.Client, sid: str, cmd: str) -> str:
    """Run a command in a sandbox through its envd (what the SDKs do)."""
    return Sandbox.connect(sid).commands.run(cmd, timeout=60).stdout


def _create(api: httpx.Client) -> str:
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 900})
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"]


# -- the invariants after a restart ----------------------------------------------------

def check_consistent(node: Node, api: httpx.Client, marks: dict[str, str]) -> dict[str, str]:
    """The node's state after a restart; ``marks`` maps sandboxes that existed before
    the crash to a file content they hold. Returns each one's fate."""
    states = _db_states(node)
    assert "creating" not in states.values(), states
    # A running sandbox whose runtime the crash ended is kept in error, with the reason
    # (to the E2B API a 404 naming it, as below), until deleted or expired.
    for sid in [sid for sid, st in states.items() if st == "error"]:
        r = api.get(f"/sandboxes/{sid}")
        assert r.status_code == 404 and "not running" in r.json()["message"], r.text
        del states[sid]
    listed = {s["sandboxID"]: s["state"] for s in _listed(api)}
    assert set(listed.values()) <= {"running", "paused"}, listed
    running = {sid for sid, st in listed.items() if st == "running"}
    paused = {sid for sid, st in listed.items() if st == "paused"}
    assert listed == {sid: st for sid, st in states.items()}, (listed, states)

    # Runtime: the running sandboxes have a runsc container and a cgroup; a paused one
    # may (frozen in memory: a pause that was resident, found frozen at the restart);
    # nothing else does.
    assert running <= _runsc(node) <= running | paused, (_runsc(node), running, paused)
    assert _cgroups() <= running | paused, (_cgroups(), running, paused)
    # No fork image or stray capture outlives the crash. Captures of paused
    # sandboxes whose commit was interrupted stay until it is done again.
    images = node.home / "run" / "images"
    assert not images.is_dir() or list(images.iterdir()) == [], list(images.iterdir())

    fates = {}
    for sid, mark in marks.items():
        if sid in running:
            assert _exec(node, api, sid, "cat /tmp/mark") == mark
            fates[sid] = "running"
        elif sid in paused:
            r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 900})
            assert r.status_code == 201, r.text
            assert _exec(node, api, sid, "cat /tmp/mark") == mark
            fates[sid] = "paused"
        else:
            r = api.get(f"/sandboxes/{sid}")
            assert r.status_code == 404 and r.json()["code"] == 404, r.text
            fates[sid] = "gone"
    return fates


def check_snapshots(node: Node, api: httpx.Client, committed: dict[str, str]) -> None:
    """Every snapshot committed before the crash is listed and restorable."""
    listed = {s["snapshotID"] for s in api.get("/snapshots").json()}
    assert set(committed) <= listed, (committed, listed)
    for snap, mark in committed.items():
        r = api.post("/sandboxes", json={"templateID": snap})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        assert _exec(node, api, sid, "cat /tmp/mark") == mark
        assert api.delete(f"/sandboxes/{sid}").status_code == 204


def _restart(node: Node) -> httpx.Client:
    node.start()
    return node.client()


def _marked(node: Node, api: httpx.Client, mark: str) -> str:
    sid = _create(api)
    _exec(node, api, sid, f"printf {mark} > /tmp/mark")
    return sid


def _clean(api: httpx.Client) -> None:
    for s in _listed(api):
        assert api.delete(f"/sandboxes/{s['sandboxID']}").status_code in (204, 404)


# -- the cases ------------------------------------------------------------------------

@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_kill_during_create(node: Node, delay: float) -> None:
    with node.client() as api:
        keep = _marked(node, api, "kept")
    before = set(_db_states(node))
    with node.client() as api:
        t = _in_background(lambda: api.post("/sandboxes", json={"templateID": "base"}))
        _kill_when(node, lambda: "creating" in _db_states(node).values(), delay,
                   "a sandbox being created")
        t.join(10)
    new = set(_db_states(node)) - before
    with _restart(node) as api:
        fates = check_consistent(node, api, {keep: "kept"})
        assert fates[keep] == "running"
        for sid in new:  # the one being created: up and usable, or gone
            r = api.get(f"/sandboxes/{sid}")
            assert r.status_code in (200, 404), r.text
            print(f"killed {delay}s into a create: {sid} is "
                  f"{r.json()['state'] if r.status_code == 200 else 'gone'}")
        assert _create(api)  # the node creates again
        _clean(api)


@pytest.mark.parametrize("moment", ["capture", "commit"])
def test_kill_during_pause(node: Node, moment: str) -> None:
    with node.client() as api:
        sid = _marked(node, api, "paused-state")
        # Dirty memory, so that capture and commit take a moment.
        _exec(node, api, sid, "head -c 120M /dev/urandom > /tmp/ballast")
        staged = _staging(node)

        def capture_started() -> bool:
            return bool(_staging(node) - staged)

        def capture_done() -> bool:
            return _db_states(node).get(sid) == "paused"

        t = _in_background(lambda: api.post(f"/sandboxes/{sid}/pause"))
        _kill_when(node, capture_started if moment == "capture" else capture_done,
                   0.05 if moment == "capture" else 0.0, f"the pause's {moment}")
        t.join(10)
    with _restart(node) as api:
        fates = check_consistent(node, api, {sid: "paused-state"})
        print(f"killed during the pause's {moment}: the sandbox is {fates[sid]}")
        if moment == "commit":
            # The capture was complete: the sandbox must survive, paused.
            assert fates[sid] == "paused"
        _clean(api)
        assert _staging(node) == set(), _staging(node)


@pytest.mark.parametrize("moment", ["capture", "children"])
def test_kill_during_fork(node: Node, moment: str) -> None:
    with node.client() as api:
        sid = _marked(node, api, "forked")
        before = set(_db_states(node))
        images = node.home / "run" / "images"

        def capturing() -> bool:
            return images.is_dir() and any(images.iterdir())

        def children() -> bool:
            return "creating" in _db_states(node).values()

        t = _in_background(lambda: api.post(f"/sandboxes/{sid}/fork", json={"count": 3}))
        _kill_when(node, capturing if moment == "capture" else children, 0.02,
                   f"the fork's {moment}")
        t.join(10)
    with _restart(node) as api:
        children_ids = set(_db_states(node)) - before
        marks = {sid: "forked", **{c: "forked" for c in children_ids}}
        fates = check_consistent(node, api, marks)
        assert fates[sid] == "running"
        _clean(api)


@pytest.mark.parametrize("moment", ["capture", "commit"])
def test_kill_during_snapshot_commit(node: Node, moment: str) -> None:
    with node.client() as api:
        sid = _marked(node, api, "first")
        r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": f"before-{moment}"})
        assert r.status_code == 201, r.text
        committed = {r.json()["snapshotID"]: "first"}
        _exec(node, api, sid, "printf second > /tmp/mark; "
                              "head -c 120M /dev/urandom > /tmp/ballast")
        staged = _staging(node)
        chunks = node.home / "snapshots" / "chunks"
        n_chunks = sum(1 for _ in chunks.rglob("*")) if chunks.is_dir() else 0

        def capture_started() -> bool:
            return bool(_staging(node) - staged)

        def commit_started() -> bool:
            return chunks.is_dir() and sum(1 for _ in chunks.rglob("*")) > n_chunks + 5

        t = _in_background(lambda: api.post(f"/sandboxes/{sid}/snapshots",
                                            json={"name": f"during-{moment}"}))
        _kill_when(node, capture_started if moment == "capture" else commit_started, 0.02,
                   f"the snapshot's {moment}")
        t.join(10)
    with _restart(node) as api:
        fates = check_consistent(node, api, {sid: "second"})
        assert fates[sid] == "running"
        check_snapshots(node, api, committed)
        # The interrupted one is either whole (and restorable) or not there at all.
        r = api.get(f"/snapshots/during-{moment}")
        if r.status_code == 200:
            check_snapshots(node, api, {r.json()["snapshotID"]: "second"})
        else:
            assert r.status_code == 404, r.text
        _clean(api)
        assert _staging(node) == set(), _staging(node)


def test_kill_during_template_build_snapshot(node: Node) -> None:
    """The build's steps are done and its sandbox is being snapshotted when the node
    dies: after the restart the build is failed (or, had it finished, ready and
    usable), its sandbox is gone and no half-published template is left."""
    from e2b import Template

    staged = _staging(node)
    spec = (Template().from_template("base")
            .run_cmd("head -c 120M /dev/urandom > /tmp/ballast; printf built > /tmp/mark"))
    info = Template.build_in_background(spec, "acs-crashy", api_key=node.api_key,
                                        api_url=node.url)
    _kill_when(node, lambda: bool(_staging(node) - staged), 0.2, "the build's snapshot")
    with _restart(node) as api:
        status = api.get(f"/templates/{info.template_id}/builds/{info.build_id}/status").json()
        print(f"killed during a build's snapshot: the build is {status['status']}")
        if status["status"] == "ready":
            r = api.post("/sandboxes", json={"templateID": "acs-crashy"})
            assert r.status_code == 201, r.text
            assert _exec(node, api, r.json()["sandboxID"], "cat /tmp/mark") == "built"
            _clean(api)
        else:
            assert status["status"] == "error", status
            assert api.get("/templates/acs-crashy").status_code == 404
            r = api.post("/sandboxes", json={"templateID": "acs-crashy"})
            assert r.status_code == 404 and r.json()["code"] == 404, r.text
        check_consistent(node, api, {})
        assert _listed(api) == []
        assert _staging(node) == set(), _staging(node)
        api.delete("/templates/acs-crashy")


def test_second_node_on_the_same_home_is_refused(node: Node) -> None:
    """Starting a node by mistake on a home another node serves must not touch it
    (it used to reconcile the first node's sandboxes as its own, then destroy them
    all when it failed to bind the port)."""
    with node.client() as api:
        sid = _marked(node, api, "first-node")
    second = Node(node.home, PREFIX, CIDR)
    second.log_path = node.home / "second-node.log"
    with pytest.raises(RuntimeError, match="another node process is serving"):
        second.start(wait=60)
    with node.client() as api:
        assert _exec(node, api, sid, "cat /tmp/mark") == "first-node"
        check_consistent(node, api, {sid: "first-node"})
        _clean(api)
