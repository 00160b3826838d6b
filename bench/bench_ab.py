"""Two trees side by side on one busy machine (issue 15): a node of each runs at once
and every operation alternates between them (old, new, old, new...), with bare
`runsc do /bin/true` between, so both see the same load. Load from other users of
the machine moves whole rounds by 2x here; interleaving each sample cancels most.

    cd bench && PYTHONPATH=<new>/src python bench_ab.py --old <old>/src --new <new>/src

Cold create (node log), pause + resume (API), create from the template's boot image
(API) and fork of 16 (call, and until every child answers). Results go to
results/<name>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from agentenv.testing import Node, leaks
from bench_node import runsc_do_true
from bench_snapshots import FORK, TTL, NodeLog, Tracker, created_ms, until_command
from common import summary, write

STEPS = ["cold create, node-side (node log)", "cold create until a command runs",
         "resume (API call until 201)", "resume until a command runs",
         "boot-image create (API call)", "boot-image create until a command runs",
         "fork of 16: fork call", "fork of 16: all 16 children answer"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="PYTHONPATH of the old tree")
    ap.add_argument("--new", required=True, help="PYTHONPATH of the new tree")
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--forks", type=int, default=3)
    ap.add_argument("--name", default="ab")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-ab-"))
    trees = {"old": args.old, "new": args.new}
    nodes: dict[tuple[str, str], Node] = {}
    for k, (side, kind) in enumerate((s, t) for s in trees for t in ("boot", "image")):
        env = {"PYTHONPATH": trees[side], "AENV_MAX_SANDBOXES": "40",
               "AENV_NET_POOL_LOW": "18" if kind == "boot" else "4", "AENV_NET_POOL_HIGH": "24",
               "AENV_WARM_POOL_SIZE": "0"}
        if kind == "boot":
            env["AENV_TEMPLATE_SNAPSHOTS"] = "0"
        nodes[side, kind] = Node(work / f"{side}-{kind}", f"aab{k}", f"10.{23 + k}.0.0/16", **env)
    samples: dict[str, dict[str, list[float]]] = {s: {k: [] for k in STEPS} for s in trees}
    bare: list[float] = []
    started: list[Node] = []
    try:
        for node in nodes.values():
            node.start()
            started.append(node)
        apis = {key: node.client() for key, node in nodes.items()}
        trackers = {key: Tracker(nodes[key], api) for key, api in apis.items()}
        logs = {key: NodeLog(node) for key, node in nodes.items()}
        time.sleep(5)
        # the first create on an image node builds the template's boot image
        for side in trees:
            _, body = trackers[side, "image"].create("base")
            trackers[side, "image"].delete(body["sandboxID"])
        time.sleep(10)
        paused: dict[str, tuple[str, str]] = {}
        for _ in range(args.n):
            for side in trees:
                bare.append(runsc_do_true())
                t, log = trackers[side, "boot"], logs[side, "boot"]
                t0 = time.perf_counter()
                _, body = t.create("base")
                samples[side][STEPS[1]].append(
                    until_command(t.node, body["sandboxID"], body["envdAccessToken"], t0))
                ms = created_ms(log, body["sandboxID"])
                if ms is not None:
                    samples[side][STEPS[0]].append(ms / 1000)
                if side not in paused:
                    paused[side] = (body["sandboxID"], body["envdAccessToken"])
                else:
                    t.delete(body["sandboxID"])
                sid, token = paused[side]
                if t.api.post(f"/sandboxes/{sid}/pause").status_code != 204:
                    raise RuntimeError("pause failed")
                time.sleep(1)  # the background commit
                t0 = time.perf_counter()
                r = t.api.post(f"/sandboxes/{sid}/resume", json={"timeout": TTL})
                samples[side][STEPS[2]].append(time.perf_counter() - t0)
                if r.status_code != 201:
                    raise RuntimeError(f"resume: {r.status_code} {r.text[:200]}")
                samples[side][STEPS[3]].append(until_command(t.node, sid, token, t0))
                ti = trackers[side, "image"]
                t0 = time.perf_counter()
                dt, body = ti.create("base")
                samples[side][STEPS[4]].append(dt)
                samples[side][STEPS[5]].append(
                    until_command(ti.node, body["sandboxID"], body["envdAccessToken"], t0))
                ti.delete(body["sandboxID"])
        for _ in range(args.forks):
            for side in trees:
                bare.append(runsc_do_true())
                t = trackers[side, "boot"]
                src, _ = paused[side]
                time.sleep(5)
                t0 = time.perf_counter()
                r = t.api.post(f"/sandboxes/{src}/fork", json={"count": FORK, "timeout": TTL},
                               timeout=600)
                samples[side][STEPS[6]].append(time.perf_counter() - t0)
                kids = [c["sandbox"] for c in r.json() if c.get("sandbox")]
                t.sandboxes.update(c["sandboxID"] for c in kids)
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(FORK) as pool:
                    ready = list(pool.map(until_command, [t.node] * len(kids),
                                          [c["sandboxID"] for c in kids],
                                          [c["envdAccessToken"] for c in kids],
                                          [t0] * len(kids)))
                if len(ready) == FORK:
                    samples[side][STEPS[7]].append(max(ready))
                t.delete_many([c["sandboxID"] for c in kids])
        for t in trackers.values():
            t.cleanup([])  # type: ignore[arg-type]
        for api in apis.values():
            api.close()
    finally:
        for node in started:
            node.stop()
    left = {n.prefix: leaks(n.prefix, n.home) for n in started}
    bare_ms = statistics.median(bare) * 1000
    rows: dict[str, dict] = {"bare runsc do /bin/true (interleaved)": summary(bare)}
    lines = ["| step | old p50 ms | new p50 ms | new / old | old / bare runsc | new / bare runsc |",
             "| --- | --- | --- | --- | --- | --- |"]
    for step in STEPS:
        o, n = summary(samples["old"][step]), summary(samples["new"][step])
        rows[f"old: {step}"], rows[f"new: {step}"] = o, n
        if "p50_ms" in o and "p50_ms" in n:
            lines.append(f"| {step} (n={o['n']}/{n['n']}) | {o['p50_ms']} | {n['p50_ms']} | "
                         f"{n['p50_ms'] / o['p50_ms']:.2f} | {o['p50_ms'] / bare_ms:.2f} | "
                         f"{n['p50_ms'] / bare_ms:.2f} |")
    lines.append(f"| bare runsc do /bin/true (interleaved, n={len(bare)}) | {bare_ms:.1f} | "
                 f"{bare_ms:.1f} | | 1 | 1 |")
    text = "\n".join(lines) + "\n"
    if any(left.values()):
        text += f"\nLeft behind: {left}\n"
    write(args.name, {"old": args.old, "new": args.new, "rows": rows, "leaks": left}, text)


if __name__ == "__main__":
    main()
