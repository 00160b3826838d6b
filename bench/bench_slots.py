"""Slot create/destroy: pyroute2 (netlink, in-thread setns) vs `ip` processes; pool timings.

Run as root:  .venv/bin/python bench/bench_slots.py [--n 20]
Prints p50/p90 in ms and writes bench/results/slots.json. Touches only
netns/links named `aebench*` (removed at the end) and sends no traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from agentenv.network import SlotPool, cleanup_all
from agentenv.network.host import install_host_rules
from agentenv.network.rules import GATEWAY_IP, SANDBOX_IP, router_rules
from agentenv.network.slot import Slot, SlotLayout, create_slot, destroy_slot, reset_slot

PREFIX = "aebench"
CIDR = "10.218.0.0/16"
RESULTS = Path(__file__).parent / "results" / "slots.json"


def pct(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

    return {"p50": at(0.5), "p90": at(0.9), "mean": round(statistics.mean(ordered) * 1000, 2)}


def run(*cmd: str, stdin: str | None = None) -> None:
    subprocess.run(cmd, input=stdin, text=True, check=True, capture_output=True)


def ip_create(slot: Slot, batch: bool) -> None:
    r, s, h = slot.router_netns, slot.netns, slot.host_link
    run("ip", "netns", "add", r)
    run("ip", "netns", "add", s)
    for ns in (r, s):
        run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    run("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    run(
        "ip", "netns", "exec", r, "iptables-restore",
        stdin=router_rules(slot.address, CIDR),
    )  # fmt: skip
    root = [
        f"link add {h} type veth peer name up0 netns {r}",
        f"addr add {slot.host_ip}/30 dev {h}",
        f"link set {h} up",
    ]
    router = [
        f"link add dn0 type veth peer name eth0 netns {s}",
        "link set lo up",
        f"addr add {slot.address}/30 dev up0",
        "link set up0 up",
        f"addr add {GATEWAY_IP}/30 dev dn0",
        "link set dn0 up",
        f"route add default via {slot.host_ip}",
    ]
    sandbox = [
        "link set lo up",
        f"addr add {SANDBOX_IP}/30 dev eth0",
        "link set eth0 up",
        f"route add default via {GATEWAY_IP}",
    ]
    for ns, cmds in ((None, root), (r, router), (s, sandbox)):
        base = ["ip"] if ns is None else ["ip", "-n", ns]
        if batch:
            run(*base, "-batch", "-", stdin="\n".join(cmds) + "\n")
        else:
            for c in cmds:
                run(*base, *c.split())


def ip_destroy(slot: Slot) -> None:
    run("ip", "link", "del", slot.host_link)
    run("ip", "netns", "del", slot.router_netns)
    run("ip", "netns", "del", slot.netns)


def measure(n: int, fn: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_create_destroy(n: int) -> dict[str, dict[str, dict[str, float]]]:
    layout = SlotLayout(PREFIX, CIDR)
    slot = layout.slot(1)
    res: dict[str, dict[str, dict[str, float]]] = {}
    variants: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "pyroute2": (lambda: create_slot(slot, CIDR), lambda: destroy_slot(slot)),
        "ip_per_command": (lambda: ip_create(slot, False), lambda: ip_destroy(slot)),
        "ip_batch": (lambda: ip_create(slot, True), lambda: ip_destroy(slot)),
    }
    for name, (create, destroy) in variants.items():
        c, d = [], []
        for _ in range(n):
            c += measure(1, create)
            d += measure(1, destroy)
        res[name] = {"create": pct(c), "destroy": pct(d)}
    create_slot(slot, CIDR)
    res["pyroute2"]["reset_for_reuse"] = pct(measure(n, lambda: reset_slot(slot, True)))
    destroy_slot(slot)
    return res


async def bench_pool(n: int) -> dict[str, dict[str, float]]:
    pool = SlotPool(PREFIX, CIDR, low=n, high=n, capacity=n + 2)
    await pool.start()
    try:
        await asyncio.wait_for(pool.wait_warm(n), 60)
        warm_same, warm_flip, flips = [], [], []
        slots = []
        for i in range(n):
            t0 = time.perf_counter()
            slots.append(await pool.acquire(internet=(i % 2 == 0)))
            (warm_same if i % 2 == 0 else warm_flip).append(time.perf_counter() - t0)
        for s in slots:
            t0 = time.perf_counter()
            await pool.set_internet(s, not s.internet)
            flips.append(time.perf_counter() - t0)
        t_rel = []
        for s in slots:
            t0 = time.perf_counter()
            await pool.release(s)
            t_rel.append(time.perf_counter() - t0)
        return {
            "acquire_warm": pct(warm_same),
            "acquire_warm_with_internet_flip": pct(warm_flip),
            "set_internet": pct(flips),
            "release_call": pct(t_rel),
        }
    finally:
        await pool.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()
    cleanup_all(PREFIX)
    install_host_rules(PREFIX, CIDR)
    try:
        slots = bench_create_destroy(args.n)
        pool = asyncio.run(bench_pool(args.n))
    finally:
        cleanup_all(PREFIX)
    out = {
        "host": platform.node(),
        "kernel": platform.release(),
        "n": args.n,
        "slot_ms": slots,
        "pool_ms": pool,
    }
    for variant, ops in slots.items():
        for op, v in ops.items():
            print(f"{variant:16} {op:16} p50 {v['p50']:7.2f} ms  p90 {v['p90']:7.2f} ms")
    for op, v in pool.items():
        print(f"{'pool':16} {op:32} p50 {v['p50']:7.3f} ms  p90 {v['p90']:7.3f} ms")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
