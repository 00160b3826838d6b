"""Density (issue 17): idle `base` sandboxes ramped in steps on one node.

At each step (every ``--step`` sandboxes up to ``--max``) it prints and records:

- host memory per idle sandbox: PSS over all processes in the sandboxes' memory
  cgroups (sentry, gofer, systrap stubs), each address space once (systrap stubs of
  one guest process share an mm and each reports it whole: ``kcmp(KCMP_VM)`` finds
  them), and the naive per-process sum as earlier benchmarks added it up; and the
  memory cgroups' own counts: the sentry's memory file (guest anonymous memory and
  tmpfs) and runsc's own anonymous memory (sentry and gofer heaps);
- idle CPU of all sandboxes (the node's cpuacct cgroup) over ``--window`` seconds;
- the node API's p50 (``GET /sandboxes/{id}``) and the exec round trip of one sandbox
  (the first command after the idle window apart: it thaws a frozen sandbox);
- how many sandboxes are frozen (``aenv_sandboxes_frozen``), failures so far.

At the end every sandbox must answer a command. The floor is a bare ``runsc``
sandbox (same platform and overlay flags, no network) running ``sleep infinity``.

    PYTHONPATH=src:bench python bench/bench_density.py --max 300 --step 50
    PYTHONPATH=src:bench python bench/bench_density.py --max 20 --step 10 --name density_small
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from e2b import AsyncSandbox

from agentenv.testing import Node, leaks, sdk_env
from agentenv.testing.hostmem import procs_pss
from common import write

MIB = 1 << 20
CG = Path("/sys/fs/cgroup")
PREFIX, CIDR = "bdn", "10.102.0.0/16"  # this benchmark's own names and addresses


def cgroup_pss(cgroup: str) -> tuple[int, int, int]:
    """(PSS counting each address space once, naive per-process sum, sandboxes) of
    every sandbox cgroup below ``cgroup`` in the memory hierarchy."""
    dedup = naive = count = 0
    root = CG / "memory" / cgroup
    for child in root.iterdir() if root.is_dir() else []:
        procs = child / "cgroup.procs"
        if not procs.is_file():
            continue
        count += 1
        one, one_naive = procs_pss(int(p) for p in procs.read_text().split())
        dedup += one
        naive += one_naive
    return dedup, naive, count


def cgroup_memory(cgroup: str) -> tuple[int, int, int]:
    """(memory file bytes, Go/runsc anonymous bytes, sandboxes) over every sandbox cgroup
    below ``cgroup``: the memory cgroup's own counts (``total_shmem`` is the sentry's
    memory file, which holds the guest's anonymous memory and tmpfs; ``total_rss`` the
    sentry's and gofer's own heaps), what PSS cannot see of pages no process maps."""
    shmem = rss = count = 0
    root = CG / "memory" / cgroup
    for child in root.iterdir() if root.is_dir() else []:
        stat = child / "memory.stat"
        if not stat.is_file():
            continue
        count += 1
        with contextlib.suppress(OSError, ValueError):
            for line in stat.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "total_shmem":
                    shmem += int(value)
                elif key == "total_rss":
                    rss += int(value)
    return shmem, rss, count


def cpu_ns(cgroup: str) -> int:
    try:
        return int((CG / "cpuacct" / cgroup / "cpuacct.usage").read_text())
    except OSError:
        return 0


def idle_cpu(cgroup: str, window: float) -> float:
    """Percent of one core the cgroup used over ``window`` seconds."""
    a, t = cpu_ns(cgroup), time.monotonic()
    time.sleep(window)
    return round((cpu_ns(cgroup) - a) / 1e9 / (time.monotonic() - t) * 100, 2)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def frozen_count(api: httpx.Client) -> int | None:
    for line in api.get("/metrics").text.splitlines():
        if line.startswith("aenv_sandboxes_frozen "):
            return int(float(line.split()[1]))
    return None


def p50_ms(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1000, 1) if xs else None


async def create_many(api_url: str, key: str, count: int, parallel: int,
                      failures: list[str]) -> list[str]:
    ids: list[str] = []
    gate = asyncio.Semaphore(parallel)
    async with httpx.AsyncClient(base_url=api_url, headers={"X-API-Key": key},
                                 timeout=120, trust_env=False) as http:
        async def one() -> None:
            async with gate:
                try:
                    r = await http.post("/sandboxes", json={"templateID": "base",
                                                            "timeout": 3600})
                    if r.status_code == 201:
                        ids.append(r.json()["sandboxID"])
                    else:
                        failures.append(f"create: {r.status_code} {r.text[:160]}")
                except httpx.HTTPError as exc:
                    failures.append(f"create: {type(exc).__name__}: {exc}")
        await asyncio.gather(*(one() for _ in range(count)))
    return ids


async def exec_times(sid: str, n: int) -> tuple[float, list[float]]:
    """(first command after idleness, then ``n`` more) in seconds."""
    sbx = await AsyncSandbox.connect(sid)
    times = []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        out = await sbx.commands.run("true")
        assert out.exit_code == 0
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


async def answer_all(ids: list[str], parallel: int, failures: list[str],
                     sweep: dict, max_load: float) -> int:
    """Every sandbox answers a command, ``parallel`` at a time, while a sampler
    records how many are awake (running, not frozen) and the load; past ``max_load``
    no further command is sent (the machine is shared: a sweep that outruns the
    freezer would take it down)."""
    gate = asyncio.Semaphore(parallel)
    ok = 0
    times: list[float] = []
    stop = asyncio.Event()

    async def one(sid: str) -> None:
        nonlocal ok
        async with gate:
            if stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                sbx = await AsyncSandbox.connect(sid)
                out = await sbx.commands.run(f"echo {sid}")
                if out.stdout.strip() == sid:
                    ok += 1
                    times.append(time.perf_counter() - t0)
                else:
                    failures.append(f"answer {sid}: {out.stdout!r}")
            except Exception as exc:
                failures.append(f"answer {sid}: {type(exc).__name__}: {str(exc)[:160]}")

    async def sample(api: httpx.AsyncClient) -> None:
        while True:
            load = os.getloadavg()[0]
            with contextlib.suppress(httpx.HTTPError):
                frozen = running = None
                for line in (await api.get("/metrics")).text.splitlines():
                    if line.startswith("aenv_sandboxes_frozen "):
                        frozen = int(float(line.split()[1]))
                    elif line.startswith('aenv_sandboxes{state="running"}'):
                        running = int(float(line.split()[1]))
                if frozen is not None and running is not None:
                    sweep["awake"].append(running - frozen)
            sweep["load"].append(round(load, 1))
            if load > max_load:
                sweep["stopped"] = f"load {load:.0f} > {max_load:.0f}"
                stop.set()
            await asyncio.sleep(1.0)

    sweep.update(awake=[], load=[])
    t0 = time.monotonic()
    url, key = os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"]
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}) as api:
        sampler = asyncio.create_task(sample(api))
        try:
            await asyncio.gather(*(one(s) for s in ids))
        finally:
            sampler.cancel()
    sweep.update(seconds=round(time.monotonic() - t0, 1),
                 per_s=round(ok / max(time.monotonic() - t0, 1e-9), 1),
                 answer_p50_ms=p50_ms(times),
                 answer_p95_ms=round(sorted(times)[int(0.95 * (len(times) - 1))] * 1000, 1)
                 if times else None,
                 awake_max=max(sweep["awake"], default=None),
                 awake_p50=statistics.median(sweep["awake"]) if sweep["awake"] else None,
                 load_max=max(sweep["load"], default=None))
    return ok


def api_p50(api: httpx.Client, sid: str, n: int = 20) -> float | None:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        api.get(f"/sandboxes/{sid}").raise_for_status()
        xs.append(time.perf_counter() - t0)
    return p50_ms(xs)


def bare_bundle(bundle: Path, argv: list[str], rootfs: Path, cgroups_path: str) -> None:
    """An OCI bundle for a bare runsc sandbox running ``argv`` on a template's rootfs."""
    subprocess.run(["runsc", "spec", "--bundle", str(bundle), "--", *argv], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": True}
    spec["process"]["terminal"] = False
    spec["linux"]["cgroupsPath"] = cgroups_path
    (bundle / "config.json").write_text(json.dumps(spec))


@contextlib.contextmanager
def bare_sandbox(cgroup: str, rootfs: Path, argv: list[str]) -> Iterator[None]:
    """A bare runsc sandbox (``cgroup``/floor) running ``argv`` on ``rootfs``: the same
    platform and overlay flags as the node's, no network."""
    work = Path(tempfile.mkdtemp(prefix="aenv-floor-"))
    root, bundle = work / "state", work / "bundle"
    bundle.mkdir(parents=True)
    flags = [f"--root={root}", "--platform=systrap", "--network=none", "--overlay2=root:memory"]
    bare_bundle(bundle, argv, rootfs, f"/{cgroup}/floor")
    try:
        subprocess.run(["runsc", *flags, "run", "--detach", "--bundle", str(bundle), "floor"],
                       check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        yield
    finally:
        subprocess.run(["runsc", *flags, "delete", "--force", "floor"], check=False,
                       capture_output=True)
        for sub in ("freezer", "memory", "cpu", "cpuacct", "pids", "cpuset", "devices",
                    "blkio", "systemd"):
            for d in (CG / sub / cgroup / "floor", CG / sub / cgroup):
                with contextlib.suppress(OSError):
                    d.rmdir()
        shutil.rmtree(work, ignore_errors=True)


def floor(window: float, rootfs: Path) -> dict:
    """A bare runsc sandbox running `sleep infinity`: idle CPU and PSS, then frozen."""
    cgroup = f"{PREFIX}floor"
    with bare_sandbox(cgroup, rootfs, ["sleep", "infinity"]):
        time.sleep(3)
        out = {"idle_cpu_pct": idle_cpu(cgroup, window),
               "pss_MiB": round(cgroup_pss(cgroup)[0] / MIB, 1)}
        state = CG / "freezer" / cgroup / "floor" / "freezer.state"
        state.write_text("FROZEN")
        out["frozen_idle_cpu_pct"] = idle_cpu(cgroup, window)
        state.write_text("THAWED")
        return out


def base_rootfs() -> Path:
    for p in Path("/var/lib/aenv/images/templates").glob("*/rootfs"):
        if p.parent.name.startswith("base"):
            return p
    raise SystemExit("no base template rootfs under /var/lib/aenv/images/templates")


def main() -> None:
    global PREFIX
    ap = argparse.ArgumentParser()
    ap.add_argument("--max", type=int, default=300)
    ap.add_argument("--step", type=int, default=50)
    ap.add_argument("--window", type=float, default=20, help="idle CPU window, seconds")
    ap.add_argument("--settle", type=float, default=15,
                    help="seconds after each step's creates before measuring")
    ap.add_argument("--parallel", type=int, default=8, help="creates at once")
    ap.add_argument("--idle-freeze-s", type=float, default=None,
                    help="the node's idle_freeze_s (default: the node's default)")
    ap.add_argument("--host-capacity", action="store_true",
                    help="the node's default capacity (derived from the host), not max + 8")
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--max-load", type=float, default=80,
                    help="the final sweep sends no further command past this load average")
    ap.add_argument("--name", default="density")
    ap.add_argument("--cidr", default=CIDR,
                    help="the node's slot addresses (a /16 no other node on the host uses)")
    ap.add_argument("--prefix", default=PREFIX, help="the node's netns/cgroup name prefix")
    args = ap.parse_args()
    PREFIX = args.prefix

    env = {"AENV_NET_POOL_LOW": "8", "AENV_NET_POOL_HIGH": "16"}
    if not args.host_capacity:
        env["AENV_MAX_SANDBOXES"] = str(args.max + 8)
    if args.idle_freeze_s is not None:
        env["AENV_IDLE_FREEZE_S"] = str(args.idle_freeze_s)
    home = Path(tempfile.mkdtemp(prefix="aenv-density-"))
    node = Node(home, PREFIX, args.cidr, **env)
    floor_out = None if args.no_floor else floor(args.window, base_rootfs())
    print("floor:", floor_out, flush=True)
    node.start()
    rows: list[dict] = []
    failures: list[str] = []
    ids: list[str] = []
    left: list[str] = []
    sweep: dict = {}
    answered = 0
    try:
        with sdk_env(node.e2b_env()), node.client() as api:
            ids += asyncio.run(create_many(node.url, node.api_key, 1, 1, failures))
            probe = ids[0]
            _, warm = asyncio.run(exec_times(probe, 10))
            unloaded = {"api_p50_ms": api_p50(api, probe), "exec_p50_ms": p50_ms(warm)}
            print("unloaded:", unloaded, flush=True)
            target = args.step
            while target <= args.max:
                t0 = time.monotonic()
                ids += asyncio.run(create_many(node.url, node.api_key, target - len(ids),
                                               args.parallel, failures))
                ramp_s = time.monotonic() - t0
                time.sleep(args.settle)
                row: dict = {"sandboxes": len(ids), "ramp_s": round(ramp_s, 1)}
                # Other users share the machine: the load beside every step's figures.
                row["load_1m"] = round(os.getloadavg()[0], 2)
                row["idle_cpu_pct"] = idle_cpu(PREFIX, args.window)
                dedup, naive, count = cgroup_pss(PREFIX)
                row["pss_MiB_per_sandbox"] = round(dedup / max(count, 1) / MIB, 1)
                row["pss_naive_MiB_per_sandbox"] = round(naive / max(count, 1) / MIB, 1)
                shmem, rss, count = cgroup_memory(PREFIX)
                row["memfile_MiB_per_sandbox"] = round(shmem / max(count, 1) / MIB, 1)
                row["runsc_anon_MiB_per_sandbox"] = round(rss / max(count, 1) / MIB, 1)
                row["mem_available_GiB"] = round(mem_available() / (1 << 30), 1)
                row["frozen"] = frozen_count(api)
                row["api_p50_ms"] = api_p50(api, probe)
                first, more = asyncio.run(exec_times(probe, 10))
                row["exec_first_ms"] = round(first * 1000, 1)
                row["exec_p50_ms"] = p50_ms(more)
                row["failures"] = len(failures)
                rows.append(row)
                print(row, flush=True)
                if len(ids) < target:  # the node refused: no point ramping further
                    break
                target += args.step
            answered = asyncio.run(answer_all(ids, args.parallel, failures, sweep,
                                              args.max_load))
            print(f"{answered}/{len(ids)} answered a command", flush=True)
            print("sweep:", {k: v for k, v in sweep.items() if k not in ("awake", "load")},
                  flush=True)
            for sid in ids:
                with contextlib.suppress(httpx.HTTPError):
                    api.delete(f"/sandboxes/{sid}")
    finally:
        node.stop()
        # What the node said of the failures (the home goes below).
        failures += [line for line in node.log_tail(100_000).splitlines()
                     if " failed: " in line or "ERROR" in line][:20]
        left = leaks(PREFIX, home)
        shutil.rmtree(home, ignore_errors=True)
    report(args, floor_out, unloaded, rows, answered, len(ids), failures, left, sweep)


def report(args: argparse.Namespace, floor_out: dict | None, unloaded: dict, rows: list[dict],
           answered: int, total: int, failures: list[str], left: list[str],
           sweep: dict) -> None:
    cols = ["sandboxes", "ramp_s", "pss_MiB_per_sandbox", "pss_naive_MiB_per_sandbox",
            "memfile_MiB_per_sandbox", "runsc_anon_MiB_per_sandbox",
            "idle_cpu_pct", "frozen", "api_p50_ms", "exec_first_ms", "exec_p50_ms",
            "mem_available_GiB", "load_1m", "failures"]
    text = (f"## Density: idle `base` sandboxes (step {args.step}, max {args.max}, "
            f"idle CPU over {args.window:.0f} s, idle_freeze_s "
            f"{args.idle_freeze_s if args.idle_freeze_s is not None else 'default'}, capacity "
            f"{'derived from the host' if args.host_capacity else args.max + 8})\n\n"
            f"Unloaded: API p50 {unloaded['api_p50_ms']} ms, exec p50 "
            f"{unloaded['exec_p50_ms']} ms. Floor (bare runsc `sleep infinity`): "
            f"{floor_out}.\n\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols) + "\n")
    for row in rows:
        text += "| " + " | ".join(str(row.get(c, "")) for c in cols) + " |\n"
    text += (f"\nidle_cpu_pct: percent of ONE core used by all sandboxes together. PSS: each "
             f"address space once (naive: per-process sum).\n{answered}/{total} sandboxes "
             f"answered a command at the end.\n")
    text += (f"\nThe final sweep ({args.parallel} commands at a time): "
             f"{ {k: v for k, v in sweep.items() if k not in ('awake', 'load')} }; awake "
             f"sandboxes each second: {sweep.get('awake')}; load: {sweep.get('load')}.\n")
    if failures:
        text += "\nFailures:\n" + "\n".join(f"- {f}" for f in failures[:30]) + "\n"
    text += f"\nLeft behind: {left}\n"
    write(args.name, {"floor": floor_out, "unloaded": unloaded, "rows": rows,
                      "answered": answered, "sandboxes": total, "failures": failures,
                      "sweep": sweep,
                      "leaks": left}, text)


if __name__ == "__main__":
    main()
