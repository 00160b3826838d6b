"""Ports and secure access through the node's proxy, as the e2b SDK addresses them."""

from __future__ import annotations

import base64
import json
import socket
import struct
import subprocess
import threading
import time

import httpx
import pytest
import websockets
from e2b import Sandbox
from websockets.sync.client import connect as ws_connect

from agentenv.testing import Node
from sandbox_helpers import (
    HOST_ECHO_LOG,
    lose_pause_snapshot,
    start_host_echo,
    start_ws_echo,
    wait_port,
)

HOST_PORT = 8082  # start_host_echo's server: answers with the Host it received


@pytest.fixture(scope="module")
def served(node: Node):
    """A sandbox with an HTTP server on 8080 and a WebSocket echo server on 8765."""
    sbx = Sandbox.create(template="base", timeout=300)
    start_ws_echo(sbx)
    start_host_echo(sbx, HOST_PORT)
    sbx.files.write("/home/user/www/index.html", "served from the sandbox\n")
    # The module's tests may outlast the SDK's default command timeout (60 s), which
    # would end the server: timeout=0.
    sbx.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True,
                     timeout=0)
    wait_port(sbx, 8080)
    yield sbx
    sbx.kill()


def _host_and_port(sbx: Sandbox, node: Node, port: int) -> str:
    # The default domain is localhost:<the node's port>, so the host names the node's port.
    host = sbx.get_host(port)
    assert host == f"{port}-{sbx.sandbox_id}.localhost:{node.port}"
    return host


def test_get_host_http_via_host_routing(node: Node, served: Sandbox) -> None:
    # Python's resolver does not resolve *.localhost: dial the node, name the host.
    r = httpx.get(f"{node.url}/index.html",
                  headers={"Host": _host_and_port(served, node, 8080)})
    assert r.status_code == 200 and r.text == "served from the sandbox\n"


