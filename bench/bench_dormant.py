"""envd dormancy (issue 17): idle `base` sandboxes with envd awake vs dormant.

Two nodes one after the other, the same in all but ``envd_dormant_after_s``: 0 (envd
stays awake, as before) and ``--after`` (envd goes dormant). Both run with the idle
freezer off, so the figures show what dormancy itself changes (a frozen sandbox's
CPU is 0 either way; its memory is what it held when frozen). At each step (``--steps``
sandboxes, ramped) after every sandbox ran one command and then sat idle:

- host memory per sandbox: PSS of all runsc processes in the sandboxes' memory cgroups,
  each address space once (agentenv.testing.hostmem), and the cgroups' memory-file
  and runsc-heap counts (what no process maps);
- idle CPU of all sandboxes together (the node's cpuacct cgroup) over ``--window`` s;
- the first command's latency in ``--probes`` idle sandboxes (a wake, when dormant),
  then a second one at once (envd awake): medians;
- how many sandboxes' envd is dormant (their console logs' last envd line).

The floor beside them, measured at every step in the same window: a bare runsc
sandbox (same platform and overlay flags, base rootfs) running ``sleep infinity``,
started before the nodes and running throughout (PSS splits the pages every runsc
process shares, the runsc binary's, among all of them: a floor measured alone on the
host is tens of MiB higher than beside 50 sandboxes).

    PYTHONPATH=src:bench python bench/bench_dormant.py --steps 20,50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from e2b import AsyncSandbox

from agentenv.envd.dormancy import WOKEN_LINE
from agentenv.runtime.gvisor import console_says_dormant
from agentenv.testing import Node, free_cidr, leaks, sdk_env
from bench_density import (
    MIB,
    bare_sandbox,
    base_rootfs,
    cgroup_memory,
    cgroup_pss,
    cpu_ns,
    create_many,
)
from common import write

PREFIX = "bdm"  # this benchmark's own netns/cgroup names


def dormant_ids(home: Path, ids: list[str]) -> list[str]:
    """The sandboxes whose envd is dormant now (as the node reads their console logs)."""
    return [sid for sid in ids
            if console_says_dormant(home / "run" / "sandboxes" / sid / "console.log")]


def idle_cpu_both(cgroups: tuple[str, str], window: float) -> tuple[float, float]:
    """Percent of one core each cgroup used over the same ``window`` seconds."""
    a, t = [cpu_ns(c) for c in cgroups], time.monotonic()
    time.sleep(window)
    dt = time.monotonic() - t
    b = [cpu_ns(c) for c in cgroups]
    return round((b[0] - a[0]) / 1e9 / dt * 100, 2), round((b[1] - a[1]) / 1e9 / dt * 100, 2)


async def run_each(ids: list[str], parallel: int, failures: list[str]) -> None:
    """One command in each sandbox (a user's first step: envd's workers forked)."""
    gate = asyncio.Semaphore(parallel)

    async def one(sid: str) -> None:
        async with gate:
            try:
                sbx = await AsyncSandbox.connect(sid)
                await sbx.files.write("/home/user/step.txt", sid)
                out = await sbx.commands.run(f"cat /home/user/step.txt; echo {sid}")
                if out.stdout != f"{sid}{sid}\n":
                    failures.append(f"run {sid}: {out.stdout!r}")
            except Exception as exc:
                failures.append(f"run {sid}: {type(exc).__name__}: {str(exc)[:160]}")
    await asyncio.gather(*(one(s) for s in ids))


async def first_and_second(ids: list[str]) -> tuple[list[float], list[float]]:
    """Per sandbox, one after the other: the first command after idleness, then another."""
    first, second = [], []
    for sid in ids:
        sbx = await AsyncSandbox.connect(sid)
        for into in (first, second):
            t0 = time.perf_counter()
            out = await sbx.commands.run("true")
            assert out.exit_code == 0
            into.append(time.perf_counter() - t0)
    return first, second


def envd_wake_ms(home: Path, ids: list[str]) -> list[float]:
    """envd's own start when woken (its console: imports and app), each sandbox's last."""
    out = []
    for sid in ids:
        with contextlib.suppress(OSError, ValueError):
            text = (home / "run" / "sandboxes" / sid / "console.log").read_text(errors="replace")
            line = text[text.rindex(WOKEN_LINE):].splitlines()[0]
            out.append(float(line.rsplit("imports and app", 1)[1].strip()) / 1000)
    return out


def ms(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1000, 1) if xs else None


def wait_idle(home: Path, ids: list[str], after: float, settle: float) -> float:
    """Seconds waited until every envd is dormant (``after`` > 0), or ``settle``."""
    t0 = time.monotonic()
    if not after:
        time.sleep(settle)
        return settle
    end = t0 + max(settle, after * 6)
    while len(dormant_ids(home, ids)) < len(ids) and time.monotonic() < end:
        time.sleep(0.5)
    time.sleep(max(2.0, t0 + settle - time.monotonic()))  # as long as awake ones idle
    return round(time.monotonic() - t0, 1)


def one_node(after: float, steps: list[int], args: argparse.Namespace, floor: str
             ) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="aenv-dormant-"))
    env = {"AENV_NET_POOL_LOW": "8", "AENV_NET_POOL_HIGH": "16",
           "AENV_MAX_SANDBOXES": str(max(steps) + 8), "AENV_IDLE_FREEZE_S": "0",
           "AENV_ENVD_DORMANT_AFTER_S": f"{after:g}"}
    node = Node(home, PREFIX, args.cidr, **env)
    node.start()
    rows: list[dict] = []
    failures: list[str] = []
    ids: list[str] = []
    try:
        with sdk_env(node.e2b_env()), node.client() as api:
            for target in steps:
                new = asyncio.run(create_many(node.url, node.api_key, target - len(ids),
                                              args.parallel, failures))
                asyncio.run(run_each(new, args.parallel, failures))
                ids += new
                row: dict = {"envd": "dormant" if after else "awake", "sandboxes": len(ids)}
                row["waited_s"] = wait_idle(home, ids, after, args.settle)
                row["dormant"] = len(dormant_ids(home, ids))
                row["load_1m"] = round(os.getloadavg()[0], 2)
                dedup, _naive, count = cgroup_pss(PREFIX)
                row["pss_MiB_per_sandbox"] = round(dedup / max(count, 1) / MIB, 1)
                shmem, rss, count = cgroup_memory(PREFIX)
                row["memfile_MiB_per_sandbox"] = round(shmem / max(count, 1) / MIB, 1)
                row["runsc_anon_MiB_per_sandbox"] = round(rss / max(count, 1) / MIB, 1)
                row["floor_pss_MiB"] = round(cgroup_pss(floor)[0] / MIB, 1)
                row["idle_cpu_pct"], row["floor_idle_cpu_pct"] = idle_cpu_both(
                    (PREFIX, floor), args.window)
                row["idle_cpu_pct_per_sandbox"] = round(row["idle_cpu_pct"] / len(ids), 3)
                first, second = asyncio.run(first_and_second(ids[:args.probes]))
                row["first_cmd_p50_ms"] = ms(first)
                row["second_cmd_p50_ms"] = ms(second)
                row["envd_wake_p50_ms"] = ms(envd_wake_ms(home, ids[:args.probes]))
                row["failures"] = len(failures)
                rows.append(row)
                print(row, flush=True)
            for sid in ids:
                with contextlib.suppress(httpx.HTTPError):
                    api.delete(f"/sandboxes/{sid}")
    finally:
        node.stop()
        left = leaks(PREFIX, home)
        shutil.rmtree(home, ignore_errors=True)
    if left or failures:
        rows.append({"envd": "dormant" if after else "awake", "left": left,
                     "failure_list": failures[:20]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="20,50", help="sandboxes at each step (ramped)")
    ap.add_argument("--after", type=float, default=5, help="envd_dormant_after_s when dormant")
    ap.add_argument("--window", type=float, default=20, help="idle CPU window, seconds")
    # 40 s: past envd's file workers' idle exit (30 s), so that awake is envd alone.
    ap.add_argument("--settle", type=float, default=40,
                    help="seconds idle before measuring (at least; dormant: until all sleep)")
    ap.add_argument("--probes", type=int, default=10, help="sandboxes timed for latency")
    ap.add_argument("--parallel", type=int, default=4, help="creates and commands at once")
    ap.add_argument("--cidr", default=None, help="the nodes' slot addresses (a free /16)")
    ap.add_argument("--name", default="dormant")
    args = ap.parse_args()
    args.cidr = args.cidr or free_cidr(160, 20, os.getpid())
    steps = sorted(int(s) for s in args.steps.split(","))
    floor = f"{PREFIX}floor"
    with bare_sandbox(floor, base_rootfs(), ["sleep", "infinity"]):
        rows = one_node(0, steps, args, floor) + one_node(args.after, steps, args, floor)
    report(args, steps, rows)


def report(args: argparse.Namespace, steps: list[int], rows: list[dict]) -> None:
    cols = ["envd", "sandboxes", "dormant", "pss_MiB_per_sandbox", "floor_pss_MiB",
            "memfile_MiB_per_sandbox", "runsc_anon_MiB_per_sandbox", "idle_cpu_pct",
            "idle_cpu_pct_per_sandbox", "floor_idle_cpu_pct", "first_cmd_p50_ms",
            "second_cmd_p50_ms", "envd_wake_p50_ms", "waited_s", "load_1m", "failures"]
    text = (f"## envd dormancy: idle `base` sandboxes, envd awake vs dormant "
            f"(envd_dormant_after_s {args.after:g}; idle freezer off; steps {steps})\n\n"
            "floor: a bare runsc sandbox (same flags, base rootfs) running `sleep infinity` "
            "beside them, measured in the same step and window.\n\n| "
            + " | ".join(cols) + " |\n|" + " --- |" * len(cols) + "\n")
    for row in rows:
        if "sandboxes" in row:
            text += "| " + " | ".join(str(row.get(c, "")) for c in cols) + " |\n"
    text += ("\npss: host PSS of all runsc processes per sandbox, each address space once. "
             "memfile/runsc_anon: the memory cgroups' total_shmem/total_rss per sandbox. "
             "idle_cpu_pct: percent of ONE core used by all sandboxes together over "
             f"{args.window:g} s. first_cmd: the first `commands.run` after the idle wait "
             f"(a wake when dormant), second_cmd: the next one at once; medians over "
             f"{args.probes} sandboxes, one at a time. envd_wake: envd's own start when "
             "woken (its console's `imports and app`, from the exec of Python on).\n")
    extra = [r for r in rows if "sandboxes" not in r]
    if extra:
        text += "\nFailures / left behind:\n" + "\n".join(f"- {r}" for r in extra) + "\n"
    write(args.name, {"rows": rows, "after_s": args.after,
                      "window_s": args.window}, text)


if __name__ == "__main__":
    main()
