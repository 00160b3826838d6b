"""`make bench`: the headline benchmarks, each beside its floor, then one summary table.

Each benchmark runs with its own defaults and writes its current result file,
results/<name>.{json,md} (bench/README.md says what each measures and how to run it
alone, and which other benchmarks are current for what). The table at the end reads
those JSON files back: the headline figure of each, beside its floor measured in the
same run.

    python bench/run.py                      # run all six, then the table
    python bench/run.py lifecycle density    # only these, then the table
    python bench/run.py --table              # no run: the table of the results on disk
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

Figures = tuple[str, str]  # (headline figure, its floor)


@dataclass(frozen=True)
class Headline:
    name: str  # results/<name>.json
    script: str
    what: str  # what the headline figure is
    floor: str  # what it is measured against
    figures: Callable[[dict], Figures]


def _ratio(value: float, floor: float) -> str:
    return f" ({value / floor:.1f}x)" if floor else ""


def lifecycle_figures(result: dict) -> Figures:
    p50 = result["p50_ms"]
    create = p50["boot-image create until a command runs"]
    bare = p50["bare runsc restore --detach"]
    return f"{create:.0f} ms{_ratio(create, bare)}", f"{bare:.0f} ms"


def rollouts_figures(result: dict) -> Figures:
    rows = result["rows"]
    host = rows["host processes"]["per_min"]
    name, best = max(((name, row["per_min"]) for name, row in rows.items()
                      if name != "host processes"), key=lambda pair: pair[1])
    return f"{best:.0f} /min ({name})", f"{host:.0f} /min"


def burst_figures(result: dict) -> Figures:
    rows = result["rows"]
    first = rows["time to first command p50 / p99 (s)"]
    ready = rows["placed to ready p50 / p99 (s)"]
    return (f"{first} s for {result['count']} creates, capacity {result['capacity']}",
            f"{ready} s")


def density_figures(result: dict) -> Figures:
    last = result["rows"][-1]
    floor = result.get("floor") or {}
    figure = (f"{last['pss_MiB_per_sandbox']} MiB, {last['idle_cpu_pct']} % CPU "
              f"at {last['sandboxes']} sandboxes")
    if not floor:
        return figure, "not measured (--no-floor)"
    return figure, f"{floor['pss_MiB']} MiB, {floor['idle_cpu_pct']} % CPU"


def images_figures(result: dict) -> Figures:
    unpack = result["unpack"]
    return (f"{unpack['pull + unpack (zstd)']['MB_per_s']} MB/s",
            f"{unpack['tar -x (zstd)']['MB_per_s']} MB/s")


def episodes_figures(result: dict) -> Figures:
    arms = {row["arm"]: row for row in result["rows"]}
    arm = next((arms[name] for name in ("default", "memory") if name in arms),
               result["rows"][0])
    excess = arm["gap_excess"]
    floors = " / ".join(f"{arm[f'warm_{k}']['p50_ms']}" for k in ("true", "python", "file"))
    return (f"+{excess['p50_ms']} ms p50, +{excess['p99_ms']} ms p99 ({arm['arm']} arm)",
            f"{floors} ms (true / python / file)")


HEADLINES = [
    Headline("lifecycle", "bench_lifecycle.py",
             "create from a template's boot image until a command runs, p50",
             "bare `runsc restore --detach`, p50", lifecycle_figures),
    Headline("rollouts", "bench_rollouts.py",
             "SWE-style rollouts per minute, the fastest sandboxed way",
             "the same rollouts as host processes", rollouts_figures),
    Headline("burst", "bench_burst.py",
             "burst of e2b SDK creates: time to first command p50 / p99",
             "one create's own time once admitted (placed to ready) p50 / p99",
             burst_figures),
    Headline("density", "bench_density.py",
             "host memory (PSS) and idle CPU per idle `base` sandbox",
             "a bare runsc sandbox running `sleep infinity`", density_figures),
    Headline("images", "bench_images.py",
             "pull + unpack of a zstd layer, throughput",
             "GNU `tar --zstd -x` of the same bytes", images_figures),
    Headline("episodes", "bench_episodes.py",
             "what a think gap adds to an agent's next step (less its kind's warm p50)",
             "the same steps in an always-awake sandbox, p50 per kind", episodes_figures),
]


def summary_rows() -> list[tuple[str, str, str, str, str]]:
    """(benchmark, headline, figure, floor, when) from results/<name>.json."""
    rows = []
    for headline in HEADLINES:
        path = RESULTS / f"{headline.name}.json"
        if not path.exists():
            rows.append((headline.name, headline.what, "no result yet", headline.floor, ""))
            continue
        result = json.loads(path.read_text())
        try:
            figure, floor = headline.figures(result)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            figure, floor = f"unreadable result ({type(e).__name__}: {e})", ""
        rows.append((headline.name, headline.what, figure,
                     f"{floor}: {headline.floor}" if floor else headline.floor,
                     result.get("when", "")))
    return rows


def summary_table() -> str:
    lines = ["| benchmark | headline | figure | floor | when |",
             "| --- | --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows()]
    return "\n".join(lines) + "\n"


def main() -> int:
    names = [h.name for h in HEADLINES]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("benchmarks", nargs="*", metavar="BENCHMARK",
                    help=f"run only these ({', '.join(names)}); default: all")
    ap.add_argument("--table", action="store_true",
                    help="run nothing: print the table of the results on disk")
    args = ap.parse_args()
    unknown = sorted(set(args.benchmarks) - set(names))
    if unknown:
        ap.error(f"no benchmark {', '.join(unknown)}; the benchmarks: {', '.join(names)}")
    failed = 0
    if not args.table:
        for headline in HEADLINES:
            if args.benchmarks and headline.name not in args.benchmarks:
                continue
            print(f"== {headline.script}", flush=True)
            failed |= subprocess.run([sys.executable, str(HERE / headline.script)],
                                     cwd=HERE).returncode
    print(summary_table(), end="")
    return failed


if __name__ == "__main__":
    sys.exit(main())
