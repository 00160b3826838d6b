"""Trace: where the node's own CPU goes in a restart (issue 28). py-spy samples the
node's Python process (on-CPU samples only, every thread) while it serves ``-n``
creates from the template's boot image (or resets, --op reset) one at a time, each
until a command ran; the collapsed stacks are summed by the frames named in GROUPS.

    cd bench && PYTHONPATH=<tree>/src:. python trace_restart_cpu.py --py-spy PATH -n 20
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from agentenv.testing import Node
from agentenv.testing.nodes import free_cidr
from snapshot_probes import Tracker, until_command

# A sample is counted under the first of these found in its stack (innermost first).
GROUPS = [
    ("subprocess start (fork/exec of runsc, ip, ...)", ("_execute_child", "fork_exec",
                                                         "_start_subprocess", "subprocess_exec")),
    ("JSON / pydantic", ("json", "pydantic", "model_dump", "model_validate")),
    ("sqlite store", ("sqlite", "store.py")),
    ("envd client (HTTP to envd)", ("envd_client",)),
    ("TLS / httpx client set-up", ("ssl", "create_ssl_context", "load_verify")),
    ("slots (network)", ("network/",)),
    ("runtime (gvisor.py, reaping, exits)", ("runtime/",)),
    ("orchestrator", ("orchestrator/",)),
    ("HTTP server (uvicorn, starlette, fastapi)", ("uvicorn", "starlette", "fastapi", "h11")),
    ("asyncio loop", ("asyncio",)),
]


def classify(stack: str) -> str:
    frames = stack.split(";")[::-1]
    for frame in frames:
        for name, keys in GROUPS:
            if any(k in frame for k in keys):
                return name
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--op", choices=["create", "reset"], default="create")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trace-restart-"))
    node = Node(work / "home", "trc", free_cidr(90, 30, 25), AENV_WARM_POOL_SIZE="0",
                AENV_NET_POOL_LOW="4", AENV_NET_POOL_HIGH="8")
    out = work / "stacks.txt"
    try:
        node.start()
        with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as http:
            t = Tracker(node, api)
            _, body = t.create("base")
            t.delete(body["sandboxID"])
            _, src = t.create("base")
            if args.op == "reset":
                t.snapshot(src["sandboxID"])
            time.sleep(8)
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(node.proc.pid),
                                    "--format", "raw", "--rate", "200", "--threads",
                                    "--nonblocking", "-o", str(out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2)
            t0 = time.perf_counter()
            for _ in range(args.n):
                t1 = time.perf_counter()
                if args.op == "create":
                    _, body = t.create("base")
                    until_command(node, body["sandboxID"], body["envdAccessToken"], t1, http=http)
                    t.delete(body["sandboxID"])
                else:
                    api.post(f"/sandboxes/{src['sandboxID']}/reset", json={})
                    until_command(node, src["sandboxID"], src["envdAccessToken"], t1, http=http)
            wall = time.perf_counter() - t0
            spy.send_signal(2)
            spy.wait(60)
            t.cleanup([])  # type: ignore[arg-type]
    finally:
        node.stop()
    totals: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            totals[classify(stack)] += int(count)
    rate = 200
    print(f"{args.n} {args.op}s in {wall:.1f} s; node process on-CPU samples at {rate}/s, "
          f"ms per {args.op} (each includes a delete for creates):")
    for name, count in totals.most_common():
        print(f"  {name}: {count / rate / args.n * 1000:.1f} ms")
    print(f"  all: {sum(totals.values()) / rate / args.n * 1000:.1f} ms; stacks in {out}")


if __name__ == "__main__":
    main()
