"""Resume from disk after eviction, beside a bare `runsc restore` of the same size.

A paused sandbox evicted from memory (POST /sandboxes/{id}/evict, as the memory
budget, a launch needing its slot or memory pressure would) resumes by restoring its
capture. The floor is what gVisor itself needs for that: `runsc restore` of an
uncompressed checkpoint (as the node captures) of a bare sandbox on the same `base`
rootfs whose Python process holds as much memory as the paused sandbox's capture.

Each round, for a sandbox that wrote 0 and 64 MiB of new files (random: no
compression helps), interleaved: the bare restore, then on each node (alternating
which goes first) a pause, its eviction and

- "at once": the SDK's connect right after the eviction (the capture's commit may
  still be going on), then a first and a second command;
- "settled": the same once the commit landed (an eviction after the idle time).

The node's own launch steps (`runsc restore` inside the node, envd answering) come
from its debug log. With ``--old PATH`` a node of an older tree runs beside this
tree's, for before/after in one run.

Run as root:  cd bench && ../.venv/bin/python bench_evicted.py [--rounds 4] [--net 207]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from e2b import Sandbox

from agentenv.config import Config
from agentenv.snapshot import SnapshotStore, open_repository
from agentenv.testing import Node, leaks, sdk_env
from agentenv.testing.checkpoints import bare_sandbox
from bench_fork import ROOTFS, BareRunsc
from bench_node import run_native
from bench_pause_modes import pause_snapshot
from common import report, summary
from restore_floor import Floor

MIB = 1 << 20
STEP = re.compile(r"resume of (\w+): slot (\d+) ms, resume (\d+) ms, envd (\d+) ms")
WHEN = {"at once": 0.0, "settled": 4.0}  # seconds between the eviction and the resume


def same_capture_floor(work: Path, node: Node, api: httpx.Client, size: int, net: int
                       ) -> dict[str, float]:
    """A running sandbox like the paused ones (``size`` MiB written, a live process),
    captured as the node captures and restored bare with the node's flags and its own
    spec into a warm slot: seconds until `runsc restore` returned and until it answered
    a command straight to envd, its files in page cache and dropped from it."""
    c = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()
    sid, tok = c["sandboxID"], c["envdAccessToken"]
    out: dict[str, float] = {}
    try:
        with httpx.Client(base_url=node.url, timeout=120) as http:
            run_native(http, sid, tok, ["/bin/sh", "-c", f"head -c {size * MIB} /dev/urandom "
                                        "> /home/user/d.bin; (sleep 4242 &)"])
        with Floor(work, node, sid, tok, net, 1) as floor:
            floor.capture()
            for cache in ("warm", "dropped"):
                if cache == "dropped":
                    floor.drop_cache()
                returned, each = floor.fan_out(1)
                out[f"same capture, {cache}: returned"] = returned
                out[f"same capture, {cache}: answered a command"] = each[0]
    finally:
        api.delete(f"/sandboxes/{sid}")
    return out


def size_matched(work: Path, mib: int) -> tuple[BareRunsc, Path, int]:
    """A bare sandbox whose process holds ``mib`` MiB, checkpointed uncompressed as
    the node checkpoints: the runner (entered), the image and its size in bytes."""
    bare = BareRunsc(work)
    program = f"import os, time\nkeep = os.urandom({mib} << 20)\ntime.sleep(1e9)\n"
    bare.base, bare.bundle = bare_sandbox(work / "matched", ROOTFS,
                                          ["/usr/bin/python3", "-c", program])
    bare.__enter__()
    cid = f"be-src-{uuid.uuid4().hex[:6]}"
    bare.run("run", "--detach", "--bundle", str(bare.bundle), cid)
    time.sleep(2 + mib / 64)  # the process has its memory
    image = work / "image"
    bare.run("checkpoint", "--image-path", str(image), "--compression=none", cid)
    bare.delete_all()
    return bare, image, sum(f.stat().st_size for f in image.rglob("*") if f.is_file())


class Side:
    """One node's resumes: per (size, when) the SDK connect, commands, launch steps."""

    def __init__(self, label: str, node: Node, work: Path) -> None:
        self.label, self.node = label, node
        self.samples: dict[tuple[int, str, str], list[float]] = {}
        self.store = SnapshotStore(open_repository(Config(home=node.home).snapshot_repository()),
                                   cache_dir=work / f"cache-{node.prefix}",
                                   staging_dir=work / f"staging-{node.prefix}")

    def add(self, size: int, when: str, key: str, value: float) -> None:
        self.samples.setdefault((size, when, key), []).append(value)

    def round(self, api: httpx.Client, size: int, when: str) -> int:
        """One pause, eviction and resume; the capture's size in bytes."""
        with sdk_env(self.node.e2b_env()):
            sbx = Sandbox.create("base", timeout=600)
            if size:
                sbx.commands.run(f"head -c {size * MIB} /dev/urandom > /home/user/d.bin")
            sbx.commands.run("sleep 4242", background=True)  # a live process
            sbx.pause()
            api.post(f"/sandboxes/{sbx.sandbox_id}/evict").raise_for_status()
            time.sleep(WHEN[when])
            offset = self.node.log_path.stat().st_size
            t0 = time.perf_counter()
            back = Sandbox.connect(sbx.sandbox_id, timeout=600)
            self.add(size, when, "resume", time.perf_counter() - t0)
            for k in ("cmd1", "cmd2"):
                t0 = time.perf_counter()
                assert back.commands.run("true").exit_code == 0
                self.add(size, when, k, time.perf_counter() - t0)
            m = STEP.search(self.node.log_path.read_text(errors="replace")[offset:])
            if m:
                self.add(size, when, "restore", int(m.group(3)) / 1000)
                self.add(size, when, "envd", int(m.group(4)) / 1000)
            # committed by now: the resume either waited for it or the test did
            for _ in range(100):
                try:
                    captured = pause_snapshot(self.store, sbx.sandbox_id, True).total_bytes
                    break
                except ValueError:  # its commit has not landed yet
                    time.sleep(0.1)
            back.kill()
        return captured

    def rows(self, size: int, label: str, floor: float) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for when in WHEN:
            s = {k: self.samples.get((size, when, k), []) for k in
                 ("resume", "cmd1", "cmd2", "restore", "envd")}
            if not s["resume"]:
                continue
            name = f"{label}, {self.label}, resumed {when}"
            resume, cmd1 = statistics.median(s["resume"]), statistics.median(s["cmd1"])
            out.update({
                f"{name}: resume (SDK connect)": summary(s["resume"]),
                f"{name}: node's `runsc restore` step (log)": summary(s["restore"]),
                f"{name}: node's envd step (log)": summary(s["envd"]),
                f"{name}: first command": summary(s["cmd1"]),
                f"{name}: second command": summary(s["cmd2"]),
                f"{name}: resume / bare restore (p50)": {"x": round(resume / floor, 2)},
                f"{name}: first command / second (p50)": {
                    "x": round(cmd1 / statistics.median(s["cmd2"]), 2)},
            })
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sizes", default="0,64", help="MiB of new files per sandbox")
    ap.add_argument("--net", type=int, default=207, help="the first node's 10.x.0.0/16")
    ap.add_argument("--old", default="", help="PYTHONPATH of an older tree to compare")
    ap.add_argument("--name", default="evicted", help="results file name under results/")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-evicted-"))
    trees = [("this tree", {})] + ([("old tree", {"PYTHONPATH": args.old})] if args.old else [])
    sides = []
    for i, (label, env) in enumerate(trees):
        node = Node(work / f"home{i}", f"be{uuid.uuid4().hex[:2]}{i}",
                    f"10.{args.net + i}.0.0/16", AENV_LOG_LEVEL="debug",
                    AENV_WARM_POOL_SIZE="0", **env)
        sides.append(Side(label, node, work))
    rows: dict[str, dict] = {}
    try:
        for side in sides:
            side.node.start()
        apis = [side.node.client() for side in sides]
        for size in (int(s) for s in args.sizes.split(",")):
            bare_s: list[float] = []
            same: dict[str, list[float]] = {}
            bare, image, bare_bytes, captured = None, Path(), 0, []
            for i in range(args.rounds):
                order = list(zip(sides, apis, strict=True))
                for side, api in (order if i % 2 == 0 else order[::-1]):
                    for when in WHEN:
                        captured.append(side.round(api, size, when))
                if bare is None:  # the floor holds what the first capture held
                    bare, image, bare_bytes = size_matched(work / f"bare{size}",
                                                           max(1, captured[0] // MIB - 3))
                bare_s.append(bare.run("restore", "--detach", "--image-path", str(image),
                                       "--bundle", str(bare.bundle), f"be-{size}-{i}"))
                bare.delete_all()
                for k, v in same_capture_floor(work / f"same{size}-{i}", sides[0].node,
                                               apis[0], size, args.net + 10).items():
                    same.setdefault(k, []).append(v)
                print(f"{size} MiB round {i}: bare {bare_s[-1] * 1000:.0f} ms; " + "; ".join(
                    f"{s.label} {when} {s.samples[size, when, 'resume'][-1] * 1000:.0f} ms"
                    for s in sides for when in WHEN), flush=True)
            assert bare is not None
            bare.__exit__(None, None, None)
            label = (f"{size} MiB written ({statistics.median(captured) / 1e6:.0f} MB capture, "
                     f"floor {bare_bytes / 1e6:.0f} MB)")
            rows[f"{label}: bare `runsc restore` (the floor)"] = summary(bare_s)
            rows.update({f"{label}: bare restore of the {k}": summary(v)
                         for k, v in same.items()})
            for side in sides:
                rows.update(side.rows(size, label, statistics.median(bare_s)))
        for api in apis:
            api.close()
    finally:
        for side in sides:
            side.node.stop()
    left = {s.node.prefix: leaks(s.node.prefix, s.node.home) for s in sides}
    left = {k: v for k, v in left.items() if v}
    shutil.rmtree(work, ignore_errors=True)
    report(args.name, "Resume from disk after eviction, beside bare runsc restore",
           f"`cd bench && ../.venv/bin/python bench_evicted.py --rounds {args.rounds} "
           f"--sizes {args.sizes}{' --old ' + args.old if args.old else ''}`; each round "
           "interleaves the nodes' resumes and the bare restore.",
           f"evicted resume ({args.rounds} rounds)", rows, left)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
