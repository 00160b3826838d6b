"""envd's strict file access acts for the user a request names (issue 12, findings 4,
5 and 7d), in a template that opts in ("fileAccess": "user" in its template.json; by
default envd writes as root and chowns to the user, as E2B's does: test_e2b_files).

Every attack goes through a real node and a real runsc sandbox, with the e2b SDK
or a plain HTTP client holding nothing but what the attacker would hold.
  4. a signed upload URL writes its own path, as its own user, and nothing else;
  5. file operations run with the requested user's rights: a symlink the user
     planted in their home does not reach root's files;
  7d. watchers per sandbox are capped, and stopped watchers free their slot.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox
from e2b.exceptions import InvalidArgumentException, RateLimitException, SandboxException
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from agentenv.testing import Node
from agentenv.testing.nodes import SHARED_HOME
from sandbox_helpers import envd_processes

STRICT = "base-strict"
ROOT_SECRET = "root secret\n"
MAX_WATCHERS = 128  # envd.filesystem.MAX_WATCHERS
DENIED = r"(?i)permission denied"


def strict_template(node: Node) -> str:
    """``base`` with the strict file access: a template of the node's own, on the same
    rootfs."""
    directory = node.home / "templates" / STRICT
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "rootfs").exists():
        (directory / "rootfs").symlink_to(SHARED_HOME / "images" / "templates" / "base" / "rootfs")
    (directory / "template.json").write_text(json.dumps(
        {"templateID": STRICT, "aliases": [STRICT], "cpuCount": 2, "memoryMB": 512,
         "buildID": "strict-1", "fileAccess": "user"}))
    return STRICT


@pytest.fixture(scope="module")
def sbx(node: Node):
    sandbox = Sandbox.create(template=strict_template(node), timeout=600)
    yield sandbox
    sandbox.kill()


def _root(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, user="root").stdout


def _exists(sbx: Sandbox, path: str) -> bool:
    return _root(sbx, f"test -e {path} && echo yes || echo no").strip() == "yes"


def _owner(sbx: Sandbox, path: str) -> str:
    return _root(sbx, f"stat -c %U {path}").strip()


# -- finding 4: a signed upload URL writes exactly its path -----------------------------
def test_signed_upload_url_cannot_plant_other_files(sbx: Sandbox) -> None:
    up = sbx.upload_url("/home/user/allowed.txt", user="user")
    assert "signature=" in up
    # The attack: the URL's path for the first part, the parts' own names for the rest.
    r = httpx.post(up, files=[
        ("file", ("allowed.txt", b"fine\n")),
        ("file", ("/etc/profile.d/zz-evil.sh", b"touch /tmp/pwned\n")),
        ("file", ("/root/.ssh/authorized_keys", b"ssh-ed25519 AAAA attacker\n")),
    ])
    assert r.status_code == 400, r.text
    assert "exactly one file part" in r.json()["message"]
    assert not _exists(sbx, "/etc/profile.d/zz-evil.sh")
    assert not _exists(sbx, "/root/.ssh/authorized_keys")
    # One part named after a root-owned file still lands on the signed path only.
    r = httpx.post(up, files={"file": ("/etc/profile.d/zz-evil.sh", b"just data\n")})
    assert r.status_code == 200, r.text
    assert [i["path"] for i in r.json()] == ["/home/user/allowed.txt"]
    assert not _exists(sbx, "/etc/profile.d/zz-evil.sh")
    assert sbx.files.read("/home/user/allowed.txt") == "just data\n"
    assert _owner(sbx, "/home/user/allowed.txt") == "user"
    # The legitimate use: one file through the URL, raw body too.
    r = httpx.post(sbx.upload_url("/home/user/up/one.bin", user="user"),
                   files={"file": ("whatever", b"\x00\x01")})
    assert r.status_code == 200, r.text
    assert sbx.files.read("/home/user/up/one.bin", format="bytes") == b"\x00\x01"
    assert _owner(sbx, "/home/user/up") == "user"


def test_signed_upload_url_is_written_as_its_user(sbx: Sandbox) -> None:
    """A URL for a path the user may not write fails, even though envd is root."""
    r = httpx.post(sbx.upload_url("/etc/profile.d/zz-evil.sh", user="user"),
                   files={"file": ("x", b"touch /tmp/pwned\n")})
    assert r.status_code == 403, r.text
    assert "permission denied" in r.json()["message"]
    assert not _exists(sbx, "/etc/profile.d/zz-evil.sh")
    # ... and through a symlink the user planted where the URL points.
    sbx.commands.run("ln -sf /etc/profile.d/zz-evil.sh /home/user/link.sh")
    r = httpx.post(sbx.upload_url("/home/user/link.sh", user="user"),
                   files={"file": ("x", b"touch /tmp/pwned\n")})
    assert r.status_code == 403, r.text
    assert not _exists(sbx, "/etc/profile.d/zz-evil.sh")


def test_sdk_multi_file_write_still_works(sbx: Sandbox) -> None:
    """The SDK's write_files sends one part per file, named by its path, no `path`."""
    infos = sbx.files.write_files([
        {"path": "/home/user/multi/a.txt", "data": "A"},
        {"path": "multi/sub/b.txt", "data": b"B"},  # relative: the user's home
        {"path": "/tmp/multi-c.txt", "data": "C"},
    ], user="user")
    assert sorted(i.path for i in infos) == [
        "/home/user/multi/a.txt", "/home/user/multi/sub/b.txt", "/tmp/multi-c.txt"]
    assert sbx.files.read("/home/user/multi/sub/b.txt", user="user") == "B"
    for p in ("/home/user/multi/sub", "/home/user/multi/sub/b.txt", "/tmp/multi-c.txt"):
        assert _owner(sbx, p) == "user", p
    # ... and each of those parts is written as the user too.
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.write_files([{"path": "/home/user/multi/ok.txt", "data": "x"},
                               {"path": "/etc/profile.d/zz-evil.sh", "data": "x"}],
                              user="user")
    assert not _exists(sbx, "/etc/profile.d/zz-evil.sh")


