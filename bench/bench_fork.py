"""Fork fan-out: a fork of N children against N bare `runsc restore`s run at once.

The floor for a fork of N on this machine is N restores of one checkpoint started
together: what gVisor itself needs to bring N copies up on these cores. Each round:

- bare: a python3 process holding 40 MiB (about envd's share) on the `base` rootfs
  (overlay root in memory, no network) is checkpointed once, then N `runsc restore
  --detach` of that image are started at once; the time until all returned, and a
  single restore alone;
- node: a `base` sandbox is forked into N children; the fork call until 201, and until
  every child has run a command (each child polled from the call's start), with the
  node's per-child launch steps (slot, restore, envd, init) from its debug log.

Run as root:  cd bench && ../.venv/bin/python bench_fork.py [--rounds 3] [--count 16]

Mode ``floor`` (``bench_fork.py floor [--counts 1,4,8,16]``): the fork of N against N
bare restores of the fork's own capture with the node's flags, spec and slots
(snapshot_probes.Floor), the capture's files in page cache and dropped from it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx

from agentenv.runtime.reaping import reap_runsc_orphans
from agentenv.testing import SHARED_HOME, Node, leaks
from agentenv.testing.checkpoints import bare_sandbox
from bench_node import run_native
from bench_snapshots import until_command
from common import main_with_modes, report, summary
from snapshot_probes import Floor

ROOTFS = SHARED_HOME / "images" / "templates" / "base" / "rootfs"
PR_SET_CHILD_SUBREAPER = 36
RESULTS_LOG = Path(tempfile.gettempdir()) / "bench-fork-node.log"  # the last run's node log
STEP = re.compile(r"restore of (\w+): slot (\d+) ms, restore (\d+) ms, envd (\d+) ms, "
                  r"init (\d+) ms")


class BareRunsc:
    """A bare runsc sandbox and restores of its checkpoint, reaped as the node reaps."""

    def __init__(self, work: Path) -> None:
        self.work = work
        # A process holding 40 MiB, about what envd and its zygote hold in a sandbox.
        program = "import os, time\nkeep = os.urandom(40 << 20)\ntime.sleep(1e9)\n"
        self.base, self.bundle = bare_sandbox(work, ROOTFS, ["/usr/bin/python3", "-c", program])
        self.err = work / "runsc.err"
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.stop = threading.Event()
        self.reaper = threading.Thread(target=self._reap, daemon=True)

    def __enter__(self) -> BareRunsc:
        self.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.reaper.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete_all()
        self.stop.set()
        self.reaper.join()
        reap_runsc_orphans()
        self.libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def _reap(self) -> None:
        while not self.stop.is_set():
            reap_runsc_orphans()
            time.sleep(0.002)

    def run(self, *args: str) -> float:
        t0 = time.perf_counter()
        with open(self.err, "ab") as err:
            code = subprocess.run([*self.base, *args], timeout=300, stdin=subprocess.DEVNULL,
                                  stdout=err, stderr=err).returncode
        if code:
            raise RuntimeError(f"runsc {args[0]} failed: {self.err.read_text()[-1500:]}")
        return time.perf_counter() - t0

    def ids(self) -> list[str]:
        out = subprocess.run([*self.base, "list", "-quiet"], capture_output=True, text=True)
        return out.stdout.split()

    def delete_all(self) -> None:
        for c in self.ids():
            subprocess.run([*self.base, "kill", c, "KILL"], capture_output=True)
            subprocess.run([*self.base, "delete", "--force", c], capture_output=True)

    def fan_out(self, image: Path, count: int) -> tuple[float, float]:
        """N restores at once: seconds until all returned; one restore alone, after."""
        tag = uuid.uuid4().hex[:6]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(lambda i: self.run("restore", "--detach", "--image-path", str(image),
                                             "--bundle", str(self.bundle), f"bf-{tag}-{i}"),
                          range(count)))
        together = time.perf_counter() - t0
        self.delete_all()
        alone = self.run("restore", "--detach", "--image-path", str(image),
                         "--bundle", str(self.bundle), f"bf-{tag}-alone")
        self.delete_all()
        return together, alone


def fork_round(node: Node, api: httpx.Client, source: str, count: int
               ) -> tuple[float, float, list[float], list[str]]:
    t0 = time.perf_counter()
    r = api.post(f"/sandboxes/{source}/fork", json={"count": count, "timeout": 300},
                 timeout=300)
    call = time.perf_counter() - t0
    r.raise_for_status()
    children = r.json()
    failed = [c["error"]["message"] for c in children if c.get("error")]
    ok = [c["sandbox"] for c in children if c.get("sandbox")]
    # One client for all (an httpx client per thread spends ~35 ms of CPU on its TLS
    # context: 16 of them at once were the benchmark's own cost, not the node's).
    with ThreadPoolExecutor(len(ok) or 1) as pool, \
            httpx.Client(base_url=node.url, timeout=30) as http:
        each = list(pool.map(lambda c: until_command(node, c["sandboxID"],
                                                     c["envdAccessToken"], t0, http=http), ok))
    for c in ok:
        api.delete(f"/sandboxes/{c['sandboxID']}")
    return call, max(each, default=0.0), each, failed


class Forked:
    """One node's fork rounds: the call, every child's first command, the launch steps."""

    def __init__(self, label: str, node: Node) -> None:
        self.label, self.node = label, node
        self.calls: list[float] = []
        self.alls: list[float] = []
        self.each: list[float] = []
        self.failures: list[str] = []
        self.steps: dict[str, list[float]] = {"slot": [], "restore": [], "envd": [],
                                              "init": []}

    def round(self, api: httpx.Client, source: str, count: int) -> str:
        offset = self.node.log_path.stat().st_size
        call, last, per, failed = fork_round(self.node, api, source, count)
        self.calls.append(call)
        self.alls.append(last)
        self.each += per
        self.failures += failed
        text = self.node.log_path.read_text(errors="replace")[offset:]
        for m in STEP.finditer(text):
            for k, v in zip(self.steps, m.groups()[1:], strict=True):
                self.steps[k].append(int(v) / 1000)
        return f"{self.label}: call {call:.2f}s, all answer {last:.2f}s"

    def rows(self, n: int, bare_all: list[float]) -> dict[str, dict]:
        return {
            f"{self.label}: fork call until 201": summary(self.calls),
            f"{self.label}: until all {n} children ran a command": summary(self.alls),
            f"{self.label}: each child ran a command (from the call)": summary(self.each),
            **{f"{self.label}, per child: {k} step (node log)": summary(v)
               for k, v in self.steps.items()},
            f"{self.label}: until all {n} children ran a command, rounds after the first":
                summary(self.alls[1:]),
            f"{self.label}: all children answer / bare fan-out (p50)": {
                "x": round(statistics.median(self.alls) / statistics.median(bare_all), 2)},
            f"{self.label}: failed children": {"count": len(self.failures)},
        }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="mode `floor`: a fork of N against N restores of its own capture with the "
               "node's flags, spec and slots (bench_fork.py floor --help)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--net", type=int, default=231,
                    help="second octet of the first node's 10.x.0.0/16 (the next uses x+1)")
    ap.add_argument("--old", default="", help="PYTHONPATH of an older tree to compare")
    ap.add_argument("--name", default="fork", help="results file name under results/")
    args = ap.parse_args()
    n = args.count
    work = Path(tempfile.mkdtemp(prefix="bench-fork-"))
    tag = uuid.uuid4().hex[:2]
    # The default warm slot pool (4 to 8 slots), and one that holds a fork's worth;
    # with --old, the default pool of an older tree against this one's.
    variants = [("fork, 4 warm slots (default)", {}),
                (f"fork, {n} warm slots", {"AENV_NET_POOL_LOW": str(n),
                                           "AENV_NET_POOL_HIGH": str(2 * n)})]
    if args.old:
        variants = [("old tree, default pool", {"PYTHONPATH": args.old}),
                    ("this tree, default pool", {})]
    forks = [Forked(label, Node(work / f"home{i}", f"bf{tag}{i}", f"10.{args.net + i}.0.0/16",
                                AENV_LOG_LEVEL="debug", AENV_MAX_SANDBOXES=str(n + 4),
                                AENV_WARM_POOL_SIZE="0", **env))
             for i, (label, env) in enumerate(variants)]
    bare_all, bare_one = [], []
    try:
        for f in forks:
            f.node.start()
        with contextlib.ExitStack() as stack:
            bare = stack.enter_context(BareRunsc(work / "bare"))
            apis = [stack.enter_context(f.node.client()) for f in forks]
            sources = []
            for api in apis:
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600})
                r.raise_for_status()
                sources.append(r.json()["sandboxID"])
            cid = f"bf-src-{uuid.uuid4().hex[:6]}"
            bare.run("run", "--detach", "--bundle", str(bare.bundle), cid)
            time.sleep(3)  # the python process has its 40 MiB; the slot pools are warm
            image = work / "bare" / "image"
            bare.run("checkpoint", "--image-path", str(image), "--leave-running",
                     "--compression=none", cid)
            subprocess.run([*bare.base, "delete", "--force", cid], capture_output=True)
            for i in range(args.rounds):
                together, alone = bare.fan_out(image, n)
                bare_all.append(together)
                bare_one.append(alone)
                trio = list(zip(forks, apis, sources, strict=True))
                # Alternated: neither node always goes first, on a busy machine.
                said = [f.round(api, source, n) for f, api, source in
                        (trio if i % 2 == 0 else trio[::-1])]
                time.sleep(3)  # slots released by the round are recycled
                print(f"round {i}: bare {together:.2f}s (one {alone:.2f}s); " + "; ".join(said))
            for api, source in zip(apis, sources, strict=True):
                api.delete(f"/sandboxes/{source}")
    finally:
        for f in forks:
            f.node.stop()
    left = {f.node.prefix: leaks(f.node.prefix, f.node.home) for f in forks}
    left = {k: v for k, v in left.items() if v}
    shutil.copy(forks[0].node.log_path, RESULTS_LOG)
    shutil.rmtree(work, ignore_errors=True)
    rows = {
        f"bare: {n} `runsc restore` at once, until all returned": summary(bare_all),
        "bare: one `runsc restore` alone": summary(bare_one),
    }
    for f in forks:
        rows.update(f.rows(n, bare_all))
    report(args.name, f"Fork of {n} against {n} bare restores at once",
           f"`cd bench && ../.venv/bin/python bench_fork.py --rounds {args.rounds} "
           f"--count {n}{' --old ' + args.old if args.old else ''}`; in each round the bare "
           f"fan-out, then a fork of {n} on each node, "
           "on the same `base` rootfs.", f"fork fan-out ({args.rounds} rounds)", rows, left)
    return 1 if left or any(f.failures for f in forks) else 0


# -------------------- mode `floor` (formerly bench_fork_floor.py)
# Fork fan-out against its true floor: N bare restores of the same capture, same flags.
#
# The floor of a fork of N children is N `runsc restore`s of the fork's own capture
# started at once, with the node's runsc flags and the source's own OCI spec (rootfs,
# mounts, cgroup limits), each into a network slot built like the node's (built
# beforehand, as a warm pool holds them), each then answering a `/bin/true` straight
# to envd at its slot address. The capture is the node's source sandbox checkpointed
# with --leave-running by runsc itself, as the node does for a fork. Measured with
# the capture's files in page cache (as a fork's fresh capture is) and dropped from it
# (posix_fadvise DONTNEED after an fsync), for N in --counts; then the node forks its
# source into N children (each polled with a command from the call's start), and its
# debug log gives every child's restore start and steps.
#
# Run as root:  cd bench && ../.venv/bin/python bench_fork.py floor [--counts 1,4,8,16]
#               [--rounds 2] [--old <tree>/src]   (--old: one more node of that tree)


CAPTURE = re.compile(r"fork of \w+: source stopped (\d+) ms")
FLOOR_STEP = re.compile(r"^(\S+ \S+) DEBUG \S+: restore of (\w+): slot (\d+) ms, restore (\d+) ms, "
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
    for m in FLOOR_STEP.finditer(text):
        ended = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        slot, restore, envd, init = (int(g) for g in m.groups()[2:])
        began = ended - (slot + restore + envd + init) / 1000 - wall0
        steps.append((round(began + slot / 1000, 3), slot, restore, envd, init))
    stopped = [int(m.group(1)) / 1000 for m in CAPTURE.finditer(text)]
    return call, each, steps, stopped


def floor_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="bench_fork.py floor",
        description="Fork fan-out against its true floor: N bare restores of the same "
                    "capture, same flags.")
    ap.add_argument("--counts", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--net", type=int, default=214, help="10.x: floor slots; nodes x+1, x+2")
    ap.add_argument("--old", default="", help="PYTHONPATH of an older tree, forked beside")
    ap.add_argument("--name", default="fork_floor")
    args = ap.parse_args(argv)
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
           f"`cd bench && ../.venv/bin/python bench_fork.py floor --counts {args.counts} "
           f"--rounds {args.rounds}{' --old ' + args.old if args.old else ''}`; load at "
           f"start {os.getloadavg()[0]:.1f}. Timelines (restore start s after the call, "
           f"slot/restore/envd/init ms): {json.dumps(timelines)}",
           f"fork fan-out against its floor ({args.rounds} rounds)", rows, left)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main_with_modes(main, {"floor": floor_main}))
