"""Per-sandbox egress policy, from inside real sandboxes, against servers in a test netns.

The "outside" is one network namespace with three addresses (A, B, C) joined to
the host by a veth pair; each runs an HTTP server. Policies are set at create time
(the e2b SDK's ``network=``) and on running sandboxes (``PUT .../network``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import ALL_TRAFFIC, Sandbox

from agentenv.testing import Node, leaks

NS = f"xsneg{os.getpid() % 10000}"
HOST_LINK = f"xsnv{os.getpid() % 10000}"
NET = "10.251.27"
HOST_SIDE = f"{NET}.1"
A, B, C = f"{NET}.2", f"{NET}.3", f"{NET}.4"
HOSTS_MARK = "# aenv-test-egress"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def outside() -> Iterator[None]:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    subprocess.run(["ip", "link", "del", HOST_LINK], capture_output=True)
    sh("ip", "netns", "add", NS)
    server = None
    try:
        sh("ip", "link", "add", HOST_LINK, "type", "veth", "peer", "name", "eth0", "netns", NS)
        sh("ip", "addr", "add", f"{HOST_SIDE}/29", "dev", HOST_LINK)
        sh("ip", "link", "set", HOST_LINK, "up")
        for addr in (A, B, C):
            sh("ip", "-n", NS, "addr", "add", f"{addr}/29", "dev", "eth0")
        sh("ip", "-n", NS, "link", "set", "eth0", "up")
        sh("ip", "-n", NS, "link", "set", "lo", "up")
        sh("ip", "-n", NS, "route", "add", "default", "via", HOST_SIDE)
        server = subprocess.Popen(
            ["ip", "netns", "exec", NS, "python3", "-m", "http.server", "8000",
             "--bind", "0.0.0.0", "--directory", "/usr/share/doc"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for _ in range(50):
            if subprocess.run(["ip", "netns", "exec", NS, "curl", "-s", "-o", "/dev/null",
                               f"http://{A}:8000/"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        yield
    finally:
        if server:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", HOST_LINK], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def reachable(sbx: Sandbox, *addrs: str) -> dict[str, bool]:
    """Which of ``addrs`` answer HTTP from inside the sandbox (one command for all)."""
    script = "; ".join(
        f"echo {a}=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 http://{a}:8000/)"
        for a in addrs
    )
    out = sbx.commands.run(script, timeout=60).stdout
    got = dict(line.split("=", 1) for line in out.split())
    return {a: got.get(a) == "200" for a in addrs}


def put_network(api: httpx.Client, sid: str, body: dict) -> httpx.Response:
    return api.put(f"/sandboxes/{sid}/network", json=body)


@contextlib.contextmanager
def sandbox(**kwargs) -> Iterator[Sandbox]:
    sbx = Sandbox.create("base", timeout=300, **kwargs)
    try:
        yield sbx
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def test_allow_wins_over_deny_all(node: Node, outside: None) -> None:
    with sandbox(network={"deny_out": [ALL_TRAFFIC], "allow_out": [A, f"{C}/32"]}) as sbx:
        assert reachable(sbx, A, B, C) == {A: True, B: False, C: True}


def test_deny_ip_and_cidr(node: Node, outside: None) -> None:
    with sandbox(network={"deny_out": [B]}) as sbx:
        assert reachable(sbx, A, B, C) == {A: True, B: False, C: True}
    # A CIDR covering all three, with one of them allowed back.
    with sandbox(network={"deny_out": [f"{NET}.0/29"], "allow_out": [C]}) as sbx:
        assert reachable(sbx, A, B, C) == {A: False, B: False, C: True}


def test_update_takes_effect_on_a_running_sandbox(node: Node, api: httpx.Client,
                                                  outside: None) -> None:
    with sandbox() as sbx:
        assert reachable(sbx, A, B) == {A: True, B: True}
        r = put_network(api, sbx.sandbox_id, {"denyOut": [A]})
        assert r.status_code == 204, r.text
        assert reachable(sbx, A, B) == {A: False, B: True}
        info = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert info["network"]["denyOut"] == [f"{A}/32"]
        assert info["allowInternetAccess"] is True
        # The SDK's own call: replaces everything (omitted fields are cleared).
        Sandbox.update_network(sbx.sandbox_id, {"deny_out": [ALL_TRAFFIC], "allow_out": [B]})
        assert reachable(sbx, A, B, C) == {A: False, B: True, C: False}
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["allowInternetAccess"] is False
        assert put_network(api, sbx.sandbox_id, {}).status_code == 204
        assert reachable(sbx, A, B, C) == {A: True, B: True, C: True}
        # allowInternetAccess=false alone is deny-all.
        assert put_network(api, sbx.sandbox_id, {"allowInternetAccess": False}).status_code == 204
        assert reachable(sbx, A, C) == {A: False, C: False}


@pytest.fixture
def hosts_name() -> Iterator[str]:
    """A name the node resolves to A (a line in /etc/hosts, removed afterwards)."""
    name = f"xsn-egress-{os.getpid()}.test"
    hosts = Path("/etc/hosts")
    original = hosts.read_text()
    kept = "".join(ln for ln in original.splitlines(True) if HOSTS_MARK not in ln)
    hosts.write_text(kept + f"{A} {name} {HOSTS_MARK}\n")
    try:
        yield name
    finally:
        hosts.write_text("".join(ln for ln in hosts.read_text().splitlines(True)
                                 if HOSTS_MARK not in ln))


def _point(name: str, addr: str) -> None:
    hosts = Path("/etc/hosts")
    kept = "".join(ln for ln in hosts.read_text().splitlines(True) if HOSTS_MARK not in ln)
    hosts.write_text(kept + f"{addr} {name} {HOSTS_MARK}\n")


def test_domain_in_allow_out(node: Node, api: httpx.Client, outside: None,
                             hosts_name: str) -> None:
    with sandbox(network={"deny_out": [ALL_TRAFFIC], "allow_out": [hosts_name]}) as sbx:
        assert reachable(sbx, A, B) == {A: True, B: False}
        info = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert info["network"]["allowOut"] == [hosts_name]


@pytest.mark.parametrize("body, fragment", [
    ({"denyOut": ["example.com"]}, "allowOut only"),
    ({"allowOut": ["*.example.com"]}, "wildcard"),
    ({"allowOut": ["::1"]}, "IPv4"),
    ({"allowOut": ["not a host!"]}, "not an IPv4 address, CIDR or domain"),
    ({"denyOut": ["10.0.0.0/33"]}, "not an IPv4 address or CIDR"),
    ({"dnsServers": ["dns.example"]}, "dnsServers"),
])
def test_bad_policies_are_400(node: Node, api: httpx.Client, body: dict, fragment: str) -> None:
    r = api.post("/sandboxes", json={"templateID": "base", "network": body})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == 400 and fragment in r.json()["message"]


def test_update_errors(node: Node, api: httpx.Client) -> None:
    r = put_network(api, "nosuchsandbox0000000", {"denyOut": [A]})
    assert r.status_code == 404 and r.json()["code"] == 404
    with sandbox() as sbx:
        r = put_network(api, sbx.sandbox_id, {"denyOut": ["example.com"]})
        assert r.status_code == 400 and "allowOut only" in r.json()["message"]
        r = httpx.put(f"{node.url}/sandboxes/{sbx.sandbox_id}/network", json={"denyOut": [A]},
                      headers={"X-API-Key": "wrong"})
        assert r.status_code == 401


def test_policy_survives_pause_resume_fork_and_restart(tmp_path: Path, outside: None,
                                                        hosts_name: str) -> None:
    """The policy lives in the record: a resumed sandbox, a fork child and a sandbox
    adopted by a restarted node all keep it; a domain's address is re-resolved while
    the sandbox runs. (A node of its own, so the restart disturbs no other test.)"""
    own = Node(tmp_path / "home", f"xq{os.getpid() % 1000}", "10.29.0.0/16",
               AENV_EGRESS_REFRESH_S="1")
    own.start()
    env = own.e2b_env()
    opts = {"api_key": env["E2B_API_KEY"], "api_url": env["E2B_API_URL"],
            "sandbox_url": env["E2B_SANDBOX_URL"]}
    try:
        with own.client() as api:
            sbx = Sandbox.create("base", timeout=300, network={"deny_out": [B]}, **opts)
            assert reachable(sbx, A, B) == {A: True, B: False}
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code in (200, 204)
            sbx = Sandbox.connect(sbx.sandbox_id, **opts)
            assert reachable(sbx, A, B) == {A: True, B: False}
            r = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
            assert r.status_code == 201, r.text
            child_id = r.json()[0]["sandbox"]["sandboxID"]
            assert reachable(Sandbox.connect(child_id, **opts), A, B) == {A: True, B: False}
            # The name moves from A to B: the running sandbox's rule follows it.
            named = Sandbox.create("base", timeout=300, network={
                "deny_out": [ALL_TRAFFIC], "allow_out": [hosts_name]}, **opts)
            assert reachable(named, A, B) == {A: True, B: False}
            _point(hosts_name, B)
            time.sleep(2.5)
            assert reachable(named, A, B) == {A: False, B: True}
            own.kill9()
            own.start()
            sbx = Sandbox.connect(sbx.sandbox_id, **opts)
            assert reachable(sbx, A, B) == {A: True, B: False}
    finally:
        code = own.stop()
        assert code in (0, -15), own.log_tail()
        assert not leaks(own.prefix, own.home)
