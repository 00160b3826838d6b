"""Lifecycle speed: cold create, resume, create from the template's boot image and fork
of 16, each beside bare runsc measured in the same run (`runsc do /bin/true` for a
boot, a bare `runsc restore --detach` for a restore), as a ratio. `make bench` runs it
and reads its headline (a boot-image create until a command runs) from
results/lifecycle.json.

    cd bench && PYTHONPATH=../src python bench_lifecycle.py [-n 5]

Before/after two trees on a shared machine: one round per tree, alternately, several
rounds (the node runs the tree on PYTHONPATH), `--name <label>` writing
results/lifecycle_<label>.json, then `--summarize BEFORE AFTER OUT` for the medians
over rounds. With --cpu: CPU-seconds per create, reset, fork child and snapshot beside
bare runsc (results/lifecycle_cpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from agentenv.envd.dormancy import DORMANT_LINE, WOKEN_LINE
from agentenv.network.slot import reset_slot
from agentenv.testing import Node, leaks
from agentenv.testing.nodes import free_cidr
from bench_node import exec_native, runsc_do_true
from bench_snapshots import (
    Failures,
    NodeLog,
    bare_runsc,
    bench_cold_creates,
    bench_fork,
    bench_pause_resume,
    bench_template_creates,
)
from common import ACCT, RESULTS, CpuMeter, write
from snapshot_probes import Floor, Tracker, answered, until_command

KEYS = {
    "cold create, node-side (node log)": "baseline: cold create, node-side (node log)",
    "cold create until a command runs": "baseline: cold create until a command runs",
    "resume (API call until 201)": "resume from the local cache (API call until 201)",
    "resume until a command runs": "resume until a command runs",
    "boot-image create (API call)": "create from template via its boot image, no pool (API call)",
    "boot-image create until a command runs":
        "create from template via its boot image, no pool, until a command runs",
    "fork of 16: fork call": "fork of 16: fork call (until 201)",
    "fork of 16: all children answer": "fork of 16: all 16 children answer a command "
                                       "(from the call's start)",
    "bare runsc restore --detach": "baseline: bare runsc restore --detach",
}


# Each row's bare-runsc counterpart, measured in the same run: a boot beside
# `runsc do /bin/true`, a restore beside `runsc restore --detach`.
BARE = {k: "bare runsc restore --detach" for k in KEYS if not k.startswith("cold")}
BARE.update({k: "runsc do /bin/true" for k in KEYS if k.startswith("cold")})


def summarize(before: str, after: str, out: str) -> None:
    """Medians over the rounds lifecycle_<before>N.json and lifecycle_<after>N.json,
    and the median of each round's ratio to its own bare runsc figure."""
    def load(label: str) -> list[dict]:
        return [json.loads(p.read_text())["p50_ms"]
                for p in sorted(RESULTS.glob(f"lifecycle_{label}[0-9]*.json"))]

    runs = {"before": load(before), "after": load(after)}
    rows: dict[str, dict] = {}
    for key in [*KEYS, "runsc do /bin/true"]:
        row: dict = {}
        for side, rounds in runs.items():
            xs = [r[key] for r in rounds if r.get(key)]
            row[f"{side}_p50_ms"] = round(statistics.median(xs), 1) if xs else None
            if key in BARE:
                ratios = [r[key] / r[BARE[key]] for r in rounds if r.get(key) and r.get(BARE[key])]
                row[f"{side}_ratio"] = round(statistics.median(ratios), 2) if ratios else None
        rows[key] = row
    lines = [f"rounds: before {len(runs['before'])}, after {len(runs['after'])} (alternately)", "",
             "| step | before p50 ms | after p50 ms | before / bare runsc | after / bare runsc "
             "| bare runsc figure |", "| --- | --- | --- | --- | --- | --- |"]
    for key, row in rows.items():
        lines.append(f"| {key} | {row['before_p50_ms']} | {row['after_p50_ms']} | "
                     f"{row.get('before_ratio', '')} | {row.get('after_ratio', '')} | "
                     f"{BARE.get(key, '')} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{out}.json").write_text(json.dumps({"rows": rows, "rounds": runs}, indent=2)
                                         + "\n")
    print(text)
    (RESULTS / f"{out}.table.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize", nargs=3, metavar=("BEFORE", "AFTER", "OUT"),
                    help="only summarize earlier rounds into results/OUT.json")
    ap.add_argument("--name", default="",
                    help="a label: results/lifecycle_<label>.json (default results/lifecycle.json)")
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--forks", type=int, default=1)
    ap.add_argument("--cpu", action="store_true",
                    help="CPU-seconds per operation beside bare runsc")
    ap.add_argument("--files-only", action="store_true",
                    help="with --cpu: only the filesystem-mode resets "
                         "(results/lifecycle_cpu_files_STEP)")
    ap.add_argument("--step", choices=("both", "file", "command", "none"), default="both",
                    help="with --files-only: what each rollout does before its reset")
    ap.add_argument("--snapshot-only", action="store_true",
                    help="with --cpu: only the leave-running snapshot and bare checkpoint "
                         "(results/lifecycle_cpu_snapshot[_NAME])")
    args = ap.parse_args()
    if args.cpu and args.snapshot_only:
        run_snapshots(args.n, args.name)
        return
    if args.cpu and args.files_only:
        run_files(args.n, args.step)
        return
    if args.cpu:
        run_cpu(args.n)
        return
    if args.summarize:
        summarize(*args.summarize)
        return
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-life-"))
    rows: dict[str, dict] = {}
    raw: dict = {}
    failures = Failures()
    left: dict[str, list[str]] = {}
    rows["runsc do /bin/true"] = {"p50_ms": round(statistics.median(
        [runsc_do_true() for _ in range(args.n)]) * 1000, 2)}
    bare_runsc(work / "bare", args.n, rows, raw)
    boot = Node(work / "home-alb", "alb", "10.21.0.0/16", AENV_MAX_SANDBOXES="40",
                AENV_NET_POOL_LOW="16", AENV_NET_POOL_HIGH="24",
                AENV_TEMPLATE_SNAPSHOTS="0", AENV_WARM_POOL_SIZE="0")
    image = Node(work / "home-ali", "ali", "10.22.0.0/16", AENV_MAX_SANDBOXES="40",
                 AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="12", AENV_WARM_POOL_SIZE="0")
    for node, steps in (
            (boot, [lambda t, log: bench_cold_creates(t, log, args.n, rows, raw),
                    lambda t, log: bench_pause_resume(t, log, args.n, rows, raw, failures),
                    lambda t, log: bench_fork(t, log, args.forks, rows, raw, failures)]),
            (image, [lambda t, log: bench_template_creates(t, log, args.n, 0, rows, raw)])):
        node.start()
        try:
            with node.client() as api:
                t = Tracker(node, api)
                time.sleep(4)  # the slot pool fills
                log = NodeLog(node)
                try:
                    for step in steps:
                        step(t, log)
                finally:
                    t.cleanup(failures)
        finally:
            node.stop()
            left[node.prefix] = leaks(node.prefix, node.home)
    rows["runsc do /bin/true, after"] = {"p50_ms": round(statistics.median(
        [runsc_do_true() for _ in range(args.n)]) * 1000, 2)}
    picked = {k: rows.get(src, {}).get("p50_ms") for k, src in KEYS.items()}
    picked["runsc do /bin/true"] = statistics.median(
        [rows["runsc do /bin/true"]["p50_ms"], rows["runsc do /bin/true, after"]["p50_ms"]])
    out = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "p50_ms": picked,
           "rows": rows, "failures": list(failures), "leaks": left}
    RESULTS.mkdir(exist_ok=True)
    name = f"lifecycle_{args.name}" if args.name else "lifecycle"
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(picked, indent=1))


