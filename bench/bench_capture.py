"""What a snapshot of a running sandbox costs as the sandbox grows (issue 15, item 6).

One node, one run, through the official e2b SDK (``create_snapshot``: a leave-running
capture, then its commit to the repository). A ``base`` sandbox holds N MiB either
as a process's memory (random bytes, so no page is zero) or as files written to its
root, whose writable layer lives in memory. For each size, in alternation on the
same sandbox:

  - the SDK call, split by the node's log into the capture (what the sandbox is
    stopped for) and the commit (chunking, hashing, storing; the sandbox runs),
    for the sandbox's first snapshot (every chunk is new) and its next ones (only
    changed chunks are stored);
  - the floor: bare ``runsc checkpoint --leave-running --compression=none`` of that
    very sandbox with the node's own runsc root and flags.

The report fits a line to each series: milliseconds per 100 MiB, and the intercept.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from e2b import Sandbox

from agentenv.testing import Node, leaks
from common import report, summary

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="0,100,200,300",
                    help="MiB each sandbox holds (a sandbox of base has 512 MiB)")
    args = ap.parse_args()
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
           f"`python bench_capture.py --rounds {args.rounds} --sizes {args.sizes}` (in bench/)."
           " Medians; the fits are least squares over every sample.",
           "capture cost", rows, left)

if __name__ == "__main__":
    main()
