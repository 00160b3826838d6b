"""The single node end to end: real server, real runsc sandboxes, real netns, real envd."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from agentenv.testing import Node


def create(api: httpx.Client, **body) -> dict:
    r = api.post("/sandboxes", json={"templateID": "base", **body})
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture
def sandbox(node: Node, api: httpx.Client) -> Iterator[Sandbox]:
    info = create(api, timeout=300)
    sbx = Sandbox.connect(info["sandboxID"])
    yield sbx
    api.delete(f"/sandboxes/{info['sandboxID']}")


def slot_address(node: Node, sandbox_id: str) -> str:
    with sqlite3.connect(node.home / "db") as db:
        row = db.execute("SELECT slot_address FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))
        return row.fetchone()[0]


def host_uplink(address: str) -> str:
    """The host side of a slot's /30 (address is host + 1)."""
    parts = address.split(".")
    return ".".join([*parts[:3], str(int(parts[3]) - 1)])


# -- API basics ---------------------------------------------------------------

def test_health_needs_no_key(node: Node) -> None:
    r = httpx.get(node.url + "/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_key_is_401(node: Node, key: str | None) -> None:
    with node.client(key=key) as client:
        r = client.get("/sandboxes")
    assert r.status_code == 401
    assert r.json() == {"code": 401, "message": "missing or invalid X-API-Key header"}


def test_api_key_file_is_private(node: Node) -> None:
    path = node.home / "secrets" / "api-key"
    assert path.stat().st_mode & 0o777 == 0o600
    assert node.api_key not in node.log_path.read_text()


# -- lifecycle ----------------------------------------------------------------

def test_create_exec_files_kill(node: Node, api: httpx.Client) -> None:
    info = create(api, timeout=120, metadata={"task": "t1"}, envVars={"GREETING": "hello"})
    sid = info["sandboxID"]
    assert info["templateID"] == "base" and info["envdAccessToken"]

    detail = api.get(f"/sandboxes/{sid}").json()
    assert detail["state"] == "running"
    assert detail["metadata"] == {"task": "t1"}
    assert detail["cpuCount"] == 2 and detail["memoryMB"] == 512
    assert sid in [s["sandboxID"] for s in api.get("/sandboxes").json()]

    sbx = Sandbox.connect(sid)
    out = sbx.commands.run("echo $GREETING; id -un; pwd; hostname")
    greeting, user, cwd, hostname = out.stdout.split()
    assert (greeting, user, cwd) == ("hello", "user", "/home/user")
    assert hostname.startswith("sbx-")
    assert sbx.commands.run("id -un", user="root").stdout.strip() == "root"

    sbx.files.write("/home/user/notes.txt", "line one\n")
    assert sbx.files.read("/home/user/notes.txt") == "line one\n"
    assert sbx.commands.run("cat notes.txt").stdout == "line one\n"

    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo oops >&2; exit 3")
    assert failed.value.exit_code == 3 and "oops" in failed.value.stderr

    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    gone = api.get(f"/sandboxes/{sid}")
    assert gone.status_code == 404 and gone.json()["code"] == 404
    assert api.delete(f"/sandboxes/{sid}").status_code == 404


def test_template_rootfs_is_never_written(sandbox: Sandbox) -> None:
    sandbox.commands.run("echo x > /etc/written-by-sandbox", user="root")
    assert sandbox.commands.run("cat /etc/written-by-sandbox").stdout == "x\n"
    from agentenv.testing import SHARED_HOME

    rootfs = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
    assert not (rootfs / "etc" / "written-by-sandbox").exists()


def test_kernel_is_the_sandbox_kernel(sandbox: Sandbox) -> None:
    inside = sandbox.commands.run("uname -r").stdout.strip()
    assert inside != os.uname().release
    assert inside.startswith("4.4")


def test_sandbox_sees_its_limits(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("nproc").stdout.strip() == "2"


def test_ttl_expiry_kills(node: Node, api: httpx.Client) -> None:
    sid = create(api, timeout=1, autoPause=False)["sandboxID"]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if api.get(f"/sandboxes/{sid}").status_code == 404:
            break
        time.sleep(0.5)
    assert api.get(f"/sandboxes/{sid}").status_code == 404


def test_set_timeout_extends(node: Node, api: httpx.Client) -> None:
    sid = create(api, timeout=30)["sandboxID"]
    try:
        before = api.get(f"/sandboxes/{sid}").json()["endAt"]
        assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 600}).status_code == 204
        after = api.get(f"/sandboxes/{sid}").json()["endAt"]
        assert after > before
        bad = api.post(f"/sandboxes/{sid}/timeout", json={"timeout": -5})
        assert bad.status_code == 400
    finally:
        api.delete(f"/sandboxes/{sid}")


# -- isolation ----------------------------------------------------------------

