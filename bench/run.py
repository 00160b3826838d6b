"""`make bench`: every benchmark, results as tables and JSON under bench/results/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITES = ["bench_node.py", "bench_slots.py", "bench_e2b.py", "bench_snapshot_store.py",
          "bench_snapshots.py", "bench_reset.py", "bench_template_build.py",
          "bench_images.py", "bench_image_create.py", "bench_cluster.py", "bench_episodes.py"]


def main() -> int:
    failed = 0
    for suite in SUITES + sys.argv[1:]:
        print(f"== {suite}", flush=True)
        failed |= subprocess.run([sys.executable, str(HERE / suite)], cwd=HERE).returncode
    return failed


if __name__ == "__main__":
    sys.exit(main())
