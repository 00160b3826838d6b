"""The node's reverse proxy: header and Host routing, HTTP streaming and WebSocket."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import websockets
from e2b import Sandbox
from websockets.sync.client import connect as ws_connect

from agentenv.testing import Node
from agentenv.web.relay import ConnectFrames
from sandbox_helpers import start_ws_echo


@pytest.fixture
def served(node: Node, api: httpx.Client):
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    start_ws_echo(sbx)
    sbx.commands.run("mkdir -p www && echo hello-from-sandbox > www/index.html")
    sbx.commands.run("cd www && python3 -m http.server 8080", background=True, timeout=0)
    for _ in range(100):
        if sbx.commands.run("curl -s localhost:8080/ || true").stdout:
            break
        time.sleep(0.1)
    yield sid
    api.delete(f"/sandboxes/{sid}")


def test_host_routing_http(node: Node, served: str) -> None:
    r = httpx.get(f"{node.url}/index.html", headers={"Host": f"8080-{served}.localhost"})
    assert r.status_code == 200 and r.text == "hello-from-sandbox\n"


def test_header_routing_http(node: Node, served: str) -> None:
    r = httpx.get(f"{node.url}/index.html",
                  headers={"E2b-Sandbox-Id": served, "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 200 and r.text == "hello-from-sandbox\n"


@pytest.mark.parametrize("routing", ["host", "headers"])
def test_websocket_through_proxy(node: Node, served: str, routing: str) -> None:
    if routing == "host":
        uri, headers = f"ws://8765-{served}.localhost:{node.port}/", {}
    else:
        uri = f"ws://127.0.0.1:{node.port}/"
        headers = {"E2b-Sandbox-Id": served, "E2b-Sandbox-Port": "8765"}
    deadline = time.monotonic() + 10
    while True:
        try:
            # *.localhost need not resolve here: dial the node, name the sandbox in the URI.
            sock = socket.create_connection(("127.0.0.1", node.port))
            with ws_connect(uri, sock=sock, additional_headers=headers, open_timeout=5) as ws:
                ws.send("ping one")
                assert ws.recv(timeout=5) == "ping one"
                ws.send(b"\x00\x01bytes")
                assert ws.recv(timeout=5) == b"\x00\x01bytes"
            return
        except (OSError, websockets.InvalidHandshake, websockets.ConnectionClosed):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _envelope(flags: int, body: bytes) -> bytes:
    return bytes([flags]) + len(body).to_bytes(4, "big") + body


def test_connect_frames_pass_whole_envelopes_only() -> None:
    """Issue 14.10: the relay passes on whole Connect envelopes, so an upstream that
    dies mid-envelope can still be followed by a well-formed end-of-stream error;
    one already ended, or cut inside an envelope too big to hold, gets none."""
    a, b = _envelope(0, b'{"a":1}'), _envelope(0, b"x" * 100)
    frames = ConnectFrames()
    assert frames.feed(a + b[:3]) == a
    assert frames.feed(b[3:50]) == b""
    end = frames.end_with_error("unavailable", "gone")
    assert end is not None and end[0] == 0x02
    assert json.loads(end[5:]) == {"error": {"code": "unavailable", "message": "gone"}}
    assert int.from_bytes(end[1:5], "big") == len(end) - 5
    assert frames.end_with_error("unavailable", "again") is None

    done = ConnectFrames()
    assert done.feed(_envelope(2, b"{}")) == _envelope(2, b"{}")
    assert done.end_with_error("unavailable", "gone") is None

    big = _envelope(0, b"y" * (ConnectFrames.HOLD + 10))
    cut = ConnectFrames()
    assert cut.feed(big[:ConnectFrames.HOLD + 6]) == big[:ConnectFrames.HOLD + 6]
    assert cut.end_with_error("unavailable", "gone") is None
    assert cut.feed(big[ConnectFrames.HOLD + 6:] + a) == big[ConnectFrames.HOLD + 6:] + a
    assert cut.end_with_error("unavailable", "gone") is not None
