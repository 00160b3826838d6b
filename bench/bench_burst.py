"""A trainer's burst: N concurrent e2b SDK creates (+ one command + kill each) against a
node whose capacity is smaller than N (issue 16).

Creates beyond capacity wait in the node's admission queue (and, past its queue time,
get 429 with Retry-After, which the SDK's own retries honour); nothing is retried by
this script. Reports how many rollouts succeeded, the time from the burst's start to
each rollout's first command (p50 / p99), where the time went (queued -> placed ->
ready, from the sandboxes' own timings), and what was left behind.

    PYTHONPATH=src:bench python bench/bench_burst.py --count 200 --capacity 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
from e2b import AsyncSandbox

from agentenv.testing import Node, leaks, sdk_env
from common import write


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 2)


def _ts(raw: str | None) -> float:
    return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp() if raw else 0.0


async def burst(count: int, node: Node) -> dict:
    start = time.perf_counter()
    first_command: list[float] = []
    queued: list[float] = []
    placing: list[float] = []
    failures: list[str] = []

    async def rollout(i: int) -> None:
        try:
            sbx = await AsyncSandbox.create(template="base", timeout=300)
        except Exception as exc:
            failures.append(f"create: {type(exc).__name__}: {str(exc)[:160]}")
            return
        try:
            out = await sbx.commands.run(f"echo {i}")
            if out.stdout.strip() != str(i):
                failures.append(f"command {i}: {out.stdout!r}")
                return
            first_command.append(time.perf_counter() - start)
            info = (await http.get(f"/sandboxes/{sbx.sandbox_id}")).json()
            wait = _ts(info.get("placedAt")) - _ts(info.get("queuedAt"))
            ready = _ts(info.get("readyAt")) - _ts(info.get("placedAt"))
            if info.get("queuedAt"):
                queued.append(wait)
                placing.append(ready)
        except Exception as exc:
            failures.append(f"rollout {i}: {type(exc).__name__}: {str(exc)[:160]}")
        finally:
            try:
                await sbx.kill()
            except Exception as exc:
                failures.append(f"kill {i}: {type(exc).__name__}: {exc}")

    async with httpx.AsyncClient(base_url=node.url, headers={"X-API-Key": node.api_key},
                                 timeout=60) as http:
        await asyncio.gather(*(rollout(i) for i in range(count)))
    return {"wall_s": round(time.perf_counter() - start, 2), "first_command_s": first_command,
            "queued_s": queued, "placed_to_ready_s": placing, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--queue-timeout", type=float, default=30.0)
    ap.add_argument("--max-starting", type=int, default=0,
                    help="admission_max_starting (0: the node's default, -1: no limit)")
    ap.add_argument("--name", default="burst", help="results file name")
    args = ap.parse_args()

    prefix = "abu"
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-burst-"))
    node = Node(home, prefix, "10.22.0.0/16", AENV_MAX_SANDBOXES=str(args.capacity),
                AENV_ADMISSION_QUEUE_TIMEOUT_S=str(args.queue_timeout),
                AENV_ADMISSION_MAX_STARTING=str(args.max_starting),
                AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="16")
    node.start()
    try:
        with sdk_env(node.e2b_env()):
            asyncio.run(_warm())
            result = asyncio.run(burst(args.count, node))
        with node.client() as api:
            left_running = [s["sandboxID"] for s in api.get(
                "/v2/sandboxes", params={"state": ["running", "paused"]}).json()]
            admission = api.get("/cluster/status").json()["admission"]
    finally:
        node.stop()
    left = leaks(prefix, home)
    ok = len(result["first_command_s"])
    fc, qs, pr = result["first_command_s"], result["queued_s"], result["placed_to_ready_s"]
    rows = {
        "rollouts": f"{ok} of {args.count} succeeded",
        "time to first command p50 / p99 (s)": f"{_pct(fc, 0.5)} / {_pct(fc, 0.99)}",
        "queued before placement p50 / p99 (s)": f"{_pct(qs, 0.5)} / {_pct(qs, 0.99)}",
        "placed to ready p50 / p99 (s)": f"{_pct(pr, 0.5)} / {_pct(pr, 0.99)}",
        "whole burst (s)": str(result["wall_s"]),
        "creates admitted at once / after waiting": (f"{admission['admitted']} / "
                                                     f"{admission['waited']}"),
        "429s answered (the SDK retried after Retry-After)": str(admission["refused"]),
        "sandboxes left after the burst": str(len(left_running)),
        "leaked after the node stopped": str(len(left)),
    }
    text = (f"## Burst: {args.count} concurrent e2b SDK creates (+ one command + kill), "
            f"capacity {args.capacity}\n\n"
            f"`python bench/bench_burst.py --count {args.count} --capacity {args.capacity} "
            f"--max-starting {args.max_starting}` "
            f"(admission queue time {args.queue_timeout:g} s, admission_max_starting "
            f"{args.max_starting} (0: the default, 2 per core, at least 4; -1: none); the SDK's "
            "default retries; "
            f"a {_cpus()}-core machine shared with other work).\n\n"
            "| measure | value |\n| --- | --- |\n"
            + "".join(f"| {k} | {v} |\n" for k, v in rows.items()))
    if result["failures"]:
        text += "\nFailures:\n" + "".join(f"- {f}\n" for f in result["failures"][:20])
    if fc:
        text += f"\nmean time to first command: {statistics.mean(fc):.2f} s\n"
    write(args.name, {"count": args.count, "capacity": args.capacity,
                    "queue_timeout_s": args.queue_timeout, "rows": rows, "raw": result,
                    "left_running": left_running, "admission": admission, "leaks": left},
          text)


async def _warm() -> None:
    """One create first: the template's boot image is built before the burst."""
    sbx = await AsyncSandbox.create(template="base", timeout=60)
    await sbx.kill()
    await asyncio.sleep(8)  # the boot image is captured in the background


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
