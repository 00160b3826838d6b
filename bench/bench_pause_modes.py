"""The pause modes, same node, same run, through the official e2b SDK:

  - memory, resident: a pause freezes the sandbox and answers (its capture follows in
    the background); a resume right after is a thaw. Floor: bare `runsc pause` and
    `runsc resume` of a sandbox of the same node, in the same run.
  - memory, evicted: resumed after POST /sandboxes/{id}/evict freed it (as its idle
    time or the memory budget would): a restore from its capture.
  - filesystem (E2B's ``memory: false``): the files only; a resume reboots the
    template and brings the files back.

For sandboxes that wrote 0, 16 and 64 MiB of new files (random bytes: no compression
helps): pause and resume-plus-a-command times, and each pause snapshot's size (total
bytes, and bytes newly stored in the repository after chunk dedup and zstd).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from e2b import Sandbox

from agentenv.config import Config
from agentenv.snapshot import SnapshotStore, open_repository
from agentenv.testing import Node, leaks
from common import report, summary

MIB = 1 << 20
MODES = ("memory, resident", "memory, resident, after its capture", "memory, evicted",
         "filesystem")
# A resume right after a pause waits for the background capture that the pause
# started; a few seconds later that capture is long done and a resume is a thaw.
CAPTURE_SETTLE_S = 3.0


def bare(home: Path, verb: str, sandbox_id: str) -> float:
    flags = [f"--root={home}/run/runsc", "--platform=systrap", "--network=sandbox",
             "--overlay2=root:memory"]
    t0 = time.perf_counter()
    subprocess.run(["runsc", *flags, verb, sandbox_id], check=True, capture_output=True)
    return time.perf_counter() - t0


def pause_snapshot(store: SnapshotStore, sandbox_id: str, memory: bool):
    mine = [m for m in store.list(sandbox_id)
            if m.metadata.get("kind") == "pause" and m.metadata.get("memory", True) == memory]
    return max(mine, key=lambda m: m.created_at)


def evict(node: Node, ids: list[str]) -> None:
    """Out of memory now (POST /sandboxes/{id}/evict waits for each capture)."""
    with node.client() as api:
        for sid in ids:
            api.post(f"/sandboxes/{sid}/evict").raise_for_status()


def fleet(n: int, mode: str, node: Node, samples: dict[str, list[float]]) -> None:
    """``n`` sandboxes paused at once, then resumed at once: wall time of each burst."""
    boxes = [Sandbox.create("base", timeout=600) for _ in range(n)]
    memory = mode != "filesystem"
    with ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda b: b.pause(mode="full" if memory else "filesystem"), boxes))
        samples.setdefault(f"fleet of {n}: pause all, {mode}", []).append(
            time.perf_counter() - t0)
        if mode == "memory, evicted":
            evict(node, [b.sandbox_id for b in boxes])
        t0 = time.perf_counter()
        list(pool.map(lambda b: (Sandbox.connect(b.sandbox_id, timeout=600),
                                 b.commands.run("true")), boxes))
        samples.setdefault(f"fleet of {n}: resume all + a command each, {mode}", []).append(
            time.perf_counter() - t0)
        list(pool.map(lambda b: b.kill(), boxes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="0,16,64", help="MiB of new files per sandbox")
    ap.add_argument("--fleet", type=int, default=8,
                    help="sandboxes paused and resumed at once, as a burst")
    ap.add_argument("--modes", default="; ".join(MODES), help="';'-separated")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(";")]
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}; known: {'; '.join(MODES)}")

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-pause-"))
    node = Node(home, "abp", "10.23.0.0/16")
    node.start()
    os.environ.update(node.e2b_env())
    store = SnapshotStore(open_repository(Config(home=home).snapshot_repository()),
                          cache_dir=home / "bench-cache", staging_dir=home / "bench-staging")
    samples: dict[str, list[float]] = {}
    sizes_out: dict[str, dict[str, int]] = {}
    try:
        for size in sizes:
            for _ in range(args.rounds):
                for mode in modes:
                    memory = mode != "filesystem"
                    sbx = Sandbox.create("base", timeout=600)
                    if size:
                        sbx.commands.run(f"head -c {size * MIB} /dev/urandom > "
                                         "/home/user/data.bin")
                    sbx.commands.run("sleep 4242", background=True)
                    if mode == "memory, resident":  # the floor, on this very sandbox
                        samples.setdefault(f"{size} MiB: bare runsc pause", []).append(
                            bare(home, "pause", sbx.sandbox_id))
                        samples.setdefault(f"{size} MiB: bare runsc resume", []).append(
                            bare(home, "resume", sbx.sandbox_id))
                    t0 = time.perf_counter()
                    sbx.pause(mode="full" if memory else "filesystem")
                    samples.setdefault(f"{size} MiB: pause, {mode}", []).append(
                        time.perf_counter() - t0)
                    if mode == "memory, evicted":
                        evict(node, [sbx.sandbox_id])
                    elif mode == "memory, resident, after its capture":
                        time.sleep(CAPTURE_SETTLE_S)
                    t0 = time.perf_counter()
                    Sandbox.connect(sbx.sandbox_id, timeout=600)
                    samples.setdefault(f"{size} MiB: resume (SDK connect alone), {mode}",
                                       []).append(time.perf_counter() - t0)
                    sbx.commands.run("true")
                    samples.setdefault(f"{size} MiB: resume + a command, {mode}", []).append(
                        time.perf_counter() - t0)
                    if mode in ("memory, evicted", "filesystem"):
                        m = pause_snapshot(store, sbx.sandbox_id, memory)
                        sizes_out[f"{size} MiB: snapshot, {'memory' if memory else mode}"] = {
                            "total_MB": round(m.total_bytes / 1e6, 1),
                            "stored_MB": round(m.stored_bytes / 1e6, 1)}
                    sbx.kill()
        for mode in modes:
            if mode != "memory, resident, after its capture":
                fleet(args.fleet, mode, node, samples)
    finally:
        node.stop()
    left = leaks("abp", home)
    rows = {name: summary(xs) for name, xs in samples.items()}
    rows.update(sizes_out)
    report("pause_modes", "Pause with memory vs filesystem-only",
           f"`python bench/bench_pause_modes.py --rounds {args.rounds} --sizes {args.sizes} "
           f"--fleet {args.fleet} --modes \"{args.modes}\"` (in bench/). The snapshot rows "
           "are the last round's.",
           "pause modes", rows, left)

if __name__ == "__main__":
    main()
