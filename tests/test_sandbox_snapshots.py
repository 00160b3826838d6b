"""Pause, resume, snapshots and create-from-snapshot through a real node,
against both repository backends (a directory, and a real S3 server on loopback)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.snapshot.errors import ObjectMissing
from agentenv.testing import Node, leaks, sdk_env
from sandbox_helpers import COUNTER, count, counting, lose_pause_snapshot, start_host_echo
from test_snapshot_store import S3Server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oss_node(tmp_path_factory: pytest.TempPathFactory, s3: S3Server) -> Iterator[Node]:
    home = tmp_path_factory.mktemp("oss-node")
    secrets = home / "s3-credentials"
    secrets.mkdir()
    for name in ("key-id", "secret"):
        (secrets / name).write_text("test")
        os.chmod(secrets / name, 0o600)
    node = Node(
        home / "home", "aeo", "10.16.0.0/16",
        AENV_SNAPSHOT_BACKEND="oss", AENV_SNAPSHOT_ENDPOINT_URL=s3.url,
        AENV_SNAPSHOT_BUCKET=s3.new_bucket(), AENV_SNAPSHOT_PREFIX="node",
        AENV_SNAPSHOT_REGION="us-east-1",
        AENV_SNAPSHOT_ACCESS_KEY_ID_FILE=str(secrets / "key-id"),
        AENV_SNAPSHOT_SECRET_ACCESS_KEY_FILE=str(secrets / "secret"),
    )
    node.start()
    yield node
    node.stop()
    assert leaks("aeo", node.home) == []


@pytest.fixture(params=["posix_fs", "oss"])
def target(request, node: Node) -> Iterator[tuple[Node, httpx.Client]]:
    """A node of each backend, with the e2b SDK pointed at it."""
    chosen = node if request.param == "posix_fs" else request.getfixturevalue("oss_node")
    with sdk_env(chosen.e2b_env()), chosen.client() as api:
        yield chosen, api


def running_sandbox(api: httpx.Client, **body) -> Sandbox:
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600, **body})
    assert r.status_code == 201, r.text
    sbx = Sandbox.connect(r.json()["sandboxID"])
    sbx.commands.run(COUNTER, background=True, timeout=0)
    sbx.files.write("/home/user/state.txt", "kept")
    assert counting(sbx)
    return sbx


def test_pause_resume_keeps_memory_processes_files(target) -> None:
    node, api = target
    sbx = running_sandbox(api)
    sid = sbx.sandbox_id
    try:
        before = count(sbx)
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 409
        # Paused means nothing runs: the proxy says so, the counter is frozen.
        r = httpx.get(node.url + "/", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "80"})
        assert r.status_code == 502
        r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 300})
        assert r.status_code == 201, r.text
        assert r.json()["sandboxID"] == sid
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 409
        resumed = Sandbox.connect(sid)
        assert count(resumed) >= before
        assert counting(resumed)
        assert resumed.files.read("/home/user/state.txt") == "kept"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_sdk_pause_and_connect_resume(target) -> None:
    _, api = target
    sbx = running_sandbox(api)
    try:
        sbx.pause()
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.is_running()
        assert counting(back)
        assert back.files.read("/home/user/state.txt") == "kept"
    finally:
        api.delete(f"/sandboxes/{sbx.sandbox_id}")


def test_snapshot_while_running_then_create_from_it(target) -> None:
    _, api = target
    sbx = running_sandbox(api)
    sid = sbx.sandbox_id
    alias = f"ready-{sid[:6]}"
    r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": alias})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    assert r.json()["names"] == [alias]
    # The source kept running through the capture.
    assert counting(sbx)
    sbx.files.write("/home/user/state.txt", "changed after the snapshot")
    children = []
    try:
        for ref in (snap, alias):
            r = api.post("/sandboxes", json={"templateID": ref})
            assert r.status_code == 201, r.text
            child = Sandbox.connect(r.json()["sandboxID"])
            children.append(child.sandbox_id)
            assert child.files.read("/home/user/state.txt") == "kept"
            assert counting(child)
    finally:
        for child_id in children:
            api.delete(f"/sandboxes/{child_id}")
        api.delete(f"/sandboxes/{sid}")
    # Listed by source sandbox even after the source is gone.
    listed = api.get("/snapshots", params={"sandboxID": sid}).json()
    assert [s["snapshotID"] for s in listed] == [snap]
    assert api.get(f"/snapshots/{alias}").json()["snapshotID"] == snap
    assert api.delete(f"/snapshots/{snap}").status_code == 204
    assert api.get(f"/snapshots/{snap}").status_code == 404
    r = api.post("/sandboxes", json={"templateID": snap})
    assert r.status_code == 404


def test_second_snapshot_after_small_change_is_incremental(target) -> None:
    """As in the benchmark: a sandbox holding real data, then a 1 MiB change. The
    second snapshot stores its change plus the sandbox's own churn (envd's included),
    not the data."""
    _, api = target
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 300})
    sbx = Sandbox.connect(r.json()["sandboxID"])
    snaps = []
    try:
        sbx.commands.run("head -c 100663296 /dev/urandom > /home/user/data.bin")
        first = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots").json()
        snaps.append(first["snapshotID"])
        sbx.commands.run("head -c 1048576 /dev/urandom > /home/user/one-mib.bin")
        second = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots").json()
        snaps.append(second["snapshotID"])
        assert first["totalBytes"] > 96 << 20
        # (+2 MiB: envd goes dormant while the first snapshot is taken, and the woken
        # envd's new heap is stored again: ~1.5 MB measured, envd/dormancy.py)
        assert second["storedBytes"] <= 0.05 * first["totalBytes"] + (2 << 20), (first, second)
    finally:
        for s in snaps:
            api.delete(f"/snapshots/{s}")
        api.delete(f"/sandboxes/{sbx.sandbox_id}")


def test_resume_after_its_snapshot_is_gone_is_404(node: Node, api: httpx.Client) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    try:
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        lose_pause_snapshot(node, api, sid)
        r = api.post(f"/sandboxes/{sid}/resume")
        assert r.status_code == 404, r.text
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    finally:
        api.delete(f"/sandboxes/{sid}")


@pytest.mark.parametrize("auto_pause", [True, False])
def test_ttl_expiry_pauses_or_deletes(api: httpx.Client, auto_pause: bool) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 1,
                                       "autoPause": auto_pause}).json()["sandboxID"]
    try:
        want = "paused" if auto_pause else None
        for _ in range(100):
            r = api.get(f"/sandboxes/{sid}")
            state = r.json()["state"] if r.status_code == 200 else None
            if state == want:
                break
            time.sleep(0.2)
        assert state == want
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_default_expiry_pauses(api: httpx.Client) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 1}).json()["sandboxID"]
    try:
        for _ in range(100):
            if api.get(f"/sandboxes/{sid}").json()["state"] == "paused":
                break
            time.sleep(0.2)
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_paused_sandbox_survives_a_restart(tmp_path: Path, monkeypatch) -> None:
    node = Node(tmp_path / "home", "aep", "10.17.0.0/16")
    node.start()
    try:
        for k, v in node.e2b_env().items():
            monkeypatch.setenv(k, v)
        with node.client() as api:
            sbx = running_sandbox(api)
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        # Auto-resume and maskRequestHost are kept across the restart too.
        ingress = Sandbox.create(template="base", timeout=300,
                                 lifecycle={"on_timeout": "pause", "auto_resume": True},
                                 network={"mask_request_host": "${PORT}-kept.example.com"})
        start_host_echo(ingress, 8082)
        ingress.pause()
        node.stop()
        node.start()
        with node.client() as api:
            assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/resume").status_code == 201
            back = Sandbox.connect(sbx.sandbox_id)
            assert back.files.read("/home/user/state.txt") == "kept"
            assert counting(back)
            info = Sandbox.get_info(ingress.sandbox_id)
            assert info.lifecycle == {"on_timeout": "pause", "auto_resume": True}
            assert info.network["mask_request_host"] == "${PORT}-kept.example.com"
            r = httpx.get(node.url, headers={"Host": ingress.get_host(8082)}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["host"] == "8082-kept.example.com"
            assert Sandbox.get_info(ingress.sandbox_id).state.value == "running"
    finally:
        node.stop()
    assert leaks("aep", node.home) == []


def _repository(node: Node):
    from agentenv.snapshot import open_repository

    return open_repository({"backend": "posix_fs", "path": str(node.home / "snapshots")})


def _manifest_ids(repo) -> set[str]:
    return {k.removeprefix("manifests/").removesuffix(".json")
            for k in repo.list_objects("manifests/")}


def _own_chunks(repo, snapshot_id: str) -> set[str]:
    """The chunks only this snapshot references (what deleting it must free)."""
    from agentenv.snapshot import Manifest

    def digests(sid: str) -> set[str]:
        return Manifest.from_json(repo.get_object(f"manifests/{sid}.json")).digests()

    others: set[str] = set()
    for sid in _manifest_ids(repo) - {snapshot_id}:
        # The node is shared: another test's snapshot (or a boot image on trial) may be
        # deleted between the listing and the read; it then references nothing.
        with contextlib.suppress(ObjectMissing):
            others |= digests(sid)
    return digests(snapshot_id) - others


def test_sdk_snapshot_list_create_from_delete_and_collect(node: Node, api: httpx.Client
                                                          ) -> None:
    """Sandbox.create_snapshot -> list_snapshots -> create from it -> delete_snapshot
    (DELETE /templates/{snapshotID}, as the SDK sends it): gone from the list, its
    manifest, alias and own chunks gone from the repository, a second delete is the
    SDK's not-found (False). A sandbox restored from it runs on; a paused sandbox's own
    snapshot is refused (409) and the sandbox still resumes."""
    from e2b import SandboxException

    sbx = Sandbox.create(template="base", timeout=300)
    made: list[Sandbox] = []
    repo = _repository(node)
    try:
        sbx.files.write("/home/user/state.txt", "in the snapshot")
        name = f"keep-{sbx.sandbox_id[:8]}"
        snap = sbx.create_snapshot(name=name)
        other = Sandbox.create_snapshot(sbx.sandbox_id)  # unnamed, deleted by E2B's form
        assert snap.names == [name] and snap.snapshot_id != other.snapshot_id
        pager = Sandbox.list_snapshots(limit=1)
        listed: list[str] = []
        while pager.has_next:
            page = pager.next_items()
            assert len(page) <= 1
            listed += [i.snapshot_id for i in page]
        # newest first, each once
        assert listed.index(other.snapshot_id) < listed.index(snap.snapshot_id)
        assert len(listed) == len(set(listed))
        for ref in (name, f"{name}:default", snap.snapshot_id):
            named = Sandbox.list_snapshots(name=ref).next_items()
            assert [(i.snapshot_id, i.names) for i in named] == [(snap.snapshot_id, [name])]
        mine = {i.snapshot_id for i in sbx.list_snapshots().next_items()}
        assert mine == {snap.snapshot_id, other.snapshot_id}

        for ref in (snap.snapshot_id, name):
            child = Sandbox.create(ref, timeout=120)
            made.append(child)
            assert child.files.read("/home/user/state.txt") == "in the snapshot"
        own = _own_chunks(repo, snap.snapshot_id)
        assert own

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(f"{other.snapshot_id}:default") is True
        left = {i.snapshot_id for i in Sandbox.list_snapshots().next_items()}
        assert not left & {snap.snapshot_id, other.snapshot_id}
        assert Sandbox.list_snapshots(name=name).next_items() == []
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert Sandbox.delete_snapshot(name) is False
        with pytest.raises(SandboxException, match="not found"):
            Sandbox.create(snap.snapshot_id, timeout=60)
        # restored sandboxes do not need it any more
        assert made[0].commands.run("cat /home/user/state.txt").stdout == "in the snapshot"
        # nothing of it is left in the repository once collected
        assert not {snap.snapshot_id, other.snapshot_id} & _manifest_ids(repo)
        assert f"aliases/{name}" not in repo.list_objects("aliases/")
        for _ in range(300):
            if not own & {d for d, _ in repo.list_chunks()}:
                break
            time.sleep(0.1)
        assert not own & {d for d, _ in repo.list_chunks()}
        assert not (node.home / "cache" / "snapshots" / snap.snapshot_id).exists()

        # A paused sandbox's own snapshot is needed: refused clearly, the sandbox fine.
        paused = made[0]
        paused.pause()
        import sqlite3

        with sqlite3.connect(node.home / "db") as db:
            pause_snap = db.execute("SELECT snapshot_id FROM sandboxes WHERE sandbox_id=?",
                                    (paused.sandbox_id,)).fetchone()[0]
        for _ in range(100):  # its commit runs in the background
            if pause_snap in _manifest_ids(repo):
                break
            time.sleep(0.1)
        with pytest.raises(SandboxException, match=r"^409: .*paused sandbox") as refused:
            Sandbox.delete_snapshot(pause_snap)
        assert refused.value.status_code == 409
        assert pause_snap in _manifest_ids(repo)
        assert pause_snap not in {i.snapshot_id for i in Sandbox.list_snapshots().next_items()}
        back = Sandbox.connect(paused.sandbox_id)
        assert back.files.read("/home/user/state.txt") == "in the snapshot"
        # killing a paused sandbox deletes its snapshot, and its chunks are collected
        back.pause()
        with sqlite3.connect(node.home / "db") as db:
            pause_snap = db.execute("SELECT snapshot_id FROM sandboxes WHERE sandbox_id=?",
                                    (back.sandbox_id,)).fetchone()[0]
        for _ in range(100):
            if pause_snap in _manifest_ids(repo):
                break
            time.sleep(0.1)
        own = _own_chunks(repo, pause_snap)
        assert own
        back.kill()
        assert pause_snap not in _manifest_ids(repo)
        for _ in range(300):
            if not own & {d for d, _ in repo.list_chunks()}:
                break
            time.sleep(0.1)
        assert not own & {d for d, _ in repo.list_chunks()}
    finally:
        for s in made:
            s.kill()
        sbx.kill()
