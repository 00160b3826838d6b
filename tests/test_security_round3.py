"""Security round 3 (issue 29), through a real node: quotas whatever header carries
the key, admission on every path that makes a sandbox run, envd's port not waking a
sandbox without a credential, bounded diffs that a GET cannot start, private networks
refused by default, and what a restart or a dead warm-pool member leaves listed.

One node of its own (quota 2 sandboxes per key, a 1 s queue, freezing after 1 s idle,
a warm pool of 1) serves every test here; the egress test uses the session node too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node, serving
from agentenv.textdiff import diff_all

PREFIX = f"r3{os.getpid() % 1000:03d}"
CIDR = f"10.{160 + os.getpid() % 20}.0.0/16"
QUEUE_S = 1.0
# The "outside" of the egress test: a netns with addresses in three private networks.
NS, LINK = f"r3ns{os.getpid() % 10000}", f"r3v{os.getpid() % 10000}"
OUTSIDE = {"cgnat": ("100.64.77.1", "100.64.77.2"), "rfc1918": ("192.168.231.1", "192.168.231.2"),
           "opened": ("172.31.231.1", "172.31.231.2")}


def wait_for(what: str, check, within: float = 30.0, step: float = 0.1):
    end = time.monotonic() + within
    while not (got := check()):
        assert time.monotonic() < end, f"not within {within}s: {what}"
        time.sleep(step)
    return got


@pytest.fixture(scope="module")
def qnode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with serving(Node(tmp_path_factory.mktemp("round3"), PREFIX, CIDR,
                      AENV_KEY_MAX_SANDBOXES="2", AENV_ADMISSION_QUEUE_TIMEOUT_S=str(QUEUE_S),
                      AENV_IDLE_FREEZE_S="1", AENV_WARM_POOL_SIZE="1", AENV_MAX_SANDBOXES="8",
                      AENV_EGRESS_PRIVATE_OPEN="172.31.231.0/30")) as node:
        yield node


def bearer(node: Node) -> httpx.Client:
    return httpx.Client(base_url=node.url, timeout=60,
                        headers={"Authorization": f"Bearer {node.api_key}"})


def live(api: httpx.Client) -> list[str]:
    return [s["sandboxID"] for s in api.get("/sandboxes").json()
            if not (s.get("metadata") or {}).get("aenv.purpose")]


def refused(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["code"] == 429 and "quota of 2" in r.json()["message"], r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 60


def kill_all(api: httpx.Client) -> None:
    for s in api.get("/v2/sandboxes", params=[("state", "running"), ("state", "paused"),
                                             ("state", "error")]).json():
        api.delete(f"/sandboxes/{s['sandboxID']}")
    wait_for("no sandbox left", lambda: not api.get("/v2/sandboxes").json())


# -- finding 1: the key's quota and idempotency, whichever header carries the key ----------

def test_quota_and_idempotency_hold_for_either_header(qnode: Node) -> None:
    with qnode.client() as api, bearer(qnode) as bapi:
        kill_all(api)
        one = {"templateID": "base", "timeout": 120}
        first = api.post("/sandboxes", json=one, headers={"Idempotency-Key": "k-1"})
        again = bapi.post("/sandboxes", json=one, headers={"Idempotency-Key": "k-1"})
        assert first.status_code == again.status_code == 201, again.text
        assert first.json()["sandboxID"] == again.json()["sandboxID"]  # one key, one caller
        assert bapi.post("/sandboxes", json=one).status_code == 201
        refused(bapi.post("/sandboxes", json=one))
        refused(api.post("/sandboxes", json=one))
        batch = bapi.post("/sandboxes/batch", json={**one, "count": 3})
        assert batch.status_code == 201, batch.text
        assert [c["error"]["code"] for c in batch.json()] == [429, 429, 429], batch.text
        assert len(live(api)) == 2
        kill_all(api)


# -- finding 2: fork, resume, connect, resume on traffic, reset and diff are admitted ------

def test_every_path_that_makes_a_sandbox_run_is_admitted(qnode: Node) -> None:
    with qnode.client() as api:
        kill_all(api)
        a = api.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()
        b = api.post("/sandboxes", json={"templateID": "base", "timeout": 300,
                                         "autoResume": {"enabled": True}}).json()
        snap = api.post(f"/sandboxes/{b['sandboxID']}/snapshots").json()["snapshotID"]
        assert api.post(f"/sandboxes/{b['sandboxID']}/pause").status_code == 204
        # One running of two: a fork of 3 makes one child; the others are 429 results.
        fork = api.post(f"/sandboxes/{a['sandboxID']}/fork", json={"count": 3})
        assert fork.status_code == 201, fork.text
        codes = sorted(c.get("error", {}).get("code", 201) for c in fork.json())
        assert codes == [201, 429, 429], fork.text
        assert len(live(api)) == 2  # (the paused one is not listed as running)
        # At quota, nothing brings the paused sandbox back, however asked.
        refused(api.post(f"/sandboxes/{a['sandboxID']}/fork", json={"count": 1}))
        sid = b["sandboxID"]
        refused(api.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}))
        refused(api.post(f"/sandboxes/{sid}/resume", json={}))
        refused(api.post(f"/sandboxes/{sid}/reset", json={"snapshotID": snap}))
        traffic = httpx.get(f"{qnode.url}/health", timeout=30, headers={
            "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
            "X-Access-Token": b["envdAccessToken"]})
        assert traffic.status_code == 429 and "quota of 2" in traffic.json()["message"]
        assert 1 <= int(traffic.headers["Retry-After"]) <= 60
        refused(api.post(f"/snapshots/{snap}/diff/{snap}"))  # its temporary sandboxes
        state = api.get("/v2/sandboxes", params=[("state", "paused")]).json()
        assert [s["sandboxID"] for s in state] == [sid]
        # Room again: the resume goes.
        child = next(c for c in fork.json() if "sandbox" in c)["sandbox"]["sandboxID"]
        assert api.delete(f"/sandboxes/{child}").status_code == 204
        assert api.post(f"/sandboxes/{sid}/connect", json={}).status_code == 201
        api.delete(f"/snapshots/{snap}")
        kill_all(api)


# -- finding 6: envd's port wakes a sandbox only for a credential --------------------------

def frozen(node: Node, sandbox_id: str) -> bool:
    state = Path(f"/sys/fs/cgroup/freezer/{node.prefix}/{sandbox_id}/freezer.state")
    return state.read_text().strip() == "FROZEN"


def test_no_token_no_thaw_and_the_sdk_still_works(qnode: Node) -> None:
    sbx = Sandbox.create("base", timeout=120)
    sid = sbx.sandbox_id
    envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
    try:
        wait_for("the idle sandbox frozen", lambda: frozen(qnode, sid))
        with httpx.Client(base_url=qnode.url, timeout=30) as anon:
            assert anon.get("/health", headers=envd).status_code == 204
            host = {"Host": sbx.get_host(49983)}
            assert anon.get("/health", headers=host).status_code == 204
            r = anon.get("/files", params={"path": "/etc/hostname"}, headers=envd)
            assert r.status_code == 401, r.text
            r = anon.post("/process.Process/List", headers={**envd, "X-Access-Token": "x"},
                          content=b"{}")
            assert r.status_code == 401, r.text
            bad = anon.get("/files", headers=envd, params={
                "path": "/etc/hostname", "username": "user", "signature": "v1_forged"})
            assert bad.status_code == 401
        assert frozen(qnode, sid), "a request without a credential thawed the sandbox"
        # The SDK's calls carry the token: they thaw it and are answered.
        assert sbx.is_running()
        assert not frozen(qnode, sid)
        assert sbx.commands.run("echo awake").stdout == "awake\n"
        wait_for("frozen again", lambda: frozen(qnode, sid))
        url = sbx.download_url("/etc/hostname")  # a signed URL needs no token
        assert httpx.get(url, timeout=30).status_code == 200
    finally:
        sbx.kill()
    assert not sbx.is_running()  # the SDK's /health probe after a kill


# -- findings 4 and 5: a GET creates nothing; text diffs are bounded ------------------------

def test_diff_get_creates_nothing_and_text_is_bounded(qnode: Node) -> None:
    with qnode.client() as api:
        kill_all(api)
        sbx = Sandbox.create("base", timeout=300)
        try:
            # Six files of 4 900 lines (within the per-file bound) and one of 6 000.
            sbx.commands.run(
                "cd /home/user && for i in 1 2 3 4 5 6; do seq 4900 > f$i.txt; done; "
                "seq 6000 > big.txt", timeout=60)
            snap = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots").json()["snapshotID"]
            sbx.commands.run("cd /home/user && for f in f*.txt big.txt; do "
                             "shuf $f > t && mv t $f; done", timeout=60)
            # A GET that would restore a snapshot: refused, nothing started.
            r = api.get(f"/snapshots/{snap}/diff/{sbx.sandbox_id}")
            assert r.status_code == 405 and r.headers["Allow"] == "POST", r.text
            assert "POST" in r.json()["message"]
            assert live(api) == [sbx.sandbox_id]
            assert api.get(f"/snapshots/{sbx.sandbox_id}/diff/{sbx.sandbox_id}"
                           ).status_code == 200  # two running sandboxes: nothing created
            # 6 x 4 900 lines in each version: more than the 50 000 a diff compares.
            r = api.post(f"/snapshots/{snap}/diff/{sbx.sandbox_id}", params={"text": "true"},
                         timeout=120)
            assert r.status_code == 413 and "50000" in r.json()["message"], r.text
            sbx.commands.run("cd /home/user && rm f3.txt f4.txt f5.txt f6.txt")
            t0 = time.monotonic()
            r = api.post(f"/snapshots/{snap}/diff/{sbx.sandbox_id}", params={"text": "true"},
                         timeout=120)
            assert r.status_code == 200, r.text
            took = time.monotonic() - t0
            body = r.json()
            assert body["notDiffed"] == {"/home/user/big.txt": "more than 5000 lines: not "
                                                                "diffed"}
            assert "/home/user/f1.txt" in body["diffs"], sorted(body["diffs"])
            assert took < 60
            assert live(api) == [sbx.sandbox_id]  # the temporary sandbox is gone
            api.delete(f"/snapshots/{snap}")
        finally:
            sbx.kill()


def test_a_diff_child_is_killed_at_its_deadline() -> None:
    # Short repeated lines in another order: ~1.9 s of difflib here.
    rng = random.Random(1)
    lines = [b"%d\n" % rng.randrange(300) for _ in range(20000)]
    old = b"".join(lines)
    rng.shuffle(lines)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        diff_all([("/x", old, b"".join(lines))], 0.3)
    assert time.monotonic() - t0 < 5
    assert diff_all([("/y", b"a\n", b"b\n")], 10)["/y"].endswith("+b\n")


# -- finding 7: private networks beyond the host are refused unless opened ----------------

def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def outside() -> Iterator[None]:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "link", "del", LINK], capture_output=True)
    sh("ip", "netns", "add", NS)
    server = None
    try:
        sh("ip", "link", "add", LINK, "type", "veth", "peer", "name", "eth0", "netns", NS)
        for host_side, inside in OUTSIDE.values():
            sh("ip", "addr", "add", f"{host_side}/30", "dev", LINK)
            sh("ip", "-n", NS, "addr", "add", f"{inside}/30", "dev", "eth0")
        sh("ip", "link", "set", LINK, "up")
        sh("ip", "-n", NS, "link", "set", "eth0", "up")
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        sh("ip", "-n", NS, "route", "add", "default", "via", OUTSIDE["cgnat"][0])
        server = subprocess.Popen(["ip", "netns", "exec", NS, "python3", "-m", "http.server",
                                   "8000", "--bind", "0.0.0.0", "--directory", "/usr/share/doc"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        addr = OUTSIDE["cgnat"][1]
        wait_for("the outside server", lambda: subprocess.run(
            ["ip", "netns", "exec", NS, "curl", "-s", "-o", "/dev/null", f"http://{addr}:8000/"],
            capture_output=True).returncode == 0)
        yield
    finally:
        if server:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", LINK], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def reachable(sbx: Sandbox) -> dict[str, bool]:
    script = "; ".join(f"echo {name}=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 "
                       f"http://{inside}:8000/)" for name, (_, inside) in OUTSIDE.items())
    got = dict(line.split("=", 1) for line in sbx.commands.run(script, timeout=60).stdout.split())
    return {name: got.get(name) == "200" for name in OUTSIDE}


def test_private_networks_are_refused_unless_opened(qnode: Node, outside: None) -> None:
    # This node's operator opened 172.31.231.0/30 (egress_private_open) only.
    with qnode.client() as api:
        kill_all(api)
    sbx = Sandbox.create("base", timeout=120)
    try:
        assert reachable(sbx) == {"cgnat": False, "rfc1918": False, "opened": True}
    finally:
        sbx.kill()
    sbx = Sandbox.create("base", timeout=120,
                         network={"allow_out": [OUTSIDE["cgnat"][1], "192.168.231.0/30"]})
    try:
        assert reachable(sbx) == {"cgnat": True, "rfc1918": True, "opened": True}
    finally:
        sbx.kill()


# -- open items of docs/security.md: a restart's dead sandboxes, a dead warm-pool member --

def runtime_pid(node: Node, sandbox_id: str) -> int:
    state = node.home / "run" / "runsc" / f"{sandbox_id}_sandbox:{sandbox_id}.state"
    return int(json.loads(state.read_text())["sandbox"]["pid"])


def pooled(node: Node, api: httpx.Client) -> set[str]:
    """The warm pool's sandboxes (runtimes with no record), once it holds one."""
    pool = (api.get("/cluster/status").json().get("bootImages") or {}).get("pooled") or {}
    if not pool.get("base"):
        return set()
    known = {s["sandboxID"] for s in api.get(
        "/v2/sandboxes", params=[("state", s) for s in ("running", "paused", "error")]).json()}
    states = (node.home / "run" / "runsc").glob("*_sandbox:*.state")
    return {p.name.split("_sandbox:")[0] for p in states} - known


