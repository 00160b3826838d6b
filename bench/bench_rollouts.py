"""SWE-style rollouts per minute, four ways side by side in one run (issue 16's figure).

Run as root:  .venv/bin/python bench/bench_rollouts.py [-n 32] [-c 8]

The task (examples/swe_task.py): a git repository whose unit tests fail, set up once
and snapshotted; each rollout applies one scripted patch (`git apply`, exec 1) and runs
the tests (exec 2): reward 1 when they pass. n rollouts, c at a time, each way:

- host: plain processes, no isolation: a copy of the set-up repository in a temp dir
  per rollout, the same two commands;
- e2b SDK: per rollout `AsyncSandbox.create(<snapshot>)`, `files.write`, two
  `commands.run` (the SDK's `bash -l -c`), `kill`;
- fork: per rollout `POST /sandboxes/<set-up sandbox>/fork` (one child), the two
  commands through envd (agentenv.rl's client, `bash -c`), DELETE;
- RL reset: agentenv.rl's EnvPool of c envs from the snapshot; per rollout the two
  commands, then `reset()` in place back to the snapshot (counted in the rollout).
- RL reset, files (`reset-fs`, `pool-fs`): the same with ``reset_mode="filesystem"``
  (issue 28): an env's resets after its first are envd's, in place, no restore. Each
  env's first (full) reset is set-up, outside the wall time, as its create is.

Rollouts per minute = n / wall time of the way; p50 seconds per rollout; per-phase
p50s (where a rollout's time goes). Every reward is checked. One node "abo"
(10.37.0.0/16, template boot images on). Writes bench/results/rollouts.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from e2b import AsyncSandbox, CommandExitException

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from agentenv.rl import EnvPool
from agentenv.rl.envd import Envd
from agentenv.testing import Node, leaks, sdk_env
from common import write
from swe_rollouts import prepare
from swe_task import (
    APPLY,
    FILES,
    PATCH_PATH,
    REPO,
    SETUP,
    TESTS,
    Clock,
    Rollout,
    patch_of,
    rollouts,
)

GOAL_PER_MIN = 900


async def _attempt(target: Any, r: Rollout, clock: Clock) -> None:
    """Upload the rollout's patch, apply it, run the tests, grade: in an env of the
    RL pool or straight through envd (both have ``upload`` and ``exec``)."""
    await target.upload(PATCH_PATH, patch_of(r))
    clock.lap("upload")
    applied = (await target.exec(APPLY, 30)).exit_code
    clock.lap("exec patch")
    tested = (await target.exec(TESTS, 60)).exit_code if applied == 0 else None
    clock.lap("exec tests")
    _grade(r, applied, tested)


def _grade(r: Rollout, applied: int, tested: int | None) -> None:
    r.reward = 1.0 if applied == 0 and tested == 0 else 0.0


async def run_way(name: str, n: int, c: int, one: Callable[[Rollout], Awaitable[None]]
                  ) -> dict:
    items = rollouts(n)
    sem = asyncio.Semaphore(c)

    async def go(r: Rollout) -> None:
        async with sem:
            t0 = time.perf_counter()
            try:
                await one(r)
            except Exception as e:  # a failed rollout is a wrong reward, reported
                r.error = f"{type(e).__name__}: {str(e)[:200]}"
            r.seconds = time.perf_counter() - t0

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    await asyncio.gather(*(go(r) for r in items))
    wall = time.perf_counter() - t0
    phases: dict[str, list[float]] = {}
    for r in items:
        for k, v in r.phases.items():
            phases.setdefault(k, []).append(v)
    row = {
        "rollouts": n, "concurrency": c, "wall_s": round(wall, 2),
        "per_min": round(60 * n / wall, 1),
        "p50_s": round(statistics.median(r.seconds for r in items), 3),
        "rewards_right": sum(r.ok for r in items),
        "phases_p50_s": {k: round(statistics.median(v), 3) for k, v in phases.items()},
        "errors": [f"#{r.index} {r.name}: {r.error}" for r in items if r.error][:10],
        # The machine is shared: its 1-minute load average before and after this way.
        "load_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }
    print(f"{name}: {row}", flush=True)
    return row


# -- the four ways --------------------------------------------------------------------
def host_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    for fname, text in FILES.items():
        (repo / fname).write_text(text)
    subprocess.run(["bash", "-c", SETUP.replace(REPO, str(repo))], check=True,
                   capture_output=True)
    return repo


async def _sh(cmd: str) -> int:
    p = await asyncio.create_subprocess_exec("bash", "-c", cmd, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)
    return await p.wait()


def host_way(repo: Path, root: Path) -> Callable[[Rollout], Awaitable[None]]:
    async def one(r: Rollout) -> None:
        clock = Clock(r)
        work = root / f"r{r.index}"
        await asyncio.to_thread(shutil.copytree, repo, work / "repo", symlinks=True)
        (work / "patch.diff").write_bytes(patch_of(r))
        clock.lap("copy")
        w = str(work / "repo")
        applied = await _sh(APPLY.replace(REPO, w).replace(PATCH_PATH, str(work / "patch.diff")))
        clock.lap("exec patch")
        tested = await _sh(TESTS.replace(REPO, w)) if applied == 0 else None
        clock.lap("exec tests")
        _grade(r, applied, tested)
        await asyncio.to_thread(shutil.rmtree, work)
        clock.lap("cleanup")
    return one


async def _sdk_code(sbx: AsyncSandbox, cmd: str) -> int:
    try:
        return (await sbx.commands.run(cmd)).exit_code
    except CommandExitException as e:  # the SDK raises for a non-zero exit
        return e.exit_code


def sdk_way(snapshot: str) -> Callable[[Rollout], Awaitable[None]]:
    async def one(r: Rollout) -> None:
        clock = Clock(r)
        sbx = await AsyncSandbox.create(snapshot)
        try:
            clock.lap("create")
            await sbx.files.write(PATCH_PATH, patch_of(r))
            clock.lap("upload")
            applied = await _sdk_code(sbx, APPLY)
            clock.lap("exec patch")
            tested = await _sdk_code(sbx, TESTS) if applied == 0 else None
            clock.lap("exec tests")
            _grade(r, applied, tested)
        finally:
            await sbx.kill()
            clock.lap("kill")
    return one


def fork_way(api: httpx.AsyncClient, envd_http: httpx.AsyncClient, source: str
             ) -> Callable[[Rollout], Awaitable[None]]:
    async def one(r: Rollout) -> None:
        clock = Clock(r)
        resp = await api.post(f"/sandboxes/{source}/fork", json={"count": 1})
        child = resp.json()[0].get("sandbox") if resp.status_code == 201 else None
        if child is None:
            raise RuntimeError(f"fork: {resp.status_code} {resp.text[:200]}")
        try:
            clock.lap("fork")
            envd = Envd(envd_http, child["sandboxID"], child.get("envdAccessToken"))
            await _attempt(envd, r, clock)
        finally:
            await api.delete(f"/sandboxes/{child['sandboxID']}")
            clock.lap("kill")
    return one


def reset_way(pool: EnvPool) -> Callable[[Rollout], Awaitable[None]]:
    async def one(r: Rollout) -> None:
        env = await pool.acquire()
        try:
            clock = Clock(r)
            await _attempt(env, r, clock)
            await env.reset()
            clock.lap("reset")
        finally:
            pool.release(env, reset=False)
    return one


def pooled_way(pool: EnvPool) -> Callable[[Rollout], Awaitable[None]]:
    """As a trainer would use the pool: acquire (waiting for a reset env if none is
    idle), work, release; the release resets in the background."""
    async def one(r: Rollout) -> None:
        clock = Clock(r)
        async with pool.env() as env:
            clock.lap("acquire")
            await _attempt(env, r, clock)
    return one


# -- the run ----------------------------------------------------------------------------
async def bench(node: Node, n: int, c: int, ways: set[str]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollouts-") as tmp:
        root = Path(tmp)
        rows["host processes"] = await run_way("host", n, c, host_way(host_repo(root), root))
    async with EnvPool(node.url, node.api_key, template="base", size=1,
                       run_name="bench-setup") as setup:
        env = await setup.acquire()
        await prepare(env)
        snapshot = await env.snapshot()
        try:
            if "sdk" in ways:
                with sdk_env(node.e2b_env()):
                    rows["e2b SDK: create from snapshot"] = await run_way(
                        "sdk", n, c, sdk_way(snapshot))
            if "fork" in ways:
                async with httpx.AsyncClient(base_url=node.url, timeout=120,
                                             headers={"X-API-Key": node.api_key}) as api, \
                        httpx.AsyncClient(base_url=node.url, timeout=120) as envd_http:
                    rows["fork of the set-up sandbox"] = await run_way(
                        "fork", n, c, fork_way(api, envd_http, env.sandbox_id))
            if "reset" in ways:
                async with EnvPool(node.url, node.api_key, snapshot=snapshot, size=c,
                                   run_name="bench-rollouts") as pool:
                    row = await run_way("reset", n, c, reset_way(pool))
                    row["reset_in_place"] = pool.reset_in_place
                    row["node_reset_p50_s"] = node_resets(node)
                    rows["agentenv.rl: reset in place"] = row
            if "pool" in ways:
                async with EnvPool(node.url, node.api_key, snapshot=snapshot, size=2 * c,
                                   run_name="bench-rollouts") as pool:
                    rows[f"agentenv.rl: pool of {2 * c}, background reset"] = await run_way(
                        "pool", n, c, pooled_way(pool))
            if "reset-fs" in ways:
                async with EnvPool(node.url, node.api_key, snapshot=snapshot, size=c,
                                   run_name="bench-rollouts", reset_mode="filesystem") as pool:
                    await layered(pool, c)
                    rows["agentenv.rl: reset in place, filesystem mode"] = await run_way(
                        "reset-fs", n, c, reset_way(pool))
            if "pool-fs" in ways:
                async with EnvPool(node.url, node.api_key, snapshot=snapshot, size=c,
                                   run_name="bench-rollouts", reset_mode="filesystem") as pool:
                    await layered(pool, c)
                    rows[f"agentenv.rl: pool of {c}, background reset, filesystem mode"] = \
                        await run_way("pool-fs", n, c, pooled_way(pool))
        finally:
            await setup.delete_snapshot(snapshot)
    return rows


async def layered(pool: EnvPool, c: int) -> None:
    """Set-up of the filesystem-mode ways: every env of the pool reset once (a full
    reset, which layers its files), so that the timed resets are the steady state's."""
    envs = [await pool.acquire() for _ in range(c)]
    await asyncio.gather(*(env.reset() for env in envs))
    for env in envs:
        pool.release(env, reset=False)


