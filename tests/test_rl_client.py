"""agentenv.rl against the session node: the SWE rollouts example (16 rollouts from a
snapshot, 8 at a time, reset in place between them) gets every reward right and
leaves nothing behind; the client's exec, files, timeouts and durable exec."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from agentenv.rl import ApiError, EnvPool, ExecTimeout, RetryPolicy
from agentenv.rl.pool import POOL_METADATA
from agentenv.testing import Node, leaks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import swe_rollouts


def _pool_sandboxes(node: Node) -> list[dict]:
    with node.client() as api:
        return [s for s in api.get("/sandboxes").json()
                if POOL_METADATA in (s.get("metadata") or {})]


@pytest.mark.timeout(240)
async def test_swe_rollouts_example_rewards(node: Node) -> None:
    results, wall, how, snapshot = await swe_rollouts.run(node.url, node.api_key, n=16, size=8)
    print(swe_rollouts.table(results, wall, "rollouts"))
    assert [(r.name, r.reward) for r in results] == [(r.name, r.expected) for r in results]
    assert {r.reward for r in results} == {0.0, 1.0}
    assert how == "in place"
    assert _pool_sandboxes(node) == []
    with node.client() as api:  # the example deletes its snapshot
        assert api.get(f"/snapshots/{snapshot}").status_code == 404


@pytest.mark.timeout(120)
async def test_env_exec_files_timeouts_and_reset(node: Node) -> None:
    async with EnvPool(node.url, node.api_key, template="base", size=1,
                       run_name="rl-test", lease_s=5) as pool:
        env = await pool.acquire()
        first = env.sandbox_id
        run_id = pool.run.run_id  # the pool's run owns its sandboxes
        with node.client() as api:
            run = api.get(f"/runs/{run_id}").json()
        assert run["name"] == "rl-test" and run["sandboxes"] == 1
        code, out, err = await env.exec("echo out; echo err >&2; exit 7")
        assert (code, out, err) == (7, "out\n", "err\n")
        await env.upload("/home/user/x/data.bin", bytes(range(256)) * 10)
        assert await env.download("/home/user/x/data.bin") == bytes(range(256)) * 10
        with pytest.raises(FileNotFoundError):
            await env.download("/home/user/nothing")
        with pytest.raises(ExecTimeout) as timed_out:
            await env.exec("echo started; sleep 30", timeout=1)
        assert timed_out.value.stdout == "started\n"
        # Durable: the same result, and the command is kept by envd afterwards.
        assert await env.exec("echo d; exit 4", durable=True) == (4, "d\n", "")
        r = await env.envd.client.get("/aenv/commands", headers=env.envd.headers)
        assert [c["exitCode"] for c in r.json()] == [4]
        with pytest.raises(ExecTimeout):
            await env.exec("sleep 30", timeout=1, durable=True)
        # A template pool resets by kill + create: a new sandbox, no old file.
        await env.reset()
        assert env.sandbox_id != first and pool.reset_in_place is False
        assert (await env.exec("ls /home/user/x 2>&1; true")).stdout.startswith("ls:")
        pool.release(env, reset=False)
        with node.client() as api:  # a 5 s lease, kept alive by the pool's heartbeat
            later = api.get(f"/runs/{run_id}").json()
        assert later["expiresAt"] > run["expiresAt"] and later["sandboxes"] == 1
    assert _pool_sandboxes(node) == []
    with node.client() as api:
        assert api.get(f"/sandboxes/{first}").status_code == 404
        assert api.get(f"/runs/{run_id}").status_code == 404  # ended with the pool


async def test_pool_refuses_bad_input(node: Node) -> None:
    with pytest.raises(ValueError):
        EnvPool(node.url, node.api_key, size=1)
    with pytest.raises(ValueError):
        EnvPool(node.url, node.api_key, template="base", size=0)
    with pytest.raises(ValueError):
        EnvPool(node.url, node.api_key, template="base", size=1, reset_mode="files")
    with pytest.raises(ApiError) as unknown:
        async with EnvPool(node.url, node.api_key, template="no-such-template", size=2):
            pass
    assert unknown.value.status == 404
    with pytest.raises(ApiError) as bad_key:
        async with EnvPool(node.url, "wrong-key", template="base", size=1):
            pass
    assert bad_key.value.status == 401
    assert _pool_sandboxes(node) == []


@pytest.mark.timeout(180)
async def test_a_files_mode_pool_resets_its_envs_in_place(node: Node) -> None:
    """reset_mode="filesystem": an env's first reset is a full one, the next ones put
    its files back in place (issue 28); what a rollout wrote and started is gone."""
    async with EnvPool(node.url, node.api_key, template="base", size=1,
                       run_name="rl-setup") as setup:
        env = await setup.acquire()
        await env.exec("echo task > /home/user/task.txt")
        snapshot = await env.snapshot()
        try:
            async with EnvPool(node.url, node.api_key, snapshot=snapshot, size=1,
                               run_name="rl-files", reset_mode="filesystem") as pool:
                env = await pool.acquire()
                for _ in range(3):
                    await env.exec("echo rollout > /home/user/task.txt; touch /tmp/x; "
                                   "(sleep 1000 &)")
                    await env.reset()
                    code, out, _ = await env.exec("cat /home/user/task.txt; ls /tmp; "
                                                  "pgrep -x sleep || true")
                    assert (code, out) == (0, "task\n")
                with node.client() as api:  # the sandbox's history, in the lineage
                    tree = api.get(f"/snapshots/{snapshot}/lineage").json()["tree"]
                mine = [n for n in tree["children"] if n["id"] == env.sandbox_id]
                assert [r["mode"] for r in mine[0]["resets"]] == \
                    ["memory", "filesystem", "filesystem"]
                pool.release(env, reset=False)
        finally:
            await setup.delete_snapshot(snapshot)


@pytest.mark.timeout(180)
async def test_pool_waits_out_a_full_node(tmp_path: Path) -> None:
    """A node with room for 2 and a 1 s admission queue: a pool's create past it is
    answered 429 + Retry-After; the pool retries as told, gives up at its deadline
    with that 429, and succeeds once room is made. Nothing leaks."""
    prefix = f"rl{os.getpid() % 4096:03x}"
    node = Node(tmp_path / "home", prefix, f"10.{140 + os.getpid() % 10}.0.0/16",
                AENV_MAX_SANDBOXES="2", AENV_ADMISSION_QUEUE_TIMEOUT_S="1")
    node.start()
    try:
        async with EnvPool(node.url, node.api_key, template="base", size=2):
            late = EnvPool(node.url, node.api_key, template="base", size=1,
                           retry=RetryPolicy(deadline_s=3))
            with pytest.raises(ApiError) as gave_up:
                async with late:
                    pass
            assert gave_up.value.status == 429 and "deadline" in gave_up.value.message
            assert set(late.api.refusals) == {429}
            waiting = EnvPool(node.url, node.api_key, template="base", size=1)
            start = asyncio.create_task(waiting.start())
            while 429 not in waiting.api.refusals:  # queued, refused, retrying
                assert not start.done(), start
                await asyncio.sleep(0.1)
        await start  # room made by the first pool's close: the retry gets in
        env = await waiting.acquire()
        assert (await env.exec("echo in")).stdout == "in\n"
        await waiting.close()
        with node.client() as api:
            assert api.get("/sandboxes").json() == []
            assert api.get("/runs").json() == []
    finally:
        node.stop()
    assert leaks(prefix, node.home) == []
