"""Template start commands: a service starts with the sandbox and is ready when create returns."""

from __future__ import annotations

import json
import shutil
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
