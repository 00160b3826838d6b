"""Starting file workers: the zygote, and a worker's drop to its user's credentials.

Workers are forked by a *zygote*, a small process envd forks at start-up before
its heavy imports (a copy of the full envd would cost twice the memory). Without
a (working) zygote a worker is forked from envd itself. Either way the new
worker, before touching anything, closes every inherited descriptor but its
socket and drops to the user's groups, gid and uid (``setgroups``/``setresgid``/
``setresuid``), then serves requests (userfs_ops) until envd closes its socket.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import signal
import socket
import sys

from .userfs_protocol import MAX_FRAME

log = logging.getLogger("agentenv.envd")


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)



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
        # (userfs_ops: already there in a zygote's worker).
        libc = _libc()
        from .userfs_ops import WorkerServer
        if os.geteuid() == 0:
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        elif os.geteuid() != uid:
            raise PermissionError(errno.EPERM, "envd is not root")
        with contextlib.suppress(Exception):  # not ptrace-able by the user's processes
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


def _zygote_main(sock: socket.socket) -> None:
    """The zygote: forks workers on envd's request and hands envd their sockets.

    It is forked from envd at start-up, before the heavy imports (protobuf,
    connectrpc, uvicorn), so every worker is a copy of a small process, not of
    envd's whole heap. Never returns.
    """
    code = 0
    try:
        gc.disable()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                    signal.SIGQUIT):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
        _close_all_but(sock.fileno())
        _libc()  # loaded here once, inherited by every worker
        while True:
            try:
                data = sock.recv(1024)
            except InterruptedError:
                continue
            if not data:
                return  # envd is gone
            try:
                req = json.loads(data)
                # The workers' code, imported here once (inherited by each worker),
                # when envd is up and says so, or at the first worker: never in
                # envd, nor beside envd's own start-up imports (CPU they share).
                if req.get("warm"):
                    with contextlib.suppress(Exception):
                        from . import userfs_ops
                    continue  # no reply
                from . import userfs_ops  # noqa: F401
                uid, gid = int(req["uid"]), int(req["gid"])
                groups = [int(g) for g in req["groups"]]
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                _tune(mine)
                _tune(theirs)
                pid = os.fork()
                if pid == 0:
                    _child_main(mine, uid, gid, groups)
                mine.close()
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [theirs.fileno()])
                theirs.close()
            except Exception as e:
                sock.send(json.dumps({"err": repr(e)}).encode())
    except BaseException as e:  # the zygote must never unwind into envd
        with contextlib.suppress(Exception):
            print(f"envd file worker zygote failed: {e!r}", file=sys.stderr, flush=True)
        code = 1
    finally:
        os._exit(code)


def _tune(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_FRAME)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 * MAX_FRAME)


_zygote: socket.socket | None = None
_zygote_pid = 0


def start_zygote() -> None:
    """Fork the zygote (call early in envd's start-up, as root, from the main thread)."""
    global _zygote, _zygote_pid
    if _zygote is not None:
        return
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the zygote
        _zygote_main(child)
    child.close()
    parent.settimeout(10)
    _zygote, _zygote_pid = parent, pid


def warm_zygote() -> None:
    """Have the zygote import the workers' code now (envd has started: it is idle)."""
    if _zygote is not None:
        with contextlib.suppress(OSError):
            _zygote.send(b'{"warm": true}')


def _from_zygote(key: tuple) -> tuple[socket.socket, int] | None:
    """A new worker's socket and pid from the zygote; None without a (working) one."""
    global _zygote
    if _zygote is None:
        return None
    uid, gid, groups = key
    try:
        _zygote.send(json.dumps({"uid": uid, "gid": gid, "groups": list(groups)}).encode())
        data, fds, _flags, _ = socket.recv_fds(_zygote, 1024, 1)
        reply = json.loads(data) if data else {"err": "the zygote ended"}
        if "pid" not in reply or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(errno.EIO, str(reply.get("err")))
    except (OSError, ValueError) as e:
        log.warning("file worker zygote unusable (%r): forking workers from envd", e)
        with contextlib.suppress(OSError):
            _zygote.close()
        _zygote = None
        return None
    os.set_inheritable(fds[0], False)
    return socket.socket(fileno=fds[0]), int(reply["pid"])


def fork_worker(key: tuple[int, int, tuple[int, ...]]) -> tuple[socket.socket, int, int]:
    """A new worker for these credentials: (its socket, its pid, the pid of its parent).

    From the zygote if there is a working one, else a copy of envd itself.
    """
    uid, gid, groups = key
    made = _from_zygote(key)
    if made is not None:
        sock, pid = made
        return sock, pid, _zygote_pid
    # no zygote (envd not started by __main__): a copy of envd itself
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    _tune(parent)
    _tune(child)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        _child_main(child, uid, gid, list(groups))
    child.close()
    return parent, pid, os.getpid()
