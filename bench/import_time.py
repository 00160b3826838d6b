"""What starting a control plane costs in imports: CPU and wall time of a fresh
interpreter importing the gateway (and building both apps), median of ``--runs``, and
the modules it loads. Run it with the tree to measure first on ``PYTHONPATH``."""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c pass": "pass",
    "import agentenv.cluster.gateway": "import agentenv.cluster.gateway",
    "both apps built": (
        "import agentenv.cluster.gateway as g, agentenv.cluster.scheduler as s\n"
        "g.create_gateway_app('redis://127.0.0.1:1/0', 'http://127.0.0.1:1', 'key')\n"
        "s.create_scheduler_app('redis://127.0.0.1:1/0', 'key')"),
}
COUNT = ("import sys, agentenv.cluster.gateway\n"
         "print(sum(m.startswith('agentenv') for m in sys.modules), len(sys.modules),"
         " sum(m.startswith('pyroute2') for m in sys.modules))")


def timed(code: str, runs: int) -> tuple[float, float]:
    """Median CPU (user + system) and wall milliseconds of ``python -c code``."""
    cpu, wall = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        wall.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(cpu) * 1000, statistics.median(wall) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for label, code in CASES.items():
        cpu, wall = timed(code, args.runs)
        print(f"{label}: CPU {cpu:.0f} ms, wall {wall:.0f} ms (median of {args.runs})")
    ours, everything, pyroute2 = subprocess.run(
        [sys.executable, "-c", COUNT], capture_output=True, text=True, check=True
    ).stdout.split()
    print(f"modules after importing the gateway: {everything} ({ours} of agentenv, "
          f"{pyroute2} of pyroute2)")


if __name__ == "__main__":
    main()
