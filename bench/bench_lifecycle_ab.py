"""Interleaved A/B of the restart path between two trees (issue 28): a node of each
runs at once and every operation alternates between them, the order flipping each
round, so both see the same load from the machine's other users.

    cd bench && PYTHONPATH=<new>/src:. python bench_lifecycle_ab.py \
        --old <old>/src --new <new>/src --label "<old sha> vs <new sha>"

Per tree and round: a create from the template's boot image (no warm pool; API call,
and until a command runs) and a leave-running snapshot of a small running sandbox
(`base`, idle; the API call: capture and commit of its changed chunks), each with the
CPU-seconds the node and its sandboxes used for it (cpu_meter). Every run appends its
table to results/lifecycle_ab.md and its samples to results/lifecycle_ab.json, keyed
by the label: one file for the whole bisection.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentenv.testing import Node, leaks
from agentenv.testing.nodes import free_cidr
from common import RESULTS
from cpu_meter import CpuMeter
from lifecycle_cpu import wait_dormant
from same_floor import Floor
from snapshot_probes import Tracker, until_command

STEPS = ["create (API call)", "create until a command runs", "create CPU-s",
         "snapshot, small sandbox (API call)", "snapshot CPU-s",
         "bare runsc restore of this tree's sandbox (returned)",
         "bare runsc restore of this tree's sandbox (answered)",
         "fork of 4 from an idle source: all answered",
         "fork of 4 from an idle source: CPU-s per child"]
FORK_N = 4


def one_round(t: Tracker, meter: CpuMeter, src: str, out: dict[str, list[float]],
              floor: Floor | None, fork: bool) -> None:
    c0 = meter.read()
    t0 = time.perf_counter()
    dt, body = t.create("base")
    ready = until_command(t.node, body["sandboxID"], body["envdAccessToken"], t0)
    out[STEPS[0]].append(dt)
    out[STEPS[1]].append(ready)
    out[STEPS[2]].append(CpuMeter.delta_s(c0, meter.read())["total"])
    t.delete(body["sandboxID"])
    time.sleep(0.5)  # the delete's tail (runsc delete, slot back to the pool)
    c0 = meter.read()
    dt, _ = t.snapshot(src)
    out[STEPS[3]].append(dt)
    out[STEPS[4]].append(CpuMeter.delta_s(c0, meter.read())["total"])
    if floor is not None:
        returned, each = floor.fan_out(1)
        out[STEPS[5]].append(returned)
        out[STEPS[6]].append(each[0])
    if fork:
        fork_idle(t, meter, src, out)


def fork_idle(t: Tracker, meter: CpuMeter, src: str, out: dict[str, list[float]]) -> None:
    """A fork of an idle source (its envd dormant, where the tree has dormancy) until
    every child ran a command."""
    with contextlib.suppress(TimeoutError):
        wait_dormant(t.node, src, timeout=20)
    c0, t0 = meter.read(), time.perf_counter()
    r = t.api.post(f"/sandboxes/{src}/fork", json={"count": FORK_N}, timeout=300)
    kids = [c["sandbox"] for c in r.json() if c.get("sandbox")]
    with ThreadPoolExecutor(FORK_N) as pool:
        list(pool.map(lambda c: until_command(t.node, c["sandboxID"], c["envdAccessToken"], t0),
                      kids))
    if len(kids) == FORK_N:
        out[STEPS[7]].append(time.perf_counter() - t0)
        out[STEPS[8]].append(CpuMeter.delta_s(c0, meter.read())["total"] / FORK_N)
    t.delete_many([c["sandboxID"] for c in kids])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="PYTHONPATH of the old tree")
    ap.add_argument("--new", required=True, help="PYTHONPATH of the new tree")
    ap.add_argument("--label", required=True)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--tag", default="lab", help="network and cgroup prefix of the nodes "
                    "(two runs at once need two)")
    ap.add_argument("--fork-idle", action="store_true",
                    help="also a fork of 4 from the idle source sandbox per round")
    ap.add_argument("--bare", action="store_true",
                    help="also bare runsc restores of a capture of each tree's sandbox, "
                         "with that tree's spec and flags (same_floor)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-lab-"))
    trees = {"old": args.old, "new": args.new}
    bare = args.bare  # a frozen (idle) sandbox cannot be checkpointed by bare runsc
    # 10.90-119: no test node takes it (tests/conftest.py)
    seed = sum(map(ord, args.tag))
    nodes = {side: Node(work / side, f"{args.tag}{k}", free_cidr(90, 30, k * 7 + seed),
                        PYTHONPATH=path,
                        AENV_MAX_SANDBOXES="20", AENV_NET_POOL_LOW="3",
                        AENV_NET_POOL_HIGH="6", AENV_WARM_POOL_SIZE="0",
                        **({"AENV_IDLE_FREEZE_S": "0"} if bare else {}))
             for k, (side, path) in enumerate(trees.items())}
    samples = {s: {k: [] for k in STEPS} for s in trees}
    loads: list[float] = []
    started: list[Node] = []
    trackers: dict[str, Tracker] = {}
    meters: dict[str, CpuMeter] = {}
    try:
        for side, node in nodes.items():
            started.append(node)  # stopped in every case, even if it never answers
            node.start(wait=300)  # an old tree at load 30 took 92 s
            assert node.proc is not None
            meters[side] = CpuMeter(node.prefix, node.proc.pid)
            trackers[side] = Tracker(node, node.client())
        srcs, tokens = {}, {}
        for side, t in trackers.items():
            # the first create builds the template's boot image; the first snapshot
            # stores every chunk: neither is what is measured
            _, body = t.create("base")
            t.delete(body["sandboxID"])
            _, body = t.create("base")
            srcs[side] = body["sandboxID"]
            tokens[side] = body["envdAccessToken"]
            t.snapshot(srcs[side])
        time.sleep(10)
        with contextlib.ExitStack() as stack:
            floors: dict[str, Floor | None] = {side: None for side in trees}
            if args.bare:
                for k, side in enumerate(trees):
                    floors[side] = stack.enter_context(Floor(
                        work / f"floor-{side}", nodes[side], srcs[side], tokens[side],
                        int(free_cidr(90, 30, 20 + k * 5).split(".")[1]), 1))
                    floors[side].capture()  # type: ignore[union-attr]
            for k in range(args.n):
                order = list(trees) if k % 2 == 0 else list(reversed(trees))
                loads.append(os.getloadavg()[0])
                for side in order:
                    one_round(trackers[side], meters[side], srcs[side], samples[side],
                              floors[side], args.fork_idle)
    finally:
        for t in trackers.values():
            t.cleanup([])  # type: ignore[arg-type]
            t.api.close()
        for node in started:
            node.stop()
        for m in meters.values():
            m.close()
    left = {n.prefix: leaks(n.prefix, n.home) for n in started}
    report(args, samples, loads, left)


def report(args: argparse.Namespace, samples: dict, loads: list[float], left: dict) -> None:
    med = {s: {k: statistics.median(v) if v else None for k, v in steps.items()}
           for s, steps in samples.items()}
    lines = [f"### {args.label}", "",
             f"{args.n} rounds, old/new alternating (order flipped each round); load 1m "
             f"{min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f}). "
             f"old = `{args.old}`, new = `{args.new}`", "",
             "| step (median) | old | new | new / old |", "| --- | --- | --- | --- |"]
    for k in STEPS:
        o, n = med["old"][k], med["new"][k]
        unit = "s" if "CPU" in k else "ms"
        scale = 1 if unit == "s" else 1000
        if o is None or n is None:
            continue
        lines.append(f"| {k} | {o * scale:.{3 if unit == 's' else 0}f} | "
                     f"{n * scale:.{3 if unit == 's' else 0}f} | {n / o:.2f} |")
    if any(left.values()):
        lines.append(f"\nLeft behind: {left}")
    text = "\n".join(lines) + "\n\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "lifecycle_ab.md", "a") as f:
        f.write(text)
    path = RESULTS / "lifecycle_ab.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[args.label] = {"old": args.old, "new": args.new, "loads": loads,
                        "medians": med, "samples": samples, "leaks": left}
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
