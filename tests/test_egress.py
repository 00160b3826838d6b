"""Egress end to end: a sandbox reaches an outside server only with internet access on.

The "outside" is a network namespace this test creates, joined to the host by a
veth pair; no traffic leaves the machine.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from agentenv.testing import Node

OUTSIDE_NS = "aetoutside"
HOST_SIDE, OUTSIDE_ADDR = "10.250.7.1", "10.250.7.2"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def outside() -> Iterator[str]:
    subprocess.run(["ip", "netns", "del", OUTSIDE_NS], capture_output=True)
    subprocess.run(["ip", "link", "del", "aetouth"], capture_output=True)
    sh("ip", "netns", "add", OUTSIDE_NS)
    server = None
    try:
        sh("ip", "link", "add", "aetouth", "type", "veth", "peer", "name", "eth0",
           "netns", OUTSIDE_NS)
        sh("ip", "addr", "add", f"{HOST_SIDE}/30", "dev", "aetouth")
        sh("ip", "link", "set", "aetouth", "up")
        sh("ip", "-n", OUTSIDE_NS, "addr", "add", f"{OUTSIDE_ADDR}/30", "dev", "eth0")
        sh("ip", "-n", OUTSIDE_NS, "link", "set", "eth0", "up")
        sh("ip", "-n", OUTSIDE_NS, "link", "set", "lo", "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", OUTSIDE_NS, "python3", "-m", "http.server", "8000",
             "--bind", OUTSIDE_ADDR, "--directory", "/usr/share/doc"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)
        yield f"http://{OUTSIDE_ADDR}:8000/"
    finally:
        if server:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", "aetouth"], capture_output=True)
        subprocess.run(["ip", "netns", "del", OUTSIDE_NS], capture_output=True)


def reach(sbx: Sandbox, url: str) -> bool:
    res = sbx.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 {url} || true")
    return res.stdout.strip() == "200"


@pytest.mark.parametrize("internet", [True, False])
def test_egress_follows_allow_internet_access(
    node: Node, api: httpx.Client, outside: str, internet: bool
) -> None:
    r = api.post("/sandboxes", json={"templateID": "base", "allow_internet_access": internet})
    sid = r.json()["sandboxID"]
    try:
        assert api.get(f"/sandboxes/{sid}").json()["allow_internet_access"] is internet
        assert reach(Sandbox.connect(sid), outside) is internet
    finally:
        api.delete(f"/sandboxes/{sid}")
