"""Ports and secure access through the node's proxy, as the e2b SDK addresses them."""

from __future__ import annotations

import base64
import json
import socket
import struct
import time

import httpx
import pytest
import websockets
from e2b import Sandbox
from websockets.sync.client import connect as ws_connect

from agentenv.testing import Node
from sandbox_helpers import start_ws_echo, wait_port


@pytest.fixture(scope="module")
def served(node: Node):
    """A sandbox with an HTTP server on 8080 and a WebSocket echo server on 8765."""
    sbx = Sandbox.create(template="base", timeout=300)
    start_ws_echo(sbx)
    sbx.files.write("/home/user/www/index.html", "served from the sandbox\n")
    sbx.commands.run("cd /home/user/www && python3 -m http.server 8080", background=True)
    wait_port(sbx, 8080)
    yield sbx
    sbx.kill()


def _host_and_port(sbx: Sandbox, node: Node, port: int) -> str:
    host = sbx.get_host(port)
    assert host == f"{port}-{sbx.sandbox_id}.localhost"
    return f"{host}:{node.port}"


def test_get_host_http_via_host_routing(node: Node, served: Sandbox) -> None:
    # *.localhost need not resolve on this machine: dial the node, name the host.
    r = httpx.get(f"{node.url}/index.html",
                  headers={"Host": _host_and_port(served, node, 8080)})
    assert r.status_code == 200 and r.text == "served from the sandbox\n"


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
