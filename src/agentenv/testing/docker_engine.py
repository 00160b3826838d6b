"""A Docker engine (Debian's docker.io) of a test's own, in a network namespace of its own.

dockerd writes the iptables of the network namespace it runs in: its FORWARD policy
DROP, its NAT, its bridges. Run in the root netns, that broke the sandboxes and the
cluster tests of everything else on the machine. Here it runs in ``netns``, joined to
the root netns by one veth (host side ``link`` 10.<net>.0.1/30, engine side .2), so its
rules, bridges and published ports live and die with that namespace, and Compose
files run as written (bridge networks, service names, published ports at .2).
Everything else of it is under ``root``: data, exec state, socket, pidfile, logs.
``stop`` leaves nothing: containers, dockerd and its containerd, mounts, the netns.
"""

from __future__ import annotations

import contextlib
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

    def start(self, wait: float = 60) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
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
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.decode().split()
                if ids:
                    self.docker("rm", "-f", *ids, check=False, timeout=60)
            children = _children(self.proc.pid)  # nsenter's dockerd, its containerd
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
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

    def _remove_netns(self) -> None:
        _ip("link", "del", self.link, check=False)
        _ip("netns", "del", self.netns, check=False)


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
