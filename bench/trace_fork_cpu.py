"""Trace: the CPU a fork of N spends, against N bare `runsc restore`s at once.

On this 2-core machine a fork's fan-out is bound by CPU, so this counts it (in
clock ticks of /proc, 10 ms): for the bare fan-out, the runsc commands reaped by
this process and the restored sandboxes; for the fork, the node process itself,
what it reaped (runsc commands, exited helpers), and its live sandboxes, from the
fork call to its answer, then until each child ran a command, then one idle second.

Run as root:  cd bench && ../.venv/bin/python trace_fork_cpu.py [count] [rounds] [net]
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.testing import Node, leaks
from bench_fork import BareRunsc
from bench_node import exec_native

HZ = os.sysconf("SC_CLK_TCK")


def _ticks(pid: int | str, reaped: bool = False) -> float:
    f = Path(f"/proc/{pid}/stat").read_text()
    fields = f[f.rindex(")") + 2:].split()
    own = int(fields[11]) + int(fields[12])
    return (int(fields[13]) + int(fields[14]) if reaped else own) / HZ


def live(marker: str, skip: int = 0) -> float:
    """CPU seconds of the live processes whose command line holds ``marker``."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == skip:
            continue
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                total += _ticks(pid)
        except (OSError, ValueError):
            continue
    return total


def node_cpu(node: Node) -> dict[str, float]:
    pid = node.proc.pid
    return {"node": _ticks(pid), "node's reaped": _ticks(pid, reaped=True),
            "sandboxes": live(str(node.home), skip=pid)}


def spent(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(b[k] - a[k], 2) for k in a}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    net = int(sys.argv[3]) if len(sys.argv) > 3 else 209
    work = Path(tempfile.mkdtemp(prefix="trace-fork-cpu-"))
    node = Node(work / "home", f"tc{uuid.uuid4().hex[:2]}", f"10.{net}.0.0/16",
                AENV_MAX_SANDBOXES=str(n + 8), AENV_WARM_POOL_SIZE="0",
                AENV_NET_POOL_LOW=str(n), AENV_NET_POOL_HIGH=str(2 * n), AENV_IDLE_FREEZE_S="0")
    node.start()
    try:
        with BareRunsc(work / "bare") as bare, node.client() as api, \
                httpx.Client(base_url=node.url, timeout=60) as http:
            sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}
                           ).json()["sandboxID"]
            bare.run("run", "--detach", "--bundle", str(bare.bundle), "tc-src")
            time.sleep(3)
            image = work / "bare" / "image"
            bare.run("checkpoint", "--image-path", str(image), "--leave-running",
                     "--compression=none", "tc-src")
            subprocess.run([*bare.base, "delete", "--force", "tc-src"], capture_output=True)
            for r in range(rounds):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(n) as pool:
                    list(pool.map(lambda i: bare.run(
                        "restore", "--detach", "--image-path", str(image), "--bundle",
                        str(bare.bundle), f"tc-{r}-{i}"), range(n)))  # noqa: B023
                wall = time.perf_counter() - t0
                time.sleep(0.5)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                reaped = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                sandboxes = live(str(work / "bare"))
                bare.delete_all()
                print(f"round {r}, bare: all {n} returned {wall:.2f} s; CPU: runsc commands "
                      f"{reaped:.2f} s, sandboxes {sandboxes:.2f} s", flush=True)
                time.sleep(2)
                c0, t0 = node_cpu(node), time.perf_counter()
                kids = [c["sandbox"] for c in api.post(
                    f"/sandboxes/{sid}/fork", json={"count": n}, timeout=300).json()]
                t201, c1 = time.perf_counter() - t0, node_cpu(node)
                with ThreadPoolExecutor(n) as pool:
                    list(pool.map(lambda c: exec_native(http, c["sandboxID"],
                                                        c["envdAccessToken"], ["/bin/true"]),
                                  kids))
                tall, c2 = time.perf_counter() - t0, node_cpu(node)
                time.sleep(1)
                c3 = node_cpu(node)
                print(f"         fork: answered {t201:.2f} s, all ran a command {tall:.2f} s; "
                      f"CPU to the answer {spent(c0, c1)}, then to the commands "
                      f"{spent(c1, c2)}, one idle second {spent(c2, c3)}", flush=True)
                for c in kids:
                    api.delete(f"/sandboxes/{c['sandboxID']}")
                time.sleep(3)
            api.delete(f"/sandboxes/{sid}")
    finally:
        node.stop()
    print("left behind:", leaks(node.prefix, node.home))


if __name__ == "__main__":
    main()
