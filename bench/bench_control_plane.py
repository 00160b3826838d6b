"""The control plane at fleet scale: the real gateway, scheduler and Redis over simulated
nodes (agentenv.testing.sim_nodes, its own process: the cluster protocol, no sandboxes),
at 10, 100 and 1,000 nodes (``--nodes``; a thousand need ``--heartbeat-s`` of 10 s or
more on one scheduler here), each node holding ``--preload`` sandboxes from its start
(1,000 x 300: the issue's 300,000).

Per size:
- Redis commands and bytes per heartbeat (nodes idle, then holding the creates'
  sandboxes), the scheduler's sweep included;
- create latency through the gateway, one at a time, against the same create sent to a
  simulated node directly: the difference is what the control plane adds;
- placement throughput: ``--creates`` creates, ``--concurrency`` at once, through one
  gateway, and Redis commands and bytes per create (the heartbeats' share taken out);
- list latency through the gateway with every sandbox held: ``GET /v2/sandboxes``'s
  first page of 100, pages followed by their tokens, a page by metadata (one job of
  100: 1 % of the sandboxes) and by state; ``GET /sandboxes`` (every sandbox, no
  paging) below ``V1_MAX`` sandboxes; Redis's memory and the gateway's RSS.

Writes bench/results/control_plane.{md,json}: one row per number of nodes, a run's rows
replacing the same sizes' rows of earlier runs (each row says how it was run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from agentenv.testing.cluster import Cluster
from common import main_with_modes, write

HEARTBEAT_S = 1.0  # --heartbeat-s
CAPACITY = 1000  # per simulated node: room is never what limits a create here
IDLE_WINDOW_S = 6.0
# GET /sandboxes (every sandbox in one answer) is timed below this many.
V1_MAX = 20_000
NAME = "control_plane"


def ttl_ms() -> int:
    """A node's heartbeat TTL: five heartbeats, at least 5 s."""
    return max(5000, round(5000 * HEARTBEAT_S))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1000, 2)


def lat(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99)}


class RedisMeter:
    """Redis's own counters: commands processed, bytes in and out, heartbeats recorded."""

    def __init__(self, port: int, nodes: int) -> None:
        self.r = redis.Redis(port=port, decode_responses=True)
        self.beat_keys = [f"aenv:beat:sim-{k}" for k in range(1, nodes + 1)]

    def read(self) -> dict[str, float]:
        stats = self.r.info("stats")
        beats = sum(int(v or 0) for v in self.r.mget(self.beat_keys))
        # Each read is two commands of its own (INFO, MGET): taken out below.
        return {"commands": stats["total_commands_processed"] - 2,
                "bytes": stats["total_net_input_bytes"] + stats["total_net_output_bytes"],
                "beats": beats, "t": time.monotonic()}

    def top(self) -> dict[str, int]:
        return {k.removeprefix("cmdstat_"): int(v["calls"])
                for k, v in self.r.info("commandstats").items()}


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user and system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def cpus(cluster: Cluster, sim: subprocess.Popen | None) -> dict[str, float]:
    procs = {"gateway": cluster.gateway, "scheduler": cluster.scheduler,
             "redis": cluster.redis, "sim_nodes": sim}
    return {name: cpu_s(p.pid) for name, p in procs.items() if p is not None}


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


def idle_cost(meter: RedisMeter) -> dict[str, float]:
    a = meter.read()
    time.sleep(IDLE_WINDOW_S)
    d = delta(a, meter.read())
    beats = max(d["beats"], 1)
    return {"heartbeats_per_s": round(d["beats"] / d["t"], 1),
            "commands_per_heartbeat": round(d["commands"] / beats, 1),
            "bytes_per_heartbeat": round(d["bytes"] / beats),
            "commands_per_s": round(d["commands"] / d["t"]),
            "bytes_per_s": round(d["bytes"] / d["t"])}