def node_resets(node: Node) -> dict[str, float]:
    """The node's own account of its resets (its log): the whole reset, and the
    destruction of the old runtime within it (the rest is the restore)."""
    found = re.findall(r"reset \S+ to snapshot \S+ in (\d+) ms \([^;]*; old runtime "
                       r"destroyed in (\d+) ms\)", node.log_path.read_text(errors="replace"))
    if not found:
        return {}
    return {"reset": round(statistics.median(float(a) for a, _ in found) / 1000, 3),
            "destroy": round(statistics.median(float(b) for _, b in found) / 1000, 3),
            "n": len(found)}


def render(rows: dict[str, dict], n: int, c: int, left: list[str]) -> str:
    host = rows["host processes"]["per_min"]
    lines = [f"### SWE-style rollouts: {n} rollouts, {c} at a time (template base)", "",
             "| way | rollouts/min | x host | p50 s/rollout | rewards right | phases (p50 s) "
             "| load 1m |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        phases = ", ".join(f"{k} {v}" for k, v in row["phases_p50_s"].items())
        if row.get("node_reset_p50_s"):
            nr = row["node_reset_p50_s"]
            phases += f" (node-side reset {nr['reset']}, of which destroy {nr['destroy']})"
        lines.append(f"| {name} | {row['per_min']} | {round(host / row['per_min'], 1)} | "
                     f"{row['p50_s']} | {row['rewards_right']}/{row['rollouts']} | {phases} | "
                     f"{row['load_1m'][0]} → {row['load_1m'][1]} |")
    lines += ["", f"Goal: ≥ {GOAL_PER_MIN} rollouts/min and within 2x of host processes "
              "(issue 28), every reward right. The SDK runs commands as `bash -l -c`, "
              "agentenv.rl as `bash -c`. A rollout's time includes its create/fork/reset "
              "and its kill; "
              "the RL pool's first creates (and, in filesystem mode, each env's first, "
              "full reset) and the snapshot are set-up, outside the wall time.", ""]
    errors = [f"- {name}: {e}" for name, row in rows.items() for e in row["errors"]]
    if errors:
        lines += ["Errors:", *errors, ""]
    lines.append(f"Left behind: {left}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-c", type=int, default=8)
    ap.add_argument("--ways", default="sdk,fork,reset,pool,reset-fs,pool-fs",
                    help="besides host processes: sdk, fork, reset, pool, reset-fs, pool-fs "
                         "(all by default)")
    args = ap.parse_args()
    ways = set(args.ways.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-rollouts-node-"))
    node = Node(work / "home", "abo", "10.37.0.0/16", AENV_MAX_SANDBOXES="24")
    rows: dict[str, dict] = {}
    try:
        node.start()
        rows = asyncio.run(bench(node, args.n, args.c, ways))
    finally:
        node.stop()
        left = leaks("abo", work / "home")
        shutil.rmtree(work, ignore_errors=True)
    text = render(rows, args.n, args.c, left)
    write("rollouts", {"rows": rows, "leaks": left, "n": args.n, "concurrency": args.c}, text)
    return 0 if all(r["rewards_right"] == r["rollouts"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
