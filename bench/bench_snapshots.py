"""Snapshots on real nodes: pause, resume, creates (cold, warm pool, from a snapshot),
fork of 16, capture after writing 256 MiB and a second snapshot after a 1 MiB change.

Baselines in the same run: a cold create, and a bare runsc checkpoint/restore of a
comparable sandbox (overlay root in memory, no network, `sleep infinity`) run
directly with runsc under its own --root.

Run as root:  .venv/bin/python bench/bench_snapshots.py [-n 10] [--forks 3]

Three nodes: "abs" (10.18.0.0/16; AENV_TEMPLATE_SNAPSHOTS=0, so a create boots) for
everything but the template creates; "abi" (10.20.0.0/16; template boot images, the
default, no pool) and "abw" (10.19.0.0/16; AENV_WARM_POOL_SIZE=4) for those. How the
node made each sandbox is read from its "created <id> in N ms (...)" log line. Every
sandbox, snapshot, node and bare runsc container is removed at the end, even on errors.
Writes bench/results/snapshots.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from e2b import Sandbox

from agentenv.testing import Node, leaks
from common import finish, main_with_modes, report, summary
from snapshot_probes import (
    TTL,
    Failures,
    NodeLog,
    Tracker,
    bare_runsc,
    created_ms,
    run_in,
    until_command,
)

MiB = 1 << 20
FORK = 16
WARM_POOL = 4

TARGETS = {
    "pause (API call)": "p50 <= 100",
    "resume from the local cache (API call until 201)": "p50 <= 150",
    "create from template, warm pool (API call)": "p50 <= 50",
    "fork of 16: source stopped (node log)": "<= 150",
    "fork of 16: all 16 children answer a command (from the call's start)": "<= 3000",
    "1 MiB-change snapshot: storedBytes / first totalBytes": "<= 5 %",
}


# -- node A: everything but the warm pool ------------------------------------------------------

def bench_cold_creates(t: Tracker, log: NodeLog, n: int, rows: dict, raw: dict) -> None:
    api_s, cmd_s, node_ms = [], [], []
    ids = []
    for _ in range(n):
        t0 = time.perf_counter()
        dt, body = t.create("base")
        api_s.append(dt)
        cmd_s.append(until_command(t.node, body["sandboxID"], body["envdAccessToken"], t0))
        ids.append(body["sandboxID"])
        if origin(log, body["sandboxID"]) != "boot":
            raw.setdefault("cold_create_not_booted", []).append(body["sandboxID"])
        ms = created_ms(log, body["sandboxID"])
        if ms is not None:
            node_ms.append(ms / 1000)
    t.delete_many(ids)
    rows["baseline: cold create from template (API call)"] = summary(api_s)
    rows["baseline: cold create until a command runs"] = summary(cmd_s)
    rows["baseline: cold create, node-side (node log)"] = summary(node_ms)
    parts: dict[str, list[float]] = {}
    for sid in ids:
        m = re.search(rf"created {sid} in [\d.]+ ms \(booted: slot (\d+), runtime (\d+), "
                      r"envd (\d+), init (\d+)\)", log.text())
        for name, value in zip(("slot", "runtime", "envd", "init"), m.groups() if m else (),
                               strict=False):
            parts.setdefault(name, []).append(float(value))
    if parts:
        rows["baseline: cold create, node-side parts p50 ms (node log)"] = {
            k: sorted(v)[len(v) // 2] for k, v in parts.items()}
    raw["cold_create_s"] = api_s


def bench_pause_resume(t: Tracker, log: NodeLog, n: int, rows: dict, raw: dict,
                       failures: Failures) -> None:
    _, body = t.create("base")
    sid, token = body["sandboxID"], body["envdAccessToken"]
    # Something in memory that must come back: a shell loop and its counter.
    run_in(t.node, sid, token, ["/bin/bash", "-c",
                                "nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > "
                                "/tmp/count; sleep 0.2; done' >/dev/null 2>&1 &"])
    pause_s, resume_s, ready_s, commit_s = [], [], [], []
    materialized = 0
    for _ in range(n):
        off = log.offset()
        t0 = time.perf_counter()
        r = t.api.post(f"/sandboxes/{sid}/pause")
        pause_s.append(time.perf_counter() - t0)
        if r.status_code != 204:
            failures.add(f"pause: {r.status_code} {r.text[:200]}")
            break
        # The commit continues in the background; a resume would wait for it.
        # Measure the resume itself, from the node-local cache.
        m = log.wait_for(r"committed snapshot \S+: (\d+) bytes, (\d+) new bytes stored, "
                         r"([\d.]+)s", off, 120)
        if m is None:
            failures.add("pause: no 'committed snapshot' line within 120 s")
        else:
            commit_s.append(float(m.group(3)))
        off = log.offset()
        t0 = time.perf_counter()
        r = t.api.post(f"/sandboxes/{sid}/resume", json={"timeout": TTL})
        resume_s.append(time.perf_counter() - t0)
        if r.status_code != 201:
            failures.add(f"resume: {r.status_code} {r.text[:200]}")
            break
        ready_s.append(until_command(t.node, sid, token, t0))
        materialized += len(re.findall(r"materialized snapshot", log.since(off)))
    code = run_in(t.node, sid, token, ["/bin/bash", "-c", "test \"$(cat /tmp/count)\" -gt 1"])
    if code != 0:
        failures.add("pause/resume: the counter loop did not survive")
    t.delete(sid)
    rows["pause (API call)"] = summary(pause_s)
    rows["pause: background commit to the repository (node log)"] = summary(commit_s)
    rows["resume from the local cache (API call until 201)"] = summary(resume_s)
    rows["resume until a command runs"] = summary(ready_s)
    raw["resume_materialized_from_repository"] = materialized
    if materialized:
        failures.add(f"resume: {materialized} resumes materialized from the repository, "
                     "not the local cache")


def bench_create_from_snapshot(t: Tracker, n: int, rows: dict) -> None:
    _, body = t.create("base")
    sid = body["sandboxID"]
    alias = f"abs-bench-{uuid.uuid4().hex[:8]}"
    dt, _ = t.snapshot(sid, alias)
    rows["snapshot of an idle sandbox, with alias (capture + commit)"] = summary([dt])
    api_s, cmd_s, ids = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        dt, child = t.create(alias)
        api_s.append(dt)
        cmd_s.append(until_command(t.node, child["sandboxID"], child["envdAccessToken"], t0))
        ids.append(child["sandboxID"])
    t.delete_many([*ids, sid])
    rows["create from a snapshot alias (API call)"] = summary(api_s)
    rows["create from a snapshot alias until a command runs"] = summary(cmd_s)


def bench_fork(t: Tracker, log: NodeLog, runs: int, rows: dict, raw: dict,
               failures: Failures) -> None:
    _, body = t.create("base")
    src, src_token = body["sandboxID"], body["envdAccessToken"]
    run_in(t.node, src, src_token, ["/bin/bash", "-c",
                                    "nohup sleep 100000 >/dev/null 2>&1 &"])
    stopped_ms, call_s, all_s, each_s = [], [], [], []
    for i in range(runs):
        time.sleep(8)  # the slot pool refills after the previous run's deletes
        off = log.offset()
        t0 = time.perf_counter()
        r = t.api.post(f"/sandboxes/{src}/fork", json={"count": FORK, "timeout": TTL},
                       timeout=600)
        call_s.append(time.perf_counter() - t0)
        if r.status_code != 201:
            failures.add(f"fork: {r.status_code} {r.text[:300]}")
            continue
        children = [c["sandbox"] for c in r.json() if c.get("sandbox")]
        t.sandboxes.update(c["sandboxID"] for c in children)
        for c in r.json():
            if c.get("error"):
                failures.add(f"fork run {i}: child failed: {c['error']}")
        with ThreadPoolExecutor(FORK) as pool:
            ready = list(pool.map(until_command, [t.node] * len(children),
                                  [c["sandboxID"] for c in children],
                                  [c["envdAccessToken"] for c in children],
                                  [t0] * len(children)))
        each_s += ready
        if len(ready) == FORK:
            all_s.append(max(ready))
        m = re.search(rf"fork of {src}: source stopped (\d+) ms", log.since(off))
        if m:
            stopped_ms.append(float(m.group(1)) / 1000)
        else:
            failures.add(f"fork run {i}: no 'source stopped' line in the node log")
        if until_command(t.node, src, src_token, time.perf_counter()) > 5:
            failures.add(f"fork run {i}: the source answered slowly")
        t.delete_many([c["sandboxID"] for c in children])
    t.delete(src)
    rows["fork of 16: source stopped (node log)"] = summary(stopped_ms)
    rows["fork of 16: fork call (until 201)"] = summary(call_s)
    rows["fork of 16: all 16 children answer a command (from the call's start)"] = \
        summary(all_s)
    rows["fork of 16: each child answers a command (from the call's start)"] = summary(each_s)
    raw["fork_children_ready_s"] = each_s


def bench_capture(t: Tracker, changes: int, rows: dict, raw: dict, failures: Failures) -> None:
    _, body = t.create("base")
    sid, token = body["sandboxID"], body["envdAccessToken"]
    t0 = time.perf_counter()
    code = run_in(t.node, sid, token, ["/bin/bash", "-c",
                                       "head -c 268435456 /dev/urandom > /home/user/big.bin "
                                       "&& sync"], timeout=600)
    write_s = time.perf_counter() - t0
    if code != 0:
        failures.add(f"writing 256 MiB inside the sandbox: exit {code}")
    rows["write 256 MiB of random data inside the sandbox"] = summary([write_s])
    dt, first = t.snapshot(sid)
    rows["capture + commit after writing 256 MiB"] = {
        "n": 1, "seconds": round(dt, 3), "totalBytes": first["totalBytes"],
        "storedBytes": first["storedBytes"],
        "stored_MiB": round(first["storedBytes"] / MiB, 1)}
    raw["first_snapshot"] = first
    seconds, stored, pct = [], [], []
    raw["incremental_snapshots"] = []
    for i in range(changes):
        code = run_in(t.node, sid, token, ["/bin/bash", "-c",
                                           f"head -c 1048576 /dev/urandom > "
                                           f"/home/user/change-{i}.bin && sync"])
        if code != 0:
            failures.add(f"1 MiB change: exit {code}")
        dt, snap = t.snapshot(sid)
        seconds.append(dt)
        stored.append(snap["storedBytes"])
        pct.append(100 * snap["storedBytes"] / first["totalBytes"])
        raw["incremental_snapshots"].append(snap)
    rows["capture + commit after a 1 MiB change"] = summary(seconds)
    rows["1 MiB-change snapshot: storedBytes"] = {
        "n": len(stored), "p50_bytes": sorted(stored)[len(stored) // 2] if stored else None,
        "max_bytes": max(stored, default=None)}
    rows["1 MiB-change snapshot: storedBytes / first totalBytes"] = {
        "n": len(pct), "p50_pct": round(sorted(pct)[len(pct) // 2], 3) if pct else None,
        "max_pct": round(max(pct), 3) if pct else None}
    t.delete(sid)


# -- nodes B and C: creates from a template's boot image, with and without a warm pool ---------

def origin(log: NodeLog, sid: str) -> str:
    """How the node made a sandbox, from its 'created <id> in N ms (...)' line."""
    m = re.search(rf"created {sid} in [\d.]+ ms \(([^)]*)\)", log.text())
    if m is None:
        return "unknown"
    how = m.group(1)
    return ("warm pool" if "warm pool" in how else "template image" if "template image" in how
            else "boot" if how.startswith(("slot", "boot")) else how)


def containers(node: Node) -> int:
    """runsc sandboxes the node runs (pooled ones have no record, but are here)."""
    state = node.home / "run" / "runsc"
    out = subprocess.run(["runsc", f"--root={state}", "list", "-quiet"], capture_output=True,
                         text=True).stdout
    return len(out.split())


def wait_containers(node: Node, want: int, cap: float) -> bool:
    end = time.monotonic() + cap
    while time.monotonic() < end:
        if containers(node) >= want:
            return True
        time.sleep(0.2)
    return False


def bench_template_creates(t: Tracker, log: NodeLog, n: int, pool: int, rows: dict,
                           raw: dict) -> None:
    """Creates from template base on a node with template images on (its default) and a
    warm pool of ``pool`` (0: none). The first create boots and has the image built."""
    label = "warm pool" if pool else "template image"
    first_dt, body = t.create("base")
    t.delete(body["sandboxID"])
    info: dict = {"first_create_ms": round(first_dt * 1000, 1),
                  "first_create_origin": origin(log, body["sandboxID"])}
    built = log.wait_for(r"template base: image \S+ built in (\d+) ms", 0, 90)
    info["image_built_ms"] = float(built.group(1)) if built else None
    if pool:
        info["pool_filled"] = wait_containers(t.node, pool, 90)
    api_s, cmd_s, second_s, per = [], [], [], []
    while len(per) < n:
        ids = []
        for _ in range(min(pool or n, n - len(per))):  # a full pool, back to back
            t0 = time.perf_counter()
            dt, body = t.create("base")
            ready = until_command(t.node, body["sandboxID"], body["envdAccessToken"], t0)
            t1 = time.perf_counter()
            until_command(t.node, body["sandboxID"], body["envdAccessToken"], t1)
            second = time.perf_counter() - t1
            ids.append(body["sandboxID"])
            how = origin(log, body["sandboxID"])
            per.append({"sandboxID": body["sandboxID"], "api_ms": round(dt * 1000, 1),
                        "origin": how})
            if how == label:
                api_s.append(dt)
                cmd_s.append(ready)
                second_s.append(second)
        t.delete_many(ids)
        if pool:
            wait_containers(t.node, pool, 60)  # the pool refills in the background
    info["creates"] = per
    raw[f"template_creates_{label.replace(' ', '_')}"] = info
    others = {p["origin"] for p in per if p["origin"] != label}
    if pool:
        name = "create from template, warm pool"
    else:
        name = "create from template via its boot image, no pool"
    if api_s:
        rows[f"{name} (API call)"] = summary(api_s)
        rows[f"{name}, until a command runs"] = summary(cmd_s)
        rows[f"{name}: the next command (new connection)"] = summary(second_s)
        if others:
            rows[f"{name}: creates not served that way"] = {
                "count": len(per) - len(api_s), "origins": "/".join(sorted(others))}
    else:
        rows[f"{name} (API call)"] = {
            "status": f"not available: no create came from the {label} "
                      f"(origins: {'/'.join(sorted(others))})"}
        rows[f"{name}: what the node did instead (API call)"] = summary(
            [p["api_ms"] / 1000 for p in per])


# -- main --------------------------------------------------------------------------------------

def busy() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "pytest"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if re.search(r"(^|\s|/)pytest(\s|$)", ln)]


class Watch:
    """Notes which steps a pytest run overlapped (2 cores: their timings are noisy)."""

    def __init__(self) -> None:
        self.step = ""
        self.overlapped: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def enter(self, step: str) -> None:
        self.step = step
        print(f"== {step}", flush=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if self.step and self.step not in self.overlapped and busy():
                self.overlapped.append(self.step)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=('mode `capture`: what a snapshot of a running sandbox costs as it grows, '
                'beside bare `runsc checkpoint --leave-running` (bench_snapshots.py capture'
                ' --help)'))
    ap.add_argument("-n", type=int, default=10, help="samples for the cheap steps")
    ap.add_argument("--forks", type=int, default=3, help="fork-of-16 runs")
    ap.add_argument("--changes", type=int, default=3, help="1 MiB-change snapshots")
    ap.add_argument("--keep", action="store_true", help="keep the nodes' homes")
    ap.add_argument("--wait-for-tests", type=float, default=1800,
                    help="seconds to wait for a running pytest to finish (2 cores)")
    args = ap.parse_args()
    end = time.monotonic() + args.wait_for_tests
    if busy():
        print("a pytest run is going on; waiting for it to finish", file=sys.stderr, flush=True)
    while busy() and time.monotonic() < end:
        time.sleep(5)
    if busy():
        print("warning: a pytest run is going on; timings will be noisy:\n  "
              + "\n  ".join(busy()), file=sys.stderr)

    rows: dict[str, dict] = {}
    raw: dict = {}
    failures = Failures()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-snap-"))
    nodes = {
        # Template images off: creates boot (the cold baseline); all but the template creates.
        "abs": Node(work / "home-abs", "abs", "10.18.0.0/16", AENV_MAX_SANDBOXES="40",
                    AENV_NET_POOL_LOW="16", AENV_NET_POOL_HIGH="24",
                    AENV_TEMPLATE_SNAPSHOTS="0", AENV_WARM_POOL_SIZE="0"),
        # Template images on (the default), warm pool of 4.
        "abw": Node(work / "home-abw", "abw", "10.19.0.0/16", AENV_MAX_SANDBOXES="40",
                    AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="12",
                    AENV_WARM_POOL_SIZE=str(WARM_POOL)),
        # Template images on, no pool.
        "abi": Node(work / "home-abi", "abi", "10.20.0.0/16", AENV_MAX_SANDBOXES="40",
                    AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="12", AENV_WARM_POOL_SIZE="0"),
    }
    left: dict[str, list[str]] = {}
    watch = Watch()
    watch.start()
    try:
        watch.enter("bare runsc")
        try:
            bare_runsc(work / "bare", args.n, rows, raw)
        except Exception as exc:
            failures.add(f"bare runsc: {exc}")

        node = nodes["abs"]
        node.start()
        log = NodeLog(node)
        with node.client() as api:
            t = Tracker(node, api)
            try:
                time.sleep(4)  # let the slot pool fill
                for name, step in (
                    ("cold creates", lambda: bench_cold_creates(t, log, args.n, rows, raw)),
                    ("pause/resume", lambda: bench_pause_resume(t, log, args.n, rows, raw,
                                                                failures)),
                    ("create from a snapshot", lambda: bench_create_from_snapshot(
                        t, args.n, rows)),
                    ("fork of 16", lambda: bench_fork(t, log, args.forks, rows, raw,
                                                      failures)),
                    ("capture of 256 MiB", lambda: bench_capture(t, args.changes, rows, raw,
                                                                 failures)),
                ):
                    watch.enter(name)
                    try:
                        step()
                    except Exception as exc:
                        failures.add(f"{name}: {type(exc).__name__}: {exc}")
            finally:
                t.cleanup(failures)
        node.stop()

        for prefix, pool in (("abi", 0), ("abw", WARM_POOL)):
            node = nodes[prefix]
            watch.enter(f"template creates, warm pool {pool}")
            node.start()
            log = NodeLog(node)
            with node.client() as api:
                t = Tracker(node, api)
                try:
                    time.sleep(2)
                    bench_template_creates(t, log, max(args.n, 12), pool, rows, raw)
                except Exception as exc:
                    failures.add(f"template creates (pool {pool}): {type(exc).__name__}: {exc}")
                finally:
                    t.cleanup(failures)
            node.stop()
    finally:
        watch.stop()
        for prefix, node in nodes.items():
            with contextlib.suppress(Exception):
                node.stop()
            left[prefix] = leaks(prefix, node.home)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"leaks: {left}", flush=True)
    rows["failures"] = {"count": len(failures)}
    groups = ("pause", "resume", "create from template", "create from a snapshot",
              "snapshot of", "fork", "write", "capture", "1 MiB", "baseline", "failures")
    order = sorted(rows, key=lambda k: next(
        (i for i, g in enumerate(groups) if k.startswith(g)), len(groups)))
    finish("snapshots", "Snapshots: pause/resume, creates, fork of 16, capture (template base, "
           "512 MiB)", {k: rows[k] for k in order}, TARGETS,
           "\nn = samples. Nodes: abs boots (AENV_TEMPLATE_SNAPSHOTS=0; pause/resume, "
           "snapshots, fork, capture, cold creates), abi restores the template's boot image "
           "(no pool), abw has a warm pool (AENV_WARM_POOL_SIZE=4; creates taken back to back "
           "from a full pool, in groups of 4). Resume is measured after the pause's "
           "background commit finished. Bare runsc baseline: `sleep infinity`, overlay root "
           "in memory, no network, no compression.\n", watch.overlapped, failures, left, raw)
    return 1 if failures or any(left.values()) else 0


# -------------------- mode `capture` (formerly bench_capture.py)
# What a snapshot of a running sandbox costs as the sandbox grows (issue 15, item 6).
#
# One node, one run, through the official e2b SDK (``create_snapshot``: a leave-running
# capture, then its commit to the repository). A ``base`` sandbox holds N MiB either
# as a process's memory (random bytes, so no page is zero) or as files written to its
# root, whose writable layer lives in memory. For each size, in alternation on the
# same sandbox:
#
#   - the SDK call, split by the node's log into the capture (what the sandbox is
#     stopped for) and the commit (chunking, hashing, storing; the sandbox runs),
#     for the sandbox's first snapshot (every chunk is new) and its next ones (only
#     changed chunks are stored);
#   - the floor: bare ``runsc checkpoint --leave-running --compression=none`` of that
#     very sandbox with the node's own runsc root and flags.
#
# The report fits a line to each series: milliseconds per 100 MiB, and the intercept.


MIB = 1 << 20
KINDS = ("process memory", "files in the root")
SNAPSHOT_LINE = re.compile(
    r"snapshot (\S+) of (\S+): capture (\d+) ms, commit (\d+) ms, (\d+) bytes")


def hold(sbx: Sandbox, kind: str, mib: int) -> None:
    """Make the sandbox hold ``mib`` MiB of incompressible state of ``kind``."""
    if not mib:
        return
    if kind == "files in the root":
        sbx.commands.run(f"head -c {mib * MIB} /dev/urandom > /home/user/data.bin")
        return
    # bytes from os.urandom, held by a process that sleeps: every page is resident
    sbx.commands.run(
        f"python3 -c \"import os, time; b = os.urandom({mib * MIB}); "
        "open('/tmp/held', 'w').write('1'); time.sleep(10**6)\"",
        background=True)
    end = time.monotonic() + 120
    while not sbx.files.exists("/tmp/held"):
        if time.monotonic() > end:
            raise RuntimeError(f"the sandbox did not allocate {mib} MiB")
        time.sleep(0.2)


def bare_checkpoint(home: Path, sandbox_id: str) -> tuple[float, int]:
    """Seconds and bytes of a bare leave-running checkpoint of the node's sandbox."""
    image = Path(tempfile.mkdtemp(prefix="bare-ckpt-", dir=home))
    flags = [f"--root={home}/run/runsc", "--platform=systrap", "--network=sandbox",
             "--overlay2=root:memory"]
    try:
        t0 = time.perf_counter()
        subprocess.run(["runsc", *flags, "checkpoint", f"--image-path={image}",
                        "--compression=none", "--leave-running", sandbox_id],
                       check=True, capture_output=True)
        seconds = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
        return seconds, size
    finally:
        shutil.rmtree(image, ignore_errors=True)


