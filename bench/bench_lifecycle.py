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
bare runsc (lifecycle_cpu.py; results/lifecycle_cpu.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lifecycle_cpu
from agentenv.testing import Node, leaks
from bench_node import runsc_do_true
from bench_snapshots import (
    Failures,
    NodeLog,
    Tracker,
    bare_runsc,
    bench_cold_creates,
    bench_fork,
    bench_pause_resume,
    bench_template_creates,
)
from common import RESULTS

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
                    help="CPU-seconds per operation beside bare runsc (lifecycle_cpu.py)")
    ap.add_argument("--files-only", action="store_true",
                    help="with --cpu: only the filesystem-mode resets "
                         "(results/lifecycle_cpu_files_STEP)")
    ap.add_argument("--step", choices=("both", "file", "command", "none"), default="both",
                    help="with --files-only: what each rollout does before its reset")
    args = ap.parse_args()
    if args.cpu and args.files_only:
        lifecycle_cpu.run_files(args.n, args.step)
        return
    if args.cpu:
        lifecycle_cpu.run(args.n)
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


if __name__ == "__main__":
    main()