def test_a_dead_pool_member_is_replaced_before_hand_out(qnode: Node) -> None:
    with qnode.client() as api:
        kill_all(api)
        first = api.post("/sandboxes", json={"templateID": "base", "timeout": 60}).json()
        member = next(iter(wait_for("a pooled sandbox", lambda: pooled(qnode, api), 60)))
        os.kill(runtime_pid(qnode, member), signal.SIGKILL)
        fresh = wait_for("the pool refilled with another sandbox",
                         lambda: pooled(qnode, api) - {member}, 60)
        assert "replacing it" in qnode.log_tail(200)
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        assert r.status_code == 201, r.text
        assert r.json()["sandboxID"] in fresh  # handed the live one, not the dead
        sbx = Sandbox.connect(r.json()["sandboxID"])
        assert sbx.commands.run("echo pooled").stdout == "pooled\n"
        api.delete(f"/sandboxes/{first['sandboxID']}")
        kill_all(api)


def test_a_sandbox_that_died_while_the_node_was_down_is_listed_in_error(qnode: Node) -> None:
    with qnode.client() as api:
        kill_all(api)
        sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 300}
                       ).json()["sandboxID"]
        pid = runtime_pid(qnode, sid)
    qnode.kill9()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    qnode.start()
    with qnode.client() as api:
        r = api.get(f"/sandboxes/{sid}")
        assert r.status_code == 404 and "ended while the node was down" in r.json()["message"]
        listed = api.get("/v2/sandboxes", params={"state": "error"}).json()
        assert [s["sandboxID"] for s in listed] == [sid]
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
        kill_all(api)
