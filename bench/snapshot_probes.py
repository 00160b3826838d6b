"""Probes the benchmarks share: a node's log, commands in sandboxes, timing the steps of
one operation, the bare-runsc floor of a checkpoint and restore, and the floor of a
restore of a node's own capture with its flags, spec and slots (Floor)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
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
from agentenv.testing import SHARED_HOME, Node
from agentenv.testing.checkpoints import bare_sandbox
from bench_node import exec_native, run_native
from common import summary

ROOTFS = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
MiB = 1 << 20
PR_SET_CHILD_SUBREAPER = 36
TTL = 1800


class Failures(list):
    def add(self, what: str) -> None:
        print(f"  ! {what}", flush=True)
        self.append(what)


# -- a node's log ---------------------------------------------------------------------------

class NodeLog:
    def __init__(self, node: Node):
        self.path = node.log_path

    def text(self) -> str:
        try:
            return self.path.read_text(errors="replace")
        except OSError:
            return ""

    def offset(self) -> int:
        return len(self.text())

    def since(self, offset: int) -> str:
        return self.text()[offset:]

    def wait_for(self, pattern: str, offset: int, timeout: float) -> re.Match | None:
        end = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.since(offset))
            if m or time.monotonic() > end:
                return m
            time.sleep(0.05)


# -- talking to sandboxes ----------------------------------------------------------------------

def run_in(node: Node, sid: str, token: str, argv: list[str], timeout: float = 60) -> int:
    with httpx.Client(base_url=node.url, timeout=timeout) as http:
        return exec_native(http, sid, token, argv)


def until_command(node: Node, sid: str, token: str, t0: float, deadline_s: float = 60,
                  http: httpx.Client | None = None) -> float:
    """Seconds from ``t0`` until `true` ran inside the sandbox (retries until it does);
    ``http``: a client to share (one per call spends ~35 ms of CPU on its TLS context)."""
    end = time.monotonic() + deadline_s
    with contextlib.ExitStack() as stack:
        if http is None:
            http = stack.enter_context(httpx.Client(base_url=node.url, timeout=30))
        while True:
            try:
                if exec_native(http, sid, token, ["/bin/true"]) == 0:
                    return time.perf_counter() - t0
            except (httpx.HTTPError, RuntimeError):
                if time.monotonic() > end:
                    raise
            if time.monotonic() > end:
                raise TimeoutError(f"{sid}: no command ran within {deadline_s}s")
            time.sleep(0.01)


class Tracker:
    """Sandboxes and snapshots a node holds for us; all removed in ``cleanup``."""

    def __init__(self, node: Node, api: httpx.Client):
        self.node, self.api = node, api
        self.sandboxes: set[str] = set()
        self.snapshots: set[str] = set()

    def create(self, template: str) -> tuple[float, dict]:
        t0 = time.perf_counter()
        r = self.api.post("/sandboxes", json={"templateID": template, "timeout": TTL})
        dt = time.perf_counter() - t0
        if r.status_code != 201:
            raise RuntimeError(f"create from {template}: {r.status_code} {r.text[:300]}")
        self.sandboxes.add(r.json()["sandboxID"])
        return dt, r.json()

    def delete(self, sid: str) -> None:
        r = self.api.delete(f"/sandboxes/{sid}")
        if r.status_code not in (204, 404):
            raise RuntimeError(f"delete {sid}: {r.status_code} {r.text[:200]}")
        self.sandboxes.discard(sid)

    def delete_many(self, ids: list[str]) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(self.delete, ids))

    def snapshot(self, sid: str, name: str | None = None) -> tuple[float, dict]:
        t0 = time.perf_counter()
        r = self.api.post(f"/sandboxes/{sid}/snapshots", json={"name": name} if name else {},
                          timeout=600)
        dt = time.perf_counter() - t0
        if r.status_code != 201:
            raise RuntimeError(f"snapshot of {sid}: {r.status_code} {r.text[:300]}")
        self.snapshots.add(r.json()["snapshotID"])
        return dt, r.json()

    def cleanup(self, failures: Failures) -> None:
        for sid in list(self.sandboxes):
            try:
                self.delete(sid)
            except Exception as exc:
                failures.add(f"cleanup: {exc}")
        for snap in list(self.snapshots):
            try:
                r = self.api.delete(f"/snapshots/{snap}")
                if r.status_code not in (204, 404):
                    failures.add(f"cleanup: delete snapshot {snap}: {r.status_code}")
            except httpx.HTTPError as exc:
                failures.add(f"cleanup: delete snapshot {snap}: {exc}")
            self.snapshots.discard(snap)


def created_ms(log: NodeLog, sid: str) -> float | None:
    m = re.search(rf"created {sid} in (\d+) ms", log.text())
    return float(m.group(1)) if m else None


# -- bare runsc baseline ----------------------------------------------------------------

def bare_runsc(work: Path, n: int, rows: dict, raw: dict) -> None:
    """runsc checkpoint/restore of `sleep infinity` (overlay root in memory, no network)."""
    base, bundle = bare_sandbox(work, ROOTFS, ["sleep", "infinity"])
    err_log = work / "runsc.err"

    def run(*args: str) -> float:
        t0 = time.perf_counter()
        with open(err_log, "ab") as err:
            code = subprocess.run([*base, *args], timeout=120, stdin=subprocess.DEVNULL,
                                  stdout=err, stderr=err).returncode
        if code:
            raise RuntimeError(f"runsc {args[0]} failed: {err_log.read_text()[-1500:]}")
        return time.perf_counter() - t0

    # As the node does: be the subreaper of runsc's sandbox processes and reap them
    # at once (a checkpoint that stops the sandbox waits for it to be reaped).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    stop = threading.Event()

    def reaper() -> None:
        while not stop.is_set():
            reap_runsc_orphans()
            time.sleep(0.002)

    thread = threading.Thread(target=reaper, daemon=True)
    thread.start()
    stop_s, leave_s, restore_s, image_bytes = [], [], [], []
    try:
        cid = f"abs-bare-{uuid.uuid4().hex[:6]}-0"
        run("run", "--detach", "--bundle", str(bundle), cid)
        time.sleep(0.5)
        for i in range(n):
            image = work / f"leave-{i}"
            leave_s.append(run("checkpoint", "--image-path", str(image), "--leave-running",
                               "--compression=none", cid))
            shutil.rmtree(image)
        for i in range(n):
            image = work / f"ck-{i}"
            stop_s.append(run("checkpoint", "--image-path", str(image), "--compression=none",
                              cid))
            image_bytes.append(sum(f.stat().st_size for f in image.iterdir()))
            run("delete", "--force", cid)
            cid = f"{cid.rsplit('-', 1)[0]}-{i + 1}"
            restore_s.append(run("restore", "--detach", "--image-path", str(image),
                                 "--bundle", str(bundle), cid))
    finally:
        out = subprocess.run([*base, "list", "-quiet"], capture_output=True, text=True).stdout
        for c in out.split():
            subprocess.run([*base, "kill", c, "KILL"], capture_output=True)
            subprocess.run([*base, "delete", "--force", c], capture_output=True)
        time.sleep(0.2)
        stop.set()
        thread.join()
        reap_runsc_orphans()
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        left = subprocess.run([*base, "list", "-quiet"], capture_output=True, text=True).stdout
        raw["bare_runsc_left"] = left.split()
    rows["baseline: bare runsc checkpoint (stops the sandbox)"] = summary(stop_s)
    rows["baseline: bare runsc checkpoint --leave-running"] = summary(leave_s)
    rows["baseline: bare runsc restore --detach"] = summary(restore_s)
    rows["baseline: bare runsc image size"] = {
        "MiB": round(sorted(image_bytes)[len(image_bytes) // 2] / MiB, 1) if image_bytes
        else None}


# -------------------- The floor of a restore (formerly restore_floor.py)
# The floor of a restore: bare `runsc restore`s of a capture of a node's own sandbox,
# with the node's runsc flags and that sandbox's OCI spec (rootfs, mounts, cgroup limits),
# each into a network slot built as the node builds them (beforehand, as a warm pool
# holds them), each timed until it returned and until it answered `/bin/true` straight
# to envd at its slot address (no node in the path). The capture is taken as the node
# takes a fork's: `runsc checkpoint --leave-running --compression=none`.


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

    def restore(self, cid: str, bundle: Path) -> None:
        """`runsc restore --detach` of the capture into a bundle, as the node runs it."""
        with open(bundle / "console.log", "ab") as out:
            subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                            "/bin/sh", "-c", MASK, *self.flags(self.state),
                            f"--log={bundle / 'runsc.log'}", "restore", "--detach",
                            f"--image-path={self.image}", f"--bundle={bundle}", cid],
                           stdin=subprocess.DEVNULL, stdout=out, stderr=out, check=True,
                           timeout=120)

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
            self.restore(cid, bundle)
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
