"""Overcommit under pressure (issue 17): sandboxes grow toward their ``memoryMB`` while
the host runs short, and the node pauses the least recently active ones to disk.

The node is told the host has ``--budget-mb`` of memory to spare: its pressure
watermark is set to the host's MemAvailable at the start minus the budget, so the
run fits in minutes on a shared machine instead of filling 24 GiB. ``--sandboxes``
sandboxes are created with ``--memory-mb`` each (the overcommit is their sum over the
budget), each then grows by ``--grow-mb`` of touched memory in steps (a process
started in the background, detached from any request). The run records, every few
seconds, how many are running / paused and MemAvailable; at the end every paused
sandbox is resumed and must still have its grower process and its file, and no
sandbox may have ended otherwise (an OOM kill shows as an ``error`` record or a
missing sandbox).

    PYTHONPATH=src:bench python bench/bench_overcommit.py --sandboxes 12 \\
        --memory-mb 1024 --budget-mb 1536 --grow-mb 320
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from e2b import AsyncSandbox

from agentenv.testing import Node, leaks, sdk_env
from common import write

GROWER = """
import sys, time
step, total, pause, chunks = int(sys.argv[2]) << 20, int(sys.argv[1]) << 20, float(sys.argv[3]), []
while sum(map(len, chunks)) < total:
    b = bytearray(step)
    for i in range(0, step, 4096):
        b[i] = 1
    chunks.append(b)
    time.sleep(pause)
open('/tmp/grown', 'w').write(str(len(chunks)))
time.sleep(1 << 30)
"""


def available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def states(api: httpx.Client, ids: list[str]) -> dict[str, str]:
    out = {}
    for sid in ids:
        r = api.get(f"/sandboxes/{sid}")
        out[sid] = r.json().get("state", "?") if r.status_code == 200 else f"http {r.status_code}"
    return out


async def start_growers(ids: list[str], grow_mb: int, step_mb: int, pause_s: float,
                        problems: list[str]) -> None:
    for sid in ids:
        # Pressure may pause a sandbox between two calls (the budget is small and the
        # other users' memory moves the watermark): connecting again resumes it.
        for attempt in range(3):
            try:
                sbx = await AsyncSandbox.connect(sid)
                await sbx.files.write("/tmp/grow.py", GROWER)
                await sbx.files.write("/tmp/mark", sid)
                # Detached: no request stays in flight, so the sandbox may be paused.
                await sbx.commands.run(f"nohup python3 /tmp/grow.py {grow_mb} {step_mb} "
                                       f"{pause_s} >/dev/null 2>&1 &")
                break
            except Exception as exc:
                problems.append(f"start grower {sid} (attempt {attempt + 1}): "
                                f"{type(exc).__name__}")


async def check(sid: str) -> str | None:
    """None when the sandbox came back whole (resumed if paused), else what is wrong."""
    try:
        sbx = await AsyncSandbox.connect(sid)
        mark = await sbx.files.read("/tmp/mark")
        out = await sbx.commands.run("pgrep -f grow.py >/dev/null && echo alive || echo gone")
        if mark != sid or out.stdout.strip() != "alive":
            return f"{sid}: mark {mark!r}, grower {out.stdout.strip()}"
        return None
    except Exception as exc:
        return f"{sid}: {type(exc).__name__}: {str(exc)[:160]}"


def oom_kills() -> int:
    """The host's OOM kills so far (every memory cgroup's and the global killer's)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def disk_mb(path: Path) -> int:
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, check=False)
    return int(out.stdout.split()[0]) if out.stdout else 0


