"""Ports for the servers tests start: handed over as listening sockets, never as numbers.

Picking a "free" port (bind port 0, read the number, close the socket) and having a
server bind that number later races every other process on the machine, the other
pytest worker first: between the close and the server's bind the port can be taken
(a server of the other worker, or any outgoing connection's ephemeral port), and the
server dies with EADDRINUSE, or worse, the test talks to somebody else's server. So:

- a server that can take an inherited socket gets one bound and listening here
  (``listening_socket``; the child inherits it through ``pass_fds``); the port is
  never free between the choice and the serving;
- a server that binds for itself is told port 0 and its port is read back from the
  kernel once it listens (``listening_port``);
- an in-process server binds ``("127.0.0.1", 0)`` itself and reports its address.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a port the kernel picks) and
    listening, inheritable, to pass to a server's process (``pass_fds``). The caller
    closes its copy once the server has started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on the connections it accepts
    # only for sockets that say so.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # A server started again on its port binds it through the old one's TIME_WAITs.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def _listening_inodes() -> dict[int, int]:
    """Socket inode -> port, of every TCP socket listening on this host's netns."""
    found: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A":  # TCP_LISTEN
                found[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return found


def listening_port(proc: subprocess.Popen, wait: float = 30) -> int:
    """The TCP port that ``proc`` (told to listen on port 0) listens on, once it does."""
    end = time.monotonic() + wait
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"pid {proc.pid} exited with {proc.returncode} before listening")
        inodes = set()
        fds = f"/proc/{proc.pid}/fd"
        try:
            for fd in os.listdir(fds):
                try:
                    target = os.readlink(f"{fds}/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:
            pass
        ports = {port for inode, port in _listening_inodes().items() if inode in inodes}
        if ports:
            return min(ports)
        if time.monotonic() > end:
            raise RuntimeError(f"pid {proc.pid} did not listen within {wait:.0f} s")
        time.sleep(0.05)


def free_port() -> int:
    """A port number nobody listened on a moment ago. Racy by nature (see the module's
    doc): only for an address that must not answer (a port nothing serves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(argv: Callable[[int], list[str]], log: Path, tries: int = 5,
                wait: float = 10) -> tuple[subprocess.Popen, int]:
    """redis-server on a free port. It binds for itself and has no port 0 over TCP
    (0 turns TCP off): it is started on a number found free, and when something took
    that number first it exits (EADDRINUSE) and another is tried. Ready once it,
    by its pid, answers on the port (not another redis-server that holds the number).
    ``argv(port)``: its command line for a port."""
    for _ in range(tries):
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv(port), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=out, start_new_session=True)
        end = time.monotonic() + wait
        while proc.poll() is None:
            info = subprocess.run(["redis-cli", "-p", str(port), "info", "server"],
                                  capture_output=True, text=True).stdout
            if f"process_id:{proc.pid}" in info.replace("\r", "").splitlines():
                return proc, port
            if time.monotonic() > end:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"redis-server did not answer on {port}: see {log}")
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not start in {tries} tries: see {log}")
