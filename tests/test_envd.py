"""envd as a real subprocess on loopback, driven by the e2b SDK's own envd clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.api.client_async import get_envd_api
from e2b.connection_config import ConnectionConfig
from e2b.envd.client_async import create_rpc_client
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb
from e2b.exceptions import (
    AuthenticationException,
    FileNotFoundException,
    InvalidArgumentException,
)
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from e2b.sandbox.signature import get_signature
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.commands.pty import Pty
from e2b.sandbox_async.filesystem.filesystem import Filesystem
from packaging.version import Version
from protobuf import Oneof

from agentenv.envd import ENVD_VERSION
from agentenv.testing import listening_socket

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="envd tests run as root")

ROOT = Path(__file__).resolve().parents[1]


async def _until(pred, limit_s: float = 10.0) -> None:
    for _ in range(int(limit_s / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)


class Envd:
    def __init__(self, token: str | None = None) -> None:
        # Its listening socket, handed over (agentenv.testing.ports).
        sock = listening_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_ENVD_")}
        env["PYTHONPATH"] = str(ROOT / "src")
        if token:
            env["AENV_ENVD_ACCESS_TOKEN"] = token
        argv = [sys.executable, "-m", "agentenv.envd", "--host", "127.0.0.1", "--port",
                str(self.port), "--listen-fd", str(sock.fileno())]
        if os.geteuid() == 0 and shutil.which("unshare"):
            # Commands run as `bash -l`. Root's .bashrc on these hosts runs `pyenv init`,
            # whose rehash lock a login shell killed mid-rehash leaves behind, and every
            # later login shell then waits 60 s for it. A sandbox's root has no such rc:
            # hide the host's from envd's shells (in a mount namespace of their own).
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind /dev/null "$HOME/.bashrc" 2>/dev/null; exec "$@"', "sh",
                    *argv]
        with sock:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, pass_fds=(sock.fileno(),))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 204:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"envd died: {self.proc.stderr.read().decode()}")
            time.sleep(0.05)
        raise RuntimeError("envd did not come up")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def hwm_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise RuntimeError("no VmHWM")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class SDK:
    """The SDK's own envd modules (commands, pty, files) pointed at one envd."""

    def __init__(self, url: str, token: str | None = None) -> None:
        headers = {"X-Access-Token": token} if token else {}
        self.config = ConnectionConfig(extra_sandbox_headers=headers, request_timeout=20)
        self.http = get_envd_api(self.config, url)
        version = Version(ENVD_VERSION)
        self.commands = Commands(url, self.config, version, self.http)
        self.pty = Pty(url, self.config, version, self.http)
        self.files = Filesystem(url, version, self.config, self.http)
        self.process_rpc = create_rpc_client(process_connect.ProcessClient, url, self.config)
        self.fs_rpc = create_rpc_client(filesystem_connect.FilesystemClient, url, self.config)


@pytest.fixture(scope="module")
def envd():
    e = Envd()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def sdk(envd):
    return SDK(envd.url)


