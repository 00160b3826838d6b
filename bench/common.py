"""Shared benchmark plumbing: percentiles, tables, JSON results."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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
    import os

    return os.cpu_count() or 0