def test_strict_writes_report_e2b_events_and_keep_the_group(sbx: Sandbox) -> None:
    """The strict mode's write gives the events E2B's does (CREATE, CHMOD, WRITE: the
    worker chowns a new file to its own uid) and leaves a setgid directory's group."""
    _root(sbx, "mkdir -p /srv/shared && chgrp users /srv/shared && chmod 2777 /srv/shared")
    handle = sbx.files.watch_dir("/srv/shared", user="user")
    try:
        sbx.files.write("/srv/shared/f.txt", "x", user="user")
        assert [e.type for e in handle.get_new_events()] == [
            FilesystemEventType.CREATE, FilesystemEventType.CHMOD, FilesystemEventType.WRITE]
    finally:
        handle.stop()
    assert _root(sbx, "stat -c '%U %G' /srv/shared/f.txt").strip() == "user users"


# -- finding 5: file operations as the requested user -----------------------------------
@pytest.fixture(scope="module")
def planted(sbx: Sandbox) -> Sandbox:
    _root(sbx, "echo root secret > /root/secret.txt && chmod 600 /root/secret.txt"
               " && mkdir -p /etc/sudoers.d")
    sbx.commands.run("ln -sf /root/secret.txt ~/report.txt && "
                     "ln -sf /etc/sudoers.d/99-x ~/upload.txt && ln -sfn /root ~/rootdir",
                     user="user")
    return sbx


