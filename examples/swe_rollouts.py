"""16 SWE-style rollouts through agentenv's RL client (agentenv.rl).

A small git repository with a failing unit test is set up once in a sandbox and
snapshotted; a pool of 8 environments from that snapshot then runs 16 rollouts, 8 at
a time, each applying a different scripted patch and graded by running the tests
(reward 1 when they pass). Between rollouts each env is reset to the snapshot in
place. Prints the rollout table and the time per rollout; exits 1 if any reward is
not the expected one.

    python examples/swe_rollouts.py --url http://127.0.0.1:8000 --key $E2B_API_KEY
(E2B_API_URL / E2B_API_KEY are read when the flags are left out.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentenv.rl import Env, EnvPool, ExecTimeout
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
    table,
)


async def prepare(env: Env) -> None:
    """The task's repository, committed, its tests failing."""
    for name, text in FILES.items():
        await env.upload(f"{REPO}/{name}", text.encode())
    code, out, err = await env.exec(SETUP, 60)
    if code != 0 or out.strip() != "failing":
        raise RuntimeError(f"set-up went wrong ({code}): {out} {err}")


async def rollout(env: Env, r: Rollout) -> Rollout:
    """Patch, grade, reward (0 for a patch that does not apply or a test run that
    times out)."""
    t0 = time.perf_counter()
    clock = Clock(r)
    try:
        await env.upload(PATCH_PATH, patch_of(r))
        code, _, err = await env.exec(APPLY, 30)
        clock.lap("exec patch")
        if code != 0:
            r.reward, r.error = 0.0, f"patch did not apply: {err.strip()[:80]}"
        else:
            code, _, _ = await env.exec(TESTS, 60)
            clock.lap("exec tests")
            r.reward = 1.0 if code == 0 else 0.0
    except ExecTimeout:
        r.reward, r.error = 0.0, "timed out"
    r.seconds = time.perf_counter() - t0
    return r


async def run(url: str, key: str, n: int = 16, size: int = 8
              ) -> tuple[list[Rollout], float, str, str]:
    """The rollouts' results, their wall time, how envs were reset, and the
    snapshot they started from (deleted by then)."""
    async with EnvPool(url, key, template="base", size=1, run_name="swe-setup") as setup:
        env = await setup.acquire()
        await prepare(env)
        snapshot = await env.snapshot()
        try:
            # The task's state is its files (the repository): from an env's second
            # reset on, its files go back in place, no restore (docs/api.md).
            async with EnvPool(url, key, snapshot=snapshot, size=size,
                               run_name="swe-rollouts", reset_mode="filesystem") as pool:
                t0 = time.perf_counter()
                results = await pool.map(rollout, rollouts(n))
                wall = time.perf_counter() - t0
                how = "in place" if pool.reset_in_place else "kill + create"
        finally:
            await setup.delete_snapshot(snapshot)
    return results, wall, how, snapshot


async def main(url: str, key: str, n: int, size: int) -> int:
    results, wall, how, _ = await run(url, key, n, size)
    print(table(results, wall, f"### {n} SWE rollouts, {size} at a time "
                                f"(agentenv.rl, reset {how})"))
    wrong = [r for r in results if not r.ok]
    if wrong:
        print(f"{len(wrong)} rewards wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=os.environ.get("E2B_API_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--key", default=os.environ.get("E2B_API_KEY", ""))
    ap.add_argument("-n", type=int, default=16, help="rollouts (16)")
    ap.add_argument("--size", type=int, default=8, help="environments at once (8)")
    args = ap.parse_args()
    sys.exit(asyncio.run(main(args.url, args.key, args.n, args.size)))
