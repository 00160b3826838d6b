"""The floor of a restore: bare `runsc restore`s of a capture of a node's own sandbox,
with the node's runsc flags and that sandbox's OCI spec (rootfs, mounts, cgroup limits),
each into a network slot built as the node builds them (beforehand, as a warm pool
holds them), each timed until it returned and until it answered `/bin/true` straight
to envd at its slot address (no node in the path). The capture is taken as the node
takes a fork's: `runsc checkpoint --leave-running --compression=none`.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.network.slot import SlotLayout, create_slot, destroy_slot, reset_slot
from agentenv.runtime.gvisor import RUNSC, remove_cgroup
from agentenv.runtime.reaping import reap_runsc_orphans
from agentenv.testing import Node
from bench_node import run_native

PR_SET_CHILD_SUBREAPER = 36
ENVD_PORT = 49983
MASK = 'mount -t tmpfs none /proc/sys/net && exec "$0" "$@"'  # as gvisor.py starts runsc


def answered(http: httpx.Client, sid: str, token: str, t0: float,
             deadline_s: float = 60) -> float:
    """Seconds from ``t0`` until `/bin/true` ran, straight to envd (``http``'s base)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            if run_native(http, sid, token, ["/bin/true"])[0] == 0:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"{http.base_url}: no answer in {deadline_s}s")
        time.sleep(0.005)


class Floor:
    """Bare restores of one capture of a node's sandbox, with the node's flags."""

    def __init__(self, work: Path, node: Node, sid: str, token: str, net: int,
                 most: int) -> None:
        self.work, self.node, self.sid, self.token = work, node, sid, token
        self.state = work / "state"
        self.state.mkdir(parents=True)
        self.cgroup = f"{node.prefix}fl"
        self.layout = SlotLayout(f"{node.prefix}f", f"10.{net}.0.0/16")
        self.slots = [self.layout.slot(i + 1) for i in range(most)]
        self.spec = json.loads((node.home / "run" / "sandboxes" / sid / "config.json")
                               .read_text())
        self.image = work / "image"
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.stop = threading.Event()
        self.reaper = threading.Thread(target=self._reap, daemon=True)

    def flags(self, root: Path) -> list[str]:
        return [RUNSC, f"--root={root}", "--platform=systrap", "--network=sandbox",
                "--overlay2=root:memory", "--net-disconnect-ok"]

    def __enter__(self) -> Floor:
        self.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.reaper.start()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda s: create_slot(s, self.layout.pool_cidr), self.slots))
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete_all()
        for s in self.slots:
            destroy_slot(s)
        self.stop.set()
        self.reaper.join()
        reap_runsc_orphans()
        self.libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        remove_cgroup(f"/{self.cgroup}")

    def _reap(self) -> None:
        while not self.stop.is_set():
            reap_runsc_orphans()
            time.sleep(0.002)

    def capture(self) -> float:
        """The node's sandbox checkpointed as a fork captures it; the seconds it took."""
        shutil.rmtree(self.image, ignore_errors=True)
        t0 = time.perf_counter()
        subprocess.run([*self.flags(self.node.home / "run" / "runsc"), "checkpoint",
                        f"--image-path={self.image}", "--compression=none", "--leave-running",
                        self.sid], check=True, capture_output=True, timeout=120)
        return time.perf_counter() - t0

    def drop_cache(self) -> None:
        for f in self.image.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def _bundle(self, cid: str, netns_path: str) -> Path:
        bundle = self.work / "bundles" / cid
        bundle.mkdir(parents=True)
        spec = json.loads(json.dumps(self.spec))
        for ns in spec["linux"]["namespaces"]:
            if ns["type"] == "network":
                ns["path"] = netns_path
        spec["linux"]["cgroupsPath"] = f"/{self.cgroup}/{cid}"
        (bundle / "config.json").write_text(json.dumps(spec))
        return bundle

    def fan_out(self, count: int) -> tuple[float, list[float]]:
        """``count`` restores at once: (seconds until all returned, each one's seconds
        until it answered a command), from the start."""
        tag = uuid.uuid4().hex[:6]
        # Clients made beforehand: one costs ~35 ms of CPU (its TLS context).
        clients = [httpx.Client(base_url=f"http://{s.address}:{ENVD_PORT}", timeout=10)
                   for s in self.slots[:count]]
        jobs = [(f"fl-{tag}-{i}", self._bundle(f"fl-{tag}-{i}", s.netns_path), clients[i])
                for i, s in enumerate(self.slots[:count])]
        returned: list[float] = []
        t0 = time.perf_counter()

        def one(job: tuple[str, Path, httpx.Client]) -> float:
            cid, bundle, http = job
            with open(bundle / "console.log", "ab") as out:
                subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                                "/bin/sh", "-c", MASK, *self.flags(self.state),
                                f"--log={bundle / 'runsc.log'}", "restore", "--detach",
                                f"--image-path={self.image}", f"--bundle={bundle}", cid],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out, check=True,
                               timeout=120)
            returned.append(time.perf_counter() - t0)
            return answered(http, self.sid, self.token, t0)

        try:
            with ThreadPoolExecutor(count) as pool:
                each = list(pool.map(one, jobs))
        finally:
            for c in clients:
                c.close()
        self.delete_all()
        for s in self.slots[:count]:  # gVisor took eth0's address: a fresh sandbox side
            reset_slot(s, internet=True)
        return max(returned), each

    def delete_all(self) -> None:
        base = self.flags(self.state)
        out = subprocess.run([*base, "list", "-quiet"], capture_output=True, text=True).stdout
        for cid in out.split():
            subprocess.run([*base, "kill", cid, "KILL"], capture_output=True)
            subprocess.run([*base, "delete", "--force", cid], capture_output=True)
            remove_cgroup(f"/{self.cgroup}/{cid}")
        shutil.rmtree(self.work / "bundles", ignore_errors=True)
