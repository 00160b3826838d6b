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
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from e2b import AsyncSandbox

from agentenv.testing import Node, leaks, sdk_env
from common import write

GROWER = """
import sys, time
step, total, chunks = 32 << 20, int(sys.argv[1]) << 20, []
while sum(map(len, chunks)) < total:
    b = bytearray(step)
    for i in range(0, step, 4096):
        b[i] = 1
    chunks.append(b)
    time.sleep(1.5)
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


async def start_growers(ids: list[str], grow_mb: int) -> None:
    for sid in ids:
        sbx = await AsyncSandbox.connect(sid)
        await sbx.files.write("/tmp/grow.py", GROWER)
        await sbx.files.write("/tmp/mark", sid)
        # Detached: no request stays in flight, so the sandbox may be paused.
        await sbx.commands.run(f"nohup python3 /tmp/grow.py {grow_mb} >/dev/null 2>&1 &")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=12)
    ap.add_argument("--memory-mb", type=int, default=1024)
    ap.add_argument("--budget-mb", type=int, default=1536,
                    help="host memory the node may use before it must relieve pressure")
    ap.add_argument("--grow-mb", type=int, default=320)
    ap.add_argument("--run-s", type=float, default=150, help="how long to watch them grow")
    ap.add_argument("--prefix", default="boc")
    ap.add_argument("--cidr", default="10.103.0.0/16")
    ap.add_argument("--name", default="overcommit")
    args = ap.parse_args()

    start_avail = available_mb()
    watermark = start_avail - args.budget_mb
    home = Path(tempfile.mkdtemp(prefix="aenv-overcommit-"))
    node = Node(home, args.prefix, args.cidr, AENV_MEMORY_PRESSURE_MB=str(watermark),
                AENV_MAX_SANDBOXES=str(args.sandboxes + 4),
                AENV_MAX_MEMORY_MB=str(max(args.memory_mb, 512)))
    node.start()
    timeline: list[dict] = []
    problems: list[str] = []
    ids: list[str] = []
    try:
        with sdk_env(node.e2b_env()), node.client() as api:
            for _ in range(args.sandboxes):
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 3600,
                                                 "memoryMB": args.memory_mb})
                if r.status_code != 201:
                    problems.append(f"create: {r.status_code} {r.text[:160]}")
                    continue
                ids.append(r.json()["sandboxID"])
            asyncio.run(start_growers(ids, args.grow_mb))
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.run_s:
                st = states(api, ids)
                counts = {s: list(st.values()).count(s) for s in set(st.values())}
                timeline.append({"t_s": round(time.monotonic() - t0), "avail_mb": available_mb(),
                                 **counts})
                print(timeline[-1], flush=True)
                time.sleep(5)
            final = states(api, ids)
            problems += [f"{sid}: {s}" for sid, s in final.items()
                         if s not in ("running", "paused")]
            paused = [sid for sid, s in final.items() if s == "paused"]

            async def check_all() -> list[str | None]:
                return [await check(sid) for sid in ids]

            problems += [p for p in asyncio.run(check_all()) if p]
            for sid in ids:
                with contextlib.suppress(httpx.HTTPError):
                    api.delete(f"/sandboxes/{sid}")
    finally:
        node.stop()
        left = leaks(args.prefix, home)
        shutil.rmtree(home, ignore_errors=True)
    ratio = round(len(ids) * args.memory_mb / args.budget_mb, 1)
    lowest = min((row["avail_mb"] for row in timeline), default=None)
    text = (f"## Overcommit: {len(ids)} sandboxes x {args.memory_mb} MiB over a budget of "
            f"{args.budget_mb} MiB ({ratio}x), each growing by {args.grow_mb} MiB\n\n"
            f"Watermark {watermark} MiB (MemAvailable {start_avail} MiB at the start minus the "
            f"budget); lowest MemAvailable seen {lowest} MiB. Paused at the end: {len(paused)}; "
            f"every sandbox checked after (paused ones resumed): its file and its grower "
            f"process.\n\n| t_s | avail_mb | running | paused |\n| --- | --- | --- | --- |\n")
    for row in timeline:
        text += (f"| {row['t_s']} | {row['avail_mb']} | {row.get('running', 0)} | "
                 f"{row.get('paused', 0)} |\n")
    text += f"\nProblems: {problems or 'none'}\n\nLeft behind: {left}\n"
    write(args.name, {"args": vars(args), "watermark_mb": watermark, "ratio": ratio,
                      "timeline": timeline, "paused_at_end": len(paused),
                      "problems": problems, "leaks": left}, text)


if __name__ == "__main__":
    main()
