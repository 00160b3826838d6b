"""`make soak`: sandboxes created and deleted in waves for about ten minutes, with
commands running in them the whole time.

Each wave creates its sandboxes at once (a few clients in parallel), runs
commands in all of them until the wave's time is up, then deletes them. What is
recorded: every failed request by kind (a 503 "at capacity" is an error the node
declares and clients retry; anything else is a failure), the node's RSS and PSS
and the host's available memory after each wave, and what is left behind at the
end. Memory must not grow from wave to wave once the first wave has warmed the
node up.

Not part of `make test`: it takes ten minutes of the whole machine.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.testing import Node, leaks
from bench_node import exec_native
from common import summary, write

MIB = 1 << 20
PREFIX = "aso"
CIDR = "10.44.0.0/16"


class Tally:
    """Failed requests by kind, and the samples of the ones that worked."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.errors: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.samples: dict[str, list[float]] = collections.defaultdict(list)

    def error(self, kind: str, detail: str) -> None:
        with self.lock:
            self.errors[kind] += 1
            self.examples.setdefault(kind, detail[:300])

    def ok(self, what: str, seconds: float) -> None:
        with self.lock:
            self.samples[what].append(seconds)


def _memory(pid: int) -> dict[str, float]:
    rollup = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        rollup[name] = int(value.split()[0]) * 1024
    meminfo = {ln.split(":")[0]: int(ln.split()[1]) * 1024
               for ln in Path("/proc/meminfo").read_text().splitlines()}
    return {"node_rss_mib": round(rollup["Rss"] / MIB, 1),
            "node_pss_mib": round(rollup["Pss"] / MIB, 1),
            "host_available_mib": round(meminfo["MemAvailable"] / MIB, 1)}


def _create(api: httpx.Client, tally: Tally, deadline: float) -> dict | None:
    """Create one sandbox; a capacity 503 is retried (and counted) until ``deadline``."""
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        try:
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 1800})
        except httpx.HTTPError as exc:
            tally.error("create: transport", repr(exc))
            return None
        if r.status_code == 201:
            tally.ok("create", time.perf_counter() - t0)
            return r.json()
        if r.status_code == 503 and ("capacity" in r.text or "no network slot" in r.text):
            tally.error("create: 503 at capacity (declared)", r.text)
            time.sleep(1)
            continue
        tally.error(f"create: {r.status_code}", r.text)
        return None
    tally.error("create: gave up at capacity", "")
    return None


def _work(http: httpx.Client, sbx: dict, tally: Tally, until: float) -> None:
    """Commands back to back in one sandbox until ``until``."""
    sid, token = sbx["sandboxID"], sbx["envdAccessToken"]
    n = 0
    while time.monotonic() < until:
        argv = ["/bin/sh", "-c", f"echo {n} > /tmp/n && cat /tmp/n && ls / > /dev/null"]
        t0 = time.perf_counter()
        try:
            code = exec_native(http, sid, token, argv)
        except httpx.HTTPStatusError as exc:
            tally.error(f"exec: {exc.response.status_code}", repr(exc))
            time.sleep(0.5)
            continue
        except (httpx.HTTPError, RuntimeError) as exc:
            tally.error("exec: error", repr(exc))
            time.sleep(0.5)
            continue
        if code != 0:
            tally.error("exec: nonzero exit", str(code))
        else:
            tally.ok("exec", time.perf_counter() - t0)
        n += 1


