"""A trainer's burst: N concurrent e2b SDK creates (+ one command + kill each) against a
node whose capacity is smaller than N (issue 16).

Creates beyond capacity wait in the node's admission queue (and, past its queue time,
get 429 with Retry-After, which the SDK's own retries honour); nothing is retried by
this script. Reports how many rollouts succeeded, the time from the burst's start to
each rollout's first command (p50 / p99), where the time went (queued -> placed ->
ready, from the sandboxes' own timings), and what was left behind.

With ``--gateway`` the same burst goes through a real cluster on this machine
(redis, scheduler, gateway and two nodes in their own network namespaces, each
with half the capacity): the gateway places each create on a node with room and
waits for one (its own queue time) before answering 429.

    PYTHONPATH=src:bench python bench/bench_burst.py --count 200 --capacity 64
    PYTHONPATH=src:bench python bench/bench_burst.py --gateway --count 200 --capacity 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import e2b.retry
import httpx
from e2b import AsyncSandbox

from agentenv.testing import Node, leaks, sdk_env
from agentenv.testing.cluster import Cluster
from common import write

# The cluster's names and networks (Cluster derives its netns, links and slot prefixes
# from the tag, the node links from 10.<link_net>.k.0/24, node k's pool from
# pool_nets[k-1]): used by nothing else in tests/ or bench/.
GATEWAY_TAG = "bgw"
GATEWAY_LINK_NET = 61
GATEWAY_POOL_NETS = (62, 63)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 2)


def _ts(raw: str | None) -> float:
    return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp() if raw else 0.0


@contextlib.contextmanager
def sdk_retry_statuses() -> Iterator[Counter[int]]:
    """Counts, by status, the answers the SDK's own retry layer looked at to decide
    whether to retry (429s with Retry-After among them); the SDK has no hook for it."""
    seen: Counter[int] = Counter()
    original = e2b.retry._retry_delay

    def counting(response: httpx.Response, *args: Any, **kwargs: Any) -> float | None:
        delay = original(response, *args, **kwargs)
        if delay is not None:
            seen[response.status_code] += 1
        return delay

    e2b.retry._retry_delay = counting
    try:
        yield seen
    finally:
        e2b.retry._retry_delay = original


async def burst(count: int, api_url: str, api_key: str) -> dict:
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
                if not await sbx.kill():  # the SDK's answer to a 404
                    failures.append(f"kill {i}: {sbx.sandbox_id} not found")
            except Exception as exc:
                failures.append(f"kill {i}: {type(exc).__name__}: {exc}")

    async with httpx.AsyncClient(base_url=api_url, headers={"X-API-Key": api_key},
                                 timeout=60, trust_env=False) as http:
        await asyncio.gather(*(rollout(i) for i in range(count)))
    return {"wall_s": round(time.perf_counter() - start, 2), "first_command_s": first_command,
            "queued_s": queued, "placed_to_ready_s": placing, "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=64,
                    help="sandboxes in all (with --gateway: split evenly over the nodes)")
    ap.add_argument("--queue-timeout", type=float, default=30.0,
                    help="admission queue time of the node(s) and, with --gateway, the gateway's")
    ap.add_argument("--max-starting", type=int, default=0,
                    help="admission_max_starting (0: the node's default, -1: no limit)")
    ap.add_argument("--gateway", action="store_true",
                    help="through a gateway in front of --nodes nodes")
    ap.add_argument("--nodes", type=int, default=2, choices=range(1, len(GATEWAY_POOL_NETS) + 1))
    ap.add_argument("--name", default=None,
                    help="results file name (default: burst, or burst_gateway)")
    args = ap.parse_args()
    run = run_gateway if args.gateway else run_node
    with sdk_retry_statuses() as retried:
        out = run(args)
    out["sdk_retried"] = dict(retried)
    report(args, out)


def _node_env(args: argparse.Namespace) -> dict[str, str]:
    return {"AENV_ADMISSION_QUEUE_TIMEOUT_S": str(args.queue_timeout),
            "AENV_ADMISSION_MAX_STARTING": str(args.max_starting)}


def _left_running(api: httpx.Client) -> list[str]:
    return [s["sandboxID"] for s in api.get(
        "/v2/sandboxes", params={"state": ["running", "paused"]}).json()]


def run_node(args: argparse.Namespace) -> dict[str, Any]:
    prefix = "abu"
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-burst-"))
    node = Node(home, prefix, "10.22.0.0/16", AENV_MAX_SANDBOXES=str(args.capacity),
                AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="16", **_node_env(args))
    node.start()
    try:
        with sdk_env(node.e2b_env()):
            asyncio.run(_warm())
            with node.client() as api:
                before = _admission(api)
            load = os.getloadavg()
            result = asyncio.run(burst(args.count, node.url, node.api_key))
        with node.client() as api:
            left_running = _left_running(api)
            admission = _since(before, _admission(api))
    finally:
        node.stop()
    return {"result": result, "left_running": left_running, "admission": admission,
            "per_node": {}, "leaks": leaks(prefix, home), "load": _load(load)}


def run_gateway(args: argparse.Namespace) -> dict[str, Any]:
    each = args.capacity // args.nodes
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="aenv-bench-burst-gw-")), GATEWAY_TAG,
                      nodes=args.nodes, link_net=GATEWAY_LINK_NET,
                      pool_nets=GATEWAY_POOL_NETS, max_sandboxes=each,
                      # the node's defaults (Cluster's own are a test's, quick to notice)
                      heartbeat_ms=1000, node_ttl_ms=5000,
                      gateway_queue_s=args.queue_timeout, **_node_env(args))
    try:
        cluster.start()
        cluster.warm()
        before = {}
        for k, node in enumerate(cluster.nodes, 1):
            with cluster.client(node.url) as direct:
                before[k] = _admission(direct)
        with sdk_env(cluster.e2b_env()):
            load = os.getloadavg()
            result = asyncio.run(burst(args.count, cluster.gateway_url, cluster.api_key))
        with cluster.client() as api:
            left_running = _left_running(api)
        per_node: dict[str, dict[str, int]] = {}
        for k, node in enumerate(cluster.nodes, 1):
            with cluster.client(node.url) as direct:
                per_node[f"node-{k}"] = _since(before[k], _admission(direct))
    finally:
        left = cluster.stop()
    admission = {key: sum(a.get(key, 0) for a in per_node.values())
                 for key in ("admitted", "waited", "refused", "gone")}
    return {"result": result, "left_running": left_running, "admission": admission,
            "per_node": per_node, "leaks": left, "load": _load(load)}


def _admission(api: httpx.Client) -> dict[str, int]:
    return api.get("/cluster/status").json()["admission"]


def _since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The admission counters' growth during the burst (the warm-up's creates left out)."""
    return {k: after[k] - before.get(k, 0) for k in ("admitted", "waited", "refused", "gone")}