async def one_create(client: httpx.AsyncClient, url: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = await client.post(url + "/sandboxes", json={"templateID": "base", "timeout": 3600})
    took = time.perf_counter() - t0
    if r.status_code != 201:
        raise RuntimeError(f"create answered {r.status_code}: {r.text[:200]}")
    return took, r.json()["sandboxID"]


async def sequential_creates(client: httpx.AsyncClient, urls: list[str], n: int
                             ) -> list[list[float]]:
    """``n`` creates one at a time to each URL in turn (alternating, so that a change of
    the machine's load meanwhile falls on each alike), after one untimed each."""
    for url in urls:
        await one_create(client, url)
    took: list[list[float]] = [[] for _ in urls]
    for _ in range(n):
        for i, url in enumerate(urls):
            took[i].append((await one_create(client, url))[0])
    return took


async def burst(client: httpx.AsyncClient, url: str, n: int, concurrency: int
                ) -> tuple[float, list[float]]:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> float:
        async with gate:
            return (await one_create(client, url))[0]

    t0 = time.perf_counter()
    took = await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - t0, list(took)


async def timed_gets(client: httpx.AsyncClient, url: str, params: dict[str, Any], n: int
                     ) -> tuple[list[float], int]:
    out, count = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            r = await client.get(url, params=params)
        except httpx.TimeoutException:  # a thousand nodes asked, one by one: recorded
            out.append(float("inf"))
            break
        out.append(time.perf_counter() - t0)
        r.raise_for_status()
        count = len(r.json())
    return out, count


def up_count(cluster: Cluster) -> int:
    with cluster.client(cluster.scheduler_url) as c:
        return len(c.get("/nodes", params={"state": "up"}).json())


def wait_up(cluster: Cluster, nodes: int, wait: float = 120) -> None:
    """Until nine in ten are up at once (past a few hundred, a node whose heartbeats
    the scheduler records late goes down and comes back: counted in the results)."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if up_count(cluster) >= 0.9 * nodes:
            return
        time.sleep(0.5)
    raise RuntimeError(f"fewer than 9 in 10 of {nodes} simulated nodes came up")


def wait_indexed(port: int, want: int, wait: float = 900) -> float:
    """Until the listings' index holds ``want`` sandboxes (the nodes' first heartbeats
    with their preloaded ones recorded); the seconds that took."""
    r = redis.Redis(port=port)
    t0 = time.monotonic()
    while r.zcard("aenv:lst:all") < want:
        if time.monotonic() - t0 > wait:
            raise RuntimeError(f"{r.zcard('aenv:lst:all')} of {want} sandboxes indexed "
                               f"after {wait:g} s")
        time.sleep(1)
    return round(time.monotonic() - t0, 1)


async def follow(client: httpx.AsyncClient, url: str, params: dict[str, Any], pages: int
                 ) -> list[float]:
    """``pages`` pages in a row, each asked with the previous one's token."""
    took, token = [], None
    for _ in range(pages):
        t0 = time.perf_counter()
        r = await client.get(url, params={**params, **({"nextToken": token} if token else {})})
        took.append(time.perf_counter() - t0)
        r.raise_for_status()
        token = r.headers.get("x-next-token")
        if not token:
            break
    return took