def _wave(node: Node, size: int, seconds: float, clients: int, tally: Tally) -> dict:
    t0 = time.monotonic()
    with node.client() as api, httpx.Client(base_url=node.url, timeout=60) as http, \
            ThreadPoolExecutor(clients) as pool:
        created = [s for s in pool.map(lambda _: _create(api, tally, t0 + seconds),
                                       range(size)) if s]
        until = t0 + seconds
        with ThreadPoolExecutor(max(1, len(created))) as workers:
            list(workers.map(lambda s: _work(http, s, tally, until), created))

        def delete(sbx: dict) -> None:
            t1 = time.perf_counter()
            try:
                r = api.delete(f"/sandboxes/{sbx['sandboxID']}")
            except httpx.HTTPError as exc:
                tally.error("delete: transport", repr(exc))
                return
            if r.status_code == 204:
                tally.ok("delete", time.perf_counter() - t1)
            else:
                tally.error(f"delete: {r.status_code}", r.text)

        list(pool.map(delete, created))
        left = api.get("/v2/sandboxes", params=[("state", "running"), ("state", "paused")])
        listed = len(left.json()) if left.status_code == 200 else -1
    time.sleep(3)  # the node frees slots and runtimes in the background
    bundles = node.home / "run" / "sandboxes"
    bundle_dirs = len(list(bundles.iterdir())) if bundles.is_dir() else 0
    return {"created": len(created), "seconds": round(time.monotonic() - t0, 1),
            "listed_after_delete": listed, "bundle_dirs_after_delete": bundle_dirs,
            **_memory(node.proc.pid)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=200)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--max-sandboxes", type=int, default=40)
    ap.add_argument("--clients", type=int, default=8, help="parallel creates and deletes")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="aenv-soak-"))
    node = Node(home, PREFIX, CIDR, AENV_MAX_SANDBOXES=str(args.max_sandboxes),
                AENV_NET_POOL_LOW="8", AENV_NET_POOL_HIGH="16")
    tally = Tally()
    per_wave = args.sandboxes // args.waves
    wave_s = args.minutes * 60 / args.waves
    waves: list[dict] = []
    node.start()
    t0 = time.monotonic()
    try:
        baseline = _memory(node.proc.pid)
        for i in range(args.waves):
            waves.append({"wave": i + 1, **_wave(node, per_wave, wave_s, args.clients, tally)})
            print(f"wave {i + 1}: {waves[-1]}", flush=True)
    finally:
        code = node.stop()
    left = leaks(PREFIX, home)
    total_s = time.monotonic() - t0
    # The node's own account of any proxy failure (the client sees only the status).
    proxy_failures = [ln for ln in node.log_path.read_text(errors="replace").splitlines()
                      if "proxy to port" in ln][:10]

    failures = {k: v for k, v in tally.errors.items() if "(declared)" not in k}
    declared = {k: v for k, v in tally.errors.items() if "(declared)" in k}
    rss = [w["node_rss_mib"] for w in waves]
    # Growth after warm-up: the first wave loads what every later one reuses.
    growth = round(max(rss[1:]) - rss[1], 1) if len(rss) > 2 else 0.0
    slope = (round(statistics.linear_regression(range(len(rss) - 1), rss[1:]).slope, 2)
             if len(rss) > 2 else 0.0)
    verdict = ("held" if not failures and not left and code in (0, -15) and growth < 40
               else "FAILED")
    samples = {k: summary(v) for k, v in tally.samples.items()}

    lines = [f"### Soak: {sum(w['created'] for w in waves)} sandboxes in {args.waves} waves "
             f"over {total_s / 60:.1f} min, commands running throughout: {verdict}", "",
             f"Node capacity {args.max_sandboxes}; {per_wave} sandboxes per wave, "
             f"{args.clients} parallel clients for creates and deletes, one command stream "
             "per sandbox. The machine (2 cores) was shared with other work.", "",
             "| wave | created | s | node RSS MiB | node PSS MiB | host available MiB "
             "| listed after delete |", "| --- | --- | --- | --- | --- | --- | --- |",
             f"| before | | | {baseline['node_rss_mib']} | {baseline['node_pss_mib']} | "
             f"{baseline['host_available_mib']} | |"]
    for w in waves:
        lines.append(f"| {w['wave']} | {w['created']} | {w['seconds']} | {w['node_rss_mib']} | "
                     f"{w['node_pss_mib']} | {w['host_available_mib']} | "
                     f"{w['listed_after_delete']} |")
    lines += ["", f"Node RSS growth after the first wave: {growth} MiB "
              f"(slope {slope} MiB/wave; limit 40 MiB).", "",
              "| request | n | p50 ms | p90 ms | max ms |", "| --- | --- | --- | --- | --- |"]
    for k, s in samples.items():
        lines.append(f"| {k} | {s['n']} | {s.get('p50_ms')} | {s.get('p90_ms')} | "
                     f"{s.get('max_ms')} |")
    lines += ["", "| errors | count | example |", "| --- | --- | --- |"]
    for k, v in sorted(tally.errors.items()):
        lines.append(f"| {k} | {v} | {tally.examples.get(k, '')[:120]!r} |")
    if not tally.errors:
        lines.append("| none | 0 | |")
    if proxy_failures:
        lines += ["", "The node's log of proxy failures:", "",
                  *(f"    {ln[:300]}" for ln in proxy_failures)]
    lines += ["", f"Node exit code {code}; left behind: {left or 'nothing'}.", ""]
    write("soak", {"args": vars(args), "verdict": verdict, "waves": waves,
                   "baseline": baseline, "rss_growth_mib": growth, "rss_slope_mib": slope,
                   "failures": failures, "declared_errors": declared,
                   "proxy_failures": proxy_failures,
                   "examples": tally.examples, "samples": samples, "leaks": left,
                   "node_exit": code, "minutes": round(total_s / 60, 1)}, "\n".join(lines))
    raise SystemExit(0 if verdict == "held" else 1)


if __name__ == "__main__":
    main()
