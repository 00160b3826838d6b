"""Pause with memory against a filesystem-only pause (E2B's ``memory: false``), same
node, same run, through the official e2b SDK.

For sandboxes that wrote 0, 16 and 64 MiB of new files (random bytes: no compression
helps), each round pauses one sandbox each way and resumes it:
  - pause and resume times (SDK call to answer; a filesystem resume reboots the
    template and brings the files back)
  - the pause snapshot's size: total bytes, and bytes newly stored in the repository
    (after chunk dedup and zstd)
Bare runsc (checkpoint and restore of the same rootfs, bench_snapshots' floor) is not
repeated here: the memory pause's figures are that comparison's subject.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from e2b import Sandbox

from agentenv.config import Config
from agentenv.snapshot import SnapshotStore, open_repository
from agentenv.testing import Node, leaks
from common import summary, table, write

MIB = 1 << 20


def pause_snapshot(store: SnapshotStore, sandbox_id: str, memory: bool):
    mine = [m for m in store.list(sandbox_id)
            if m.metadata.get("kind") == "pause" and m.metadata.get("memory", True) == memory]
    return max(mine, key=lambda m: m.created_at)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="0,16,64", help="MiB of new files per sandbox")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-pause-"))
    node = Node(home, "abp", "10.23.0.0/16", AENV_TEMPLATE_SNAPSHOTS="false")
    node.start()
    os.environ.update(node.e2b_env())
    store = SnapshotStore(open_repository(Config(home=home).snapshot_repository()),
                          cache_dir=home / "bench-cache", staging_dir=home / "bench-staging")
    samples: dict[str, list[float]] = {}
    sizes_out: dict[str, dict[str, int]] = {}
    try:
        for size in sizes:
            for _ in range(args.rounds):
                for memory in (True, False):
                    kind = "memory" if memory else "filesystem"
                    sbx = Sandbox.create("base", timeout=600)
                    if size:
                        sbx.commands.run(f"head -c {size * MIB} /dev/urandom > "
                                         "/home/user/data.bin")
                    sbx.commands.run("sleep 4242", background=True)
                    t0 = time.perf_counter()
                    sbx.pause(mode="full" if memory else "filesystem")
                    samples.setdefault(f"{size} MiB: pause, {kind}", []).append(
                        time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    Sandbox.connect(sbx.sandbox_id, timeout=600)
                    sbx.commands.run("true")
                    samples.setdefault(f"{size} MiB: resume + a command, {kind}", []).append(
                        time.perf_counter() - t0)
                    m = pause_snapshot(store, sbx.sandbox_id, memory)
                    sizes_out[f"{size} MiB: snapshot, {kind}"] = {
                        "total_MB": round(m.total_bytes / 1e6, 1),
                        "stored_MB": round(m.stored_bytes / 1e6, 1)}
                    sbx.kill()
    finally:
        node.stop()
    left = leaks("abp", home)
    rows = {name: summary(xs) for name, xs in samples.items()}
    rows.update(sizes_out)
    text = ("## Pause with memory vs filesystem-only\n\n"
            f"`python bench/bench_pause_modes.py --rounds {args.rounds} --sizes {args.sizes}`"
            " (in bench/). The snapshot rows are the last round's.\n\n"
            + table("pause modes", rows) + (f"\nleaks: {left}\n" if left else ""))
    write("pause_modes", {"rows": rows, "leaks": left}, text)


if __name__ == "__main__":
    main()
