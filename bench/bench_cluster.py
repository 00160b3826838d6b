"""Cluster: create throughput through the gateway with three nodes against one node,
and the latency the gateway adds to a request against the same request sent to the
node directly (an API call, and a proxied envd call). With two gateways
(``--gateways``, bench_gateways.py): create throughput through one and two gateways,
and the time to recover from a gateway killed with -9.

All on one 2-core machine: three nodes share the cores one node has, so the
throughput figure measures the gateway's spreading, not extra hardware.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
                    help="only the two-gateway phases (bench_gateways.py)")
    ap.add_argument("--net", type=int, default=23,
                    help="the first of the 10.<net>/16 ranges the clusters use (3 of them)")
    args = ap.parse_args()
    if args.gateways:
        from bench_gateways import run as run_gateways
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


if __name__ == "__main__":
    main()