# -------------------- --cpu: CPU-seconds per operation (formerly lifecycle_cpu.py)
# CPU-seconds per restart, host-wide (issue 28): what a create, a reset, a fork child and
# a leave-running snapshot cost the machine, beside bare `runsc restore` / `runsc
# checkpoint` of the same capture with the same flags and spec, in the same run.
#
# Operations run one at a time. Each one's CPU is read from cgroup v1 cpuacct (common.CpuMeter):
# the node's own Python process, the processes it starts (runsc commands, `ip`,
# `iptables`, the unshare wrapper) and its sandboxes (sentry, gofer); a new sandbox's
# processes are split by name. A window runs from the call until a command has run in
# the restored sandbox (creates, resets, forks) or until the call returns (snapshots).
# The idle CPU of the node's other sandboxes over a window is measured apart and named.
#
#     cd bench && PYTHONPATH=<tree>/src:. python bench_lifecycle.py --cpu [-n 5]


HZ = os.sysconf("SC_CLK_TCK")
SNAPSHOT = "leave-running snapshot, small sandbox (envd awake)"
RESET_AWAKE = "reset to a snapshot of it (envd awake at the capture)"
RESET_DORMANT = "reset to a snapshot taken while its envd was dormant"
RESET_FILES = "reset in filesystem mode (its files layer, no restore)"
RESET_FILES_CALL = "reset in filesystem mode: the call alone (until it returns)"
PARTS = ["node process", "node's commands (runsc CLI, ip, ...)", "sentry", "gofer", "total"]