def test_get_host_url_opens_with_curl(node: Node, served: Sandbox) -> None:
    """``http://<get_host(port)>/`` opens as it is on the node's machine: curl resolves
    *.localhost to loopback itself (no --resolve, no DNS set-up), and the host names the
    node's port. (No browser is installed here to try one.)"""
    url = f"http://{served.get_host(8080)}/index.html"
    out = subprocess.run(["curl", "-sS", "--noproxy", "*", "--max-time", "30", url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "served from the sandbox\n"
    # A closed port is the proxy's JSON 502, as for any client.
    out = subprocess.run(["curl", "-sS", "--noproxy", "*", "--max-time", "30",
                          "-w", "\n%{http_code}", f"http://{served.get_host(9999)}/"],
                         capture_output=True, text=True, timeout=60)
    body, status = out.stdout.rsplit("\n", 1)
    assert status == "502" and "port is not open" in json.loads(body)["message"]


def test_ports_see_the_clients_host(node: Node, served: Sandbox) -> None:
    """Without maskRequestHost a port sees the Host the client sent (E2B's proxy passes
    it on), not the node's address for the sandbox."""
    host = _host_and_port(served, node, HOST_PORT)
    seen = httpx.get(f"{node.url}/", headers={"Host": host}).json()
    assert seen == {"host": host, "forwarded": None}
    seen = httpx.get(f"{node.url}/", headers={"E2b-Sandbox-Id": served.sandbox_id,
                                              "E2b-Sandbox-Port": str(HOST_PORT)}).json()
    assert seen == {"host": f"127.0.0.1:{node.port}", "forwarded": None}


def test_http_via_header_routing(node: Node, served: Sandbox) -> None:
    r = httpx.get(f"{node.url}/index.html",
                  headers={"E2b-Sandbox-Id": served.sandbox_id, "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 200 and r.text == "served from the sandbox\n"
    # the API key is not forwarded into the sandbox, and nothing else breaks with it
    r = httpx.get(f"{node.url}/index.html",
                  headers={"E2b-Sandbox-Id": served.sandbox_id, "E2b-Sandbox-Port": "8080",
                           "X-API-Key": node.api_key})
    assert r.status_code == 200


@pytest.mark.parametrize("routing", ["host", "headers"])
def test_websocket_echo(node: Node, served: Sandbox, routing: str) -> None:
    if routing == "host":
        uri, headers = f"ws://{_host_and_port(served, node, 8765)}/", {}
    else:
        uri = f"ws://127.0.0.1:{node.port}/"
        headers = {"E2b-Sandbox-Id": served.sandbox_id, "E2b-Sandbox-Port": "8765"}
    sock = socket.create_connection(("127.0.0.1", node.port))
    with ws_connect(uri, sock=sock, additional_headers=headers, open_timeout=10) as ws:
        for message in ("hello", "x" * 100_000):
            ws.send(message)
            assert ws.recv(timeout=10) == message
        ws.send(b"\x00\xffbinary")
        assert ws.recv(timeout=10) == b"\x00\xffbinary"


def test_closed_port_is_a_clear_502(node: Node, served: Sandbox) -> None:
    t0 = time.monotonic()
    r = httpx.get(f"{node.url}/", headers={"Host": _host_and_port(served, node, 9999)},
                  timeout=30)
    assert time.monotonic() - t0 < 10
    assert r.status_code == 502
    body = r.json()
    assert body["code"] == 502
    assert "port is not open" in body["message"] and "9999" in body["message"]
    # The node's log says what the connect met: refused (nothing listens there), as
    # opposed to a network fault (unreachable, reset, timed out).
    said = [line for line in node.log_path.read_text(errors="replace").splitlines()
            if f"proxy to port 9999 of {served.sandbox_id} at " in line]
    assert said and "ECONNREFUSED" in said[-1], said
    # a WebSocket to a closed port is refused, not left hanging
    sock = socket.create_connection(("127.0.0.1", node.port))
    with pytest.raises((websockets.InvalidStatus, websockets.ConnectionClosed,
                        websockets.InvalidHandshake)):
        with ws_connect(f"ws://{_host_and_port(served, node, 9999)}/", sock=sock,
                        open_timeout=10) as ws:
            ws.recv(timeout=10)


def test_unknown_sandbox_is_a_502_with_message(node: Node) -> None:
    r = httpx.get(f"{node.url}/", headers={"Host": "8080-nosuchsandbox00000.localhost"})
    assert r.status_code == 502 and "not found" in r.json()["message"]
    assert r.json()["sandboxId"] == "nosuchsandbox00000"


def _connect_envelope(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return b"\x00" + struct.pack(">I", len(data)) + data


def test_envd_refuses_requests_without_the_access_token(node: Node, served: Sandbox) -> None:
    token = served._envd_access_token
    assert token  # create returned it; the SDK sends it as X-Access-Token
    route = {"E2b-Sandbox-Id": served.sandbox_id, "E2b-Sandbox-Port": "49983"}
    user = {"Authorization": "Basic " + base64.b64encode(b"user:").decode()}
    rpc = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    body = _connect_envelope({"process": {"cmd": "/bin/true"}})
    with httpx.Client(base_url=node.url, timeout=30) as http:
        # files: no token and no signature -> 401; a wrong token -> 401; the token -> 200
        params = {"path": "/home/user/www/index.html"}
        assert http.get("/files", params=params, headers=route).status_code == 401
        assert http.get("/files", params=params,
                        headers={**route, "X-Access-Token": "wrong"}).status_code == 401
        ok = http.get("/files", params=params, headers={**route, **user,
                                                        "X-Access-Token": token})
        assert ok.status_code == 200 and ok.text == "served from the sandbox\n"
        # process RPCs likewise
        r = http.post("/process.Process/Start", content=body, headers={**route, **user, **rpc})
        assert r.status_code == 401
        r = http.post("/process.Process/Start", content=body,
                      headers={**route, **user, **rpc, "X-Access-Token": token})
        assert r.status_code == 200
        # the health check stays open (the SDK's is_running uses it)
        assert http.get("/health", headers=route).status_code == 204
    # a token from another sandbox does not open this one
    other = Sandbox.create(template="base", timeout=60)
    try:
        r = httpx.get(f"{node.url}/files", params={"path": "/home/user/www/index.html"},
                      headers={**route, **user, "X-Access-Token": other._envd_access_token})
        assert r.status_code == 401
    finally:
        other.kill()


# -- network.maskRequestHost -----------------------------------------------------------

MASK = "${PORT}-myhost.example.com"


def test_mask_request_host_is_the_host_ports_see(node: Node) -> None:
    """E2B's network.maskRequestHost: a port sees the mask (``${PORT}`` replaced) as its
    Host and the client's Host in X-Forwarded-Host, through either routing, for HTTP
    and WebSocket handshakes; after a pause and resume too."""
    sbx = Sandbox.create(template="base", timeout=300, network={"mask_request_host": MASK})
    try:
        assert sbx.get_info().network["mask_request_host"] == MASK
        start_host_echo(sbx, HOST_PORT)
        masked = f"{HOST_PORT}-myhost.example.com"
        host = _host_and_port(sbx, node, HOST_PORT)
        for _ in range(2):  # before and after a pause
            seen = httpx.get(f"{node.url}/", headers={"Host": host,
                                                      "X-Forwarded-Host": "forged"}).json()
            assert seen == {"host": masked, "forwarded": host}
            seen = httpx.get(f"{node.url}/", headers={
                "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(HOST_PORT)}).json()
            assert seen == {"host": masked, "forwarded": f"127.0.0.1:{node.port}"}
            sbx.pause()
            sbx = Sandbox.connect(sbx.sandbox_id)
        # A WebSocket handshake carries the mask too (the server answers it with a 200,
        # so the handshake fails; its log shows what it got).
        sock = socket.create_connection(("127.0.0.1", node.port))
        with pytest.raises((websockets.InvalidHandshake, websockets.ConnectionClosed)):
            with ws_connect(f"ws://{host}/", sock=sock, open_timeout=10) as ws:
                ws.recv(timeout=10)
        last = json.loads(sbx.files.read(HOST_ECHO_LOG).splitlines()[-1])
        assert last == {"host": masked, "forwarded": host}
        # envd's port keeps the client's Host: the SDK's own traffic still works.
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        sbx.kill()


@pytest.mark.parametrize("mask", ["-https://abcd", "a b", "host:99999", "h\r\nX-Evil: 1",
                                  "user@host", "x" * 256 + ".com", 42])
def test_invalid_mask_request_host_is_a_400(node: Node, api: httpx.Client, mask) -> None:
    before = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
    r = api.post("/sandboxes", json={"templateID": "base", "network": {"maskRequestHost": mask}})
    assert r.status_code == 400, r.text
    assert "maskRequestHost" in r.json()["message"]
    assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} == before
    if isinstance(mask, str) and "\r" not in mask:  # the SDK sends it as it is
        with pytest.raises(Exception, match="maskRequestHost"):
            Sandbox.create(template="base", network={"mask_request_host": mask})


# -- auto-resume on traffic -------------------------------------------------------------

AUTO_RESUME = {"on_timeout": "pause", "auto_resume": True}


def _paused_with_server(**create) -> Sandbox:
    sbx = Sandbox.create(template="base", timeout=300, **create)
    start_host_echo(sbx, HOST_PORT)
    sbx.pause()
    assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    return sbx


def _resumes_logged(node: Node, sid: str) -> int:
    return node.log_path.read_text(errors="replace").count(
        f"sandbox {sid}: traffic arrived while paused")


def test_traffic_resumes_a_paused_auto_resume_sandbox(node: Node) -> None:
    """lifecycle auto_resume: requests to a port of the paused sandbox resume it (one
    resume for many concurrent requests, every one answered); envd's port resumes it
    only with envd's access token."""
    sbx = _paused_with_server(lifecycle=AUTO_RESUME)
    sid = sbx.sandbox_id
    try:
        assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        host = _host_and_port(sbx, node, HOST_PORT)
        results: list[httpx.Response | BaseException] = []

        def get() -> None:
            try:
                results.append(httpx.get(f"{node.url}/", headers={"Host": host}, timeout=120))
            except BaseException as exc:  # reported below
                results.append(exc)

        threads = [threading.Thread(target=get) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), \
            results
        assert results[0].json()["host"] == host  # type: ignore[union-attr]
        assert Sandbox.get_info(sid).state.value == "running"
        assert _resumes_logged(node, sid) == 1
        # The server inside kept running through the pause; the SDK works on.
        assert sbx.commands.run("echo ok").stdout == "ok\n"

        # envd's port: without envd's token it stays paused (403, E2B's message) ...
        sbx.pause()
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
        r = httpx.get(f"{node.url}/health", headers=route, timeout=60)
        assert r.status_code == 403 and "can't be resumed" in r.json()["message"]
        assert Sandbox.get_info(sid).state.value == "paused"
        # ... and with it, it is resumed.
        r = httpx.get(f"{node.url}/health", headers={**route,
                                                     "X-Access-Token": sbx._envd_access_token},
                      timeout=120)
        assert r.status_code == 204
        assert Sandbox.get_info(sid).state.value == "running"
        assert _resumes_logged(node, sid) == 2
    finally:
        sbx.kill()


def test_traffic_to_a_paused_sandbox_without_auto_resume(node: Node) -> None:
    """E2B's proxy answers a paused sandbox it may not resume as one it cannot find:
    502, with the sandbox's ID; the sandbox stays paused."""
    sbx = _paused_with_server()
    try:
        assert sbx.get_info().lifecycle["auto_resume"] is False
        r = httpx.get(f"{node.url}/", headers={"Host": _host_and_port(sbx, node, HOST_PORT)},
                      timeout=60)
        assert r.status_code == 502
        body = r.json()
        assert body["code"] == 502 and body["sandboxId"] == sbx.sandbox_id
        assert "not found" in body["message"] and "paused" in body["message"]
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    finally:
        sbx.kill()


def test_auto_resume_that_fails_is_a_clear_502(node: Node, api: httpx.Client) -> None:
    """A paused sandbox whose pause snapshot is gone cannot resume: traffic gets a 502
    that says so, the sandbox stays paused and the node goes on serving."""
    sbx = _paused_with_server(lifecycle=AUTO_RESUME)
    sid = sbx.sandbox_id
    try:
        lose_pause_snapshot(node, api, sid)
        r = httpx.get(f"{node.url}/", headers={"Host": _host_and_port(sbx, node, HOST_PORT)},
                      timeout=60)
        assert r.status_code == 502, r.text
        assert r.json()["sandboxId"] == sid
        assert "could not be resumed" in r.json()["message"]
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        assert api.get("/health").status_code == 200
    finally:
        api.delete(f"/sandboxes/{sid}")