def test_sandboxes_cannot_see_each_other(node: Node, api: httpx.Client) -> None:
    a_id, b_id = create(api)["sandboxID"], create(api)["sandboxID"]
    try:
        a, b = Sandbox.connect(a_id), Sandbox.connect(b_id)
        a.files.write("/home/user/secret-a", "mine")
        a.commands.run("sleep 4242", background=True, timeout=0)
        a.commands.run("python3 -m http.server 8080 --bind 0.0.0.0", background=True, timeout=0)
        _wait_port(a, 8080)

        assert b.commands.run("ls /home/user").stdout.strip() == ""
        assert "4242" not in b.commands.run("ps aux").stdout
        # A's server answers through A's own slot (sanity), never from B.
        a_addr = slot_address(node, a_id)
        r = httpx.get(f"{node.url}/", headers={"E2b-Sandbox-Id": a_id, "E2b-Sandbox-Port": "8080"})
        assert r.status_code == 200
        for target in (a_addr, "169.254.0.21"):
            res = b.commands.run(
                f"curl -sS --max-time 2 http://{target}:8080/ || echo unreachable",
            )
            assert "unreachable" in res.stdout, f"B reached A at {target}"
    finally:
        api.delete(f"/sandboxes/{a_id}")
        api.delete(f"/sandboxes/{b_id}")


def test_sandbox_cannot_reach_node_or_host_services(node: Node, sandbox: Sandbox) -> None:
    # A service on the host bound to every address, as careless services are.
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted: list[str] = []

    def serve() -> None:
        listener.settimeout(8)
        try:
            conn, peer = listener.accept()
            accepted.append(peer[0])
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    uplink = host_uplink(slot_address(node, sandbox.sandbox_id))
    try:
        for target in (f"{uplink}:{port}", f"{uplink}:{node.port}", f"127.0.0.1:{node.port}",
                       f"169.254.0.22:{node.port}"):
            res = sandbox.commands.run(
                f"curl -sS --max-time 2 http://{target}/health || echo unreachable"
            )
            assert "unreachable" in res.stdout, f"sandbox reached {target}: {res.stdout}"
    finally:
        listener.close()
        t.join()
    assert accepted == []


def test_memory_hog_dies_sandbox_survives(node: Node, sandbox: Sandbox) -> None:
    with pytest.raises(CommandExitException) as hog:
        sandbox.commands.run(
            "python3 -c 'import time; b = [bytearray(64 << 20) for _ in range(16)]; time.sleep(5)'",
            timeout=60,
        )
    assert hog.value.exit_code != 0
    # Only the hog died: what runs next, for a while after, is left alone.
    for _ in range(6):
        assert sandbox.commands.run("echo alive").stdout == "alive\n"
        time.sleep(0.3)
    assert httpx.get(node.url + "/health").status_code == 200


# -- bad input ----------------------------------------------------------------

def test_malformed_json_is_400(api: httpx.Client) -> None:
    r = api.post("/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["code"] == 400 and r.json()["message"]


def test_unknown_template_is_404(api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"templateID": "no-such-template"})
    assert r.status_code == 404
    assert "no-such-template" in r.json()["message"]


def test_negative_timeout_is_400(api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": -1})
    assert r.status_code == 400
    assert "timeout" in r.json()["message"]


def test_wrong_types_are_400(api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"templateID": "base", "metadata": {"a": {"b": 1}}})
    assert r.status_code == 400
    r = api.post("/sandboxes", json={"timeout": 5})
    assert r.status_code == 400 and "templateID" in r.json()["message"]


def test_huge_metadata_body_is_refused(node: Node, api: httpx.Client) -> None:
    body = json.dumps({"templateID": "base", "metadata": {"blob": "x" * (10 << 20)}})
    r = api.post("/sandboxes", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["code"] == 413
    assert httpx.get(node.url + "/health").status_code == 200


def test_unknown_sandbox_is_404(api: httpx.Client) -> None:
    for r in (api.get("/sandboxes/doesnotexist"), api.delete("/sandboxes/doesnotexist"),
              api.post("/sandboxes/doesnotexist/timeout", json={"timeout": 5})):
        assert r.status_code == 404 and r.json()["code"] == 404


def test_proxy_to_unknown_sandbox_or_closed_port_is_502(node: Node, sandbox: Sandbox) -> None:
    r = httpx.get(node.url + "/", headers={"E2b-Sandbox-Id": "nope", "E2b-Sandbox-Port": "80"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    r = httpx.get(node.url + "/", headers={"E2b-Sandbox-Id": sandbox.sandbox_id,
                                           "E2b-Sandbox-Port": "9"}, timeout=10)
    assert r.status_code == 502 and "port is not open" in r.json()["message"]


def _wait_port(sbx: Sandbox, port: int) -> None:
    for _ in range(50):
        probe = f"curl -s -o /dev/null -w '%{{http_code}}' localhost:{port}/ || true"
        res = sbx.commands.run(probe)
        if res.stdout.strip() == "200":
            return
        time.sleep(0.1)
    raise AssertionError(f"port {port} never opened")
