"""Reset in place, agentenv's ``POST /sandboxes/{id}/reset`` (E2B has no reset), on the
session's real node. What the user does in the sandbox goes through the official e2b
SDK, the reset through plain HTTP (the SDK has no call for it). A reset brings the
snapshot's memory, processes and files back under the same sandbox ID, envd access
token (the same Sandbox object goes on working), traffic token and proxy routes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest
from e2b import Sandbox, Template

from agentenv.testing import Node
from sandbox_helpers import COUNTER, count, counting, wait_port

WEB_PORT = 8000


def reset(api: httpx.Client, sid: str, body: dict | None = None) -> httpx.Response:
    return api.post(f"/sandboxes/{sid}/reset", json=body)


def snapshot(api: httpx.Client, sid: str, **body) -> str:
    r = api.post(f"/sandboxes/{sid}/snapshots", json=body)
    assert r.status_code == 201, r.text
    return r.json()["snapshotID"]


def end_at(api: httpx.Client, sid: str) -> float:
    r = api.get(f"/sandboxes/{sid}")
    assert r.status_code == 200, r.text
    return datetime.fromisoformat(r.json()["endAt"].replace("Z", "+00:00")).timestamp()


def pids(sbx: Sandbox, pattern: str) -> str:
    return sbx.commands.run(f"pgrep -f '{pattern}' | sort || true").stdout.strip()


def advance(sbx: Sandbox, past: int) -> int:
    """Wait until the counter is beyond ``past``; return where it is."""
    for _ in range(100):
        now = count(sbx)
        if now > past:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the counter did not pass {past}")


@pytest.fixture
def private_web(api: httpx.Client) -> Iterator[tuple[Sandbox, str]]:
    """A sandbox with private ports (a traffic token) running the counter and a web
    server over /home/user; the SDK's Sandbox object for it and its traffic token."""
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600,
                                     "network": {"allowPublicTraffic": False}})
    assert r.status_code == 201, r.text
    sbx = Sandbox.connect(r.json()["sandboxID"])
    try:
        sbx.commands.run(COUNTER, background=True, timeout=0)
        sbx.files.write("/home/user/state.txt", "at the snapshot")
        sbx.files.write("/home/user/doomed.txt", "removed after the snapshot")
        sbx.commands.run(f"python3 -m http.server {WEB_PORT} --directory /home/user",
                         background=True, timeout=0)
        wait_port(sbx, WEB_PORT)
        assert counting(sbx)
        yield sbx, r.json()["trafficAccessToken"]
    finally:
        api.delete(f"/sandboxes/{sbx.sandbox_id}")


