"""Starting a command for the process service: as the user, with pipes or a PTY.

The command becomes a ``running.Proc`` in the registry, whose output is then read
in envd's event loop. Through a helper (see spawn) when the user changes, so that
CPython can vfork instead of copying envd.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import subprocess
import termios
from typing import Any

from aenv_envd_protos.process import process_pb as pb
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from .running import Proc, Registry
from .spawn import as_user, exec_as
from .state import State, User

MAX_PTY_DIM = 4096
# How long envd waits for exec-as to say whether it entered the cwd: it is a few system
# calls; past this the command is taken as started and its exit tells the rest.
ENTER_REPORT_S = 5.0


def cwd_refused(cwd: str, user: User) -> ConnectError:
    return ConnectError(Code.INVALID_ARGUMENT,
                        f"cwd '{cwd}' does not exist, is not a directory, or "
                        f"'{user.name}' may not enter it")


def enters_cwd_as_user(request: pb.StartRequest) -> bool:
    """Whether spawn_process itself has the cwd entered as the user (exec-as, after the
    credentials drop). Otherwise the caller checks it first: a PTY command, or no
    exec-as, changes directory before dropping root."""
    return request.pty is None and exec_as() is not None and os.geteuid() == 0


def _null_stdin() -> int:
    """/dev/null, or (in a rootfs without it) an already-closed pipe: EOF either way."""
    if os.path.exists(os.devnull):
        return subprocess.DEVNULL
    r, w = os.pipe()
    os.close(w)
    return r  # Popen dups it onto fd 0; closed by the caller below


def _set_controlling_tty() -> None:  # runs in the child, after setsid
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def set_winsize(fd: int, rows: int, cols: int) -> None:
    rows = min(max(rows, 0), MAX_PTY_DIM) or 24  # the kernel's fields are 16-bit
    cols = min(max(cols, 0), MAX_PTY_DIM) or 80
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def spawn_process(state: State, registry: Registry, request: pb.StartRequest, user: User,
                  cwd: str | None) -> Proc:
    """Start ``request``'s command as ``user`` (pipes, or a PTY) and register it.

    Raises ConnectError INVALID_ARGUMENT when the command cannot be started, including
    a cwd the user may not enter (see enters_cwd_as_user). The event loop does not run
    meanwhile, so the caller subscribes to the process before any of its events."""
    # A requested cwd is entered as the user; the default one (the template's workdir,
    # else home) as envd always has, even where the user could not enter it.
    requested = cwd is not None
    if cwd is None:
        cwd = state.default_cwd(user)
    proc, report = _start(state, registry, request, user, cwd, requested)
    registry.add(proc)
    if report is not None and _entered_error(report):
        proc.discard()
        raise cwd_refused(cwd, user)
    return proc


def _start(state: State, registry: Registry, request: pb.StartRequest, user: User,
           cwd: str, enter_as_user: bool) -> tuple[Proc, int | None]:
    """The child started (a vfork where it can), and the read end of exec-as's report
    on entering ``cwd`` when it enters it as the user."""
    cfg = request.process
    if cfg is None or not cfg.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process config with a cmd is required")
    cmd = cfg.cmd
    if cmd == "/bin/bash" and not os.path.exists(cmd) and os.path.exists("/bin/sh"):
        cmd = "/bin/sh"  # the SDK always asks for bash; minimal rootfses have only sh
    argv = [cmd, *cfg.args]
    env = state.process_env(user, dict(cfg.envs))
    creds: dict[str, Any] = {}
    if os.geteuid() == 0:
        try:
            groups = os.getgrouplist(user.name, user.gid)
        except OSError:
            groups = [user.gid]
        if (user.uid, user.gid) != (os.getuid(), os.getgid()) \
                or set(groups) != set(os.getgroups()):  # else envd's own: no switch
            creds = {"user": user.uid, "group": user.gid, "extra_groups": groups}
    elif user.uid != os.geteuid():
        raise ConnectError(Code.PERMISSION_DENIED,
                           f"envd is not root and cannot run commands as '{user.name}'")
    use_stdin = request.stdin if request.has_field("stdin") else True
    pty = request.pty
    report: int | None = None  # exec-as's word on the cwd (read end)
    try:
        if pty is not None:
            master, slave = os.openpty()
            try:
                size = pty.size
                set_winsize(slave, size.rows if size else 24, size.cols if size else 80)
                popen = subprocess.Popen(
                    argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                    start_new_session=True, preexec_fn=_set_controlling_tty, **creds)
            finally:
                os.close(slave)
            proc = Proc(registry, popen, cfg, request.tag if request.has_field("tag")
                        else None, {master: "pty"}, None, master)
        else:
            # Through exec-as or setpriv when the user changes: a vfork, not a fork.
            spawn_argv, report_w = argv, None
            popen_cwd: str | None = cwd
            stdin_src: int = subprocess.PIPE
            try:  # report_w is the child's alone once it runs, or nobody's if it does not
                if creds:
                    if enter_as_user and exec_as() is not None:  # see exec_as.c
                        report, report_w = os.pipe()
                    via = as_user(argv, user.uid, user.gid, creds["extra_groups"],
                                  env.get("PATH", ""),
                                  (cwd, report_w) if report_w is not None else None)
                    if via is not None:
                        spawn_argv, creds = via, {}
                        if report_w is not None:
                            popen_cwd = None
                stdin_src = subprocess.PIPE if use_stdin else _null_stdin()
                popen = subprocess.Popen(
                    spawn_argv, stdin=stdin_src,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=popen_cwd,
                    start_new_session=True, pass_fds=(report_w,) if report_w is not None else (),
                    **creds)
            finally:
                if report_w is not None:
                    os.close(report_w)
            if isinstance(stdin_src, int) and stdin_src >= 0:
                os.close(stdin_src)
            assert popen.stdout is not None and popen.stderr is not None  # both PIPE
            out = {os.dup(popen.stdout.fileno()): "stdout",
                   os.dup(popen.stderr.fileno()): "stderr"}
            popen.stdout.close()
            popen.stderr.close()
            stdin_fd = None
            if popen.stdin is not None:
                stdin_fd = os.dup(popen.stdin.fileno())
                popen.stdin.close()
                os.set_blocking(stdin_fd, False)
            popen.stdin = popen.stdout = popen.stderr = None
            proc = Proc(registry, popen, cfg, request.tag if request.has_field("tag")
                        else None, out, stdin_fd, None)
    except OSError as e:
        if pty is not None:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.close(master)
        if report is not None:
            os.close(report)
        why = e.strerror or str(e)
        if e.filename and e.filename != cmd:
            why += f": '{e.filename}'"
        raise ConnectError(Code.INVALID_ARGUMENT,
                           f"failed to start process '{cmd}': {why}") from None
    if pty is not None:
        os.set_blocking(master, False)
    return proc, report


def _entered_error(fd: int) -> int:
    """The errno exec-as reports for entering the cwd (0: entered; also 0 when it ended
    or timed out without a word: the command's own exit then says what happened).

    It blocks envd's loop while exec-as drops root and changes directory, a few system
    calls (Popen has just blocked the same way until exec-as was executing): waiting in
    the loop instead would let a quick command end before its caller subscribed."""
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        word = os.read(fd, 1) if poller.poll(ENTER_REPORT_S * 1000) else b""
    except OSError:
        word = b""
    finally:
        os.close(fd)
    return word[0] if word else 0