async def listings(client: httpx.AsyncClient, cluster: Cluster, held: int, reps: int
                   ) -> dict[str, Any]:
    url = cluster.gateway_url + "/v2/sandboxes"
    procs = {"gateway": cluster.gateway, "redis": cluster.redis}
    before = {k: cpu_s(p.pid) for k, p in procs.items() if p is not None}
    page, n_page = await timed_gets(client, url, {"limit": 100}, reps)
    # CPU per page: what a page costs whatever else the machine runs meanwhile.
    cpu_page = {k: round((cpu_s(p.pid) - before[k]) * 1000 / reps, 2)
                for k, p in procs.items() if p is not None}
    deep = await follow(client, url, {"limit": 100}, reps)
    by_job, n_job = await timed_gets(client, url, {"limit": 100, "metadata": "job=j7"}, reps)
    running, _ = await timed_gets(client, url, {"limit": 100, "state": "running"}, reps)
    out: dict[str, Any] = {"sandboxes_held": held, "v2_first_page": lat(page),
                           "v2_page_items": n_page, "v2_followed_pages": lat(deep),
                           "v2_by_metadata": lat(by_job), "v2_by_metadata_items": n_job,
                           "v2_running": lat(running), "v2_page_cpu_ms": cpu_page}
    if held <= V1_MAX:
        whole, n_whole = await timed_gets(client, cluster.gateway_url + "/sandboxes", {},
                                          max(reps // 10, 2))
        out.update(v1_all=lat(whole), v1_items=n_whole)
    return out


def measure(root: Path, nodes: int, creates: int, concurrency: int, sequential: int,
            preload: int) -> dict[str, Any]:
    cluster = Cluster(root / f"cp{nodes}", f"p{os.getpid() % 256:02x}", nodes=0,
                      node_ttl_ms=ttl_ms(), gateway_queue_s=10.0)
    sim: subprocess.Popen | None = None
    try:
        cluster.start()
        sim = subprocess.Popen(
            [sys.executable, "-m", "agentenv.testing.sim_nodes", "--nodes", str(nodes),
             "--scheduler-url", cluster.scheduler_url, "--capacity", str(CAPACITY),
             "--heartbeat-s", str(HEARTBEAT_S), "--preload", str(preload)],
            env={**os.environ, "AENV_SIM_API_KEY": cluster.api_key},
            stdout=subprocess.DEVNULL, stderr=open(root / f"sim{nodes}.log", "ab"))
        # A node's first heartbeat writes every sandbox it holds: 300 each, a thousand
        # nodes, take minutes on one scheduler here.
        wait_up(cluster, nodes, max(120, nodes * preload / 250))
        indexed_s = wait_indexed(cluster.redis_port, int(0.99 * nodes * preload))
        time.sleep(2 * HEARTBEAT_S)  # every node past its first heartbeat
        meter = RedisMeter(cluster.redis_port, nodes)
        out: dict[str, Any] = {"nodes": nodes, "preload": preload,
                               "heartbeat_s": HEARTBEAT_S, "creates": creates,
                               "concurrency": concurrency, "sequential": sequential,
                               "preload_indexed_s": indexed_s}
        cpu_before = cpus(cluster, sim)
        out["idle"] = {"nodes_up": up_count(cluster), **idle_cost(meter)}
        cpu_after = cpus(cluster, sim)
        out["cpu_idle_per_s"] = {k: round((cpu_after[k] - cpu_before[k]) / IDLE_WINDOW_S, 3)
                                 for k in cpu_after}

        with cluster.client(cluster.scheduler_url) as c:
            a_node = c.get("/nodes").json()[0]["url"]

        async def run() -> None:
            limits = httpx.Limits(max_connections=concurrency,
                                  max_keepalive_connections=concurrency)
            async with httpx.AsyncClient(headers={"X-API-Key": cluster.api_key}, timeout=60,
                                         trust_env=False, limits=limits) as client:
                direct, via = await sequential_creates(
                    client, [a_node, cluster.gateway_url], sequential)
                out["create_direct"] = lat(direct)
                out["create_via_gateway"] = lat(via)
                out["create_added_ms"] = {
                    "p50": round(pct(via, 0.5) - pct(direct, 0.5), 2),
                    "p99": round(pct(via, 0.99) - pct(direct, 0.99), 2)}
                before, top_before = meter.read(), meter.top()
                cpu_before = cpus(cluster, sim)
                wall, took = await burst(client, cluster.gateway_url, creates, concurrency)
                cpu_after = cpus(cluster, sim)
                after, top_after = meter.read(), meter.top()
                d = delta(before, after)
                idle = out["idle"]
                # The heartbeats' and sweeps' share during the burst, at the idle rate.
                heartbeat_commands = d["beats"] * idle["commands_per_heartbeat"]
                heartbeat_bytes = d["beats"] * idle["bytes_per_heartbeat"]
                out["burst"] = {
                    "creates": creates, "concurrency": concurrency, "wall_s": round(wall, 2),
                    "creates_per_s": round(creates / wall, 1), **lat(took),
                    "redis_commands_per_create": round(
                        (d["commands"] - heartbeat_commands) / creates, 1),
                    "redis_bytes_per_create": round((d["bytes"] - heartbeat_bytes) / creates),
                    # CPU per create of each process, heartbeats and sweeps included (the
                    # idle share is small: see cpu_idle_per_s).
                    "cpu_ms_per_create": {
                        k: round((cpu_after[k] - cpu_before[k]) * 1000 / creates, 2)
                        for k in cpu_after},
                    "top_commands_per_create": {
                        k: round((top_after.get(k, 0) - top_before.get(k, 0)) / creates, 1)
                        for k in sorted(top_after, key=lambda k: top_before.get(k, 0)
                                        - top_after[k])[:6]}}
                held = creates + 2 * (sequential + 1) + nodes * preload
                out["list"] = await listings(client, cluster, held, 100)
                out["list"]["redis_used_mb"] = round(
                    meter.r.info("memory")["used_memory"] / 2 ** 20, 1)
                out["list"]["gateway_rss_mb"] = rss_mb(cluster.gateway.pid)

        asyncio.run(run())
        time.sleep(2 * HEARTBEAT_S)
        out["idle_holding"] = {"sandboxes_per_node": round(
            (creates + 2 * (sequential + 1)) / nodes + preload, 1),
            "nodes_up": up_count(cluster),
            **idle_cost(meter)}
        return out
    finally:
        try:
            if sim is not None:
                sim.terminate()
                try:
                    sim.wait(30)
                except subprocess.TimeoutExpired:
                    sim.kill()
                    sim.wait()
        finally:
            cluster.stop()


def growth(rows: list[dict[str, Any]], pick: Any) -> str:
    first, last = rows[0], rows[-1]
    a, b = pick(first), pick(last)
    if not a:
        return "n/a"
    return f"x{b / a:.2f} for x{last['nodes'] / first['nodes']:g} nodes"


def _cpu(row: dict[str, Any]) -> str:
    c = row["burst"].get("cpu_ms_per_create") or {}
    idle = row.get("cpu_idle_per_s") or {}
    return (f"{c.get('gateway', '?')} / {c.get('scheduler', '?')} / {c.get('redis', '?')} "
            f"({c.get('sim_nodes', '?')}); idle: scheduler "
            f"{round(idle.get('scheduler', 0) * 1000)} ms/s")


def _pp(d: dict[str, Any] | None) -> str:
    return f"{d['p50_ms']} / {d['p99_ms']}" if d else "n/a"


def _how(r: dict[str, Any]) -> str:
    return (f"`--nodes {r['nodes']} --preload {r.get('preload', 0)} --heartbeat-s "
            f"{r.get('heartbeat_s', 1):g} --creates {r.get('creates', 300)} --sequential "
            f"{r.get('sequential', 30)}` ({r.get('when', '?')})")


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table under its title, a row a list of cells."""
    return ["", title, "", "| " + " | ".join(columns) + " |",
            "| " + " | ".join(["---"] * len(columns)) + " |",
            *("| " + " | ".join(str(cell) for cell in cells) + " |" for cells in rows)]


CREATE_COLUMNS = [
    "nodes", "creates/s", "per gateway core (1 s / its CPU per create)",
    "burst create p50 / p99 ms", "create direct p50 / p99 ms", "via gateway p50 / p99 ms",
    "added p50 / p99 ms", "Redis cmds / bytes per create",
    "CPU ms per create, heartbeats meanwhile included: gateway / scheduler / Redis "
    "(sim nodes); the scheduler's when idle"]


def _create_cells(r: dict[str, Any]) -> list[Any]:
    b = r["burst"]
    per_core = round(1000 / max(b["cpu_ms_per_create"].get("gateway", 0), 0.01))
    return [r["nodes"], b["creates_per_s"], per_core, f"{b['p50_ms']} / {b['p99_ms']}",
            _pp(r["create_direct"]), _pp(r["create_via_gateway"]),
            f"{r['create_added_ms']['p50']} / {r['create_added_ms']['p99']}",
            f"{b['redis_commands_per_create']} / {b['redis_bytes_per_create']}", _cpu(r)]


LIST_COLUMNS = [
    "nodes", "sandboxes held", "v2 first page (100)", "CPU ms per first page: gateway / Redis",
    "v2 pages followed by token", "v2 by metadata, 1 % match (items)", "v2 state=running",
    "v1 all (items)", "Redis used MB", "gateway RSS MB"]


def _list_cells(r: dict[str, Any]) -> list[Any]:
    lst = r["list"]
    cpu = lst.get("v2_page_cpu_ms") or {}
    v1 = f"{_pp(lst.get('v1_all'))} ({lst['v1_items']})" if lst.get("v1_all") \
        else f"not timed (over {V1_MAX})"
    return [r["nodes"], lst["sandboxes_held"], _pp(lst["v2_first_page"]),
            f"{cpu.get('gateway', '?')} / {cpu.get('redis', '?')}",
            _pp(lst.get("v2_followed_pages")),
            f"{_pp(lst.get('v2_by_metadata'))} ({lst.get('v2_by_metadata_items', '?')})",
            _pp(lst.get("v2_running")), v1, lst.get("redis_used_mb", "?"),
            lst.get("gateway_rss_mb", "?")]


HEARTBEAT_COLUMNS = [
    "nodes", "Redis cmds / bytes per heartbeat (idle)", "same, holding (sandboxes/node)",
    "heartbeats/s recorded, idle / holding (due: nodes/s; nodes up)",
    "first heartbeats' preload indexed in s"]


def _heartbeat_cells(r: dict[str, Any]) -> list[Any]:
    i, h = r["idle"], r["idle_holding"]
    return [r["nodes"], f"{i['commands_per_heartbeat']} / {i['bytes_per_heartbeat']}",
            f"{h['commands_per_heartbeat']} / {h['bytes_per_heartbeat']} "
            f"({h['sandboxes_per_node']})",
            f"{i['heartbeats_per_s']} / {h['heartbeats_per_s']} "
            f"({r['nodes'] / r.get('heartbeat_s', 1):g}; up {i['nodes_up']} / "
            f"{h['nodes_up']})", r.get("preload_indexed_s", "n/a")]


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["## Control plane at fleet scale (simulated nodes)", "",
             "The real gateway, scheduler and Redis (one each) over simulated nodes "
             "(agentenv.testing.sim_nodes, one process; no node latency), each holding "
             "`--preload` sandboxes from its start. One 2-core machine shared with other "
             "work runs all of it: counts are reliable, rates and latencies are not. "
             "Reproduce a row: `PYTHONPATH=src:bench python bench/bench_control_plane.py` "
             "and its arguments (each run replaces its sizes' rows):", ""]
    lines += [f"- {r['nodes']} nodes: {_how(r)}" for r in rows]
    lines += _table("Creates:", CREATE_COLUMNS, [_create_cells(r) for r in rows])
    lines += _table("Listings through the gateway (from Redis; p50 / p99 ms; 100 of each):",
                    LIST_COLUMNS, [_list_cells(r) for r in rows])
    lines += _table("Heartbeats:", HEARTBEAT_COLUMNS, [_heartbeat_cells(r) for r in rows])
    if len(rows) > 1:
        lines += ["", "Growth from the smallest to the largest size:", "",
                  f"- creates/s: {growth(rows, lambda r: r['burst']['creates_per_s'])}",
                  f"- Redis commands per create: "
                  f"{growth(rows, lambda r: r['burst']['redis_commands_per_create'])}",
                  f"- list v2 first page p50: "
                  f"{growth(rows, lambda r: r['list']['v2_first_page']['p50_ms'])}",
                  f"- sandboxes held: {growth(rows, lambda r: r['list']['sandboxes_held'])}",
                  f"- gateway CPU per create: "
                  f"{growth(rows, lambda r: r['burst']['cpu_ms_per_create']['gateway'])}"]
    lines += ["", "Redis commands per create, the most frequent (largest size): "
              + ", ".join(f"{k} {v}" for k, v in rows[-1]["burst"]["top_commands_per_create"]
                          .items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    global HEARTBEAT_S
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="mode `imports`: what starting a gateway costs in imports "
               "(bench_control_plane.py imports --help)")
    parser.add_argument("--nodes", default="10,100")
    parser.add_argument("--creates", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=30)
    parser.add_argument("--preload", type=int, default=0,
                        help="sandboxes each simulated node holds from its start")
    parser.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S,
                        help="each simulated node's heartbeat interval (TTL: five of them)")
    args = parser.parse_args()
    HEARTBEAT_S = args.heartbeat_s
    path = Path(__file__).parent / "results" / f"{NAME}.json"
    kept = json.loads(path.read_text()).get("rows", []) if path.exists() else []
    rows = {r["nodes"]: r for r in kept if "preload" in r}  # older runs' rows differ
    with tempfile.TemporaryDirectory(prefix="aenv-cp-") as tmp:
        for n in (int(x) for x in args.nodes.split(",")):
            t0 = time.monotonic()
            row = measure(Path(tmp), n, args.creates, args.concurrency, args.sequential,
                          args.preload)
            row["when"] = time.strftime("%Y-%m-%d", time.gmtime())
            rows[n] = row
            print(f"{n} nodes measured in {time.monotonic() - t0:.0f} s", flush=True)
    ordered = [rows[n] for n in sorted(rows)]
    write(NAME, {"rows": ordered}, render(ordered))


# -------------------- mode `imports` (formerly import_time.py)
# What starting a control plane costs in imports: CPU and wall time of a fresh
# interpreter importing the gateway (and building both apps), median of ``--runs``, and
# the modules it loads. Run it with the tree to measure first on ``PYTHONPATH``.


CASES = {
    "python -c pass": "pass",
    "import agentenv.cluster.gateway": "import agentenv.cluster.gateway",
    "both apps built": (
        "import agentenv.cluster.gateway as g, agentenv.cluster.scheduler as s\n"
        "g.create_gateway_app('redis://127.0.0.1:1/0', 'http://127.0.0.1:1', 'key')\n"
        "s.create_scheduler_app('redis://127.0.0.1:1/0', 'key')"),
}
COUNT = ("import sys, agentenv.cluster.gateway\n"
         "print(sum(m.startswith('agentenv') for m in sys.modules), len(sys.modules),"
         " sum(m.startswith('pyroute2') for m in sys.modules))")


def timed(code: str, runs: int) -> tuple[float, float]:
    """Median CPU (user + system) and wall milliseconds of ``python -c code``."""
    cpu, wall = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        wall.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(cpu) * 1000, statistics.median(wall) * 1000


IMPORTS = "What starting a gateway costs in imports (the tree to measure on PYTHONPATH)."


def imports_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_control_plane.py imports", description=IMPORTS)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    for label, code in CASES.items():
        cpu, wall = timed(code, args.runs)
        print(f"{label}: CPU {cpu:.0f} ms, wall {wall:.0f} ms (median of {args.runs})")
    ours, everything, pyroute2 = subprocess.run(
        [sys.executable, "-c", COUNT], capture_output=True, text=True, check=True
    ).stdout.split()
    print(f"modules after importing the gateway: {everything} ({ours} of agentenv, "
          f"{pyroute2} of pyroute2)")


if __name__ == "__main__":
    main_with_modes(main, {"imports": imports_main})
