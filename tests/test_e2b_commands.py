"""Commands and PTYs through the official e2b SDK (Python, unchanged) against a node."""

from __future__ import annotations

import threading
import time

import pytest
from e2b import CommandExitException, Sandbox, SandboxNotRunningException, TimeoutException
from e2b.exceptions import InvalidArgumentException
from e2b.sandbox.commands.command_handle import PtySize

from agentenv.testing import Node
from sandbox_helpers import envd_processes


@pytest.fixture(scope="module")
def sbx(node: Node):
    sandbox = Sandbox.create(template="base", timeout=300, envs={"FROM_CREATE": "yes"})
    yield sandbox
    sandbox.kill()


def test_run_foreground(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo out; echo err >&2; echo $FROM_CREATE")
    assert result.exit_code == 0
    assert result.stdout == "out\nyes\n"
    assert result.stderr == "err\n"
    assert result.error is None


def test_nonzero_exit_raises_with_output(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; echo broken >&2; exit 7")
    err = failed.value
    assert err.exit_code == 7
    assert err.stdout == "partial\n"
    assert err.stderr == "broken\n"


def test_streamed_output_arrives_while_running(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    errors: list[str] = []
    sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.3; done; echo done >&2",
        on_stdout=lambda s: seen.append((time.monotonic(), s)),
        on_stderr=errors.append,
    )
    assert "".join(s for _, s in seen) == "line1\nline2\nline3\n"
    assert errors == ["done\n"]
    # streamed, not delivered at the end: the first line came well before the last
    assert seen[-1][0] - seen[0][0] > 0.4


def test_cwd_and_users(sbx: Sandbox) -> None:
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    assert sbx.commands.run("id -un").stdout == "user\n"
    assert sbx.commands.run("id -un", user="user").stdout == "user\n"
    assert sbx.commands.run("id -un; echo $HOME", user="root").stdout == "root\n/root\n"
    sbx.commands.run("touch /home/user/owned-by-user")
    owner = sbx.commands.run("stat -c %U /home/user/owned-by-user").stdout.strip()
    assert owner == "user"


def test_cwd_is_entered_as_the_user_without_a_file_worker(sbx: Sandbox) -> None:
    """A command's cwd is entered with the user's own rights, after envd drops root (as
    Go's os/exec orders it for E2B's envd), and refused before the command runs. That
    takes no file worker: a command with a cwd after a think gap forked one, ~420 ms
    under load (issue 27). A PTY changes directory as root, so it is still checked
    first; a refused start leaves no process, listed or running, and no descriptor."""
    for pid in envd_processes(sbx):
        if pid != "1":
            sbx.commands.run(f"kill -9 {pid} || true", user="root")
    sbx.commands.run("mkdir -p /tmp/closed && chmod 700 /tmp/closed && touch /tmp/afile",
                     user="root")
    fds = sbx.commands.run("ls /proc/1/fd | wc -l", user="root").stdout
    for cwd in ("/root", "/tmp/closed", "/tmp/afile", "/no/such/dir"):
        for _ in range(3):
            with pytest.raises(InvalidArgumentException, match="may not enter"):
                sbx.commands.run("touch /tmp/ran", cwd=cwd, user="user")
    assert sbx.commands.run("test -e /tmp/ran || echo never ran").stdout == "never ran\n"
    assert sbx.commands.run("ls /proc/1/fd | wc -l", user="root").stdout == fds
    assert sbx.commands.run("pwd; id -un", cwd="/tmp").stdout == "/tmp\nuser\n"
    assert sbx.commands.run("pwd", cwd="/tmp/closed", user="root").stdout == "/tmp/closed\n"
    handle = sbx.commands.run("sleep 30", cwd="/home/user", background=True)
    try:
        assert [p.pid for p in sbx.commands.list()] == [handle.pid]
        assert envd_processes(sbx) == ["1"]
    finally:
        handle.kill()
    with pytest.raises(InvalidArgumentException, match="may not enter"):
        sbx.pty.create(PtySize(rows=24, cols=80), cwd="/tmp/closed", user="user")
    # A command with a cwd that ends as soon as it starts: its end still reaches the
    # caller (envd must not serve other events between the start and the subscription).
    for i in range(80):
        user = ("root", "user")[i % 2]
        assert sbx.commands.run(f"echo {i}", cwd="/tmp", user=user, timeout=15).stdout == f"{i}\n"


def test_user_command_gets_its_groups_and_no_privileges(sbx: Sandbox) -> None:
    """envd switches to the user before the command (spawn.py's exec-as): all of the
    user's groups from /etc/group, real = effective = saved ids, no capabilities."""
    sbx.commands.run("groupadd -f aenvgrp && usermod -aG aenvgrp user", user="root")
    assert set(sbx.commands.run("id -Gn").stdout.split()) == {"user", "aenvgrp"}
    status = sbx.commands.run("grep -E '^(Uid|Gid|CapEff):' /proc/self/status").stdout
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split() == ["1000"] * 4 and fields["Gid"].split() == ["1000"] * 4
    assert int(fields["CapEff"], 16) == 0
    with pytest.raises(CommandExitException):
        sbx.commands.run("cat /etc/shadow")


def test_envs_per_command(sbx: Sandbox) -> None:
    out = sbx.commands.run("echo $ONE-$TWO-$FROM_CREATE", envs={"ONE": "1", "TWO": "2"})
    assert out.stdout == "1-2-yes\n"
    assert sbx.commands.run("echo ${ONE:-unset}").stdout == "unset\n"


def test_timeout_raises_timeout_exception(sbx: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 10


def test_background_wait_and_list(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 1; echo finished", background=True)
    assert handle.pid > 0
    pids = [p.pid for p in sbx.commands.list()]
    assert handle.pid in pids
    listed = next(p for p in sbx.commands.list() if p.pid == handle.pid)
    assert "sleep 1; echo finished" in " ".join([listed.cmd, *listed.args])
    result = handle.wait()
    assert result.exit_code == 0 and result.stdout == "finished\n"
    assert handle.pid not in [p.pid for p in sbx.commands.list()]


def test_stdin_send_and_close(sbx: Sandbox) -> None:
    handle = sbx.commands.run("read a; read b; echo got:$a:$b; cat", background=True,
                              stdin=True)
    sbx.commands.send_stdin(handle.pid, "first\n")
    handle.send_stdin("second\nrest of it\n")
    handle.close_stdin()
    result = handle.wait()
    assert result.stdout == "got:first:second\nrest of it\n"


def test_kill_background_command(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 600", background=True)
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as killed:
        handle.wait()
    assert killed.value.exit_code != 0
    assert sbx.commands.kill(handle.pid) is False  # gone


def test_connect_to_running_command(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 1; echo from-the-past; sleep 1; echo later",
                              background=True)
    handle.disconnect()
    again = sbx.commands.connect(handle.pid)
    lines: list[str] = []
    result = again.wait(on_stdout=lines.append)
    assert result.exit_code == 0
    assert "later\n" in "".join(lines)


def test_handle_kill(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 600", background=True)
    assert handle.kill() is True
    with pytest.raises(CommandExitException):
        handle.wait()


def test_many_commands_in_a_row(sbx: Sandbox) -> None:
    for i in range(10):
        assert sbx.commands.run(f"echo {i}").stdout == f"{i}\n"


def test_pty_create_input_resize_kill(sbx: Sandbox) -> None:
    chunks: list[bytes] = []
    got = threading.Event()

    handle = sbx.pty.create(PtySize(rows=24, cols=80), cwd="/tmp", envs={"PTYVAR": "pv"})

    def read() -> None:
        try:
            handle.wait(on_pty=lambda data: (chunks.append(bytes(data)), got.set()))
        except Exception:
            pass  # killed at the end

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def output() -> str:
        return b"".join(chunks).decode(errors="replace")

    def wait_for(text: str, timeout: float = 15) -> None:
        end = time.monotonic() + timeout
        while text not in output():
            assert time.monotonic() < end, f"{text!r} not in PTY output: {output()[-500:]!r}"
            time.sleep(0.05)

    sbx.pty.send_stdin(handle.pid, b"echo pty-$PTYVAR-$(pwd)\n")
    wait_for("pty-pv-/tmp")
    sbx.pty.send_stdin(handle.pid, b"tty; stty size\n")
    wait_for("/dev/pts/")
    wait_for("24 80")
    sbx.pty.resize(handle.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(handle.pid, b"stty size\n")
    wait_for("40 120")
    assert sbx.pty.kill(handle.pid) is True
    reader.join(timeout=10)
    assert not reader.is_alive()


def test_pty_runs_as_root_on_request(sbx: Sandbox) -> None:
    chunks: list[bytes] = []
    handle = sbx.pty.create(PtySize(rows=10, cols=60), user="root")
    reader = threading.Thread(
        target=lambda: _quiet(lambda: handle.wait(on_pty=lambda d: chunks.append(bytes(d)))),
        daemon=True)
    reader.start()
    sbx.pty.send_stdin(handle.pid, b"echo whoami=$(id -un)\nexit\n")
    reader.join(timeout=15)
    assert "whoami=root" in b"".join(chunks).decode(errors="replace")


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:
        pass


def test_killing_the_sandbox_mid_command_says_so(node: Node, api) -> None:
    """Issue 14.10: a sandbox killed while ``commands.run`` streams ends the stream with
    a Connect end-of-stream error (not a chunked body cut mid-frame), which the SDK
    turns into what E2B shows: SandboxNotRunningException, 'killed or reached its end
    of life while the request was in flight'. The node keeps serving."""
    victim = Sandbox.create(template="base", timeout=120)
    chunks: list[str] = []

    def kill_once_streaming() -> None:
        end = time.monotonic() + 30
        while not chunks and time.monotonic() < end:
            time.sleep(0.05)
        api.delete(f"/sandboxes/{victim.sandbox_id}")

    killer = threading.Thread(target=kill_once_streaming)
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(SandboxNotRunningException) as gone:
            victim.commands.run("echo started; sleep 30", on_stdout=chunks.append, timeout=60)
    finally:
        killer.join()
    assert chunks == ["started\n"]
    assert time.monotonic() - t0 < 20
    assert "killed or reached its end of life while the request was in flight" in \
        str(gone.value), gone.value
    assert "chunk" not in str(gone.value).lower()
    # the node still serves: the API, and commands in another sandbox
    assert api.get(f"/sandboxes/{victim.sandbox_id}").status_code == 404
    other = Sandbox.create(template="base", timeout=60)
    try:
        assert other.commands.run("echo alive").stdout == "alive\n"
    finally:
        other.kill()


def test_connect_timeout_raises_timeout_exception(sbx: Sandbox) -> None:
    """Issue 14.9: a stream attached with ``commands.connect(timeout=...)`` ends with
    TimeoutException at its deadline (as E2B's envd: deadline_exceeded); the command
    itself keeps running, as there."""
    handle = sbx.commands.run("sleep 30", background=True)
    try:
        attached = sbx.commands.connect(handle.pid, timeout=1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutException):
            attached.wait()
        assert time.monotonic() - t0 < 10
        assert handle.pid in [p.pid for p in sbx.commands.list()]
    finally:
        sbx.commands.kill(handle.pid)


def test_python_is_python3(sbx: Sandbox) -> None:
    # E2B's base has `python` beside `python3`.
    out = sbx.commands.run("python -c 'import sys; print(sys.version_info[0])'")
    assert out.stdout == "3\n"
    where = sbx.commands.run("readlink -f $(command -v python)").stdout
    assert where.startswith("/usr/bin/python3"), where


def test_sudo_as_user(sbx: Sandbox) -> None:
    # gVisor ignores setuid bits: envd runs the real sudo as root for users sudoers
    # grants everything (`user`, passwordless, as on E2B).
    assert sbx.commands.run("sudo whoami").stdout == "root\n"
    assert sbx.commands.run("sudo -n true").exit_code == 0
    assert sbx.commands.run("cd /tmp && sudo pwd").stdout == "/tmp\n"
    assert sbx.commands.run("sudo -u nobody id -un").stdout == "nobody\n"
    assert sbx.commands.run("echo piped | sudo cat").stdout == "piped\n"
    out = sbx.commands.run("sudo touch /root/by-sudo && sudo stat -c %U /root/by-sudo")
    assert out.stdout == "root\n" and out.stderr == ""  # no "unable to resolve host"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("sudo sh -c 'echo out; echo err >&2; exit 3'")
    assert (failed.value.exit_code, failed.value.stdout, failed.value.stderr) == (
        3, "out\n", "err\n")
    # A user sudoers does not name is refused, as sudo would.
    sbx.commands.run("sudo useradd --create-home other")
    with pytest.raises(CommandExitException) as refused:
        sbx.commands.run("sudo -n whoami", user="other")
    assert refused.value.exit_code == 1 and "may not run sudo" in refused.value.stderr
    # Killing the sudo a user started ends the command it runs as root.
    handle = sbx.commands.run("sudo sleep 777", background=True)
    time.sleep(1)
    assert "sleep 777" in sbx.commands.run("ps -eo args", user="root").stdout
    assert handle.kill() is True
    end = time.monotonic() + 10
    while "sleep 777" in sbx.commands.run("ps -eo args", user="root").stdout:
        assert time.monotonic() < end, "the command outlived its sudo"
        time.sleep(0.2)


def test_sudo_in_a_pty(sbx: Sandbox) -> None:
    chunks: list[bytes] = []
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    reader = threading.Thread(
        target=lambda: _quiet(lambda: handle.wait(on_pty=lambda d: chunks.append(bytes(d)))),
        daemon=True)
    reader.start()

    def wait_for(text: str, timeout: float = 15) -> None:
        end = time.monotonic() + timeout
        while text not in b"".join(chunks).decode(errors="replace"):
            assert time.monotonic() < end, f"{text!r} not in {b''.join(chunks)[-500:]!r}"
            time.sleep(0.05)

    sbx.pty.send_stdin(handle.pid, b"sudo whoami; echo rc=$((40 + $?))\n")
    wait_for("root\r\nrc=40")
    # Ctrl-C reaches the command sudo runs (as root), and the shell carries on.
    sbx.pty.send_stdin(handle.pid, b"sudo sleep 600\n")
    time.sleep(1.5)
    sbx.pty.send_stdin(handle.pid, b"\x03")
    sbx.pty.send_stdin(handle.pid, b"sleep 0.5; pgrep -f 'sleep 600' || echo gone=$((1 + 1))\n")
    wait_for("gone=2")
    assert sbx.pty.kill(handle.pid) is True
    reader.join(timeout=10)
