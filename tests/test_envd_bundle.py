"""The envd runtime bundle: built for real, then run inside a busybox rootfs that has
no Python and no glibc (plain chroot in a private mount namespace)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from e2b.api.client_async import get_envd_api
from e2b.connection_config import ConnectionConfig
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.filesystem.filesystem import Filesystem
from packaging.version import Version

from agentenv.envd import ENVD_VERSION
from agentenv.envd.bundle import build_bundle, envd_command
from agentenv.testing import listening_socket

BUSYBOX = Path("/bin/busybox")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, mount namespace)"),
    pytest.mark.skipif(not BUSYBOX.exists() or not shutil.which("unshare"),
                       reason="needs busybox-static (scripts/setup-system.sh) and unshare"),
]


@pytest.fixture(scope="module")
def scratch():
    # own temp dir: pytest's tmp_path retention is shared with concurrent runs
    d = Path(tempfile.mkdtemp(prefix="aenv-envd-bundle-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def bundle(scratch) -> Path:
    return build_bundle(scratch / "bundles")


@pytest.fixture(scope="module")
def rootfs(scratch) -> Path:
    """busybox-only rootfs: static busybox, /etc/passwd, no libc, no python, empty /dev."""
    r = scratch / "rootfs"
    r.mkdir()
    r.chmod(0o755)
    for d in ("bin", "etc", "tmp", "root", "proc", "dev", ".aenv", "home/user"):
        (r / d).mkdir(parents=True, exist_ok=True)
    (r / "tmp").chmod(0o1777)
    shutil.copy2(BUSYBOX, r / "bin" / "busybox")
    for applet in ("sh", "ls", "cat", "id", "echo", "env", "sleep", "mkdir", "pwd"):
        (r / "bin" / applet).symlink_to("busybox")
    (r / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n")
    (r / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    os.chown(r / "home" / "user", 1000, 1000)
    assert not list(r.rglob("libc.so*")) and not list(r.rglob("python*"))
    return r


def _in_rootfs(bundle: Path, rootfs: Path, argv: list[str]) -> list[str]:
    """argv running ``argv`` chrooted in ``rootfs`` with the bundle at /.aenv (ro)."""
    script = (f'mount --bind -o ro "{bundle}" "{rootfs}/.aenv" && '
              f'mount -t proc proc "{rootfs}/proc" && exec chroot "{rootfs}" "$@"')
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def test_bundle_layout_and_idempotence(bundle):
    assert build_bundle(bundle.parent) == bundle  # keyed by content hash: reused
    manifest = json.loads((bundle / "BUNDLE.json").read_text())
    assert manifest["hash"] == bundle.name
    libs = set(os.listdir(bundle / "lib"))
    for need in ("ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libz.so.1",
                 "libssl.so.3", "libcrypto.so.3", "libffi.so.8", "libpython3.11.so.1.0"):
        assert need in libs
    stdlib = bundle / "python" / "lib" / "python3.11"
    for gone in ("test", "idlelib", "tkinter", "ensurepip", "site-packages"):
        assert not (stdlib / gone).exists()
    assert list((stdlib / "asyncio" / "__pycache__").glob("*.pyc"))
    site = bundle / "site"
    assert (site / "aenv_envd_protos" / "process" / "process_connect.py").exists()
    assert (site / "agentenv" / "envd" / "__main__.py").exists()
    assert not (site / "e2b").exists() and not (site / "agentenv" / "api").exists()
    argv, env = envd_command("/.aenv", 49983)
    assert argv[:3] == ["/.aenv/lib/ld-linux-x86-64.so.2", "--library-path", "/.aenv/lib"]
    assert argv[3:] == ["/.aenv/python/bin/python3.11", "-S", "-m", "agentenv.envd", "--port",
                        "49983"]
    assert (bundle / "bin" / "setpriv").is_file()
    assert os.access(bundle / "bin" / "exec-as", os.X_OK)
    assert env["PYTHONHOME"] == "/.aenv/python" and env["PYTHONPATH"] == "/.aenv/site"


def test_exec_as_sets_credentials_then_execs_like_execvp(bundle, scratch):
    """envd's credential switch for a user's command (spawn.py): groups, gid and uid
    all set, a PATH search, a file without #! run by /bin/sh, and 127/126 with a
    message for a command that is missing or cannot be run."""
    helper = str(bundle / "bin" / "exec-as")
    d = scratch / "exec-as"
    d.mkdir(mode=0o755)
    (d / "noshebang").write_text('echo "by sh: $0 $1"\n')
    (d / "noshebang").chmod(0o755)
    (d / "noexec").write_text("echo never\n")
    env = {"PATH": f"/nonexistent:{d}:/usr/bin:/bin"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([helper, *argv], env=env, capture_output=True, text=True,
                              timeout=30)

    out = run("65534", "65533", "65532,65531", "sh", "-c",
              "grep -E '^(Uid|Gid|Groups|CapEff):' /proc/self/status")
    assert out.returncode == 0, out.stderr
    status = dict(line.split(":", 1) for line in out.stdout.splitlines())
    assert status["Uid"].split() == ["65534"] * 4 and status["Gid"].split() == ["65533"] * 4
    assert sorted(status["Groups"].split()) == ["65531", "65532"]
    assert int(status["CapEff"], 16) == 0
    assert run("65534", "65534", "-", "id", "-G").stdout.split() == ["65534"]
    assert run("0", "0", "-", "noshebang", "arg").stdout == f"by sh: {d}/noshebang arg\n"
    missing = run("0", "0", "-", "no-such-command")
    assert missing.returncode == 127 and "no-such-command: No such file" in missing.stderr
    denied = run("0", "0", "-", str(d / "noexec"))
    assert denied.returncode == 126 and "Permission denied" in denied.stderr
    for bad in (("x", "0", "-"), ("0", "0", "1,,2"), ("0", "4294967296", "-")):
        refused = run(*bad, "touch", str(d / "ran"))
        assert refused.returncode == 126 and not (d / "ran").exists()


def test_exec_as_enters_the_cwd_as_the_user_and_reports_it(bundle, scratch):
    """-C DIR FD: the directory is entered once the credentials are the user's, and
    the outcome is one byte on FD (0, else the errno) before CMD runs or not."""
    helper = str(bundle / "bin" / "exec-as")
    closed = scratch / "closed"
    closed.mkdir(mode=0o700, exist_ok=True)
    (scratch / "afile").write_text("")
    open_dir = scratch / "open"
    open_dir.mkdir(mode=0o755, exist_ok=True)
    scratch.chmod(0o755)

    def enter(where: Path, uid: str, *cmd: str) -> tuple[bytes, subprocess.CompletedProcess]:
        r, w = os.pipe()
        try:
            done = subprocess.run([helper, "-C", str(where), str(w), uid, uid, "-", *cmd],
                                  pass_fds=(w,), capture_output=True, text=True, timeout=30)
        finally:
            os.close(w)
        with os.fdopen(r, "rb") as report:
            return report.read(), done

    word, done = enter(open_dir, "65534", "pwd")
    assert (word, done.returncode, done.stdout) == (b"\0", 0, f"{open_dir}\n")
    for where, err in ((closed, errno.EACCES), (scratch / "afile", errno.ENOTDIR),
                       (scratch / "none", errno.ENOENT)):
        word, done = enter(where, "65534", "touch", str(scratch / "ran"))
        assert (word, done.returncode) == (bytes([err]), 126), (where, done.stderr)
    assert not (scratch / "ran").exists()
    word, done = enter(closed, "0", "pwd")  # root may
    assert (word, done.stdout) == (b"\0", f"{closed}\n")
    word, done = enter(closed, "x", "pwd")  # bad credentials: FD closed unwritten
    assert (word, done.returncode) == (b"", 126)


def test_bundled_python_in_busybox(bundle, rootfs):
    argv, env = envd_command()
    code = ("import ssl, ctypes, zlib, lzma, bz2, hashlib, sys; "
            "print(ssl.OPENSSL_VERSION); print(sys.prefix)")
    py = [*argv[:4], "-c", code]
    out = subprocess.run(_in_rootfs(bundle, rootfs, py), env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "OpenSSL" in out.stdout and "/.aenv/python" in out.stdout


@pytest.fixture(scope="module")
def busybox_envd(bundle, rootfs):
    """envd started from the bundle, chrooted in the busybox rootfs; yields its URL."""
    sock = listening_socket()  # handed over (agentenv.testing.ports)
    port = sock.getsockname()[1]
    argv, env = envd_command(port=port)
    argv += ["--host", "127.0.0.1", "--listen-fd", str(sock.fileno())]
    with sock:
        proc = subprocess.Popen(_in_rootfs(bundle, rootfs, argv), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(sock.fileno(),))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        ok = False
        while time.monotonic() < deadline and not ok:
            with contextlib.suppress(httpx.HTTPError):
                ok = httpx.get(url + "/health", timeout=1).status_code == 204
            if proc.poll() is not None:
                raise AssertionError(f"envd exited: {proc.stderr.read().decode()}")
            time.sleep(0.05)
        assert ok, "envd in the busybox rootfs did not answer /health"
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def test_envd_runs_in_busybox(busybox_envd, rootfs):
    url = busybox_envd
    config = ConnectionConfig(request_timeout=20)
    http = get_envd_api(config, url)
    commands = Commands(url, config, Version(ENVD_VERSION), http)
    files = Filesystem(url, Version(ENVD_VERSION), config, http)
    # the SDK asks for /bin/bash; the rootfs has only busybox sh
    r = await commands.run("echo hello from $(id -un); pwd; env", user="user")
    lines = r.stdout.splitlines()
    assert lines[:2] == ["hello from user", "/home/user"]
    assert not [v for v in lines if v.startswith(("PYTHON", "LD_"))]
    r = await commands.run("id -u", user="root")
    assert r.stdout == "0\n"
    await files.write("notes/a.txt", "in busybox", user="user")
    assert (rootfs / "home" / "user" / "notes" / "a.txt").stat().st_uid == 1000
    assert await files.read("/home/user/notes/a.txt", user="root") == "in busybox"


def test_layer_keeper_runs_a_batch_in_order_and_names_the_first_failure(bundle, scratch):
    """envd's mounts for a filesystem reset go to layer-keeper a batch to a request
    (layers.py): done in order up to the first failure, which the answer names; a
    batch beyond the keeper's bounds is split; a malformed request does nothing. The
    keeper runs in a mount namespace of its own, as envd's real root is to it."""
    from agentenv.envd.layers import KEEPER_FD, KEEPER_MAX_OPS, LayerError, Layers

    d = scratch / "keeper"
    d.mkdir()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.posix_spawn(shutil.which("unshare") or "unshare",
                         ["unshare", "--mount", "--propagation", "private",
                          str(bundle / "bin" / "layer-keeper")], dict(os.environ),
                         file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3)])
    theirs.close()
    os.dup2(ours.fileno(), KEEPER_FD)

    def tmpfs(name: str) -> tuple:
        (d / name).mkdir(exist_ok=True)
        return ("M", "tmpfs", str(d / name), "tmpfs", 0, "size=1m")

    def mounted() -> set[str]:
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        return {Path(line.split()[4]).name for line in lines
                if line.split()[4].startswith(str(d))}

    try:
        layers = Layers()
        missing = ("U", str(d / "never-mounted"), 2)
        # Unmounts allowed to fail, then a mount: all in one request.
        layers._keeper([missing, missing, tmpfs("a")], may_fail=2)
        assert mounted() == {"a"}
        # In order, stopped at the first failure, which the error names.
        with pytest.raises(LayerError, match="never-mounted: No such file or directory"):
            layers._keeper([tmpfs("b"), missing, tmpfs("c")])
        assert mounted() == {"a", "b"}
        # A failure that may not happen is one even among those that may.
        with pytest.raises(LayerError, match="never-mounted"):
            layers._keeper([missing, missing], may_fail=1)
        # More operations than one request holds: split, all done.
        many = [tmpfs(f"m{i}") for i in range(KEEPER_MAX_OPS + 3)]
        layers._keeper(many)
        assert {f"m{i}" for i in range(KEEPER_MAX_OPS + 3)} <= mounted()
        # A malformed request (a mount short of its fields after a good one, too many
        # operations, an unknown one) does nothing and says EINVAL at operation 0.
        good = b"Mtmpfs\0" + str(d / "x").encode() + b"\0tmpfs\x000\0\0"
        (d / "x").mkdir()
        for bad in (good + b"Mtmpfs\0", good * (KEEPER_MAX_OPS + 1), good + b"X\0",
                    b"U" + str(d / "a").encode() + b"\0two\0"):
            os.write(KEEPER_FD, bad)
            assert struct.unpack("ii", os.read(KEEPER_FD, 8)) == (0, errno.EINVAL)
        assert "x" not in mounted() and "a" in mounted()
    finally:
        os.close(KEEPER_FD)
        ours.close()
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # it ends when envd's end closes