def test_reset_brings_back_memory_processes_and_files_same_id_and_tokens(
        node: Node, api: httpx.Client, private_web) -> None:
    sbx, traffic = private_web
    sid = sbx.sandbox_id
    web = httpx.Client(base_url=node.url, timeout=30, headers={
        "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(WEB_PORT),
        "e2b-traffic-access-token": traffic})
    counter = pids(sbx, "[i]tertools.count")
    assert counter
    before = count(sbx)
    snap = snapshot(api, sid, name=f"reset-{sid[:8]}")
    at_snapshot = count(sbx)

    # After the snapshot: files change, a process starts, the counter goes on.
    sbx.files.write("/home/user/state.txt", "changed")
    sbx.files.write("/home/user/new.txt", "new")
    sbx.files.remove("/home/user/doomed.txt")
    sbx.commands.run("sleep 4242", background=True, timeout=0)
    assert web.get("/state.txt").text == "changed"  # the proxy holds a connection now
    expiry = end_at(api, sid)
    running_on = advance(sbx, at_snapshot + 40)

    t0 = time.monotonic()
    r = reset(api, sid)  # no body: the last snapshot taken of it
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["sandboxID"], body["snapshotID"]) == (sid, snap)
    assert body["trafficAccessToken"] == traffic
    assert abs(end_at(api, sid) - expiry) < 1  # the TTL is kept

    # The same Sandbox object (same envd token) sees the snapshot's state.
    restored = count(sbx)
    assert before <= restored < running_on, (before, restored, running_on, took)
    assert counting(sbx)
    assert pids(sbx, "[i]tertools.count") == counter  # the very process, not a new one
    assert pids(sbx, "^sleep 4242") == ""
    assert sbx.files.read("/home/user/state.txt") == "at the snapshot"
    assert sbx.files.read("/home/user/doomed.txt") == "removed after the snapshot"
    assert not sbx.files.exists("/home/user/new.txt")
    # The proxy dropped its connections to the old processes: the same client is
    # served by the restored web server, with the same traffic token.
    assert web.get("/state.txt").text == "at the snapshot"
    assert httpx.get(f"{node.url}/state.txt", headers={
        "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(WEB_PORT)}).status_code == 403
    assert [s["sandboxID"] for s in api.get("/sandboxes").json()].count(sid) == 1

    # By name, with a new TTL.
    sbx.files.write("/home/user/state.txt", "changed again")
    r = reset(api, sid, {"snapshotID": f"reset-{sid[:8]}", "timeout": 120})
    assert r.status_code == 200, r.text
    assert abs(end_at(api, sid) - (time.time() + 120)) < 10
    assert sbx.files.read("/home/user/state.txt") == "at the snapshot"
    assert counting(sbx)
    assert api.delete(f"/snapshots/{snap}").status_code == 204


def test_what_cannot_be_reset_to_is_a_clear_error_and_the_sandbox_runs_on(
        api: httpx.Client) -> None:
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    other = None
    try:
        sbx.files.write("/home/user/mine.txt", "untouched")
        r = reset(api, sid)
        assert r.status_code == 409 and "no snapshot to reset to" in r.json()["message"]
        r = reset(api, sid, {"snapshotID": "no-such-snapshot"})
        assert r.status_code == 404 and "no-such-snapshot" in r.json()["message"]
        for bad in ({"snapshotID": "../../etc"}, {"snapshotID": ""}, {"snapshotID": 7},
                    {"snapshotID": "x" * 300}, {"timeout": -1}):
            r = reset(api, sid, bad)
            assert r.status_code == 400, (bad, r.text)
        # A snapshot of another template's sandbox.
        Template.build(Template().from_template("base").run_cmd("true"), "reset-other")
        other = Sandbox.create("reset-other", timeout=120)
        theirs = snapshot(api, other.sandbox_id)
        r = reset(api, sid, {"snapshotID": theirs})
        assert r.status_code == 400, r.text
        assert "of template" in r.json()["message"] and "its own template" in r.json()["message"]
        assert sbx.files.read("/home/user/mine.txt") == "untouched"  # nothing was touched
        assert api.delete(f"/snapshots/{theirs}").status_code == 204

        assert reset(api, "nosuchsandbox").status_code == 404
        mine = snapshot(api, sid)
        sbx.kill()
        r = reset(api, sid, {"snapshotID": mine})
        assert r.status_code == 404 and "not found" in r.json()["message"]
        assert api.delete(f"/snapshots/{mine}").status_code == 204
    finally:
        sbx.kill()
        if other is not None:
            other.kill()
        api.delete("/templates/reset-other")


def test_reset_to_another_sandboxs_snapshot_and_two_resets_at_once(
        node: Node, api: httpx.Client) -> None:
    """A sandbox reset to a snapshot of another sandbox of its template gets that state
    and keeps its own envd token (rotated in); two resets at once both answer, one
    after the other, and the sandbox ends in one snapshot's state, whole."""
    source = Sandbox.create("base", timeout=300)
    target = Sandbox.create("base", timeout=300)
    snaps = []
    try:
        for label in ("A", "B"):
            source.files.write("/home/user/which.txt", label)
            source.commands.run(f"sleep 42{ord(label)}", background=True, timeout=0)
            snaps.append(snapshot(api, source.sandbox_id))
        results: list[httpx.Response] = []

        def one(snap: str) -> None:
            with node.client() as c:
                results.append(reset(c, target.sandbox_id, {"snapshotID": snap}))

        threads = [threading.Thread(target=one, args=(s,)) for s in snaps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.status_code for r in results) == [200, 200], [r.text for r in results]
        # The target's own Sandbox object (its token) works; the source's token does not.
        label = target.files.read("/home/user/which.txt")
        assert label in ("A", "B")
        assert (pids(target, "^sleep 4265") != "", pids(target, "^sleep 4266") != "") == \
            (True, label == "B")
        envd = {"E2b-Sandbox-Id": target.sandbox_id, "E2b-Sandbox-Port": "49983"}
        r = httpx.get(f"{node.url}/files", params={"path": "/home/user/which.txt"},
                      headers={**envd, "X-Access-Token": api.get(
                          f"/sandboxes/{source.sandbox_id}").json()["envdAccessToken"]})
        assert r.status_code == 401, r.text
        assert source.files.read("/home/user/which.txt") == "B"  # the source runs on
    finally:
        source.kill()
        target.kill()
        for s in snaps:
            api.delete(f"/snapshots/{s}")


def test_reset_of_a_paused_sandbox_and_to_a_files_only_snapshot(api: httpx.Client) -> None:
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    snaps = []
    try:
        sbx.files.write("/home/user/state.txt", "files only")
        sbx.commands.run("sleep 4343", background=True, timeout=0)
        snaps.append(snapshot(api, sid, memory=False))
        sbx.files.write("/home/user/state.txt", "with memory")
        snaps.append(snapshot(api, sid))
        sbx.files.write("/home/user/state.txt", "changed")
        sbx.pause()
        r = reset(api, sid)  # paused: restored into a slot, running afterwards
        assert r.status_code == 200, r.text
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert end_at(api, sid) > time.time() + 200  # a paused one gets a fresh TTL
        assert sbx.files.read("/home/user/state.txt") == "with memory"
        assert pids(sbx, "^sleep 4343") != ""
        # Files only: the template reboots with the snapshot's files, no old process.
        r = reset(api, sid, {"snapshotID": snaps[0]})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/home/user/state.txt") == "files only"
        assert pids(sbx, "^sleep 4343") == ""
    finally:
        sbx.kill()
        for s in snaps:
            api.delete(f"/snapshots/{s}")
