"""Fork fan-out against its true floor: N bare restores of the same capture, same flags.

The floor of a fork of N children is N `runsc restore`s of the fork's own capture
started at once, with the node's runsc flags and the source's own OCI spec (rootfs,
mounts, cgroup limits), each into a network slot built like the node's (built
beforehand, as a warm pool holds them), each then answering a `/bin/true` straight
to envd at its slot address. The capture is the node's source sandbox checkpointed
with --leave-running by runsc itself, as the node does for a fork. Measured with
the capture's files in page cache (as a fork's fresh capture is) and dropped from it
(posix_fadvise DONTNEED after an fsync), for N in --counts; then the node forks its
source into N children (each polled with a command from the call's start), and its
debug log gives every child's restore start and steps.

Run as root:  cd bench && ../.venv/bin/python bench_fork_floor.py [--counts 1,4,8,16]
              [--rounds 2] [--old <tree>/src]   (--old: one more node of that tree)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx

from agentenv.testing import Node, leaks
from bench_node import run_native
from common import report, summary
from restore_floor import Floor

CAPTURE = re.compile(r"fork of \w+: source stopped (\d+) ms")
STEP = re.compile(r"^(\S+ \S+) DEBUG \S+: restore of (\w+): slot (\d+) ms, restore (\d+) ms, "
                  r"envd (\d+) ms, init (\d+) ms", re.M)


def fork(node: Node, api: httpx.Client, sid: str, count: int
         ) -> tuple[float, list[float], list[tuple[float, int, int, int, int]], list[float]]:
    """A fork of ``count``, streamed: (seconds until the last child was handed over, each
    child's seconds until it ran a command, sent as soon as the child was handed over),
    and per child from the node log (restore start after the call, in s; slot,
    restore, envd, init ms), and the source's capture (s)."""
    offset = node.log_path.stat().st_size
    kids: list[dict] = []
    with ThreadPoolExecutor(count) as pool, \
            httpx.Client(base_url=node.url, timeout=30) as http:
        def first(c: dict) -> float:
            while True:
                try:
                    if run_native(http, c["sandboxID"], c["envdAccessToken"],
                                  ["/bin/true"])[0] == 0:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    time.sleep(0.005)

        wall0, t0 = time.time(), time.perf_counter()
        # Streamed (NDJSON): each child is used as soon as it is up, as a client would.
        with api.stream("POST", f"/sandboxes/{sid}/fork", json={"count": count, "timeout": 300},
                        headers={"Accept": "application/x-ndjson"}, timeout=300) as r:
            r.raise_for_status()
            runs = []
            for line in r.iter_lines():
                if line.strip():
                    kids.append(json.loads(line)["sandbox"])
                    runs.append(pool.submit(first, kids[-1]))
        call = time.perf_counter() - t0
        each = [f.result() for f in runs]
    for c in kids:
        api.delete(f"/sandboxes/{c['sandboxID']}")
    text = node.log_path.read_bytes()[offset:].decode(errors="replace")
    steps = []
    for m in STEP.finditer(text):
        ended = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        slot, restore, envd, init = (int(g) for g in m.groups()[2:])
        began = ended - (slot + restore + envd + init) / 1000 - wall0
        steps.append((round(began + slot / 1000, 3), slot, restore, envd, init))
    stopped = [int(m.group(1)) / 1000 for m in CAPTURE.finditer(text)]
    return call, each, steps, stopped


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--net", type=int, default=214, help="10.x: floor slots; nodes x+1, x+2")
    ap.add_argument("--old", default="", help="PYTHONPATH of an older tree, forked beside")
    ap.add_argument("--name", default="fork_floor")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-fork-floor-"))
    tag = uuid.uuid4().hex[:2]
    trees = [("this tree", {})] + ([("old tree", {"PYTHONPATH": args.old})] if args.old else [])
    nodes = [(label, Node(work / f"home{i}", f"ff{tag}{i}", f"10.{args.net + 1 + i}.0.0/16",
                          AENV_LOG_LEVEL="debug", AENV_MAX_SANDBOXES=str(max(counts) + 4),
                          AENV_WARM_POOL_SIZE="0", AENV_IDLE_FREEZE_S="0", **env))
             for i, (label, env) in enumerate(trees)]
    data: dict[str, list[float]] = {}
    timelines: dict[str, list] = {}
    left: dict[str, list[str]] = {}
    try:
        for _, node in nodes:
            node.start()
        with contextlib.ExitStack() as stack:
            apis = [stack.enter_context(n.client()) for _, n in nodes]
            srcs = []
            for api in apis:
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 1800})
                r.raise_for_status()
                srcs.append(r.json())
            node0, src0 = nodes[0][1], srcs[0]
            floor = stack.enter_context(Floor(work / "floor", node0, src0["sandboxID"],
                                              src0["envdAccessToken"], args.net, max(counts)))
            time.sleep(2)
            for rnd in range(args.rounds):
                for n in counts:
                    data.setdefault("bare capture (checkpoint --leave-running)", []).append(
                        floor.capture())
                    for cache in ("in page cache", "dropped from page cache"):
                        if cache.startswith("dropped"):
                            floor.drop_cache()
                        ret, each = floor.fan_out(n)
                        data.setdefault(f"N={n} bare, {cache}: all restores returned",
                                        []).append(ret)
                        data.setdefault(f"N={n} bare, {cache}: all answered a command",
                                        []).append(max(each))
                        print(f"round {rnd} N={n} bare {cache}: returned {ret:.2f}s, "
                              f"answered {max(each):.2f}s", flush=True)
                    order = list(zip(nodes, apis, srcs, strict=True))
                    for (label, node), api, src in (order if rnd % 2 == 0 else order[::-1]):
                        call, each, steps, stopped = fork(node, api, src["sandboxID"], n)
                        data.setdefault(f"N={n} {label} fork: source stopped for the capture",
                                        []).extend(stopped)
                        data.setdefault(f"N={n} {label} fork: call until its last child came",
                                        []).append(call)
                        data.setdefault(f"N={n} {label} fork: all answered a command",
                                        []).append(max(each))
                        for k, i in (("slot", 1), ("restore", 2), ("envd", 3), ("init", 4)):
                            data.setdefault(f"N={n} {label} fork, per child: {k} step", []) \
                                .extend(s[i] / 1000 for s in steps)
                        timelines[f"round {rnd} N={n} {label}"] = sorted(steps)
                        print(f"round {rnd} N={n} {label}: call {call:.2f}s, answered "
                              f"{max(each):.2f}s; restores began "
                              f"{[s[0] for s in sorted(steps)][:4]}..", flush=True)
                    time.sleep(2)
            for api, src in zip(apis, srcs, strict=True):
                api.delete(f"/sandboxes/{src['sandboxID']}")
    finally:
        for _, node in nodes:
            node.stop()
            if found := leaks(node.prefix, node.home):
                left[node.prefix] = found
    shutil.rmtree(work, ignore_errors=True)
    rows = {k: summary(v) for k, v in data.items()}
    for n in counts:
        bare = statistics.median(data[f"N={n} bare, in page cache: all answered a command"])
        for label, _ in nodes:
            ours = statistics.median(data[f"N={n} {label} fork: all answered a command"])
            rows[f"N={n} {label}: all answered / bare in page cache (p50)"] = {
                "x": round(ours / bare, 2)}
    report(args.name, "Fork of N against N bare restores of the same capture",
           f"`cd bench && ../.venv/bin/python bench_fork_floor.py --counts {args.counts} "
           f"--rounds {args.rounds}{' --old ' + args.old if args.old else ''}`; load at "
           f"start {os.getloadavg()[0]:.1f}. Timelines (restore start s after the call, "
           f"slot/restore/envd/init ms): {json.dumps(timelines)}",
           f"fork fan-out against its floor ({args.rounds} rounds)", rows, left)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