def test_read_through_planted_symlink_is_denied(planted: Sandbox) -> None:
    sbx = planted
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.read("/home/user/report.txt", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.read("/root/secret.txt", user="user")
    r = httpx.get(sbx.download_url("/home/user/report.txt", user="user"))
    assert r.status_code == 403 and ROOT_SECRET not in r.text
    # root still reads it, and the user their own files
    assert sbx.files.read("/home/user/report.txt", user="root") == ROOT_SECRET
    sbx.files.write("/home/user/mine.txt", "mine", user="user")
    assert sbx.files.read("/home/user/mine.txt", user="user") == "mine"


def test_write_through_planted_symlink_is_denied(planted: Sandbox) -> None:
    sbx = planted
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.write("/home/user/upload.txt", "user ALL=(ALL) NOPASSWD:ALL\n", user="user")
    assert not _exists(sbx, "/etc/sudoers.d/99-x")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.write("/home/user/rootdir/.bashrc", "evil", user="user")
    # A new file is the user's; over an existing root-owned file it is refused.
    sbx.files.write("/home/user/new/deep/file.txt", "x", user="user")
    assert _owner(sbx, "/home/user/new") == "user"
    assert _owner(sbx, "/home/user/new/deep/file.txt") == "user"
    _root(sbx, "echo root > /home/user/roots.txt && chmod 644 /home/user/roots.txt")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.write("/home/user/roots.txt", "overwritten", user="user")
    assert _root(sbx, "cat /home/user/roots.txt") == "root\n"


def test_metadata_ops_as_user_are_denied(planted: Sandbox) -> None:
    sbx = planted
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.list("/root", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.list("/home/user/rootdir", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.get_info("/root/secret.txt", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.remove("/root/secret.txt", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.rename("/root/secret.txt", "/home/user/stolen.txt", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.rename("/home/user/report.txt", "/etc/sudoers.d/99-moved", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.make_dir("/root/.ssh-evil", user="user")
    with pytest.raises(SandboxException, match=DENIED):
        sbx.files.watch_dir("/root", user="user")
    assert _root(sbx, "cat /root/secret.txt") == ROOT_SECRET
    assert not _exists(sbx, "/etc/sudoers.d/99-moved")
    assert not _exists(sbx, "/root/.ssh-evil")
    # The link itself is the user's to see (not its target's contents).
    info = sbx.files.get_info("/home/user/report.txt", user="user")
    assert info.symlink_target == "/root/secret.txt"
    # The same operations on the user's own files work, as the user.
    assert sbx.files.make_dir("/home/user/ops/d", user="user") is True
    assert _owner(sbx, "/home/user/ops/d") == "user"
    sbx.files.write("/home/user/ops/f.txt", "f", user="user")
    assert sbx.files.rename("/home/user/ops/f.txt", "/home/user/ops/d/g.txt",
                            user="user").path == "/home/user/ops/d/g.txt"
    names = {e.name for e in sbx.files.list("/home/user/ops", depth=2, user="user")}
    assert names == {"d", "g.txt"}
    sbx.files.remove("/home/user/ops", user="user")
    assert not sbx.files.exists("/home/user/ops", user="user")
    # root keeps root's powers
    assert "secret.txt" in {e.name for e in sbx.files.list("/root", user="root")}


def test_command_cwd_is_checked_as_the_user(planted: Sandbox) -> None:
    sbx = planted
    with pytest.raises(InvalidArgumentException, match="may not enter"):
        sbx.commands.run("ls", cwd="/root", user="user")
    assert sbx.commands.run("pwd", cwd="/root", user="root").stdout == "/root\n"
    assert sbx.commands.run("pwd", cwd="/home/user", user="user").stdout == "/home/user\n"


# -- finding 7d: watchers are capped ---------------------------------------------------
def _envd_fds(sbx: Sandbox) -> int:
    return int(_root(sbx, "ls /proc/1/fd | wc -l"))


def test_watchers_are_capped_and_freed(node: Node, sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/w")
    before = _envd_fds(sbx)
    handles = [sbx.files.watch_dir("/home/user/w") for _ in range(MAX_WATCHERS)]
    try:
        with pytest.raises(RateLimitException, match="too many watchers"):
            sbx.files.watch_dir("/home/user/w")
        # a stopped watcher frees its slot
        handles.pop().stop()
        handles.append(sbx.files.watch_dir("/home/user/w"))
        sbx.files.write("/home/user/w/ping.txt", "x")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not handles[-1].get_new_events():
            time.sleep(0.1)
        # the sandbox still serves everything else meanwhile
        assert sbx.commands.run("echo alive").stdout == "alive\n"
        assert sbx.files.read("/home/user/w/ping.txt") == "x"
    finally:
        for h in handles:
            h.stop()
    assert _envd_fds(sbx) <= before + 4
    # all slots free again, and a streaming watcher (async SDK) takes one too
    handles = [sbx.files.watch_dir("/home/user/w") for _ in range(MAX_WATCHERS - 1)]
    try:
        async def stream_then_stop() -> None:
            asbx = await AsyncSandbox.connect(sbx.sandbox_id)
            seen: list = []
            stream = await asbx.files.watch_dir("/home/user/w", seen.append)
            with pytest.raises(RateLimitException, match="too many watchers"):
                await asyncio.to_thread(sbx.files.watch_dir, "/home/user/w")
            await stream.stop()
            for _ in range(50):  # the stream's end reaches envd asynchronously
                try:
                    h = await asyncio.to_thread(sbx.files.watch_dir, "/home/user/w")
                except RateLimitException:
                    await asyncio.sleep(0.1)
                    continue
                handles.append(h)
                return
            raise AssertionError("a stopped stream watcher kept its slot")

        asyncio.run(stream_then_stop())
    finally:
        for h in handles:
            h.stop()


# -- cost ------------------------------------------------------------------------------
def test_small_file_ops_stay_fast(sbx: Sandbox) -> None:
    """A 1 KiB write and read as the user, through the node: median of 40 each."""
    data = "x" * 1024
    sbx.files.write("/home/user/t.txt", data, user="user")  # warm: the user's worker
    writes, reads, stats = [], [], []
    for _ in range(40):
        t0 = time.perf_counter()
        sbx.files.write("/home/user/t.txt", data, user="user")
        t1 = time.perf_counter()
        assert sbx.files.read("/home/user/t.txt", user="user") == data
        t2 = time.perf_counter()
        sbx.files.get_info("/home/user/t.txt", user="user")
        t3 = time.perf_counter()
        writes.append(t1 - t0)
        reads.append(t2 - t1)
        stats.append(t3 - t2)
    med = {k: sorted(v)[len(v) // 2] * 1000 for k, v in
           (("write", writes), ("read", reads), ("stat", stats))}
    print("1 KiB as user, median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    assert med["write"] < 100 and med["read"] < 100 and med["stat"] < 100


def test_file_workers_survive_pause_and_resume(node: Node) -> None:
    """envd's per-user file workers are processes in the checkpoint: after a resume
    the user's file operations work, and are still the user's."""
    sbx = Sandbox.create(template=strict_template(node), timeout=300)
    try:
        sbx.files.write("/home/user/before.txt", "kept", user="user")  # a worker is up
        sbx.pause()
        back = Sandbox.connect(sbx.sandbox_id)
        assert back.files.read("/home/user/before.txt", user="user") == "kept"
        back.files.write("/home/user/after.txt", "new", user="user")
        assert _owner(back, "/home/user/after.txt") == "user"
        with pytest.raises(SandboxException, match=DENIED):
            back.files.list("/root", user="user")
        # A files reset (issue 28): the user's workers cannot chroot, so they end and
        # the next is forked in the reset files; a file of before the reset is gone
        # for it, and it is still the user's.
        with node.client() as api:
            r = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
            assert r.status_code == 201, r.text
            body = {"snapshotID": r.json()["snapshotID"], "mode": "filesystem"}
            for mode in ("memory", "filesystem"):
                back.files.write("/home/user/rollout.txt", "gone after", user="user")
                r = api.post(f"/sandboxes/{sbx.sandbox_id}/reset", json=body)
                assert r.status_code == 200 and r.json()["mode"] == mode, r.text
                assert not back.files.exists("/home/user/rollout.txt", user="user")
                assert back.files.read("/home/user/after.txt", user="user") == "new"
                with pytest.raises(SandboxException, match=DENIED):
                    back.files.list("/root", user="user")
    finally:
        sbx.kill()


def test_fifo_planted_by_the_user_does_not_hang_envd(node: Node) -> None:
    """Opening a FIFO blocks until the other end opens: envd must not wait on it (a
    download or upload of one would otherwise stop envd's whole event loop)."""
    sbx = Sandbox.create(template=strict_template(node), timeout=300)
    try:
        sbx.commands.run("mkfifo /home/user/pipe")
        t0 = time.monotonic()
        with pytest.raises(InvalidArgumentException, match="not a regular file"):
            sbx.files.read("/home/user/pipe", user="user", request_timeout=15)
        with pytest.raises(InvalidArgumentException, match="not a regular file"):
            sbx.files.write("/home/user/pipe", "x", user="user", request_timeout=15)
        r = httpx.get(sbx.download_url("/home/user/pipe", user="user"), timeout=15)
        assert r.status_code == 400, r.text
        assert time.monotonic() - t0 < 10
        assert sbx.commands.run("echo alive", timeout=15).stdout == "alive\n"
    finally:
        sbx.kill()


# -- issue 17: what an idle sandbox holds of envd's; a worker is the user's, sealed -----


_PEEK = """
import sys
pid = sys.argv[1]
heap = [ln for ln in open(f"/proc/{pid}/maps") if "[heap]" in ln][0].split("-")[0]
try:
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(int(heap, 16))
        print("readable" if f.read(4096) else "empty")
except PermissionError:
    print("sealed")
"""


def test_an_idle_sandbox_runs_envd_alone_and_a_file_worker_is_sealed(node: Node) -> None:
    sandbox = Sandbox.create(template=strict_template(node), timeout=120)
    try:
        # Fresh: envd (pid 1) and nothing else of its own (no start-up zygote, which
        # held ~12 MiB of every idle sandbox's memory).
        assert envd_processes(sandbox) == ["1"]
        sandbox.files.write("/home/user/w.txt", "x", user="user")
        workers = [p for p in envd_processes(sandbox) if p != "1"]
        assert len(workers) == 1, workers
        pid = workers[0]
        status = _root(sandbox, f"cat /proc/{pid}/status")
        uid = sandbox.commands.run("id -u", user="user").stdout.strip()
        assert f"Uid:\t{uid}\t{uid}\t{uid}" in status, status
        # A copy of envd's memory (its access token among it): the user whose
        # worker it is may not read it.
        sandbox.files.write("/tmp/peek.py", _PEEK)
        out = sandbox.commands.run(f"python3 /tmp/peek.py {pid}", user="user")
        assert out.stdout.strip() == "sealed", out.stdout
        assert sandbox.files.read("/home/user/w.txt", user="user") == "x"
    finally:
        sandbox.kill()
