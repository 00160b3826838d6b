"""Cluster: create throughput through the gateway with three nodes against one node,
and the latency the gateway adds to a request against the same request sent to the
node directly (an API call, and a proxied envd call). With two gateways
(``--gateways``): create throughput through one and two gateways,
and the time to recover from a gateway killed with -9.

All on one 2-core machine: three nodes share the cores one node has, so the
throughput figure measures the gateway's spreading, not extra hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.rl.http import Api
from agentenv.testing.cluster import Cluster
from common import summary, table, write

ENVD = "49983"


def create_round(cluster: Cluster, n: int, urls: list[str] | None = None) -> float:
    """Wall time of ``n`` concurrent creates through the gateway (``urls``: the i-th
    through the i-th URL in turn), then deletes, untimed."""
    def one(i: int) -> str:
        with cluster.client(urls[i % len(urls)] if urls else None) as c:
            r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120})
            if r.status_code != 201:
                raise RuntimeError(f"create answered {r.status_code}: {r.text}")
            return r.json()["sandboxID"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        ids = list(pool.map(one, range(n)))
    took = time.perf_counter() - t0
    with cluster.client() as c:
        for sid in ids:
            c.delete(f"/sandboxes/{sid}")
    return took


def throughput(root: Path, tag: str, nodes: int, n: int, rounds: int) -> dict:
    # Room for a round beyond n (the gateway now counts its deletes between heartbeats,
    # but a node still tears a deleted sandbox down in the background).
    cluster = Cluster(root / f"c{nodes}", tag, nodes=nodes, max_sandboxes=2 * n)
    try:
        cluster.start()
        cluster.warm()
        create_round(cluster, n)  # warm-up: pools and caches settle
        times = [create_round(cluster, n) for _ in range(rounds)]
    finally:
        left = cluster.stop()
    median = statistics.median(times)
    return {"nodes": nodes, "creates": n, "rounds": rounds, "round_s": [round(t, 2) for t in times],
            "creates_per_s": round(n / median, 2), "leaks": left}


def latency(root: Path, tag: str, samples: int) -> tuple[dict, list[str]]:
    cluster = Cluster(root / "lat", tag, nodes=1)
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("api direct", "api via gateway", "envd direct",
                                     "envd via gateway")}
    try:
        cluster.start()
        node = cluster.nodes[0]
        with cluster.client() as gw, cluster.client(node.url) as direct:
            created = gw.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()
            sid = created["sandboxID"]
            envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": ENVD}
            calls = {
                "api direct": lambda: direct.get(f"/sandboxes/{sid}"),
                "api via gateway": lambda: gw.get(f"/sandboxes/{sid}"),
                "envd direct": lambda: direct.get("/health", headers=envd),
                "envd via gateway": lambda: gw.get("/health", headers=envd),
            }
            for call in calls.values():
                call().raise_for_status()
            for _ in range(samples):  # interleaved: the machine's noise hits all alike
                for name, call in calls.items():
                    t0 = time.perf_counter()
                    r = call()
                    rows[name].append(time.perf_counter() - t0)
                    assert r.status_code in (200, 204), r.text
            gw.delete(f"/sandboxes/{sid}")
    finally:
        left = cluster.stop()
    return {k: summary(v) for k, v in rows.items()}, left


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--gateways", action="store_true",
                    help="only the two-gateway phases ")
    ap.add_argument("--net", type=int, default=23,
                    help="the first of the 10.<net>/16 ranges the clusters use (3 of them)")
    args = ap.parse_args()
    if args.gateways:
        run_gateways(args.creates, args.rounds, args.net)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    # A prefix of its own per phase: no phase meets another's slots.
    lat, lat_left = latency(root, "bl", args.samples)
    one = throughput(root, "bo", 1, args.creates, args.rounds)
    three = throughput(root, "bt", 3, args.creates, args.rounds)
    added = {
        "api": round(lat["api via gateway"]["p50_ms"] - lat["api direct"]["p50_ms"], 2),
        "envd": round(lat["envd via gateway"]["p50_ms"] - lat["envd direct"]["p50_ms"], 2),
    }
    text = table("Per-request latency: gateway against the node directly (1 node)", lat)
    text += (f"\nAdded by the gateway (p50): API {added['api']} ms, proxied envd "
             f"{added['envd']} ms.\n\n")
    text += "### Create throughput through the gateway\n\n"
    text += "| nodes | concurrent creates | round s (each) | creates/s (median round) |\n"
    text += "| --- | --- | --- | --- |\n"
    for r in (one, three):
        text += (f"| {r['nodes']} | {r['creates']} | {', '.join(map(str, r['round_s']))} | "
                 f"{r['creates_per_s']} |\n")
    text += ("\nOne 2-core machine runs every node: three nodes do not add cores, so "
             "the ratio shows the cost or gain of spreading, not of more hardware.\n")
    write("cluster", {"latency": lat, "added_p50_ms": added, "throughput": [one, three],
                      "leaks": lat_left + one["leaks"] + three["leaks"]}, text)


# -------------------- --gateways: two gateways (formerly bench_gateways.py)
# Two gateways (and two schedulers) over two nodes, with HAProxy in front as deployed
# (deploy/haproxy.cfg): create throughput through one gateway, through both (clients
# split between them), and through the front; then a gateway killed with -9 under load,
# through the front (the e2b SDK's way) and through the native client's list of URLs.
#
# Run by ``bench_cluster.py --gateways [--net N]`` (10.N/16 for the links, N+1 and N+2
# for the nodes' sandboxes).


def _creates_through_a_kill(cluster: Cluster, n: int) -> dict:
    """``n`` concurrent creates through the front, the first gateway killed -9 0.5 s
    in; each with an Idempotency-Key and retried once on a 502 (as the e2b SDK does):
    the 502s the front answered, the creates that failed after the retry, and how many
    sandboxes exist after (one a create: none extra)."""
    errors: list[str] = []
    first_502 = 0

    def one(_: int) -> str:
        nonlocal first_502
        headers = {"Idempotency-Key": f"bench-{uuid.uuid4().hex}"}
        with cluster.client() as c:
            body = {"templateID": "base", "timeout": 120}
            r = c.post("/sandboxes", json=body, headers=headers)
            if r.status_code == 502:
                first_502 += 1
                r = c.post("/sandboxes", json=body, headers=headers)
        if r.status_code != 201:
            errors.append(f"{r.status_code}: {r.text[:200]}")
            return ""
        return r.json()["sandboxID"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        time.sleep(0.5)
        cluster.gateways[0].kill()
        cluster.gateways[0].wait()
        ids = [f.result() for f in futures]
    took = time.perf_counter() - t0
    with cluster.client() as c:
        listed = c.get("/v2/sandboxes").json()
        for item in listed:
            c.delete(f"/sandboxes/{item['sandboxID']}")
    return {"creates": n, "answered_502_first": first_502, "failed": len(errors),
            "errors": errors[:3], "sandboxes_after": len(listed), "round_s": round(took, 2),
            "made": len({i for i in ids if i})}


async def _calls_through_a_kill(cluster: Cluster, call: Callable[[], Awaitable[int]],
                                kill: int, loops: int = 4, seconds: float = 6.0) -> dict:
    """API calls from ``loops`` concurrent loops; gateway ``kill`` is killed -9 a third
    of the way: failures, the p50 before, the slowest call in flight at or after the
    kill, and how long after it calls were back at their usual speed (the end of the
    last call slower than 5x the p50 before)."""
    calls: list[tuple[float, float, int]] = []
    stop = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                status = await call()
            except Exception:  # a failed call, counted
                status = 0
            calls.append((t0, time.perf_counter(), status))

    async def killer() -> float:
        await asyncio.sleep(seconds / 3)
        at = time.perf_counter()
        cluster.gateways[kill].kill()
        await asyncio.to_thread(cluster.gateways[kill].wait)
        return at

    *_, killed_at = await asyncio.gather(*(loop() for _ in range(loops)), killer())
    before = [end - start for start, end, _ in calls if end < killed_at]
    p50 = statistics.median(before)
    after = [(start, end) for start, end, _ in calls if end >= killed_at]
    slow = [end for start, end in after if end - start > 5 * p50]
    return {"calls": len(calls), "failed": sum(1 for *_, s in calls if s != 200),
            "p50_before_ms": round(p50 * 1000, 1),
            "slowest_after_kill_ms": round(max(e - s for s, e in after) * 1000, 1),
            "recovered_after_s": round(max(slow) - killed_at, 3) if slow else 0.0}


async def _through_front(c: Cluster) -> dict:
    async with httpx.AsyncClient(base_url=c.gateway_url, headers={"X-API-Key": c.api_key},
                                 timeout=60) as front:
        async def call() -> int:
            return (await front.get("/v2/sandboxes")).status_code
        return await _calls_through_a_kill(c, call, kill=0)


async def _through_urls(c: Cluster) -> dict:
    """The RL client's API (agentenv.rl): both gateways' URLs, its own retries."""
    api = Api(c.gateway_urls(), c.api_key)
    try:
        async def call() -> int:
            return (await api.call("GET", "/v2/sandboxes")).status_code
        return await _calls_through_a_kill(c, call, kill=0)
    finally:
        await api.aclose()


def run_gateways(creates: int, rounds: int, net: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-gateways-"))

    def cluster() -> Cluster:
        c = Cluster(root / f"c{time.monotonic_ns()}", "bg", nodes=2, link_net=net,
                    pool_nets=(net + 1, net + 2), max_sandboxes=2 * creates, schedulers=2,
                    gateways=2, front=True)
        c.start()
        c.warm()
        return c

    leaks: list[str] = []
    rows: dict[str, list[float]] = {"one gateway": [], "two gateways (clients split)": [],
                                    "two gateways (HAProxy front)": []}
    c = cluster()
    try:
        direct = c.gateway_urls()
        create_round(c, creates, direct[:1])  # warm-up
        for _ in range(rounds):  # interleaved: the machine's noise hits all alike
            rows["one gateway"].append(create_round(c, creates, direct[:1]))
            rows["two gateways (clients split)"].append(create_round(c, creates, direct))
            rows["two gateways (HAProxy front)"].append(create_round(c, creates))
        kill_creates = _creates_through_a_kill(c, creates)
    finally:
        leaks += c.stop()
    c = cluster()
    try:
        via_front = asyncio.run(_through_front(c))
    finally:
        leaks += c.stop()
    c = cluster()
    try:
        via_urls = asyncio.run(_through_urls(c))
    finally:
        leaks += c.stop()

    text = "### Create throughput: one gateway and two (2 nodes, 2 schedulers)\n\n"
    text += "| through | concurrent creates | round s (each) | creates/s (median round) |\n"
    text += "| --- | --- | --- | --- |\n"
    throughput = {}
    for name, times in rows.items():
        throughput[name] = round(creates / statistics.median(times), 2)
        text += (f"| {name} | {creates} | {', '.join(f'{t:.2f}' for t in times)} | "
                 f"{throughput[name]} |\n")
    text += ("\nOne 2-core machine runs every process: a second gateway adds no cores; "
             "what it buys is no single point of failure.\n\n")
    text += "### A gateway killed with -9\n\n"
    text += (f"During {creates} concurrent creates through the front (each with an "
             f"Idempotency-Key, a 502 retried once as the e2b SDK does): "
             f"{kill_creates['answered_502_first']} answered 502 at first (HAProxy did "
             f"not retry them), {kill_creates['failed']} failed after the retry, "
             f"{kill_creates['made']} made, {kill_creates['sandboxes_after']} sandboxes "
             f"listed after, round {kill_creates['round_s']} s.\n\n")
    text += ("| API calls (4 concurrent loops) through | calls | failed | p50 before ms | "
             "slowest in flight or after ms | back to usual speed after s |\n"
             "| --- | --- | --- | --- | --- | --- |\n")
    for name, r in (("HAProxy front", via_front), ("RL client (agentenv.rl), 2 URLs", via_urls)):
        text += (f"| {name} | {r['calls']} | {r['failed']} | {r['p50_before_ms']} | "
                 f"{r['slowest_after_kill_ms']} | {r['recovered_after_s']} |\n")
    write("cluster_gateways", {"throughput_creates_per_s": throughput,
                               "rounds_s": rows, "kill_during_creates": kill_creates,
                               "kill_during_calls": {"front": via_front, "native": via_urls},
                               "leaks": leaks}, text)


if __name__ == "__main__":
    main()