def _load(before: tuple[float, float, float]) -> dict[str, list[float]]:
    return {"before": [round(x, 2) for x in before],
            "after": [round(x, 2) for x in os.getloadavg()]}


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    result, admission = out["result"], out["admission"]
    ok = len(result["first_command_s"])
    fc, qs, pr = result["first_command_s"], result["queued_s"], result["placed_to_ready_s"]
    retried = out["sdk_retried"]
    rows = {
        "rollouts": f"{ok} of {args.count} succeeded",
        "time to first command p50 / p99 (s)": f"{_pct(fc, 0.5)} / {_pct(fc, 0.99)}",
        "queued before placement p50 / p99 (s)": f"{_pct(qs, 0.5)} / {_pct(qs, 0.99)}",
        "placed to ready p50 / p99 (s)": f"{_pct(pr, 0.5)} / {_pct(pr, 0.99)}",
        "whole burst (s)": str(result["wall_s"]),
        "creates admitted at once / after waiting": (f"{admission['admitted']} / "
                                                     f"{admission['waited']}"),
        ("429s answered by the node(s)" + (" (to the gateway, which tried the other node)"
                                           if args.gateway else "")): str(admission["refused"]),
        "429s the SDK retried after Retry-After": str(retried.get(429, 0)),
        "sandboxes left after the burst": str(len(out["left_running"])),
        "leaked after stop": str(len(out["leaks"])),
    }
    other = {k: v for k, v in retried.items() if k != 429}
    if other:
        rows["other answers the SDK retried (status: count)"] = str(other)
    load = out["load"]
    where = (f"through the gateway, {args.nodes} nodes of capacity "
             f"{args.capacity // args.nodes} each" if args.gateway
             else f"one node of capacity {args.capacity}")
    flags = f"--gateway --nodes {args.nodes} " if args.gateway else ""
    text = (f"## Burst: {args.count} concurrent e2b SDK creates (+ one command + kill), "
            f"capacity {args.capacity}, {where}\n\n"
            f"`python bench/bench_burst.py {flags}"
            f"--count {args.count} --capacity {args.capacity} "
            f"--max-starting {args.max_starting}` "
            f"(admission queue time {args.queue_timeout:g} s"
            + (" at the gateway and at each node" if args.gateway else "")
            + f", admission_max_starting {args.max_starting} (0: the default, 2 per core, "
            "at least 4, per node; -1: none); the SDK's default retries; "
            f"a {_cpus()}-core machine shared with other work, load average (1/5/15 min) "
            f"{' / '.join(map(str, load['before']))} at the burst's start, "
            f"{' / '.join(map(str, load['after']))} after).\n\n"
            "| measure | value |\n| --- | --- |\n"
            + "".join(f"| {k} | {v} |\n" for k, v in rows.items()))
    if out["per_node"]:
        text += ("\nPer node (admitted at once / after waiting / 429): "
                 + ", ".join(f"{n} {a['admitted']} / {a['waited']} / {a['refused']}"
                             for n, a in out["per_node"].items()) + "\n")
    if result["failures"]:
        text += "\nFailures:\n" + "".join(f"- {f}\n" for f in result["failures"][:20])
    if out["leaks"]:
        text += f"\nLeaked: {out['leaks'][:20]}\n"
    if fc:
        text += f"\nmean time to first command: {statistics.mean(fc):.2f} s\n"
    name = args.name or ("burst_gateway" if args.gateway else "burst")
    write(name, {"count": args.count, "capacity": args.capacity, "gateway": args.gateway,
                 "nodes": args.nodes if args.gateway else 1,
                 "queue_timeout_s": args.queue_timeout, "rows": rows, "raw": result,
                 "left_running": out["left_running"], "admission": admission,
                 "per_node": out["per_node"], "sdk_retried": retried,
                 "load_average": load, "leaks": out["leaks"]}, text)


async def _warm() -> None:
    """One create first: the template's boot image is built before the burst."""
    sbx = await AsyncSandbox.create(template="base", timeout=60)
    await sbx.kill()
    await asyncio.sleep(8)  # the boot image is captured in the background


def _cpus() -> int:
    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
