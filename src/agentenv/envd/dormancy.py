"""envd goes dormant when idle: pid 1 becomes a tiny native stub until the next connection.

An idle envd is a Python process of ~22 MiB of host memory in every sandbox
(issue 17). After ``AENV_ENVD_DORMANT_AFTER_S`` seconds (0: never) with no request in
flight, no process in the sandbox but envd's own idle file workers, no durable command
running, no watcher and no open stream, envd writes what a user can observe of it (the
/init state: env vars, default user and workdir, access token; ended durable commands
with their output, up to durable.MAX_CARRIED_BYTES) to a root-only file, and executes
the bundle's ``envd-stub`` (envd_stub.c) in its own place: pid 1 stays pid 1, the
listening socket stays open, gVisor frees the Python process's memory at once. The
first connection that arrives wakes the stub, which executes envd again with the same
socket (``--listen-fd``, ``--woken``): the waiting connection is accepted by envd
itself, which loads the saved state (and deletes the file) first.

Nothing else runs while envd is dormant (that is the condition), so nothing needs
its memory guard meanwhile; the stub still reaps whatever exits (it is init) and
ignores signals (the node's memory-pressure SIGUSR2 would otherwise end the sandbox).
A metrics request does not keep envd awake, and the node answers a dormant sandbox's
metrics from its last sample; the console log says when envd is dormant (the node
reads it: ``runtime.envd_dormant``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("envd")

AFTER_ENV = "AENV_ENVD_DORMANT_AFTER_S"
STATE_DIR = "/run/aenv-envd"
STATE_FILE = STATE_DIR + "/dormant.json"
STUB = "envd-stub"
LOADER = "ld-linux-x86-64.so.2"
MAX_STATE_BYTES = 4 << 20
# A timer this late means envd was stopped meanwhile (frozen, paused, snapshotted).
LATE_S = 1.0
# Requests that do not keep envd awake (the node's ask to sleep among them).
PASSIVE = frozenset({"/metrics", "/aenv/dormancy"})
# Asked to sleep (``Dormancy.ask``): the idle time that then suffices. The ask's own
# connection has closed by then (the node's clients keep idle ones 0.5 s at most,
# and dormancy ends idle keep-alive connections with a FIN anyway).
ASKED_IDLE_S = 0.25
# A connection that has carried no request yet keeps envd awake this long after envd
# first sees it: it was just accepted and its request is on the way (the node's
# clients write it at once). Closed by the exec instead, that request would be lost.
FRESH_S = 2.0
# asyncio's coroutine that hands an accepted connection to the server, and how soon to
# look again while one runs.
ACCEPT_TASK = "_accept_connection2"
ACCEPT_RECHECK_S = 0.05
# What envd and envd-stub say on the console (the host reads them: runtime.envd_dormant).
DORMANT_LINE = "envd dormant"  # the stub's, once it runs (envd_stub.c)
WOKEN_LINE = "envd woken"
START_LINE = "envd start-up"  # /init's env vars are bounded by the node far below this


def after_from_env() -> float:
    raw = os.environ.get(AFTER_ENV, "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        return 0.0
    return value if 0 < value <= 86400 else 0.0


def _bundle() -> Path:
    return Path(sys.prefix).parent  # PYTHONHOME is <bundle>/python


def stub_path() -> str | None:
    """The bundle's stub, when envd runs from a bundle that has one."""
    stub = _bundle() / "bin" / STUB
    return str(stub) if os.access(stub, os.X_OK) else None


