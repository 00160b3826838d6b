"""Probes bench_snapshots.py uses: a node's log, commands in sandboxes, timing the
steps of one operation, and the bare-runsc floor of a checkpoint and restore."""

from __future__ import annotations

import contextlib
import ctypes
import re
import shutil
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.runtime.reaping import reap_runsc_orphans
from agentenv.testing import SHARED_HOME, Node
from agentenv.testing.checkpoints import bare_sandbox
from bench_node import exec_native
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
