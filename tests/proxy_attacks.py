"""Attacks on a sandbox proxy (the node's or the gateway's) from outside, with no API key:
hostile request-targets that must never reach the host's own loopback, and routing
headers that must never reach the sandbox."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from e2b import Sandbox

from sandbox_helpers import wait_port

SECRET = "host-loopback-secret"
ECHO_PORT = 8090
# A service in the sandbox that answers with the headers it was sent.
_HEADER_ECHO = f"""
import json
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

HTTPServer(("0.0.0.0", {ECHO_PORT}), H).serve_forever()
"""


@contextmanager
def host_listener() -> Iterator[tuple[int, list[str]]]:
    """A service on the host's loopback (what an SSRF would reach): its port, and the
    paths it was asked for."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            body = SECRET.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()


def raw_request(port: int, target: str, headers: dict[str, str | bytes],
                method: str = "GET") -> tuple[int, bytes]:
    """Send a request-target exactly as given (no client library would): status, body."""
    lines = [f"{method} {target} HTTP/1.1".encode()]
    for name, value in {**headers, "Connection": "close"}.items():
        lines.append(name.encode() + b": " + (value if isinstance(value, bytes)
                                              else value.encode()))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return status, body


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


def hostile_targets(listener_port: int) -> list[str]:
    return [
        f"@127.0.0.1:{listener_port}/x",              # the sandbox address becomes userinfo
        f"@127.0.0.1:{listener_port}",
        f"http://127.0.0.1:{listener_port}/x",        # absolute-form
        f"//127.0.0.1:{listener_port}/x",             # scheme-relative: stays a path
        "*",
    ]


def routings(sandbox_id: str, port: int) -> list[dict[str, str | bytes]]:
    return [{"Host": f"{port}-{sandbox_id}.localhost"},
            {"Host": "localhost", "E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}]


def assert_no_ssrf(proxy_port: int, sandbox_id: str) -> None:
    """No hostile target reaches the host's loopback, whatever the routing: each is a
    400 in the API's error shape (or, for '//host/x', a path the sandbox answers)."""
    with host_listener() as (listener, hits):
        for target in hostile_targets(listener):
            for headers in routings(sandbox_id, 49983):
                status, body = raw_request(proxy_port, target, headers)
                assert SECRET.encode() not in body, (target, headers, body)
                if target.startswith("//"):
                    continue  # origin-form: envd's own 404 for that path
                assert status == 400, (target, headers, status, body)
                assert json.loads(body)["code"] == 400
            # The same as a WebSocket handshake.
            status, body = raw_request(proxy_port, target, {
                **routings(sandbox_id, 49983)[1], "Upgrade": "websocket",
                "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
            assert SECRET.encode() not in body and status != 101, (target, status, body)
        assert hits == [], f"the proxy reached the host's loopback: {hits}"


def assert_bad_routing_is_400(proxy_port: int, sandbox_id: str) -> None:
    """Routing headers that are not an ID and a port are a clear 400, not a 500."""
    for headers in (
        {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": b"\xb2"},   # latin-1 '²': isdigit()
        {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "99999"},
        {"E2b-Sandbox-Id": sandbox_id},
        {"E2b-Sandbox-Id": "../../x", "E2b-Sandbox-Port": "49983"},
    ):
        status, body = raw_request(proxy_port, "/health", {"Host": "localhost", **headers})
        assert status == 400 and json.loads(body)["code"] == 400, (headers, status, body)


def start_header_echo(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/echo_headers.py", _HEADER_ECHO)
    sbx.commands.run("python3 /home/user/echo_headers.py", background=True, timeout=0)
    wait_port(sbx, ECHO_PORT)


def assert_routing_headers_stripped(proxy_port: int, sandbox_id: str) -> None:
    """The sandbox never sees the routing headers or the API key (a service inside
    that sent them on to the node would be routed again)."""
    for headers in routings(sandbox_id, ECHO_PORT):
        status, body = raw_request(proxy_port, "/", {**headers, "X-API-Key": "not-for-sandbox"})
        assert status == 200, (headers, status, body)
        seen = json.loads(body)
        assert not {"e2b-sandbox-id", "e2b-sandbox-port", "x-api-key"} & set(seen), seen
        # Nor headers the client never sent (an HTTP library's defaults).
        assert not {"user-agent", "accept", "accept-encoding"} & set(seen), seen
