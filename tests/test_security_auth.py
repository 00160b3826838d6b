"""Auth: API keys (constant-time, rotation), envd access tokens, traffic access tokens
for private ports, and no secret in any log or file of the node's home."""

from __future__ import annotations

import hmac
import os
import stat
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node, leaks
from agentenv.testing.nodes import AENV
from agentenv.web import keys as auth
from sandbox_helpers import wait_port

ENVD_PORT = 49983
APP_PORT = 8080
# Answers every GET with the request's header names (so a test sees what the sandbox got).
HEADER_ECHO = (
    "python3 -c \"import http.server as h\n"
    "class H(h.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = ','.join(k.lower() for k in self.headers.keys()).encode()\n"
    "        self.send_response(200); self.send_header('Content-Length', str(len(body)))\n"
    "        self.end_headers(); self.wfile.write(body)\n"
    f"h.HTTPServer(('0.0.0.0', {APP_PORT}), H).serve_forever()\""
)


def test_key_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         node: Node) -> None:
    """Every key check goes through hmac.compare_digest (no early-exit ==), and the node
    refuses wrong, empty, prefix and padded keys alike."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = auth.ApiKeys(tmp_path / "secrets")
    key = keys.current
    assert keys.matches(key) and not keys.matches(key[:-1]) and not keys.matches("")
    assert len(calls) >= 2  # the empty key is refused before any comparison
    monkeypatch.undo()
    for bad in (None, "", "x", node.api_key[:-1], node.api_key + "x", node.api_key.upper()):
        headers = {} if bad is None else {"X-API-Key": bad}
        r = httpx.get(f"{node.url}/sandboxes", headers=headers)
        assert r.status_code == 401 and r.json()["code"] == 401, (bad, r.text)
    assert httpx.get(f"{node.url}/sandboxes", headers={"X-API-Key": node.api_key}
                     ).status_code == 200


def _via_proxy(node: Node, sid: str, port: int, path: str = "/", **headers: str
               ) -> httpx.Response:
    return httpx.get(f"{node.url}{path}", headers={"E2b-Sandbox-Id": sid,
                                                   "E2b-Sandbox-Port": str(port), **headers},
                     timeout=30)


def test_envd_wants_the_access_token(node: Node, api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"templateID": "base", "secure": True})
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    try:
        assert token and len(token) >= 32
        assert _via_proxy(node, sid, ENVD_PORT, "/metrics").status_code == 401
        assert _via_proxy(node, sid, ENVD_PORT, "/metrics",
                          **{"X-Access-Token": token[:-1] + ("B" if token.endswith("A") else "A")}
                          ).status_code == 401
        # The node's own API key is no envd token.
        assert _via_proxy(node, sid, ENVD_PORT, "/metrics",
                          **{"X-Access-Token": node.api_key}).status_code == 401
        assert _via_proxy(node, sid, ENVD_PORT, "/metrics",
                          **{"X-Access-Token": token}).status_code == 200
        # Another sandbox's token does not open this one.
        other = api.post("/sandboxes", json={"templateID": "base"}).json()
        try:
            assert _via_proxy(node, sid, ENVD_PORT, "/metrics", **{
                "X-Access-Token": other["envdAccessToken"]}).status_code == 401
        finally:
            api.delete(f"/sandboxes/{other['sandboxID']}")
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_private_ports_want_the_traffic_token(node: Node, api: httpx.Client) -> None:
    sbx = Sandbox.create("base", timeout=300, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token and len(token) >= 32
        # envd traffic (the SDK's own calls) goes on with the envd token alone.
        sbx.commands.run(HEADER_ECHO, background=True, timeout=0)
        wait_port(sbx, APP_PORT)
        sid = sbx.sandbox_id
        for headers in ({}, {"e2b-traffic-access-token": "wrong"},
                        {"e2b-traffic-access-token": token[:-1]},
                        {"X-Access-Token": sbx._envd_access_token or "x"}):
            r = _via_proxy(node, sid, APP_PORT, **headers)
            assert r.status_code == 403, (headers, r.text)
            assert r.json()["code"] == 403 and "traffic access token" in r.json()["message"]
        r = _via_proxy(node, sid, APP_PORT, **{"e2b-traffic-access-token": token})
        assert r.status_code == 200, r.text
        # The token (and the API key) stop at the proxy.
        assert "e2b-traffic-access-token" not in r.text and "x-api-key" not in r.text
        # Host-based routing is guarded alike.
        host = f"{APP_PORT}-{sid}.{node_domain(api, sid)}"
        assert httpx.get(node.url, headers={"Host": host}).status_code == 403
        assert httpx.get(node.url, headers={"Host": host, "e2b-traffic-access-token": token}
                         ).status_code == 200
        assert api.get(f"/sandboxes/{sid}").json()["network"]["allowPublicTraffic"] is False
    finally:
        sbx.kill()
    # A public sandbox needs no traffic token.
    pub = Sandbox.create("base", timeout=300)
    try:
        assert pub.traffic_access_token is None
        pub.commands.run(HEADER_ECHO, background=True, timeout=0)
        wait_port(pub, APP_PORT)
        assert _via_proxy(node, pub.sandbox_id, APP_PORT).status_code == 200
    finally:
        pub.kill()


def node_domain(api: httpx.Client, sid: str) -> str:
    return api.get(f"/sandboxes/{sid}").json().get("domain") or "localhost"


def _secret_files(home: Path) -> list[Path]:
    return [p for p in home.rglob("*") if p.is_file() and not p.is_symlink()]


def _found_in(paths: list[Path], secret: str) -> list[str]:
    needle = secret.encode()
    hits = []
    for p in paths:
        try:
            if needle in p.read_bytes():
                hits.append(str(p))
        except OSError:
            continue
    return hits


def test_key_rotation_and_no_secret_in_logs(tmp_path: Path) -> None:
    """`aenv keys rotate` gives a running node a new key (0600); the old one is refused
    at once, or after a grace period; no key or token is in any log or stray file."""
    own = Node(tmp_path / "home", f"xk{os.getpid() % 1000}", "10.30.0.0/16")
    own.start()
    secrets_dir = own.home / "secrets"
    rotate_env = {**own.env}
    try:
        first = own.api_key
        assert httpx.get(f"{own.url}/sandboxes", headers={"X-API-Key": first}).status_code == 200
        with own.client() as api:
            created = api.post("/sandboxes", json={
                "templateID": "base", "network": {"allowPublicTraffic": False}}).json()
        envd_token, traffic_token = created["envdAccessToken"], created["trafficAccessToken"]
        out = subprocess.run([str(AENV), "keys", "rotate"], env=rotate_env,
                             capture_output=True, text=True, check=True)
        second = own.api_key
        assert second != first and first not in out.stdout + out.stderr
        assert stat.S_IMODE((secrets_dir / "api-key").stat().st_mode) == 0o600
        assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
        assert httpx.get(f"{own.url}/sandboxes", headers={"X-API-Key": first}).status_code == 401
        assert httpx.get(f"{own.url}/sandboxes", headers={"X-API-Key": second}).status_code == 200
        # With a grace period the old key works until it ends, then not.
        subprocess.run([str(AENV), "keys", "rotate", "--grace", "3"], env=rotate_env,
                       capture_output=True, check=True)
        third = own.api_key
        assert stat.S_IMODE((secrets_dir / "api-key.previous").stat().st_mode) == 0o600
        for key in (second, third):
            assert httpx.get(f"{own.url}/sandboxes", headers={"X-API-Key": key}
                             ).status_code == 200
        time.sleep(3.5)
        assert httpx.get(f"{own.url}/sandboxes", headers={"X-API-Key": second}).status_code == 401
        assert httpx.get(f"{own.url}/sandboxes", headers={"X-API-Key": third}).status_code == 200
        # `--show` is the one way a key reaches a terminal.
        shown = subprocess.run([str(AENV), "keys", "rotate", "--show"], env=rotate_env,
                               capture_output=True, text=True, check=True)
        assert shown.stdout.strip() == own.api_key
        with own.client() as api:
            api.delete(f"/sandboxes/{created['sandboxID']}")
    finally:
        code = own.stop()
    assert code in (0, -15), own.log_tail()
    assert not leaks(own.prefix, own.home)
    files = _secret_files(own.home)
    outside_secrets = [p for p in files if secrets_dir not in p.parents]
    logs = [p for p in files if p.suffix == ".log"]
    assert logs, "the node wrote no log"
    for key in (first, second, third, own.api_key):
        assert not _found_in(outside_secrets, key), key
    for token in (envd_token, traffic_token):
        assert not _found_in(logs, token)