def host_ram_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=12)
    ap.add_argument("--memory-mb", type=int, default=1024)
    ap.add_argument("--budget-mb", type=int, default=1536,
                    help="host memory the node may use before it must relieve pressure")
    ap.add_argument("--watermark-mb", type=int, default=0,
                    help="the node's pressure watermark itself (MemAvailable in MiB); "
                         "overrides --budget-mb: the host's whole memory, less this")
    ap.add_argument("--grow-mb", type=int, default=320)
    ap.add_argument("--step-mb", type=int, default=32, help="each grower's step")
    ap.add_argument("--pause-s", type=float, default=1.5, help="each grower's pause per step")
    ap.add_argument("--abort-below-mb", type=int, default=1024,
                    help="safety for a shared host: below this MemAvailable the run ends")
    ap.add_argument("--run-s", type=float, default=150, help="how long to watch them grow")
    ap.add_argument("--idle-freeze-s", type=float, default=0,
                    help="the node's idle_freeze_s: 0 (default here) keeps the growers "
                         "growing; idle freezing stops a low-CPU background process")
    ap.add_argument("--prefix", default="boc")
    ap.add_argument("--cidr", default="10.103.0.0/16")
    ap.add_argument("--name", default="overcommit")
    args = ap.parse_args()

    start_avail = available_mb()
    if args.watermark_mb:
        watermark, budget = args.watermark_mb, start_avail - args.watermark_mb
    else:
        watermark, budget = start_avail - args.budget_mb, args.budget_mb
    kills_before = oom_kills()
    home = Path(tempfile.mkdtemp(prefix="aenv-overcommit-"))
    node = Node(home, args.prefix, args.cidr, AENV_MEMORY_PRESSURE_MB=str(watermark),
                AENV_MAX_SANDBOXES=str(args.sandboxes + 4),
                AENV_MAX_MEMORY_MB=str(max(args.memory_mb, 512)),
                AENV_IDLE_FREEZE_S=str(args.idle_freeze_s))
    node.start()
    timeline: list[dict] = []
    problems: list[str] = []
    ids: list[str] = []
    paused: list[str] = []
    resume_s: list[float] = []
    peak_disk = 0
    try:
        with sdk_env(node.e2b_env()), node.client() as api:
            for _ in range(args.sandboxes):
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 3600,
                                                 "memoryMB": args.memory_mb})
                if r.status_code != 201:
                    problems.append(f"create: {r.status_code} {r.text[:160]}")
                    continue
                ids.append(r.json()["sandboxID"])
            asyncio.run(start_growers(ids, args.grow_mb, args.step_mb, args.pause_s, problems))
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.run_s:
                st = states(api, ids)
                counts = {s: list(st.values()).count(s) for s in set(st.values())}
                disk = disk_mb(home)
                peak_disk = max(peak_disk, disk)
                timeline.append({"t_s": round(time.monotonic() - t0), "avail_mb": available_mb(),
                                 "disk_mb": disk, "load_1m": round(os.getloadavg()[0], 1),
                                 **counts})
                print(timeline[-1], flush=True)
                if timeline[-1]["avail_mb"] < args.abort_below_mb:
                    problems.append(f"aborted: MemAvailable {timeline[-1]['avail_mb']} MiB "
                                    f"below {args.abort_below_mb} MiB")
                    break
                time.sleep(5)
            final = states(api, ids)
            problems += [f"{sid}: {s}" for sid, s in final.items()
                         if s not in ("running", "paused")]
            paused = [sid for sid, s in final.items() if s == "paused"]

            async def check_all() -> list[str | None]:
                # Each checked sandbox is deleted at once: resuming them all would only
                # make the node pause others again.
                found = []
                for sid in ids:
                    t = time.monotonic()
                    found.append(await check(sid))
                    if sid in paused:
                        resume_s.append(time.monotonic() - t)
                    with contextlib.suppress(httpx.HTTPError):
                        api.delete(f"/sandboxes/{sid}")
                return found

            problems += [p for p in asyncio.run(check_all()) if p]
    finally:
        node.stop()
        left = leaks(args.prefix, home)
        shutil.rmtree(home, ignore_errors=True)
    kills = oom_kills() - kills_before
    ram = host_ram_mb()
    ratio = round(len(ids) * args.memory_mb / budget, 1)
    ram_ratio = round(len(ids) * args.memory_mb / ram, 1)
    lowest = min((row["avail_mb"] for row in timeline), default=None)
    most = max((row.get("paused", 0) for row in timeline), default=0)
    resume = (round(statistics.median(resume_s), 2) if resume_s else None,
              round(max(resume_s), 2) if resume_s else None)
    text = (f"## Overcommit: {len(ids)} sandboxes x {args.memory_mb} MiB = "
            f"{len(ids) * args.memory_mb} MiB: {ram_ratio}x the host's RAM ({ram} MiB), "
            f"{ratio}x the node's budget ({budget} MiB); each growing by {args.grow_mb} MiB "
            f"({args.step_mb} MiB every {args.pause_s} s)\n\n"
            f"Watermark {watermark} MiB of MemAvailable (MemAvailable {start_avail} MiB at the "
            f"start); lowest MemAvailable seen {lowest} MiB. Most paused at once: {most}; paused "
            f"at the end: {len(paused)}; peak disk of the node's home {peak_disk} MiB. Host OOM "
            f"kills during the run (/proc/vmstat oom_kill): {kills}. Every sandbox checked "
            f"after (paused ones resumed by the SDK's connect): its file and its grower "
            f"process; check of a paused one (resume + file read + command), median / max: "
            f"{resume[0]} / {resume[1]} s.\n\n"
            f"| t_s | avail_mb | running | paused | disk_mb | load_1m |\n"
            f"| --- | --- | --- | --- | --- | --- |\n")
    for row in timeline:
        text += (f"| {row['t_s']} | {row['avail_mb']} | {row.get('running', 0)} | "
                 f"{row.get('paused', 0)} | {row['disk_mb']} | {row['load_1m']} |\n")
    text += f"\nProblems: {problems or 'none'}\n\nLeft behind: {left}\n"
    write(args.name, {"args": vars(args), "watermark_mb": watermark, "budget_mb": budget,
                      "ratio_over_budget": ratio, "ratio_over_host_ram": ram_ratio,
                      "host_ram_mb": ram, "timeline": timeline, "paused_at_end": len(paused),
                      "most_paused": most, "peak_disk_mb": peak_disk, "oom_kills": kills,
                      "resume_check_s": resume_s, "problems": problems, "leaks": left}, text)


if __name__ == "__main__":
    main()
