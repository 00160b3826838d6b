"""A Docker engine (Debian's docker.io) of a test's own, in a network namespace of its own.

dockerd writes the iptables of the network namespace it runs in: its FORWARD policy
DROP, its NAT, its bridges. Run in the root netns, that broke the sandboxes and the
cluster tests of everything else on the machine. Here it runs in ``netns``, joined to
the root netns by one veth (host side ``link`` 10.<net>.0.1/30, engine side .2), so its
rules, bridges and published ports live and die with that namespace, and Compose
files run as written (bridge networks, service names, published ports at .2).
Everything else of it is under ``root``: data, exec state, socket, pidfile, logs.
``stop`` leaves nothing: containers, dockerd and its containerd, mounts, the netns.
An engine whose owner died first (a test run killed mid-file) is stopped the same way
by the next run's ``reap_abandoned``: ``owner.json`` under its root names the owner
process (pid and start time) and the engine's netns and link.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path


class DockerEngine:
    def __init__(self, root: Path, netns: str, link: str, net: int) -> None:
        self.root = root
        self.netns = netns
        self.link = link
        self.host_address = f"10.{net}.0.1"
        self.address = f"10.{net}.0.2"
        self.socket = root / "docker.sock"
        self.log = root / "dockerd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}

    def docker(self, *args: str, input: bytes | None = None, check: bool = True,
               timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run(["docker", *args], env=self.env, input=input, capture_output=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args[:2])}: {r.stderr.decode()[-2000:]}")
        return r

    @classmethod
    def reap_abandoned(cls, parent: Path, pattern: str) -> list[str]:
        """Stop every engine under ``parent``/``pattern`` whose owner process is gone;
        returns the roots stopped."""
        reaped = []
        for owner_file in sorted(parent.glob(f"{pattern}/{OWNER_FILE}")):
            try:
                owner = json.loads(owner_file.read_text())
                pid, started = int(owner["pid"]), int(owner["start"])
                engine = cls(owner_file.parent, str(owner["netns"]), str(owner["link"]), 0)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if _start_time(pid) == started:
                continue  # its owner still runs (another test run on this machine)
            engine.stop()
            reaped.append(str(engine.root))
        return reaped

    def start(self, wait: float = 60) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        me = os.getpid()
        (self.root / OWNER_FILE).write_text(json.dumps(
            {"pid": me, "start": _start_time(me), "netns": self.netns, "link": self.link}))
        self._remove_netns()  # a crashed run's, ours by name
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _ip("addr", "add", f"{self.host_address}/30", "dev", self.link)
        _ip("link", "set", self.link, "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        _ip("-n", self.netns, "addr", "add", f"{self.address}/30", "dev", "eth0")
        _ip("-n", self.netns, "link", "set", "eth0", "up")
        (self.root / "daemon.json").write_text("{}\n")  # not the machine's /etc/docker
        log = open(self.log, "ab")
        # Only the network namespace changes (nsenter, not `ip netns exec`, which would
        # remount /sys and hide the cgroups dockerd needs).
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{self.netns}", "dockerd",
             "--config-file", str(self.root / "daemon.json"),
             "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
             "--pidfile", str(self.root / "dockerd.pid"), "-H", f"unix://{self.socket}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + wait
        while self.docker("version", check=False, timeout=10).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> list[str]:
        """Stops everything; returns what could not be removed (empty: all gone)."""
        left: list[str] = []
        daemon = self._daemon()
        if daemon is not None:
            with contextlib.suppress(Exception):
                ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.decode().split()
                if ids:
                    self.docker("rm", "-f", *ids, check=False, timeout=60)
            children = _children(daemon)  # dockerd's containerd
            # (dockerd leads a session of its own: nsenter execs it)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon, signal.SIGTERM)
            if not self._gone(daemon, 30):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon, signal.SIGKILL)
                self._gone(daemon, 10)
            for pid in children:  # containerd runs in a session of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for mount in _mounts_under(self.root):
            if subprocess.run(["umount", "-l", mount], capture_output=True).returncode != 0:
                left.append(f"mount {mount}")
        self._remove_netns()
        if subprocess.run(["rm", "-rf", str(self.root)], capture_output=True).returncode != 0:
            left.append(f"dir {self.root}")
        return left

    def _daemon(self) -> int | None:
        """dockerd's pid while it runs: ours, or from the pidfile of an abandoned one
        (checked against its command line, so a reused pid is never signalled)."""
        if self.proc is not None:
            return self.proc.pid if self.proc.poll() is None else None
        try:
            pid = int((self.root / "dockerd.pid").read_text())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        return pid if b"dockerd" in argv[0] and str(self.root).encode() in b" ".join(argv) \
            else None

    def _gone(self, pid: int, within: float) -> bool:
        if self.proc is not None:
            try:
                self.proc.wait(within)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + within
        while _state(pid) not in (None, "Z"):  # (not our child: init reaps it)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _remove_netns(self) -> None:
        _ip("link", "del", self.link, check=False)
        _ip("netns", "del", self.netns, check=False)


OWNER_FILE = "owner.json"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _state(pid: int) -> str | None:
    """The process's state letter (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _mounts_under(root: Path) -> list[str]:
    """Mount points below ``root``, deepest first."""
    prefix = str(root) + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix):
            points.append(point)
    return sorted(points, key=len, reverse=True)
