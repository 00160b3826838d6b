"""Template start commands: a service starts with the sandbox and is ready when create returns."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.testing import SHARED_HOME, Node

TEMPLATES = SHARED_HOME / "images" / "templates"


def make_template(name: str, **meta) -> Path:
    root = TEMPLATES / name
    root.mkdir(parents=True, exist_ok=True)
    link = root / "rootfs"
    if not link.exists():
        link.symlink_to(TEMPLATES / "base" / "rootfs")
    (root / "template.json").write_text(json.dumps({"templateID": name, **meta}))
    return root


@pytest.fixture
def templates() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        shutil.rmtree(TEMPLATES / name, ignore_errors=True)


def test_start_command_is_ready_when_create_returns(
    node: Node, api: httpx.Client, templates: list[str]
) -> None:
    make_template(
        "aet-startdemo",
        startCmd="cd /etc && python3 -m http.server 8123 >/dev/null 2>&1",
        readyCmd="curl -sf -o /dev/null localhost:8123/hostname",
    )
    templates.append("aet-startdemo")
    r = api.post("/sandboxes", json={"templateID": "aet-startdemo"})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        page = httpx.get(f"{node.url}/os-release",
                         headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8123"})
        assert page.status_code == 200 and "bookworm" in page.text
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_failing_ready_check_fails_create_cleanly(
    node: Node, api: httpx.Client, templates: list[str]
) -> None:
    make_template("aet-neverready", readyCmd="false", readyTimeoutSec=2)
    templates.append("aet-neverready")
    before = {s["sandboxID"] for s in api.get("/sandboxes").json()}
    r = api.post("/sandboxes", json={"templateID": "aet-neverready"})
    assert r.status_code == 500
    assert "ready check did not pass" in r.json()["message"]
    assert {s["sandboxID"] for s in api.get("/sandboxes").json()} == before
    assert httpx.get(node.url + "/health").status_code == 200


# A service that does not outlive a restore for a create: it ends when the sandbox's
# boot ID changes (each create's restore of an image gives the sandbox a new one).
FRAGILE = """python3 -c '
import http.server, os, threading, time
def boot(): return open("/proc/sys/kernel/random/boot_id").read()
first = boot()
web = http.server.HTTPServer(("0.0.0.0", 8125), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=web.serve_forever, daemon=True).start()
while boot() == first:
    time.sleep(0.1)
os._exit(1)
' >/dev/null 2>&1"""


def test_an_image_whose_service_dies_on_restore_is_never_used(
    node: Node, api: httpx.Client, templates: list[str]
) -> None:
    """A template's boot image is tried once before creates use it: restored, its ready
    check must pass a moment later. An image whose service does not survive a restore
    would give every create a sandbox with that service down ('port is not open'); it
    is captured again, and when no capture passes, the template's sandboxes boot."""
    make_template("aet-fragile", startCmd=FRAGILE, readyCmd="curl -sf -o /dev/null "
                  "localhost:8125/", readyTimeoutSec=20)
    templates.append("aet-fragile")

    def create_and_fetch() -> tuple[str, int]:
        r = api.post("/sandboxes", json={"templateID": "aet-fragile"})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        try:
            page = httpx.get(f"{node.url}/", timeout=30,
                             headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8125"})
            return sid, page.status_code
        finally:
            api.delete(f"/sandboxes/{sid}")

    assert create_and_fetch()[1] == 200  # booted; the image is captured meanwhile
    end = time.monotonic() + 120
    while "template aet-fragile: no capture of it passed" not in node.log_tail(100_000):
        assert time.monotonic() < end, node.log_tail(100_000)[-3000:]
        time.sleep(0.5)
    assert node.log_tail(100_000).count("template aet-fragile: image tpl.aet-fragile.") >= 3
    sid, status = create_and_fetch()
    assert status == 200
    assert f"created {sid} in" in node.log_tail(100_000)
    assert "(booted)" in next(line for line in node.log_tail(100_000).splitlines()
                              if f"created {sid} in" in line)