def relaunch_argv(host: str, port: int, log_level: str, fd: int) -> list[str] | None:
    """How the stub starts envd again: the bundle's loader and interpreter, as the node
    started it (bundle.envd_command), with the inherited listener's descriptor."""
    bundle = _bundle()
    loader = bundle / "lib" / LOADER
    python = Path(sys.prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if not (loader.is_file() and python.is_file()):
        return None
    return [str(loader), "--library-path", str(bundle / "lib"), str(python), "-S", "-m",
            "agentenv.envd", "--host", host, "--port", str(port), "--log-level", log_level,
            "--listen-fd", str(fd), "--woken"]


# -- the saved state -------------------------------------------------------------------
def _private_dir() -> bool:
    """STATE_DIR exists as root's own directory, mode 0700 (made so if missing)."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(STATE_DIR, mode=0o700)
    st = os.lstat(STATE_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        return False
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(STATE_DIR, 0o700)
    return True


def save(saved: dict[str, Any]) -> bool:
    """Write the state to STATE_FILE (0600, in a 0700 root directory); False if it
    cannot be written safely (then envd stays awake)."""
    try:
        if not _private_dir():
            log.warning("dormancy: %s is not root's own directory; staying awake", STATE_DIR)
            return False
        tmp = STATE_FILE + ".new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(saved, f)
        os.rename(tmp, STATE_FILE)
        return True
    except OSError as e:
        log.warning("dormancy: state not saved (%s); staying awake", e.strerror or e)
        return False


def load() -> dict[str, Any]:
    """The state saved before dormancy, then deleted: it lives only while envd sleeps.
    Empty when there is none, or when the file is not root's own."""
    try:
        fd = os.open(STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        ok = stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o077 \
            and st.st_size <= MAX_STATE_BYTES
        raw = os.read(fd, MAX_STATE_BYTES) if ok else b""
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(STATE_FILE)
    try:
        saved = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return saved if isinstance(saved, dict) else {}


def discard() -> None:
    """A fresh boot: a state file left in the root layer (a filesystem capture taken
    while some sandbox slept) is not this sandbox's."""
    with contextlib.suppress(OSError):
        os.unlink(STATE_FILE)


# -- the watch -------------------------------------------------------------------------
def _pending(fds: list[int]) -> bool:
    """Some descriptor has something to read now (a connection waiting, a request)."""
    if not fds:
        return False
    poll = select.poll()
    for fd in fds:
        poll.register(fd, select.POLLIN)
    with contextlib.suppress(OSError):
        return bool(poll.poll(0))
    return True


def _others(exclude: set[int]) -> bool:
    """Any process in the sandbox but ``exclude`` (envd and its idle file workers)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return True
    return any(n.isdigit() and int(n) not in exclude for n in names)


def _close_gracefully(fds: list[int]) -> None:
    """Idle keep-alive connections end with a FIN, as at a keep-alive timeout: left to
    the exec, gVisor resets them, and a client that reuses one (the node's proxy pools
    them) fails its request instead of opening a new connection."""
    import socket

    for fd in fds:
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_WR)
            finally:
                sock.detach()


def _accepting(loop: asyncio.AbstractEventLoop) -> bool:
    """A connection accepted from the listener but not yet the server's: asyncio sets
    each one up in a task of its own (``_accept_connection2``), a loop iteration or two
    after the accept, and until then it is in neither the backlog nor the server's
    connections. Closed by the exec then, its request would be lost."""
    return any(not task.done() and getattr(task.get_coro(), "__qualname__", "")
               .endswith(ACCEPT_TASK) for task in asyncio.all_tasks(loop))


def _peer(address: Any) -> Any:
    """A peer's address as a set key (ASGI gives a list or tuple, sockets a tuple)."""
    return tuple(address) if isinstance(address, list | tuple) else address


class Dormancy:
    """Counts envd's requests, and once envd has been idle ``after_s`` seconds (see
    the module's doc for what idle means) executes the stub in its place. With
    ``after_s`` 0 envd sleeps only when asked (``ask``): the node asks its idle
    sandboxes' envds when the host needs their memory (orchestrator/envd_sleep.py),
    so a sandbox's next command pays no wake while memory is plentiful."""

    def __init__(self, after_s: float, app: Any, busy: Callable[[int], str | None],
                 own_pids: Callable[[], list[int]], saved: Callable[[], dict[str, Any]],
                 connections: Callable[[], list[tuple[int, Any]]],
                 listener_fd: int, argv: list[str], stub: str,
                 before_exec: Callable[[], None]) -> None:
        self.after_s = after_s
        self.app = app
        self._busy = busy  # why envd must stay awake (its own state), or None
        self._own_pids = own_pids  # envd's idle file workers (ended before the exec)
        self._saved = saved
        # Open client connections: (descriptor, the peer's address), as uvicorn holds them.
        self._connections = connections
        self._served: set[Any] = set()  # peers of connections that carried a request
        self._first_seen: dict[Any, float] = {}  # unserved connections: when first seen
        self._listener = listener_fd
        self._argv = argv
        self._stub = stub
        self._before_exec = before_exec
        self.in_flight = 0
        self._asked = False  # asked to sleep once idle ASKED_IDLE_S (one check)
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._timer: asyncio.TimerHandle | None = None
        if after_s:
            self._arm(self._last + after_s)

    def _idle_s(self) -> float:
        return ASKED_IDLE_S if self._asked else self.after_s

    def busy(self, serving: int = 0) -> str | None:
        """Why envd cannot sleep now (its own state, or processes in the sandbox), not
        counting ``serving`` requests in flight."""
        why = self._busy(serving)
        if why is None and _others({os.getpid(), *self._own_pids()}):
            why = "processes running"
        return why

    def ask(self) -> str | None:
        """Sleep as soon as envd is idle (ASKED_IDLE_S): the node needs the memory.
        Returns why it cannot (then nothing changes), or None: it will, unless a
        request comes first (the ask is then forgotten; the node asks again)."""
        why = self.busy(serving=1)  # (this ask's own request)
        if why is not None:
            return why
        self._asked = True
        self._arm(self._loop.time() + ASKED_IDLE_S, earlier=True)
        return None

    async def __call__(self, scope, receive, send) -> None:
        """The ASGI app, counted: a request in flight keeps envd awake, and its end
        starts the idle delay again, but for a metrics sample's (a dashboard polling
        them must not keep envd up; the node answers them itself while envd sleeps)."""
        self.in_flight += 1
        self._served.add(_peer(scope.get("client")))
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if scope.get("path") not in PASSIVE:
                self._last = self._loop.time()
                self._asked = False  # a request came: the ask is forgotten
            if self._idle_s():
                self._arm(self._last + self._idle_s())

    def _arm(self, when: float, earlier: bool = False) -> None:
        """Check at ``when``: later than the check armed already (a request pushed
        the delay on), or, ``earlier``, sooner (an ask)."""
        if self._timer is None or self._timer.when() < when or \
                (earlier and self._timer.when() > when):
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        late = self._loop.time() - self._timer.when() if self._timer else 0.0
        self._timer = None
        now = self._loop.time()
        if late > LATE_S:
            # The sandbox was frozen, paused or restored from a snapshot meanwhile:
            # whoever thawed it is about to ask something (a restore's /init).
            self._last = now
        idle_s = self._idle_s()
        if not idle_s:  # no timer, no ask
            return
        if self.in_flight or now - self._last < idle_s:
            self._arm(self._last + idle_s)
            return
        why = self.busy()
        conns = self._connections()
        if why is None and _pending([self._listener, *(fd for fd, _ in conns)]):
            why = "a request is arriving"
        fresh_until = self._fresh_until([peer for _, peer in conns], now)
        if why is None and _accepting(self._loop):
            fresh_until = max(fresh_until, now + ACCEPT_RECHECK_S)
        if why is None and fresh_until > now:
            self._arm(fresh_until)
            return
        if why is not None:
            log.debug("dormancy: staying awake: %s", why)
            self._asked = False  # the node asks again if it still needs the memory
            if self.after_s:
                self._arm(now + self.after_s)  # look again later, at no cost meanwhile
            return
        self._sleep()

    def _fresh_until(self, peers: list[Any], now: float) -> float:
        """Until when the connections that carried no request yet keep envd awake
        (``now`` or earlier: none does). Forgets the peers of closed connections."""
        open_peers = set(peers)
        self._served &= open_peers
        self._first_seen = {p: t for p, t in self._first_seen.items() if p in open_peers}
        until = now
        for peer in open_peers - self._served:
            until = max(until, self._first_seen.setdefault(peer, now) + FRESH_S)
        return until

    def _sleep(self) -> None:
        saved = self._saved()
        saved["dormant_at"] = time.time()
        if not save(saved):
            self._asked = False
            if self.after_s:
                self._arm(self._loop.time() + self.after_s)
            return
        self._before_exec()
        _close_gracefully([fd for fd, _ in self._connections()])
        why = "asked by the node" if self._asked else f"idle {self.after_s:g} s"
        print(f"envd {why}: executing {STUB}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            logging.shutdown()
        os.set_inheritable(self._listener, True)
        try:
            os.execve(self._stub, [self._stub, str(self._listener), *self._argv],
                      dict(os.environ))
        except OSError as e:  # envd carries on awake
            os.set_inheritable(self._listener, False)
            discard()
            log.warning("dormancy: cannot execute %s: %s", self._stub, e)