def proc_s(pid: int | str) -> float:
    """CPU-seconds of a live process (all its threads) so far."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def sandbox_split(prefix: str, sid: str) -> dict[str, float]:
    """A live sandbox's processes' CPU so far, by kind (its sentry, its gofer)."""
    out = {"sentry": 0.0, "gofer": 0.0}
    for group in ("cpuacct",):
        try:
            pids = (Path("/sys/fs/cgroup") / group / prefix / sid / "cgroup.procs"
                    ).read_text().split()
        except OSError:
            return out
        for pid in pids:
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                # runsc-gofer; the rest is the sentry (runsc-sandbox) and its stubs
                out["gofer" if argv0.endswith(b"gofer") else "sentry"] += proc_s(pid)
            except OSError:
                continue
    return out


class Window:
    """CPU of one operation on one node, split into PARTS."""

    def __init__(self, meter: CpuMeter, node: Node):
        self.meter, self.pid = meter, node.proc.pid  # type: ignore[union-attr]
        self.c0, self.p0 = meter.read(), proc_s(self.pid)

    def close(self, prefix: str, new_sandbox: str | None, idle_rate: float,
              wall: float) -> dict[str, float]:
        c1, p1 = self.meter.read(), proc_s(self.pid)
        d = CpuMeter.delta_s(self.c0, c1)
        split = sandbox_split(prefix, new_sandbox) if new_sandbox else {}
        out = {"node process": p1 - self.p0,
               "node's commands (runsc CLI, ip, ...)": d["node"] - (p1 - self.p0),
               "sentry": split.get("sentry", 0.0), "gofer": split.get("gofer", 0.0),
               "sandboxes, other": d["sandboxes"] - sum(split.values()) - idle_rate * wall,
               "total": d["total"] - idle_rate * wall, "wall": wall}
        return out


def wait_dormant(node: Node, sid: str, timeout: float = 60) -> None:
    """Until the sandbox's envd has gone dormant (the stub's line last on its console)."""
    console = node.home / "run" / "sandboxes" / sid / "console.log"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = console.read_text(errors="replace") if console.exists() else ""
        if text.rfind(DORMANT_LINE) > text.rfind(WOKEN_LINE):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{sid}: envd did not go dormant within {timeout:.0f}s")


def med(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def floor_cpu(floor: Floor, sid: str, token: str, prefix: str, n: int) -> dict[str, list]:
    """Bare checkpoint (leave-running) of the node's sandbox and bare restores of it:
    CPU of the runsc commands (reaped by this process) and of the sandboxes' cgroups."""
    out: dict[str, list] = {"bare runsc checkpoint --leave-running": [],
                            "bare runsc restore (until a command ran)": []}
    src_group = ACCT / prefix / sid

    def usage(g: Path) -> float:
        try:
            return int((g / "cpuacct.usage").read_text()) / 1e9
        except OSError:
            return 0.0

    def reaped() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    for _ in range(n):
        until_command(floor.node, sid, token, time.perf_counter())  # envd awake, as above
        r0, s0, t0 = reaped(), usage(src_group), time.perf_counter()
        floor.capture()
        wall = time.perf_counter() - t0
        out["bare runsc checkpoint --leave-running"].append(
            {"runsc commands": reaped() - r0, "sentry": usage(src_group) - s0,
             "total": reaped() - r0 + usage(src_group) - s0, "wall": wall})
        time.sleep(0.3)
        out["bare runsc restore (until a command ran)"].append(bare_restore(floor, usage, reaped))
        time.sleep(0.3)
    return out


