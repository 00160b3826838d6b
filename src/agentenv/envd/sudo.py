"""``sudo`` under gVisor: envd runs the real sudo as root for the users sudoers lets.

gVisor ignores set-user-ID bits (every process has no_new_privs set, and an exec
resets the effective uid to the real one), so the setuid-root ``sudo`` binary cannot
become root by itself. The base template diverts it to ``/usr/bin/sudo.real`` and
puts the bundle's client (``sudo_client``) at ``/usr/bin/sudo``; the client passes
its argv, environment, working directory and stdio (a PTY's included) over a unix
socket to this broker. The kernel names the caller: SCM_CREDENTIALS, which it fills
in and refuses to let a sender forge (gVisor's SO_PEERCRED names the listener, not
the peer, so it is not used). Root may always;
another user only when sudoers grants them everything, passwordless (``sudo -l -U``
as root says so), as it grants `user`: then this user could become root anyway, and
the real sudo, run as root, does the rest (options, env_reset, target user). Signals
the client gets are passed on; its exit is the command's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import re
import select
import signal
import socket
import struct
import subprocess
import threading
from collections.abc import Callable

log = logging.getLogger("envd")

ADDRESS = "\0aenv-sudo"  # abstract: nothing in the sandbox's files to remove or replace
REAL_SUDO = "/usr/bin/sudo.real"
MAX_REQUEST = 256 * 1024
MAX_CLIENTS = 64
FORWARDED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH}
_GRANT_ALL = re.compile(r"^\s*\(ALL(\s*:\s*ALL)?\)\s+NOPASSWD:\s*ALL\s*$")


class Children:
    """Where the reaper (envd is init: it waits for every child) hands the broker the
    status of the sudo processes it started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held over fork + registration, and over reaping
        self.waiting: dict[int, Callable[[int], None]] = {}

    def exited(self, pid: int, status: int) -> bool:
        done = self.waiting.pop(pid, None)
        if done is None:
            return False
        done(status)
        return True


def may_sudo(uid: int) -> bool:
    if uid == 0:
        return True
    try:
        name = pwd.getpwuid(uid).pw_name
        out = subprocess.run([REAL_SUDO, "-n", "-l", "-U", name], capture_output=True,
                             text=True, timeout=20, stdin=subprocess.DEVNULL).stdout
    except (KeyError, OSError, subprocess.SubprocessError):
        return False
    return any(_GRANT_ALL.match(line) for line in out.splitlines())


_FDS_SPACE = socket.CMSG_SPACE(3 * 4)
_CREDS_SPACE = socket.CMSG_SPACE(struct.calcsize("3i"))


def _request(conn: socket.socket
             ) -> tuple[int, list[str], dict[str, str], str, list[int]]:
    """The caller's uid (from the kernel), argv, env, cwd and stdio."""
    data, ancillary, _flags, _addr = conn.recvmsg(MAX_REQUEST, _FDS_SPACE + _CREDS_SPACE)
    fds: list[int] = []
    uid = None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4]))
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            uid = struct.unpack("3i", payload[:12])[1]
    try:
        if uid is None:
            raise ValueError("no credentials")
        req = json.loads(data)
        argv, env, cwd = req["argv"], req["env"], req["cwd"]
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)
                and isinstance(env, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
                and isinstance(cwd, str) and len(fds) == 3):
            raise ValueError("malformed")
    except (ValueError, KeyError, TypeError):
        for fd in fds:
            os.close(fd)
        raise ValueError("malformed request") from None
    return uid, argv, env, cwd, fds


def _serve(conn: socket.socket, children: Children, slots: threading.Semaphore) -> None:
    fds: list[int] = []
    try:
        # Credentials ride on what is sent after this: the client waits for "R".
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        conn.send(b"R")
        uid, argv, env, cwd, fds = _request(conn)
        if not os.path.exists(REAL_SUDO):
            conn.send(b"X sudo is not available in this sandbox")
            return
        if not may_sudo(uid):
            conn.send(b"X this user may not run sudo here: under gVisor only users "
                      b"sudoers grants ALL, NOPASSWD, are served")
            return
        _run(conn, children, argv, env, cwd, fds)
    except (OSError, ValueError) as e:
        with contextlib.suppress(OSError):
            conn.send(f"X {e}".encode())
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.close()
        slots.release()


def _run(conn: socket.socket, children: Children, argv: list[str], env: dict[str, str],
         cwd: str, fds: list[int]) -> None:
    done_r, done_w = os.pipe()
    try:
        def exited(status: int) -> None:
            os.write(done_w, struct.pack("i", status))

        with children.lock:
            proc = subprocess.Popen([REAL_SUDO, *argv], stdin=fds[0], stdout=fds[1],
                                    stderr=fds[2], env=env, cwd=cwd or "/",
                                    start_new_session=True)
            children.waiting[proc.pid] = exited
        for fd in fds:
            os.close(fd)
        fds.clear()
        status = _relay(conn, proc.pid, done_r)
        proc.returncode = status  # reaped already: Popen must not wait for the pid
        code = os.waitstatus_to_exitcode(status)
        conn.send(f"E {code}".encode())
    finally:
        os.close(done_r)
        os.close(done_w)


def _relay(conn: socket.socket, pid: int, done_r: int) -> int:
    """Signals from the client go to sudo (it passes them to its command) until it ends;
    a client gone (killed) takes the command's whole session with it."""
    poll = select.poll()
    poll.register(conn.fileno(), select.POLLIN)
    poll.register(done_r, select.POLLIN)
    client = True
    while True:
        for fd, _ev in poll.poll():
            if fd == done_r:
                return struct.unpack("i", os.read(done_r, 4))[0]
            msg = conn.recv(64) if client else b""
            if msg.startswith(b"S "):
                with contextlib.suppress(ValueError, ProcessLookupError):
                    sig = int(msg[2:])
                    if sig in FORWARDED:
                        os.kill(pid, sig)
            elif not msg:
                client = False
                poll.unregister(conn.fileno())
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def start(children: Children) -> None:
    """Listen (envd as root only) and serve each client in a thread of its own."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(ADDRESS)
    except OSError as e:
        log.warning("sudo broker not started: %s", e)
        sock.close()
        return
    sock.listen(64)
    slots = threading.Semaphore(MAX_CLIENTS)

    def accept_loop() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            if not slots.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.send(b"X too many sudo commands at once")
                conn.close()
                continue
            threading.Thread(target=_serve, args=(conn, children, slots), daemon=True,
                             name="sudo").start()

    threading.Thread(target=accept_loop, daemon=True, name="sudo-accept").start()
