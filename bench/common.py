"""Shared benchmark plumbing: percentiles, tables, JSON results, a node's CPU."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main_with_modes(main: Callable[[], object],
                    modes: dict[str, Callable[[list[str]], object]]) -> object:
    """`script.py MODE [its options]` runs MODE, a benchmark folded into this script
    (`script.py MODE --help` lists its options); with no MODE first, the script's own."""
    if len(sys.argv) > 1 and sys.argv[1] in modes:
        return modes[sys.argv[1]](sys.argv[2:])
    return main()


def summary(samples_s: list[float]) -> dict[str, float]:
    """p50 / p90 / max in milliseconds."""
    xs = sorted(samples_s)
    if not xs:
        return {"n": 0}
    p90 = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]
    return {
        "n": len(xs),
        "p50_ms": round(statistics.median(xs) * 1000, 2),
        "p90_ms": round(p90 * 1000, 2),
        "max_ms": round(xs[-1] * 1000, 2),
    }


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def table(title: str, rows: dict[str, dict], target: dict[str, str] | None = None) -> str:
    target = target or {}
    lines = [f"### {title}", "", "| step | n | p50 ms | p90 ms | max ms | target |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, s in rows.items():
        if "p50_ms" in s:
            lines.append(f"| {name} | {s['n']} | {s['p50_ms']} | {s['p90_ms']} | {s['max_ms']} "
                         f"| {target.get(name, '')} |")
        else:
            value = ", ".join(f"{k}={v}" for k, v in s.items())
            lines.append(f"| {name} | | {value} | | | {target.get(name, '')} |")
    return "\n".join(lines) + "\n"


def write(name: str, data: dict, text: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"machine": {"cpus": _cpus(), "python": platform.python_version(),
                        "kernel": platform.release()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **data}
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


def report(name: str, heading: str, intro: str, title: str, rows: dict[str, dict],
           left) -> None:
    """A heading, a line on how it was run, the table and any leaks, as text and JSON."""
    text = (f"## {heading}\n\n{intro}\n\n" + table(title, rows)
            + (f"\nleaks: {left}\n" if left else ""))
    write(name, {"rows": rows, "leaks": left}, text)


def finish(name: str, title: str, rows: dict[str, dict], target: dict[str, str], note: str,
           overlapped: list[str], failures: list[str], left, raw: dict) -> None:
    """The table, its note, what disturbed it and what went wrong, as text and JSON."""
    text = table(title, rows, target) + note
    if overlapped:
        text += ("\nA pytest run went on during these steps (their timings are noisy): "
                 + ", ".join(overlapped) + "\n")
    if failures:
        text += "\nFailures:\n" + "\n".join(f"- {f}" for f in failures[:30]) + "\n"
    text += f"\nLeft behind: {left}\n"
    write(name, {"rows": rows, "raw": raw, "failures": failures, "leaks": left,
                 "pytest_overlapped_steps": overlapped}, text)


def _cpus() -> int:
    return os.cpu_count() or 0


# -------------------- A node's CPU (formerly cpu_meter.py)
# CPU-seconds of one node and everything it starts, read from cgroup v1 cpuacct.
#
# A node's own process and the short-lived processes it runs (runsc invocations, `ip`,
# `iptables`, unshare wrappers) sit in a cpuacct cgroup of their own; each sandbox's
# sentry and gofer sit in ``/<prefix>/<sandbox id>`` (runsc joins the spec's cgroup
# path), under the node's prefix. cgroup v1 charges every ancestor at the moment CPU is
# used, so the prefix cgroup keeps what removed sandboxes used. Both counters together
# are the node's host-wide CPU, whatever else runs on the machine: other users' load
# only stretches the wall time.


ACCT = Path("/sys/fs/cgroup/cpuacct")


def _usage_ns(group: Path) -> int:
    try:
        return int((group / "cpuacct.usage").read_text())
    except (OSError, ValueError):
        return 0


def _split_ns(group: Path) -> tuple[int, int]:
    """(user, system) of a group, in ns (cpuacct.stat is in USER_HZ ticks)."""
    try:
        fields = dict(line.split() for line in (group / "cpuacct.stat").read_text().splitlines())
    except (OSError, ValueError):
        return 0, 0
    tick = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return int(fields.get("user", 0)) * tick, int(fields.get("system", 0)) * tick


class CpuMeter:
    """The CPU of one node: its own cgroup (created here, the node's process tree moved
    into it) plus its sandboxes' parent cgroup."""

    def __init__(self, prefix: str, node_pid: int):
        self.node_group = ACCT / f"bench-node-{prefix}"
        self.node_group.mkdir(exist_ok=True)
        self.sandbox_group = ACCT / prefix
        self.sandbox_group.mkdir(exist_ok=True)  # runsc makes it if missing; same thing
        for pid in _session_pids(node_pid):
            try:
                (self.node_group / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # ended meanwhile

    def read(self) -> dict[str, int]:
        """Cumulative ns: node (its process and children), sandboxes (sentries, gofers)."""
        return {"node": _usage_ns(self.node_group), "sandboxes": _usage_ns(self.sandbox_group)}

    @staticmethod
    def delta_s(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
        out = {k: (after[k] - before[k]) / 1e9 for k in before}
        out["total"] = sum(out.values())
        return out

    def close(self) -> None:
        """Remove the node's group once its processes are gone (rmdir fails otherwise)."""
        for group in (self.node_group,):
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    (ACCT / "cgroup.procs").write_text(pid)
                group.rmdir()
            except OSError:
                pass


def _session_pids(pid: int) -> list[int]:
    """The node's process and every process in its session (it starts its own)."""
    sid = os.getsid(pid)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out
