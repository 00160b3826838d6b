"""Fork: children continue the source's exact state, then diverge; the source carries on."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from e2b import Sandbox

from agentenv.runtime.gvisor import console_says_dormant
from agentenv.testing import Node
from sandbox_helpers import COUNTER, counting

MEMORY_SERVER = """
import http.server, json
state = {"n": 0}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/inc":
            state["n"] += 1
        body = json.dumps(state).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def memory(node: Node, sid: str, path: str = "/get") -> int:
    r = httpx.get(node.url + path, headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"},
                  timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["n"]


@pytest.fixture
def source(node: Node, api: httpx.Client):
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    sbx.files.write("/home/user/mem.py", MEMORY_SERVER)
    # timeout=0: a command's timeout (the SDK's default: 60 s) bounds a background
    # command too, and its children inherit that deadline; under load this file's
    # tests outlast it (the server killed mid-test: its port refused in a child).
    sbx.commands.run("python3 /home/user/mem.py", background=True, timeout=0)
    sbx.commands.run(COUNTER, background=True, timeout=0)
    sbx.files.write("/home/user/origin.txt", "from the source")
    deadline = time.monotonic() + 60  # a python3 start in gVisor, on a loaded machine
    while True:
        try:
            memory(node, sid)
            break
        except (AssertionError, httpx.HTTPError):
            assert time.monotonic() < deadline, "the memory server did not come up"
            time.sleep(0.1)
    yield sbx
    api.delete(f"/sandboxes/{sid}")


def test_sixteen_children_continue_then_diverge(node: Node, api: httpx.Client, source) -> None:
    sid = source.sandbox_id
    for _ in range(5):
        memory(node, sid, "/inc")
    end_before = api.get(f"/sandboxes/{sid}").json()["endAt"]

    r = api.post(f"/sandboxes/{sid}/fork", json={"count": 16, "timeout": 300})
    assert r.status_code == 201, r.text
    results = r.json()
    assert len(results) == 16
    errors = [x["error"] for x in results if "error" in x]
    assert errors == []
    children = [x["sandbox"]["sandboxID"] for x in results]
    assert len(set(children)) == 16 and sid not in children
    tokens = {x["sandbox"]["envdAccessToken"] for x in results}
    assert len(tokens) == 16  # each child has its own envd token
    try:
        for i, child in enumerate(children):
            sbx = Sandbox.connect(child)
            # Memory: the Python server's state continues from the fork point...
            assert memory(node, child) == 5
            # ...and diverges per child (each reached through its own slot): one step
            # each, so memory shared between any two would show as more than one.
            assert memory(node, child, "/inc") == 6
            # Processes: the counter loop keeps counting.
            assert counting(sbx)
            # Files: inherited, then private.
            assert sbx.files.read("/home/user/origin.txt") == "from the source"
            sbx.files.write("/home/user/child.txt", f"child {i}")
        for i, child in enumerate(children):
            assert memory(node, child) == 6
            assert Sandbox.connect(child).files.read("/home/user/child.txt") == f"child {i}"
        # The source is untouched: same state, TTL, memory; none of the children's files.
        assert memory(node, sid) == 5
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert api.get(f"/sandboxes/{sid}").json()["endAt"] == end_before
        assert not source.files.exists("/home/user/child.txt")
        assert counting(source)
    finally:
        for child in children:
            api.delete(f"/sandboxes/{child}")


def test_a_streamed_fork_hands_over_each_child_as_it_comes_up(node: Node, api: httpx.Client,
                                                              source) -> None:
    sid = source.sandbox_id
    memory(node, sid, "/inc")
    children: list[str] = []
    try:
        with api.stream("POST", f"/sandboxes/{sid}/fork", json={"count": 4},
                        headers={"Accept": "application/x-ndjson"}) as r:
            assert r.status_code == 201
            assert r.headers["content-type"].startswith("application/x-ndjson")
            for line in r.iter_lines():
                child = json.loads(line)["sandbox"]["sandboxID"]
                children.append(child)
                # Usable on arrival, while the stream still has children to come.
                assert memory(node, child, "/inc") == 2
        assert len(set(children)) == 4 and sid not in children
        assert memory(node, sid) == 1
    finally:
        for child in children:
            api.delete(f"/sandboxes/{child}")
    # The fork's own errors keep their status: nothing is streamed for them.
    r = api.post("/sandboxes/nosuchsandbox/fork", json={"count": 2},
                 headers={"Accept": "application/x-ndjson"})
    assert r.status_code == 404 and r.json()["message"]


def test_a_batch_create_from_a_template_and_from_a_snapshot(node: Node, api: httpx.Client,
                                                            source) -> None:
    made: list[str] = []
    try:
        r = api.post("/sandboxes/batch", json={"templateID": "base", "count": 3,
                                               "metadata": {"batch": "t"}})
        assert r.status_code == 201, r.text
        ids = [x["sandbox"]["sandboxID"] for x in r.json()]
        made += ids
        assert len(set(ids)) == 3
        for sid in ids:
            assert Sandbox.connect(sid).commands.run("echo up").stdout == "up\n"
        assert {s["sandboxID"] for s in api.get("/sandboxes", params={
            "metadata": "batch=t"}).json()} == set(ids)

        snap = api.post(f"/sandboxes/{source.sandbox_id}/snapshots").json()["snapshotID"]
        with api.stream("POST", "/sandboxes/batch", json={"snapshotID": snap, "count": 2},
                        headers={"Accept": "application/x-ndjson"}) as stream:
            assert stream.status_code == 201
            for line in stream.iter_lines():
                sid = json.loads(line)["sandbox"]["sandboxID"]
                made.append(sid)  # the snapshot's files and live processes, in each
                assert Sandbox.connect(sid).files.read("/home/user/origin.txt") == \
                    "from the source"
                assert memory(node, sid) == 0
        assert len(made) == 5
    finally:
        for sid in made:
            api.delete(f"/sandboxes/{sid}")
    before = {s["sandboxID"] for s in api.get("/sandboxes").json()}
    for body, status in (({"templateID": "base", "count": 0}, 400),
                         ({"templateID": "base", "count": 65}, 400),
                         ({"templateID": "base", "snapshotID": "x", "count": 1}, 400),
                         ({"count": 1}, 400),
                         ({"templateID": "no-such-template", "count": 2}, 404)):
        r = api.post("/sandboxes/batch", json=body)
        assert r.status_code == status and r.json()["message"], (body, r.text)
    assert {s["sandboxID"] for s in api.get("/sandboxes").json()} == before  # none made


@pytest.mark.parametrize("n", [0, 17, -1])
def test_fork_count_out_of_range_is_400(api: httpx.Client, source, n: int) -> None:
    r = api.post(f"/sandboxes/{source.sandbox_id}/fork", json={"count": n})
    assert r.status_code == 400 and "count" in r.json()["message"]


def test_fork_of_unknown_sandbox_is_404(api: httpx.Client) -> None:
    r = api.post("/sandboxes/nosuchsandbox/fork", json={"count": 1})
    assert r.status_code == 404


def test_a_child_pauses_and_resumes(node: Node, api: httpx.Client, source) -> None:
    for _ in range(3):
        memory(node, source.sandbox_id, "/inc")
    child = api.post(f"/sandboxes/{source.sandbox_id}/fork",
                     json={"count": 1}).json()[0]["sandbox"]["sandboxID"]
    try:
        memory(node, child, "/inc")
        assert api.post(f"/sandboxes/{child}/pause").status_code == 204
        assert api.get(f"/sandboxes/{child}").json()["state"] == "paused"
        assert api.post(f"/sandboxes/{child}/resume").status_code == 201
        assert memory(node, child) == 4  # its own state, kept across the pause
        assert counting(Sandbox.connect(child))
        assert memory(node, source.sandbox_id) == 3
    finally:
        api.delete(f"/sandboxes/{child}")


BOOT_ID = "cat /proc/sys/kernel/random/boot_id"


def test_boot_id_is_one_per_boot(node: Node, api: httpx.Client) -> None:
    """Each created sandbox boots anew (its own boot ID, though restored from the
    template's image); fork children and a resume continue their source's boot."""
    # Once the template's image exists, so that both are restored from it (a create
    # before that boots, and a booted kernel draws its own ID anyway).
    Sandbox.create(template="base", timeout=60).kill()
    end = time.monotonic() + 120
    while not list((node.home / "snapshots" / "aliases").glob("tpl.base.*")):
        assert time.monotonic() < end, "base's boot image was not captured"
        time.sleep(0.2)
    a, b = Sandbox.create(template="base", timeout=300), Sandbox.create(template="base",
                                                                         timeout=300)
    children: list[str] = []
    try:
        boot_a = a.commands.run(BOOT_ID).stdout
        assert len(boot_a.strip()) == 36
        assert b.commands.run(BOOT_ID).stdout != boot_a
        assert a.files.read("/proc/sys/kernel/random/boot_id") == boot_a
        out = api.post(f"/sandboxes/{a.sandbox_id}/fork", json={"count": 2}).json()
        children = [c["sandbox"]["sandboxID"] for c in out]
        for child in children:
            assert Sandbox.connect(child).commands.run(BOOT_ID).stdout == boot_a
        a.beta_pause()
        assert api.get(f"/sandboxes/{a.sandbox_id}").json()["state"] == "paused"
        resumed = Sandbox.connect(a.sandbox_id)
        assert resumed.commands.run(BOOT_ID).stdout == boot_a
        # Only envd (pid 1) may mount: root's commands have no CAP_SYS_ADMIN, and
        # envd itself gave it up after start-up.
        status = resumed.commands.run("grep CapBnd /proc/self/status /proc/1/status",
                                      user="root").stdout
        for line in status.splitlines():
            assert not int(line.split()[-1], 16) & (1 << 21), status
    finally:
        for sid in (a.sandbox_id, b.sandbox_id, *children):
            api.delete(f"/sandboxes/{sid}")


def test_a_fork_of_a_dormant_source_gives_children_an_awake_envd(node: Node,
                                                                 api: httpx.Client) -> None:
    """The source's envd is woken for the capture: a child restored from a capture of
    the dormant stub would run envd's whole start on its first request (about a
    CPU-second inside gVisor, in every child)."""
    created = api.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()
    sid = created["sandboxID"]
    kids: list[str] = []
    try:
        console = node.home / "run" / "sandboxes" / sid / "console.log"
        deadline = time.monotonic() + 60
        while not console_says_dormant(console):  # asked to sleep, as a node short of memory
            assert time.monotonic() < deadline, "the source's envd did not go dormant"
            httpx.post(node.url + "/aenv/dormancy", timeout=30, headers={
                "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                "X-Access-Token": created["envdAccessToken"]})
            time.sleep(1)
        r = api.post(f"/sandboxes/{sid}/fork", json={"count": 1})
        assert r.status_code == 201, r.text
        kids = [c["sandbox"]["sandboxID"] for c in r.json()]
        child = Sandbox.connect(kids[0])
        assert child.commands.run("echo child").stdout == "child\n"
        child_console = node.home / "run" / "sandboxes" / kids[0] / "console.log"
        assert "envd woken" not in child_console.read_text(errors="replace")
        assert console.read_text(errors="replace").count("envd woken") == 1  # at the fork
    finally:
        for cid in [*kids, sid]:
            api.delete(f"/sandboxes/{cid}")