def bare_restore(floor: Floor, usage, reaped) -> dict[str, float]:
    """One bare restore into the floor's slot, as Floor.fan_out runs it, read before
    the restored sandbox is deleted (its reaped sentry would count twice after)."""
    cid = f"fl-{uuid.uuid4().hex[:6]}"
    slot = floor.slots[0]
    bundle = floor._bundle(cid, slot.netns_path)
    fl_group = ACCT / floor.cgroup
    with httpx.Client(base_url=f"http://{slot.address}:49983", timeout=10) as http:
        r0, f0, t0 = reaped(), usage(fl_group), time.perf_counter()
        floor.restore(cid, bundle)
        wall = answered(http, floor.sid, floor.token, t0)
        row = {"runsc commands": reaped() - r0, "sentry": usage(fl_group) - f0}
    row["total"], row["wall"] = row["runsc commands"] + row["sentry"], wall
    floor.delete_all()
    reset_slot(slot, internet=True)
    return row


def cpu_node(prefix: str, cidr: str, **env: str) -> tuple[Path, Node, CpuMeter]:
    """A started node in a work directory of its own, with no warm pool (its sandboxes'
    CPU would mix with the operations'), and the meter of its CPU."""
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-cpu-"))
    node = Node(work / "home", prefix, cidr, AENV_WARM_POOL_SIZE="0", **env)
    try:
        node.start()
    except BaseException:
        node.stop()  # a node that never answered is stopped too
        raise
    return work, node, CpuMeter(prefix, node.proc.pid)


