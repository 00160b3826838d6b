"""Snapshot faults through a real node: a full disk and an unreachable S3 store give
clear errors, the sandbox keeps running, nothing half-committed, and a retry works."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from agentenv.testing import Node, free_cidr, leaks
from sandbox_helpers import COUNTER, counting
from test_snapshot_store import S3Server

PID = os.getpid()


@pytest.fixture
def small_disk_node(tmp_path: Path) -> Iterator[Node]:
    """A node whose snapshot staging area is an 8 MiB tmpfs: any capture fills it."""
    home = tmp_path / "home"
    staging = home / "snapshots-staging"
    staging.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(staging)], check=True)
    node = Node(home, f"f{PID % 4096:03x}", free_cidr(170, 10, PID))
    try:
        node.start()
        yield node
    finally:
        node.stop()
        subprocess.run(["umount", "-l", str(staging)], check=False)
    assert leaks(node.prefix, home) == []


def test_disk_full_during_capture(small_disk_node: Node, monkeypatch) -> None:
    with small_disk_node.client() as api:
        sid, sbx = counting_sandbox(small_disk_node, api, monkeypatch)
        r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": "too-big"})
        assert r.status_code == 507, r.text
        assert "space" in r.json()["message"]
        # The sandbox runs on, nothing was committed, nothing is left staged.
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert counting(sbx)
        assert api.get("/snapshots").json() == []
        assert api.get("/snapshots/too-big").status_code == 404
        # Nothing is left staged (the template's boot image, captured in the background
        # after the first create, may still be failing on the same full disk).
        staging = small_disk_node.home / "snapshots-staging"
        end = time.monotonic() + 30
        while list(staging.iterdir()) and time.monotonic() < end:
            time.sleep(0.2)
        assert [p.name for p in staging.iterdir()] == []
        api.delete(f"/sandboxes/{sid}")


@pytest.fixture
def s3_node(tmp_path: Path) -> Iterator[tuple[Node, S3Server]]:
    s3 = S3Server()
    s3.start()
    node = Node(
        tmp_path / "home", f"s{PID % 4096:03x}", free_cidr(190, 10, PID),
        AENV_SNAPSHOT_BACKEND="oss", AENV_SNAPSHOT_ENDPOINT_URL=s3.url,
        AENV_SNAPSHOT_BUCKET=s3.new_bucket(), AENV_SNAPSHOT_REGION="us-east-1",
        AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
        AENV_TEMPLATE_SNAPSHOTS="false",
    )
    try:
        node.start()
        yield node, s3
    finally:
        node.stop()
        s3.stop()
    assert leaks(node.prefix, node.home) == []


def counting_sandbox(node: Node, api, monkeypatch) -> tuple[str, Sandbox]:
    """A sandbox on ``node`` running the counter loop, with the SDK pointed at the node."""
    for k, v in node.e2b_env().items():
        monkeypatch.setenv(k, v)
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    sbx = Sandbox.connect(sid)
    sbx.commands.run(COUNTER, background=True, timeout=0)
    return sid, sbx


def test_s3_down_snapshot_fails_clearly_then_retry_works(s3_node, monkeypatch) -> None:
    node, s3 = s3_node
    with node.client() as api:
        sid, sbx = counting_sandbox(node, api, monkeypatch)
        s3.stop()
        r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": "later"})
        assert r.status_code == 503, r.text
        assert "unavailable" in r.json()["message"]
        assert counting(sbx)
        s3.start()
        r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": "later"})
        assert r.status_code == 201, r.text
        assert api.get("/snapshots/later").status_code == 200
        api.delete(f"/sandboxes/{sid}")


def test_s3_down_pause_still_resumes_from_local_state(s3_node, monkeypatch) -> None:
    node, s3 = s3_node
    with node.client() as api:
        sid, sbx = counting_sandbox(node, api, monkeypatch)
        sbx.files.write("/home/user/state.txt", "kept")
        s3.stop()
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        time.sleep(1)  # the background commit fails meanwhile
        r = api.post(f"/sandboxes/{sid}/resume")
        assert r.status_code == 201, r.text
        back = Sandbox.connect(sid)
        assert back.files.read("/home/user/state.txt") == "kept"
        assert counting(back)
        s3.start()
        # Paused again with the store back: the commit goes through.
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 201
        api.delete(f"/sandboxes/{sid}")
