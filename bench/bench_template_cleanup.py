"""How the clean-up of creates' own image templates grows with their number n:
its start (the templates directory listed once), a use (touch), a sweep finding k
expired names; beside them what a scan of every record costs (TemplateRegistry.list,
and a lookup by an alias that is not an ID, which scans).

Runs on files only (no node): n template directories as a pull writes them, under a
temporary directory. The sweep's other work per expired name (its record, its
sandboxes and snapshots, the removal) is the same at any n and is not in the table.

    PYTHONPATH=src python bench/bench_template_cleanup.py [n ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from agentenv.builds.auto_cleanup import TemplateCleanup
from agentenv.templates import TemplateRegistry
from common import summary, table, write


def populate(local: Path, n: int) -> list[str]:
    names = []
    for i in range(n):
        name = f"img-{i:016x}"
        (local / name).mkdir(parents=True)
        digest = f"sha256:{i:064x}"
        (local / name / "template.json").write_text(json.dumps({
            "templateID": name, "aliases": [name], "image": {
                "source": f"registry.example/task-{i}:v1", "manifestDigest": digest,
                "layers": [{"digest": f"sha256:{i + 1:064x}", "size": 1000}], "config": {}}}))
        names.append(name)
    return names


def measure(n: int) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "templates"
        names = populate(local, n)
        registry = TemplateRegistry(Path(tmp) / "builtin", local, Path(tmp) / "rootfs")
        manager = SimpleNamespace(templates=registry)
        sources = SimpleNamespace(builder=None, manager=manager, removing={})
        cleanup = TemplateCleanup(sources, 3600)  # type: ignore[arg-type]
        rows: dict[str, dict] = {}
        t0 = time.perf_counter()
        cleanup._load()
        rows[f"n={n}: start (index {n})"] = summary([time.perf_counter() - t0])
        touches = []
        for name in names[:: max(1, n // 200)]:
            t0 = time.perf_counter()
            cleanup.touch(name)
            touches.append(time.perf_counter() - t0)
        rows[f"n={n}: touch (a use)"] = summary(touches)
        t0 = time.perf_counter()
        cleanup._expired()
        rows[f"n={n}: sweep, none expired"] = summary([time.perf_counter() - t0])
        old = time.time() - 7200
        for name in names[:100]:
            cleanup._index(name, old)
        t0 = time.perf_counter()
        expired = cleanup._expired()
        rows[f"n={n}: sweep, {len(expired)} expired (pop only)"] = summary(
            [time.perf_counter() - t0])
        t0 = time.perf_counter()
        for name in expired:
            registry.get(name)
        rows[f"n={n}: their records read"] = summary([time.perf_counter() - t0])
        t0 = time.perf_counter()
        registry.list()
        rows[f"n={n}: for comparison, TemplateRegistry.list()"] = summary(
            [time.perf_counter() - t0])
        return rows


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1000, 10000]
    rows: dict[str, dict] = {}
    for n in sizes:
        rows.update(measure(n))
    text = table("Clean-up of creates' image templates: cost by their number", rows)
    text += ("\nA use is O(log n) (heap push; the .used mtime written at most once per "
             "idle_s/8); a sweep pops only expired names; only the start lists the "
             "directory. A scan of every record (list) is what the clean-up avoids.\n"
             f"cpus {os.cpu_count()}; the machine is shared (noisy).\n")
    write("template_cleanup", {"rows": rows}, text)


if __name__ == "__main__":
    main()
