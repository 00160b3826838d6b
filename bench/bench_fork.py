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
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.runtime.reaping import reap_runsc_orphans
from agentenv.testing import SHARED_HOME, Node, leaks
from agentenv.testing.checkpoints import bare_sandbox
from bench_snapshots import until_command
from common import report, summary

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
    ap = argparse.ArgumentParser()
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


if __name__ == "__main__":
    raise SystemExit(main())