def node_split(log_path: Path, snapshot_id: str) -> tuple[float, float, int]:
    """The node's own capture and commit seconds, and the snapshot's bytes."""
    for line in reversed(log_path.read_text(errors="replace").splitlines()):
        m = SNAPSHOT_LINE.search(line)
        if m and m.group(1) == snapshot_id:
            return int(m.group(3)) / 1000, int(m.group(4)) / 1000, int(m.group(5))
    raise RuntimeError(f"no capture line for snapshot {snapshot_id} in the node's log")


def fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares: ms per 100 MiB, and ms at 0 MiB."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return {"ms_per_100MiB": round(slope * 100 * 1000, 1),
            "ms_at_0MiB": round((my - slope * mx) * 1000, 1)}


def capture_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        prog="bench_snapshots.py capture",
        description="What a snapshot of a running sandbox costs as the sandbox grows.")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="0,100,200,300",
                    help="MiB each sandbox holds (a sandbox of base has 512 MiB)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-capture-"))
    node = Node(home, "abc", "10.24.0.0/16")
    node.start()
    os.environ.update(node.e2b_env())
    samples: dict[str, list[float]] = {}
    sizes_mb: dict[str, float] = {}
    series: dict[str, list[tuple[float, float]]] = {}
    # Deleted at the end only: a delete's chunk collection would run beside the
    # next commits and slow them.
    taken: list[str] = []
    try:
        for kind in KINDS:
            for mib in sizes:
                sbx = Sandbox.create("base", timeout=900)
                try:
                    hold(sbx, kind, mib)
                    for round_ in range(args.rounds):
                        bare_s, bare_bytes = bare_checkpoint(home, sbx.sandbox_id)
                        t0 = time.perf_counter()
                        snap = sbx.create_snapshot()
                        api_s = time.perf_counter() - t0
                        taken.append(snap.snapshot_id)
                        capture_s, commit_s, total = node_split(node.log_path,
                                                                snap.snapshot_id)
                        # The first snapshot stores every chunk; later ones of the
                        # same sandbox only the chunks that changed.
                        which = "first" if round_ == 0 else "next"
                        key = f"{kind}, {mib} MiB"
                        for name, value in (("bare runsc checkpoint", bare_s),
                                            ("node capture (sandbox stopped)", capture_s),
                                            (f"node commit, {which} snapshot", commit_s),
                                            (f"SDK create_snapshot, {which} snapshot", api_s)):
                            samples.setdefault(f"{key}: {name}", []).append(value)
                            series.setdefault(f"{kind}: {name}", []).append((mib, value))
                        sizes_mb[f"{key}: image"] = round(bare_bytes / 1e6, 1)
                        sizes_mb[f"{key}: snapshot"] = round(total / 1e6, 1)
                finally:
                    sbx.kill()
        for snapshot_id in taken:
            Sandbox.delete_snapshot(snapshot_id)
    finally:
        node.stop()
    left = leaks("abc", home)
    rows: dict[str, dict] = {name: summary(xs) for name, xs in samples.items()}
    for name, points in series.items():
        rows[f"fit, {name}"] = fit(points)
    for key in sorted({k.rsplit(": ", 1)[0] for k in sizes_mb}):
        rows[f"{key}: size"] = {"bare_image_MB": sizes_mb[f"{key}: image"],
                                "snapshot_MB": sizes_mb[f"{key}: snapshot"]}
    for kind in KINDS:
        for mib in sizes:
            key = f"{kind}, {mib} MiB"
            bare = rows[f"{key}: bare runsc checkpoint"]["p50_ms"]
            node_ms = rows[f"{key}: node capture (sandbox stopped)"]["p50_ms"]
            rows[f"{key}: capture / bare"] = {"ratio": round(node_ms / bare, 2) if bare else None}
    report("capture", "Snapshot of a running sandbox as it grows",
           f"`python bench_snapshots.py capture --rounds {args.rounds} --sizes {args.sizes}` "
           "(in bench/)."
           " Medians; the fits are least squares over every sample.",
           "capture cost", rows, left)


if __name__ == "__main__":
    sys.exit(main_with_modes(main, {"capture": capture_main}))