@pytest.fixture
def workdir():
    # Not under tmp_path: pytest's base dir is root's alone (0700), and envd does
    # file operations as the requested user, who must reach the directory.
    d = Path(tempfile.mkdtemp(prefix="envd-test-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- processes ---------------------------------------------------------------------------
async def test_run_stdout_stderr_exit_code(sdk):
    r = await sdk.commands.run("echo out; echo err >&2; exit 0", user="root")
    assert r.exit_code == 0
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"


async def test_nonzero_exit_raises(sdk):
    with pytest.raises(CommandExitException) as ei:
        await sdk.commands.run("echo bad >&2; exit 3", user="root")
    assert ei.value.exit_code == 3
    assert ei.value.stderr == "bad\n"
    assert ei.value.error == "exit status 3"


async def test_user_root_vs_nobody(sdk):
    r = await sdk.commands.run("id -un; echo $HOME $USER $LOGNAME", user="root")
    assert r.stdout.split() == ["root", "/root", "root", "root"]
    nobody = pwd.getpwnam("nobody")
    r = await sdk.commands.run("id -u; id -un; echo $USER", user="nobody")
    assert r.stdout.split() == [str(nobody.pw_uid), "nobody", "nobody"]


async def test_unknown_user_is_clear_error(sdk):
    with pytest.raises(AuthenticationException, match="no-such-user"):
        await sdk.commands.run("true", user="no-such-user")


async def test_cwd_and_envs(sdk, workdir):
    r = await sdk.commands.run("pwd; echo $FOO", cwd=str(workdir), envs={"FOO": "bar"},
                               user="root")
    assert r.stdout.split() == [str(workdir), "bar"]
    with pytest.raises(InvalidArgumentException, match="does not exist"):
        await sdk.commands.run("pwd", cwd="/definitely/not/here", user="root")
    # envd's own PYTHON*/LD_* settings never leak into commands
    r = await sdk.commands.run("env", user="root")
    assert "PYTHONPATH=" not in r.stdout and "LD_LIBRARY_PATH" not in r.stdout


async def test_stdin_and_close_stdin(sdk):
    h = await sdk.commands.run("cat; echo done", background=True, stdin=True, user="root")
    await h.send_stdin("hello ")
    await h.send_stdin(b"world\n")
    await h.close_stdin()
    r = await h.wait()
    assert r.stdout == "hello world\ndone\n"


async def test_stream_input(sdk):
    h = await sdk.commands.run("head -c 6", background=True, stdin=True, user="root")
    async with sdk.commands.stream_input(h.pid) as inp:
        await inp.send("abc")
        await inp.send(b"def")
    r = await h.wait()
    assert r.stdout == "abcdef"


async def test_kill_list_and_connect(sdk):
    h = await sdk.commands.run("echo started; sleep 30", background=True, user="root")
    await asyncio.sleep(0.2)
    procs = await sdk.commands.list()
    assert h.pid in [p.pid for p in procs]
    info = next(p for p in procs if p.pid == h.pid)
    assert info.cmd == "/bin/bash" and "sleep 30" in info.args[-1]
    # a second client attaches to the running process
    h2 = await sdk.commands.connect(h.pid)
    assert h2.pid == h.pid
    assert await sdk.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as ei:
        await h.wait()
    assert ei.value.exit_code == -1 and "killed" in ei.value.error
    assert "started" in ei.value.stdout
    with pytest.raises(CommandExitException):
        await h2.wait()
    assert h.pid not in [p.pid for p in await sdk.commands.list()]
    assert await sdk.commands.kill(h.pid) is False  # gone: NOT_FOUND


async def test_sigterm_and_tag(sdk):
    req = process_pb.StartRequest(
        process=process_pb.ProcessConfig(cmd="/bin/sleep", args=["30"]), tag="my-tag")
    stream = sdk.process_rpc.start(req, headers={"Authorization": "Basic cm9vdDo="})
    first = await anext(stream)
    pid = first.event.event.value.pid
    await sdk.process_rpc.send_signal(process_pb.SendSignalRequest(
        process=process_pb.ProcessSelector(selector=Oneof("tag", "my-tag")),
        signal=process_pb.Signal.SIGTERM))
    ends = [ev async for ev in stream if ev.event.event.field == "end"]
    assert ends[0].event.event.value.status == "signal: terminated"
    with pytest.raises(ConnectError) as ei:
        await sdk.process_rpc.send_signal(process_pb.SendSignalRequest(
            process=process_pb.ProcessSelector(selector=Oneof("pid", pid)),
            signal=process_pb.Signal.SIGKILL))
    assert ei.value.code == Code.NOT_FOUND


async def test_pty_input_and_resize(sdk):
    out = bytearray()
    h = await sdk.pty.create(PtySize(rows=24, cols=80), on_data=out.extend, user="root")
    await sdk.pty.send_stdin(h.pid, b"stty size; tty\n")
    await _until(lambda: b"/dev/pts/" in out)
    await sdk.pty.resize(h.pid, PtySize(rows=40, cols=132))
    await sdk.pty.send_stdin(h.pid, b"stty size; exit 0\n")
    r = await asyncio.wait_for(h.wait(), 15)
    assert r.exit_code == 0
    text = out.decode(errors="replace")
    assert "24 80" in text and "40 132" in text and "/dev/pts/" in text


async def test_start_timeout_kills_process(sdk):
    h = await sdk.commands.run("sleep 30", background=True, timeout=1, user="root")
    t = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - deadline or kill, both end the command
        await h.wait()
    assert time.monotonic() - t < 10
    await asyncio.sleep(0.3)
    assert h.pid not in [p.pid for p in await sdk.commands.list()]


async def test_zombies_are_reaped(envd, sdk):
    # an orphaned grandchild is re-parented to... the host's init here, but our own
    # children never linger as zombies
    for _ in range(5):
        await sdk.commands.run("true", user="root")
    await asyncio.sleep(0.2)
    children = Path(f"/proc/{envd.proc.pid}/task/{envd.proc.pid}/children").read_text().split()
    zombies = [c for c in children
               if Path(f"/proc/{c}/stat").exists()
               and Path(f"/proc/{c}/stat").read_text().split(")")[1].split()[0] == "Z"]
    assert zombies == []


# -- filesystem --------------------------------------------------------------------------
async def test_filesystem_ops(sdk, workdir):
    d = workdir / "a"
    assert await sdk.files.make_dir(str(d / "b" / "c"), user="nobody") is True
    assert await sdk.files.make_dir(str(d), user="nobody") is False
    assert (d / "b").stat().st_uid == pwd.getpwnam("nobody").pw_uid
    (d / "f.txt").write_text("12345")
    os.symlink(d / "f.txt", d / "link")
    info = await sdk.files.get_info(str(d / "f.txt"), user="root")
    assert info.size == 5 and info.type.value == "file" and info.owner == "root"
    assert info.permissions.startswith("-rw")
    link = await sdk.files.get_info(str(d / "link"), user="root")
    assert link.symlink_target == str(d / "f.txt")
    names1 = sorted(e.name for e in await sdk.files.list(str(d), user="root"))
    assert names1 == ["b", "f.txt", "link"]
    deep = sorted(e.path for e in await sdk.files.list(str(d), depth=3, user="root"))
    assert str(d / "b" / "c") in deep
    moved = await sdk.files.rename(str(d / "f.txt"), str(d / "new" / "g.txt"), user="root")
    assert moved.path == str(d / "new" / "g.txt") and (d / "new" / "g.txt").exists()
    assert await sdk.files.exists(str(d / "f.txt"), user="root") is False
    await sdk.files.remove(str(d / "b"), user="root")
    assert not (d / "b").exists()
    # relative paths resolve against the user's home
    r = await sdk.files.get_info(".", user="root")
    assert r.path == "/root"


async def test_filesystem_errors(sdk, workdir):
    with pytest.raises(FileNotFoundException):
        await sdk.files.get_info(str(workdir / "missing"), user="root")
    await sdk.files.remove(str(workdir / "missing"), user="root")  # a no-op, as upstream
    with pytest.raises(FileNotFoundException):
        await sdk.files.read(str(workdir / "missing"), user="root")
    (workdir / "file").write_text("x")
    with pytest.raises(InvalidArgumentException, match="not a directory"):
        await sdk.files.list(str(workdir / "file"), user="root")
    with pytest.raises(InvalidArgumentException, match="NUL"):
        await sdk.files.get_info("bad\x00path", user="root")
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        await sdk.files.read(str(workdir), user="root")


async def test_watch_dir(sdk, workdir):
    events = []
    w = await sdk.files.watch_dir(str(workdir), events.append, user="root", recursive=True)
    (workdir / "new.txt").write_text("x")
    (workdir / "sub").mkdir()
    await asyncio.sleep(0.2)
    (workdir / "sub" / "inner").write_text("y")
    (workdir / "new.txt").chmod(0o600)
    (workdir / "new.txt").rename(workdir / "renamed.txt")
    (workdir / "renamed.txt").unlink()
    await _until(lambda: any(e.type == FilesystemEventType.REMOVE for e in events))
    await w.stop()
    seen = {(e.name, e.type) for e in events}
    assert ("new.txt", FilesystemEventType.CREATE) in seen
    assert ("new.txt", FilesystemEventType.WRITE) in seen
    assert ("new.txt", FilesystemEventType.CHMOD) in seen
    assert ("new.txt", FilesystemEventType.RENAME) in seen
    assert ("sub/inner", FilesystemEventType.CREATE) in seen
    assert ("renamed.txt", FilesystemEventType.REMOVE) in seen


async def test_polling_watcher(sdk, workdir):
    rpc = sdk.fs_rpc
    hdr = {"Authorization": "Basic cm9vdDo="}
    w = await rpc.create_watcher(filesystem_pb.CreateWatcherRequest(path=str(workdir)),
                                 headers=hdr)
    (workdir / "x").write_text("1")
    await asyncio.sleep(0.2)
    ev = await rpc.get_watcher_events(
        filesystem_pb.GetWatcherEventsRequest(watcher_id=w.watcher_id), headers=hdr)
    assert any(e.name == "x" and e.type == filesystem_pb.EventType.CREATE for e in ev.events)
    await rpc.remove_watcher(filesystem_pb.RemoveWatcherRequest(watcher_id=w.watcher_id),
                             headers=hdr)
    with pytest.raises(ConnectError) as ei:
        await rpc.get_watcher_events(
            filesystem_pb.GetWatcherEventsRequest(watcher_id=w.watcher_id), headers=hdr)
    assert ei.value.code == Code.NOT_FOUND


# -- /files ------------------------------------------------------------------------------
async def test_write_read_small_files(sdk, workdir):
    info = await sdk.files.write(str(workdir / "d" / "hello.txt"), "hi there", user="nobody")
    assert info.path == str(workdir / "d" / "hello.txt")
    assert (workdir / "d" / "hello.txt").stat().st_uid == pwd.getpwnam("nobody").pw_uid
    assert await sdk.files.read(str(workdir / "d" / "hello.txt"), user="root") == "hi there"
    # several files in one multipart request
    infos = await sdk.files.write_files(
        [{"path": str(workdir / "m1"), "data": b"one"},
         {"path": str(workdir / "m2"), "data": "two"}], user="root")
    assert [i.name for i in infos] == ["m1", "m2"]
    assert (workdir / "m2").read_text() == "two"
    # octet-stream + gzip upload, with metadata (xattrs, when the fs supports them)
    info = await sdk.files.write(str(workdir / "gz"), b"zipped" * 1000, gzip=True, user="root")
    assert (workdir / "gz").read_bytes() == b"zipped" * 1000


async def test_big_file_streams_with_bounded_memory(envd, sdk, workdir):
    size = 120 * 1024 * 1024
    src = workdir / "big.src"
    with open(src, "wb") as f:
        block = os.urandom(1024 * 1024)
        for _ in range(size // len(block)):
            f.write(block)
    base = envd.rss_kib()
    # upload (multipart, streamed from a file object by httpx)
    async with httpx.AsyncClient(base_url=envd.url, timeout=120) as c:
        with open(src, "rb") as f:
            r = await c.post("/files", params={"path": str(workdir / "big.up"),
                                               "username": "root"}, files={"file": f})
        assert r.status_code == 200, r.text
        assert r.json()[0]["path"] == str(workdir / "big.up")
        assert (workdir / "big.up").stat().st_size == size
        # download, streamed
        n = 0
        async with c.stream("GET", "/files", params={"path": str(workdir / "big.up"),
                                                      "username": "root"}) as resp:
            assert resp.status_code == 200
            assert int(resp.headers["content-length"]) == size
            async for chunk in resp.aiter_raw():
                n += len(chunk)
        assert n == size
    grown_mib = (envd.hwm_kib() - base) / 1024
    print(f"envd peak RSS growth for 120 MiB up+download: {grown_mib:.1f} MiB")
    assert grown_mib < 40, f"envd grew by {grown_mib:.1f} MiB for a 120 MiB file"


# -- HTTP API, auth ----------------------------------------------------------------------
async def test_init_envs_metrics(envd):
    async with httpx.AsyncClient(base_url=envd.url) as c:
        r = await c.post("/init", json={"envVars": {"FROM_INIT": "yes"},
                                        "timestamp": "2024-01-01T00:00:00Z"})
        assert r.status_code == 204
        assert (await c.get("/envs")).json()["FROM_INIT"] == "yes"
        m = (await c.get("/metrics")).json()
        assert m["cpu_count"] >= 1 and m["mem_total"] > m["mem_used"] > 0
        assert m["disk_total"] >= m["disk_used"] > 0
    sdk = SDK(envd.url)
    r = await sdk.commands.run("echo $FROM_INIT", user="root")
    assert r.stdout == "yes\n"


async def test_access_token(tmp_path):
    token = uuid.uuid4().hex
    e = Envd(token=token)
    try:
        async with httpx.AsyncClient(base_url=e.url) as c:
            assert (await c.get("/health")).status_code == 204
            assert (await c.get("/envs")).status_code == 401
            assert (await c.get("/envs", headers={"X-Access-Token": "wrong"})).status_code == 401
            assert (await c.get("/envs", headers={"X-Access-Token": token})).status_code == 200
            # signed URL instead of the header
            (tmp_path / "s.txt").write_text("signed")
            path = str(tmp_path / "s.txt")
            assert (await c.get("/files", params={"path": path})).status_code == 401
            sig = get_signature(path, "read", "root", token, 60)
            r = await c.get("/files", params={
                "path": path, "username": "root", "signature": sig["signature"],
                "signature_expiration": sig["expiration"]})
            assert r.status_code == 200 and r.text == "signed"
            old = get_signature(path, "read", "root", token, -10)
            r = await c.get("/files", params={
                "path": path, "username": "root", "signature": old["signature"],
                "signature_expiration": old["expiration"]})
            assert r.status_code == 401
            # rotate the token through /init (authenticated with the old one)
            new = uuid.uuid4().hex
            r = await c.post("/init", json={"accessToken": new},
                             headers={"X-Access-Token": token})
            assert r.status_code == 204
            assert (await c.get("/envs", headers={"X-Access-Token": token})).status_code == 401
            token = new
        with pytest.raises(AuthenticationException):
            await SDK(e.url).commands.run("true", user="root")
        with pytest.raises(AuthenticationException):
            await SDK(e.url, "wrong").files.list("/", user="root")
        r = await SDK(e.url, token).commands.run("echo ok", user="root")
        assert r.stdout == "ok\n"
    finally:
        e.stop()


def test_idle_rss_is_small(envd):
    rss_mib = envd.rss_kib() / 1024
    print(f"envd RSS: {rss_mib:.1f} MiB")
    assert rss_mib < 80
