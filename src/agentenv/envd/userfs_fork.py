"""Starting file workers: a worker forked from envd, and its drop to its user's credentials.

A worker is a copy-on-write fork of envd: under gVisor it costs the pages either
side writes while it lives (a few MB; it exits when idle, see userfs), where the
start-up *zygote* this replaced held ~12 MB of every sandbox's memory for good
(issue 17). The new worker, before touching anything, closes every inherited
descriptor but its socket and drops to the user's groups, gid and uid
(``setgroups``/``setresgid``/``setresuid``), makes itself not dumpable (no process
of the user's may read envd's memory in it), then serves requests (userfs_ops)
until envd closes its socket.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import signal
import socket
import sys

from .userfs_protocol import MAX_FRAME

_LIBC = None


def load_libc():
    """libc through ctypes, loaded once in envd: a worker inherits it, so it never
    dlopens after the fork (a lock another envd thread held then would stay held)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _child_main(sock: socket.socket, uid: int, gid: int, groups: list[int]) -> None:
    """The forked worker: never returns (os._exit), never touches envd's loop."""
    code = 0
    try:
        # No cyclic GC here: a collected leftover of envd's (a socket object) would
        # close a descriptor number this worker may by then use for something else.
        gc.disable()
        keep = sock.fileno()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                    signal.SIGUSR1, signal.SIGQUIT):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        # Every descriptor of envd's (listener, client connections, pipes of
        # commands) closes here: holding one would keep a connection open.
        _close_all_but(keep)
        # Everything to import, before the user may no longer read envd's files
        # (both normally loaded in envd already: prepare_forks).
        libc = load_libc()
        from .userfs_ops import WorkerServer
        # Not dumpable before the drop as well as after it: at no moment may a process
        # of the user's attach to it while it holds a copy of envd's memory.
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
        if os.geteuid() == 0:
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        elif os.geteuid() != uid:
            raise PermissionError(errno.EPERM, "envd is not root")
        # Not dumpable, after the credentials change (which may reset it): no process
        # of the user's may ptrace it or read its memory (a copy of envd's).
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
        os.chdir("/")
        WorkerServer(sock, libc).serve()
    except BaseException as e:  # the child must never unwind into envd
        with contextlib.suppress(Exception):
            print(f"envd file worker (uid {uid}) failed: {e!r}", file=sys.stderr, flush=True)
        code = 1
    finally:
        os._exit(code)


def _close_all_but(*keep: int) -> None:
    try:
        open_fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        open_fds = list(range(3, 1024))
    for fd in open_fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _tune(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_FRAME)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 * MAX_FRAME)


def prepare_forks() -> None:
    """Get envd ready to fork workers cheaply: the workers' code and libc loaded here
    once (so a worker loads nothing after the fork), then every object envd holds so
    far moved out of the cyclic GC's reach (``gc.freeze``): its collections would
    write to every one of them, and under copy-on-write each page written in envd
    while a worker lives is a page copied."""
    from . import userfs_ops  # noqa: F401

    load_libc()
    gc.collect()
    gc.freeze()


def fork_worker(key: tuple[int, int, tuple[int, ...]]) -> tuple[socket.socket, int, int]:
    """A new worker for these credentials: (its socket, its pid, the pid of its parent).

    A copy of envd itself: copy-on-write, it costs only the pages either side writes
    while it lives (see prepare_forks).
    """
    uid, gid, groups = key
    load_libc()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    _tune(parent)
    _tune(child)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child_main(child, uid, gid, list(groups))
    child.close()
    return parent, pid, os.getpid()