def run_cpu(n: int) -> None:
    prefix = "lcpu"
    work, node, meter = cpu_node(
        prefix, free_cidr(90, 30, 3), AENV_MAX_SANDBOXES="20",
        AENV_NET_POOL_LOW="4", AENV_NET_POOL_HIGH="8",
        # bare runsc cannot checkpoint a frozen (idle) sandbox: no idle freezing
        AENV_IDLE_FREEZE_S="0",
        # envd sleeps by itself once idle (for the snapshot taken while dormant: the
        # node asks only when short of memory), and no idle memory goes to swap
        # meanwhile (issue 27)
        AENV_ENVD_DORMANT_AFTER_S="5", AENV_COLD_MEMORY_AFTER_S="0")
    samples: dict[str, list] = {k: [] for k in (
        "create from the template's boot image", RESET_AWAKE, RESET_DORMANT, RESET_FILES,
        RESET_FILES_CALL,
        "fork child (fork of 1)", "fork of 4, per child", SNAPSHOT)}
    loads: list[float] = []
    try:
        with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as http:
            t = Tracker(node, api)
            _, body = t.create("base")  # builds the boot image
            t.delete(body["sandboxID"])
            _, src = t.create("base")
            sid, token = src["sandboxID"], src["envdAccessToken"]
            t.snapshot(sid)  # the first snapshot stores every chunk; later ones are measured
            wait_dormant(node, sid)
            _, dormant = t.snapshot(sid)
            c0 = meter.read()
            time.sleep(3)
            idle_rate = CpuMeter.delta_s(c0, meter.read())["sandboxes"] / 3
            until_command(node, sid, token, time.perf_counter(), http=http)  # envd awake
            # The snapshot the filesystem-mode resets go back to: taken outside any
            # files layer (one taken inside a layer is one more layer when reset to).
            _, files_snap = t.snapshot(sid)

            def reset(key: str, snapshot_id: str, mode: str = "memory") -> None:
                w, call, t0 = Window(meter, node), Window(meter, node), time.perf_counter()
                r = api.post(f"/sandboxes/{sid}/reset",
                             json={"snapshotID": snapshot_id, "mode": mode})
                if r.status_code != 200 or r.json()["mode"] != mode:
                    raise RuntimeError(f"reset: {r.status_code} {r.text[:200]}")
                if mode == "filesystem":  # the same sandbox and kernel: no split by process
                    samples[RESET_FILES_CALL].append(
                        call.close(prefix, None, idle_rate, time.perf_counter() - t0))
                until_command(node, sid, token, t0, http=http)
                samples[key].append(w.close(prefix, sid if mode == "memory" else None,
                                            idle_rate, time.perf_counter() - t0))
                time.sleep(0.5)

            for _ in range(n):
                loads.append(os.getloadavg()[0])
                w, t0 = Window(meter, node), time.perf_counter()
                _, body = t.create("base")
                until_command(node, body["sandboxID"], body["envdAccessToken"], t0, http=http)
                samples["create from the template's boot image"].append(
                    w.close(prefix, body["sandboxID"], idle_rate, time.perf_counter() - t0))
                t.delete(body["sandboxID"])
                time.sleep(0.5)
                until_command(node, sid, token, time.perf_counter(), http=http)  # envd awake
                w, t0 = Window(meter, node), time.perf_counter()
                dt, awake = t.snapshot(sid)
                samples[SNAPSHOT].append(w.close(prefix, None, idle_rate, dt))
                time.sleep(0.5)
                reset(RESET_AWAKE, awake["snapshotID"])
                reset(RESET_DORMANT, dormant["snapshotID"])
                # The first reset in filesystem mode is a full one that layers the files
                # (not measured); the next is the layer's.
                api.post(f"/sandboxes/{sid}/reset",
                         json={"snapshotID": files_snap["snapshotID"], "mode": "filesystem"})
                until_command(node, sid, token, time.perf_counter(), http=http)
                http.post("/files?path=/home/user/rollout.txt", content=b"x", headers={
                    "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                    "X-Access-Token": token})
                reset(RESET_FILES, files_snap["snapshotID"], "filesystem")
                for count, key in ((1, "fork child (fork of 1)"), (4, "fork of 4, per child")):
                    w, t0 = Window(meter, node), time.perf_counter()
                    kids = [c["sandbox"] for c in api.post(
                        f"/sandboxes/{sid}/fork", json={"count": count}, timeout=300).json()]
                    for c in kids:
                        until_command(node, c["sandboxID"], c["envdAccessToken"], t0, http=http)
                    row = w.close(prefix, None, idle_rate, time.perf_counter() - t0)
                    for c in kids:
                        for part, v in sandbox_split(prefix, c["sandboxID"]).items():
                            row[part] += v
                    row["sandboxes, other"] -= row["sentry"] + row["gofer"]
                    samples[key].append({k: v / count for k, v in row.items()})
                    t.delete_many([c["sandboxID"] for c in kids])
                    time.sleep(0.5)
            until_command(node, sid, token, time.perf_counter(), http=http)  # envd awake
            with Floor(work / "floor", node, sid, token, int(free_cidr(90, 30, 15).split(".")[1]),
                       1) as floor:
                floor.capture()
                floor_rows = floor_cpu(floor, sid, token, prefix, n)
            t.cleanup([])  # type: ignore[arg-type]
    finally:
        node.stop()
        meter.close()
    left = leaks(prefix, node.home)
    report(samples, floor_rows, loads, idle_rate, left, n)


def run_snapshots(n: int, name: str = "") -> None:
    """The leave-running snapshot row alone (``--snapshot-only``): n snapshots of one
    small sandbox, its envd awake (a command ran just before each), beside n bare
    ``runsc checkpoint --leave-running`` of the same sandbox in the same run. For
    interleaved before/after rounds (``--name``: results/lifecycle_cpu_snapshot_NAME)."""
    prefix = "lcps"
    work, node, meter = cpu_node(prefix, free_cidr(90, 30, os.getpid()), AENV_MAX_SANDBOXES="4",
                                 AENV_IDLE_FREEZE_S="0", AENV_COLD_MEMORY_AFTER_S="0")
    samples: dict[str, list] = {SNAPSHOT: []}
    loads: list[float] = []
    floor_rows: dict[str, list] = {"bare runsc checkpoint --leave-running": []}
    try:
        with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as http:
            t = Tracker(node, api)
            _, src = t.create("base")
            sid, token = src["sandboxID"], src["envdAccessToken"]
            until_command(node, sid, token, time.perf_counter(), http=http)
            t.snapshot(sid)  # the first snapshot stores every chunk; later ones are measured
            c0 = meter.read()
            time.sleep(3)
            idle_rate = CpuMeter.delta_s(c0, meter.read())["sandboxes"] / 3
            for _ in range(n):
                loads.append(os.getloadavg()[0])
                until_command(node, sid, token, time.perf_counter(), http=http)  # envd awake
                time.sleep(0.3)
                w, t0 = Window(meter, node), time.perf_counter()
                dt, _ = t.snapshot(sid)
                samples[SNAPSHOT].append(w.close(prefix, None, idle_rate, dt))
                time.sleep(0.5)
            until_command(node, sid, token, time.perf_counter(), http=http)
            with Floor(work / "floor", node, sid, token, int(free_cidr(90, 30, 15).split(".")[1]),
                       1) as floor:
                src_group = ACCT / prefix / sid
                for _ in range(n):
                    until_command(node, sid, token, time.perf_counter(), http=http)
                    time.sleep(0.3)
                    r = resource.getrusage(resource.RUSAGE_CHILDREN)
                    r0 = r.ru_utime + r.ru_stime
                    s0 = int((src_group / "cpuacct.usage").read_text()) / 1e9
                    t0 = time.perf_counter()
                    floor.capture()
                    wall = time.perf_counter() - t0
                    r = resource.getrusage(resource.RUSAGE_CHILDREN)
                    ran = r.ru_utime + r.ru_stime - r0
                    sentry = int((src_group / "cpuacct.usage").read_text()) / 1e9 - s0
                    floor_rows["bare runsc checkpoint --leave-running"].append(
                        {"runsc commands": ran, "sentry": sentry, "total": ran + sentry,
                         "wall": wall})
            t.cleanup([])  # type: ignore[arg-type]
    finally:
        node.stop()
        meter.close()
    left = leaks(prefix, node.home)
    report(samples, floor_rows, loads, idle_rate, left, n,
           name=f"lifecycle_cpu_snapshot_{name}" if name else "lifecycle_cpu_snapshot")


def run_files(n: int, step: str = "both") -> None:
    """The filesystem-mode rows alone (``--files-only``), n resets of one sandbox, each
    after a rollout's ``step``: ``file`` (a file written: a file worker to end, as in
    the full run's row), ``command`` (a command left running with nohup), ``both``, or
    ``none`` (then the window ends with the call)."""
    prefix = "lcpf"
    _work, node, meter = cpu_node(prefix, free_cidr(90, 30, os.getpid()), AENV_MAX_SANDBOXES="4",
                                 AENV_IDLE_FREEZE_S="0")
    samples: dict[str, list] = {RESET_FILES: [], RESET_FILES_CALL: []}
    loads: list[float] = []
    try:
        with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as http:
            t = Tracker(node, api)
            _, src = t.create("base")
            sid, token = src["sandboxID"], src["envdAccessToken"]
            until_command(node, sid, token, time.perf_counter(), http=http)
            _, snap = t.snapshot(sid)
            c0 = meter.read()
            time.sleep(3)
            idle_rate = CpuMeter.delta_s(c0, meter.read())["sandboxes"] / 3
            body = {"snapshotID": snap["snapshotID"], "mode": "filesystem"}
            api.post(f"/sandboxes/{sid}/reset", json=body)  # the full one, that layers
            until_command(node, sid, token, time.perf_counter(), http=http)
            for _ in range(n):
                loads.append(os.getloadavg()[0])
                if step in ("file", "both"):
                    http.post("/files?path=/home/user/rollout.txt", content=b"x", headers={
                        "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                        "X-Access-Token": token})
                if step in ("command", "both"):
                    exec_native(http, sid, token,
                                ["/bin/sh", "-c", "nohup sleep 86399 >/dev/null 2>&1 &"])
                time.sleep(0.3)
                w, call, t0 = Window(meter, node), Window(meter, node), time.perf_counter()
                r = api.post(f"/sandboxes/{sid}/reset", json=body)
                if r.status_code != 200 or r.json()["mode"] != "filesystem":
                    raise RuntimeError(f"reset: {r.status_code} {r.text[:200]}")
                samples[RESET_FILES_CALL].append(
                    call.close(prefix, None, idle_rate, time.perf_counter() - t0))
                if step != "none":
                    until_command(node, sid, token, t0, http=http)
                samples[RESET_FILES].append(
                    w.close(prefix, None, idle_rate, time.perf_counter() - t0))
                time.sleep(0.3)
            t.cleanup([])  # type: ignore[arg-type]
    finally:
        node.stop()
        meter.close()
    left = leaks(prefix, node.home)
    report(samples, {}, loads, idle_rate, left, n, name=f"lifecycle_cpu_files_{step}")


def report(samples: dict, floor_rows: dict, loads: list[float], idle_rate: float,
           left: list, n: int, name: str = "lifecycle_cpu") -> None:
    cols = ["node process", "node's commands (runsc CLI, ip, ...)", "sentry", "gofer",
            "sandboxes, other", "total", "wall"]
    lines = ["### CPU-seconds per operation, host-wide (one node, operations one at a time)", "",
             f"n = {n} each, medians; load 1m {min(loads):.1f}-{max(loads):.1f}. CPU in "
             "seconds (cgroup cpuacct), wall in seconds. Windows end when a command ran in "
             "the new sandbox (snapshot: when the call returned). The node's other sandboxes' "
             f"idle CPU ({idle_rate * 1000:.1f} ms/s) is taken out.", "",
             "| operation | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    rows = {}
    for key, rs in samples.items():
        rows[key] = m = med(rs)
        lines.append(f"| {key} | " + " | ".join(f"{m.get(c, 0):.3f}" for c in cols) + " |")
    for key, rs in floor_rows.items():
        rows[key] = m = med(rs)
        lines.append(f"| floor: {key} | | {m['runsc commands']:.3f} | {m['sentry']:.3f} "
                     f"(+gofer) | | | {m['total']:.3f} | {m['wall']:.3f} |")
    if left:
        lines.append(f"\nLeft behind: {left}")
    text = "\n".join(lines) + "\n"
    write(name, {"rows": rows, "samples": samples, "floor": floor_rows,
                            "loads": loads, "idle_rate_s_per_s": idle_rate, "leaks": left}, text)
    print(text)


if __name__ == "__main__":
    main()
