"""Agent episodes (issue 27): every step follows a think gap; what does that step cost?

N `base` sandboxes on one node, each running an episode through the async e2b SDK:
think for a gap drawn uniformly from ``--gap`` seconds, then one step, a mix of
``true``, a short python, and a file write then read; ``--steps`` steps in all across
the N. Beside them in the same run, ``--warm`` reference sandboxes do the same steps
with no gap (always awake): the floor a step after a gap is measured against.

Recorded per arm (a node configuration):
- step latency after a gap, p50 / p99 / max, per kind and overall, and the warm floor
  per kind; and what the gap adds: each step's latency less its kind's warm p50 (the
  overall p50s compare medians of a mix of three kinds, 35-250 ms apart, so they move
  with the mix as much as with the gap);
- idle cost once every sandbox has had its first step and sat idle (before the
  episodes): the RAM the host holds for each (its memory cgroup, plus its share of
  the zram swap's RAM), host PSS over all runsc processes (each address space once),
  and the CPU of all sandboxes together over ``--window`` s in % of one core;
- the same per sandbox sampled during the episodes (median), the node process's own
  CPU (reclaims run in it), envds dormant at the end;
- failures (any step that raised), which must be 0.

Arms (``ARMS``), run one after the other on the same machine: ``cold`` (memory to
compressed swap 5 s after a freeze), ``default`` (after 60 s, or 1 s when memory is
short), ``awake`` (never frozen: what the gap costs with nothing saved while idle) and
``idle`` (envd sleeps after 5 s idle, two defaults ago).

    PYTHONPATH=src:bench python bench/bench_episodes.py            # quick (make bench)
    PYTHONPATH=src:bench python bench/bench_episodes.py --sandboxes 300 --steps 1000 \
        --gap 5,60 --name episodes_300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from e2b import AsyncSandbox

from agentenv.runtime.gvisor import console_says_dormant
from agentenv.runtime.swap import swap_stats
from agentenv.testing import Node, free_cidr, leaks, sdk_env
from bench_density import CG, MIB, cgroup_memory, cgroup_pss, cpu_ns, create_many
from common import write

ARMS = {
    # frozen sandboxes' memory to compressed swap 5 s after their freeze, envd awake
    "cold": {"AENV_COLD_MEMORY_AFTER_S": "5"},
    # the default: the same after 60 s frozen, or 1 s while memory is short
    "default": {},
    # never frozen, memory kept, envd awake: what a step after a gap costs with nothing
    # saved while idle (each idle sandbox then costs 1-3 % of a core)
    "awake": {"AENV_IDLE_FREEZE_S": "0", "AENV_COLD_MEMORY_AFTER_S": "0"},
    # envd sleeps after 5 s idle (the default two versions ago)
    "idle": {"AENV_ENVD_DORMANT_AFTER_S": "5", "AENV_ENVD_DORMANCY_MB": "-1",
             "AENV_COLD_MEMORY_AFTER_S": "0"},
}
KINDS = ("true", "python", "file")


async def step(sbx: AsyncSandbox, kind: str, n: int) -> None:
    if kind == "true":
        await sbx.commands.run("true")
    elif kind == "python":
        out = await sbx.commands.run("python3 -c 'print(6 * 7)'")
        assert out.stdout == "42\n", out.stdout
    else:
        path = f"/home/user/step-{n % 4}.txt"
        await sbx.files.write(path, f"step {n}\n")
        assert await sbx.files.read(path) == f"step {n}\n"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1000, 1)


def stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99),
            "max_ms": round(max(xs) * 1000, 1) if xs else None}


def dormant_count(home: Path, ids: list[str]) -> int:
    return sum(console_says_dormant(home / "run" / "sandboxes" / sid / "console.log")
               for sid in ids)


def zram_used() -> int:
    stats = swap_stats()
    return stats.used if stats else 0


def cgroup_usage(prefix: str) -> int:
    root = CG / "memory" / prefix
    return sum(int((c / "memory.usage_in_bytes").read_text())
               for c in root.iterdir() if (c / "memory.usage_in_bytes").is_file()) \
        if root.is_dir() else 0


def idle_cost(prefix: str, n: int, window: float, zram_before: int) -> dict:
    pss, _naive, counted = cgroup_pss(prefix)
    shmem, rss, _ = cgroup_memory(prefix)
    usage = cgroup_usage(prefix)
    zram = max(0, zram_used() - zram_before)
    a, t = cpu_ns(prefix), time.monotonic()
    time.sleep(window)
    cpu = (cpu_ns(prefix) - a) / 1e9 / (time.monotonic() - t) * 100
    return {"pss_MiB_per_sandbox": round(pss / MIB / max(1, counted), 1),
            # what the host holds for each: its cgroup's RAM plus its share of zram
            "usage_MiB_per_sandbox": round(usage / MIB / max(1, n), 1),
            "zram_MiB_per_sandbox": round(zram / MIB / max(1, n), 1),
            "host_MiB_per_sandbox": round((usage + zram) / MIB / max(1, n), 1),
            "memfile_MiB_per_sandbox": round(shmem / MIB / max(1, n), 1),
            "runsc_anon_MiB_per_sandbox": round(rss / MIB / max(1, n), 1),
            "idle_cpu_pct_all": round(cpu, 2)}


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its reaped children (the node: its reclaims run in
    its own thread, in the kernel)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def episodes(ids: list[str], warm_ids: list[str], args: argparse.Namespace,
                   prefix: str, failures: list[str], zram_before: int, node_pid: int) -> dict:
    rng = random.Random(args.seed)
    gmin, gmax = args.gap
    budget = {"left": args.steps}
    after_gap: dict[str, list[float]] = {k: [] for k in KINDS}
    warm: dict[str, list[float]] = {k: [] for k in KINDS}
    pss_samples: list[float] = []
    host_samples: list[float] = []
    stop = asyncio.Event()

    async def one(sid: str) -> None:
        sbx = await AsyncSandbox.connect(sid)
        n = 0
        while budget["left"] > 0:
            await asyncio.sleep(rng.uniform(gmin, gmax))
            if budget["left"] <= 0:
                return
            budget["left"] -= 1
            kind = rng.choice(KINDS)
            t0 = time.perf_counter()
            try:
                await step(sbx, kind, n)
                after_gap[kind].append(time.perf_counter() - t0)
            except Exception as exc:
                failures.append(f"{sid} {kind}: {type(exc).__name__}: {exc}"[:200])
            n += 1

    async def reference(sid: str) -> None:
        sbx = await AsyncSandbox.connect(sid)
        n = 0
        while not stop.is_set():
            kind = KINDS[n % len(KINDS)]
            t0 = time.perf_counter()
            try:
                await step(sbx, kind, n)
                warm[kind].append(time.perf_counter() - t0)
            except Exception as exc:
                failures.append(f"warm {sid} {kind}: {type(exc).__name__}: {exc}"[:200])
            n += 1
            await asyncio.sleep(0.2)

    async def sampler() -> None:
        while not stop.is_set():
            pss, _n, counted = await asyncio.to_thread(cgroup_pss, prefix)
            if counted:
                pss_samples.append(pss / MIB / counted)
                host = cgroup_usage(prefix) + max(0, zram_used() - zram_before)
                host_samples.append(host / MIB / counted)
            await asyncio.sleep(10)

    t0 = time.monotonic()
    cpu0 = cpu_ns(prefix)
    node_cpu0 = process_cpu_s(node_pid)
    side = [asyncio.create_task(reference(s)) for s in warm_ids]
    side.append(asyncio.create_task(sampler()))
    await asyncio.gather(*(one(s) for s in ids))
    stop.set()
    await asyncio.gather(*side)
    wall = time.monotonic() - t0
    every = [x for xs in after_gap.values() for x in xs]
    floor = {k: statistics.median(v) for k, v in warm.items() if v}
    excess = [x - floor[k] for k, xs in after_gap.items() if k in floor for x in xs]
    return {"after_gap": stats(every), **{f"after_gap_{k}": stats(v) for k, v in after_gap.items()},
            "warm": stats([x for xs in warm.values() for x in xs]),
            **{f"warm_{k}": stats(v) for k, v in warm.items()},
            # what the gap adds to a step, against the warm p50 of the step's own kind
            "gap_excess": {"p50_ms": pct(excess, 0.5), "p99_ms": pct(excess, 0.99)},
            "episode_wall_s": round(wall, 1),
            "cpu_pct_all_during": round((cpu_ns(prefix) - cpu0) / 1e9 / wall * 100, 1),
            "node_cpu_pct_during": round((process_cpu_s(node_pid) - node_cpu0) / wall * 100, 1),
            "host_MiB_per_sandbox_during": round(statistics.median(host_samples), 1)
            if host_samples else None,
            "pss_MiB_per_sandbox_during": round(statistics.median(pss_samples), 1)
            if pss_samples else None}


def one_arm(arm: str, args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"bench-ep-{arm}-"))
    prefix = f"bep{arm[0]}"
    zram_before = zram_used()  # (the device is the host's: other tenants' pages are in it)
    node = Node(home, prefix, free_cidr(200, 20, os.getpid()),
                AENV_MAX_SANDBOXES=str(args.sandboxes + args.warm + 8), **ARMS[arm])
    node.start()
    failures: list[str] = []
    row: dict = {"arm": arm, "sandboxes": args.sandboxes}
    try:
        with sdk_env(node.e2b_env()):
            total = args.sandboxes + args.warm
            t = time.monotonic()
            ids = asyncio.run(create_many(node.url, node.api_key, total, 8, failures))
            row["create_s"] = round(time.monotonic() - t, 1)
            warm_ids, ids = ids[:args.warm], ids[args.warm:]

            async def first_steps() -> None:  # every sandbox as an episode's first step
                gate = asyncio.Semaphore(8)

                async def first(sid: str) -> None:
                    async with gate:
                        try:
                            await step(await AsyncSandbox.connect(sid), "true", 0)
                        except Exception as exc:
                            failures.append(f"{sid} first: {type(exc).__name__}: {exc}"[:200])
                await asyncio.gather(*(first(s) for s in ids))
            asyncio.run(first_steps())
            time.sleep(args.settle)  # idle: frozen (and, in the idle arm, dormant)
            row["idle"] = idle_cost(prefix, len(ids), args.window, zram_before)
            row["dormant_idle"] = dormant_count(home, ids)
            assert node.proc is not None
            row.update(asyncio.run(episodes(ids, warm_ids, args, prefix, failures, zram_before,
                                            node.proc.pid)))
            row["dormant_end"] = dormant_count(home, ids)
            row["load_1m"] = round(os.getloadavg()[0], 1)
    finally:
        # (a node ends its sandboxes as it stops: hundreds take minutes on 2 cores)
        node.stop(timeout=900)
        row["failures"] = len(failures)
        row["failure_samples"] = failures[:5]
        row["leaks"] = leaks(prefix, home)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=16)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--gap", type=lambda s: tuple(float(x) for x in s.split(",")),
                    default=(5.0, 30.0))
    # (idle_freeze_s 10 + the cold arm's 5 + the reclaims, one at a time)
    ap.add_argument("--settle", type=float, default=30.0)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--arms", default="cold,default")
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--name", default="episodes")
    args = ap.parse_args()
    rows = [one_arm(arm, args) for arm in args.arms.split(",")]
    report(args, rows)


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    lines = [f"## Agent episodes: {args.sandboxes} sandboxes, {args.steps} steps after think "
             f"gaps of {args.gap[0]:g}-{args.gap[1]:g} s (issue 27)", "",
             f"Beside them, {args.warm} always-awake sandboxes doing the same steps with no gap "
             "(the warm floor, same run, same load). Arms: `cold` = a sandbox frozen 5 s "
             "has its memory moved to compressed swap, envd awake; `default` = the same after "
             "60 s frozen, or 1 s while the host is short of memory (here it is not: envds "
             "awake and resident, as the previous default); `idle` = envd sleeps after 5 s "
             "idle (the default two versions ago).", "",
             "| arm | step after gap p50 / p99 / max ms | warm p50 / p99 ms "
             "| gap adds p50 / p99 ms | true p50 after gap / warm | python | file "
             "| idle host MiB each (RAM + zram) | idle PSS MiB each "
             "| idle CPU % of a core (all) | host MiB each during | node CPU % during "
             "| dormant idle / end | failures | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- |"]
    for r in rows:
        g, w, i = r.get("after_gap", {}), r.get("warm", {}), r.get("idle", {})
        x = r.get("gap_excess", {})
        kinds = " | ".join(f"{r.get(f'after_gap_{k}', {}).get('p50_ms')} / "
                           f"{r.get(f'warm_{k}', {}).get('p50_ms')}" for k in KINDS)
        lines.append(
            f"| {r['arm']} | {g.get('p50_ms')} / {g.get('p99_ms')} / {g.get('max_ms')} "
            f"| {w.get('p50_ms')} / {w.get('p99_ms')} | {x.get('p50_ms')} / {x.get('p99_ms')} "
            f"| {kinds} "
            f"| {i.get('host_MiB_per_sandbox')} ({i.get('usage_MiB_per_sandbox')} + "
            f"{i.get('zram_MiB_per_sandbox')}) | {i.get('pss_MiB_per_sandbox')} "
            f"| {i.get('idle_cpu_pct_all')} | {r.get('host_MiB_per_sandbox_during')} "
            f"| {r.get('node_cpu_pct_during')} "
            f"| {r.get('dormant_idle')} / {r.get('dormant_end')} | {r['failures']} "
            f"| {r.get('load_1m')} |")
    lines += ["", "host MiB: the sandboxes' memory cgroups (RAM they are charged) plus the "
              "zram device's RAM grown since the arm began, per sandbox. PSS: all runsc "
              "processes, each address space once, per sandbox (it cannot see swapped "
              "pages, nor memory-file pages no process maps). idle CPU: all sandboxes "
              "together over the idle window, % of one core; node CPU: the node process "
              "and its reaped children (runsc calls; reclaims run in its thread).", ""]
    write(args.name, {"args": {k: v for k, v in vars(args).items()}, "rows": rows},
          "\n".join(lines))


if __name__ == "__main__":
    main()
