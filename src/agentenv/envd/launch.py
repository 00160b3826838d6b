"""Starting a command for the process service: as the user, with pipes or a PTY.

The command becomes a ``running.Proc`` in the registry, whose output is then read
in envd's event loop. Through a helper (see spawn) when the user changes, so that
CPython can vfork instead of copying envd.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import subprocess
import termios
from typing import Any

from aenv_envd_protos.process import process_pb as pb
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from .running import Proc, Registry
from .spawn import as_user
from .state import State, User

MAX_PTY_DIM = 4096


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
    """Start ``request``'s command as ``user`` (pipes, or a PTY) and register it."""
    cfg = request.process
    if cfg is None or not cfg.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process config with a cmd is required")
    cmd = cfg.cmd
    if cmd == "/bin/bash" and not os.path.exists(cmd) and os.path.exists("/bin/sh"):
        cmd = "/bin/sh"  # the SDK always asks for bash; minimal rootfses have only sh
    argv = [cmd, *cfg.args]
    env = state.process_env(user, dict(cfg.envs))
    if cwd is None:
        cwd = state.default_cwd(user)
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
            spawn_argv = argv
            if creds:
                via = as_user(argv, user.uid, user.gid, creds["extra_groups"],
                              env.get("PATH", ""))
                if via is not None:
                    spawn_argv, creds = via, {}
            stdin_src = subprocess.PIPE if use_stdin else _null_stdin()
            popen = subprocess.Popen(
                spawn_argv, stdin=stdin_src,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                start_new_session=True, **creds)
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
        why = e.strerror or str(e)
        if e.filename and e.filename != cmd:
            why += f": '{e.filename}'"
        raise ConnectError(Code.INVALID_ARGUMENT,
                           f"failed to start process '{cmd}': {why}") from None
    if pty is not None:
        os.set_blocking(master, False)
    registry.add(proc)
    return proc
