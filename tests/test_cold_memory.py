"""Frozen sandboxes' memory moved to the host's compressed swap (issue 27).

An idle sandbox keeps its envd awake (no 0.3-0.7 s wake on the step after a think
gap) and still gives most of its memory back: frozen for ``cold_memory_after_s``, its
pages go to zram (runtime/reclaim.py), and the next command faults back what it
touches. The sandbox's own memory limit stays a limit on RAM: the kernel never swaps a
sandbox by itself.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from agentenv.orchestrator.cold_memory import ColdMemory
from agentenv.runtime import SandboxSpec
from agentenv.runtime.reclaim import reclaim_frozen
from agentenv.runtime.swap import active_swaps, swap_stats
from agentenv.testing import Node, sdk_env, serving
from agentenv.testing.fakes import FakeRuntime
from agentenv.testing.nodes import free_cidr

PREFIX = f"cm{os.getpid() % 4096:03x}"
MEMORY_CG = Path("/sys/fs/cgroup/memory")
MIB = 1 << 20
COLD_MIB = 8  # what stays resident of a reclaimed sandbox, at most


def cgroup_value(sandbox_id: str, name: str) -> int:
    return int((MEMORY_CG / PREFIX / sandbox_id / name).read_text())


def swapped(sandbox_id: str) -> int:
    return cgroup_value(sandbox_id, "memory.memsw.usage_in_bytes") - \
        cgroup_value(sandbox_id, "memory.usage_in_bytes")


@pytest.fixture(scope="module")
def cold_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    cidr = free_cidr(150, 10, os.getpid())
    with serving(Node(tmp_path_factory.mktemp("cold"), PREFIX, cidr,
                      AENV_IDLE_FREEZE_S="1", AENV_COLD_MEMORY_AFTER_S="1",
                      AENV_MAX_SANDBOXES="4")) as node:
        with sdk_env(node.e2b_env()):
            yield node


def state(sandbox_id: str) -> str:
    frozen = Path("/sys/fs/cgroup/freezer") / PREFIX / sandbox_id / "freezer.state"
    return (f"{frozen.read_text().strip()}, resident "
            f"{cgroup_value(sandbox_id, 'memory.usage_in_bytes') / MIB:.1f} MiB, swapped "
            f"{swapped(sandbox_id) / MIB:.1f} MiB")


def wait_for(check, timeout: float, what: str, sandbox_id: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state(sandbox_id)}"
        time.sleep(0.2)


def test_an_idle_sandbox_gives_its_memory_back_and_answers_with_envd_awake(
        cold_node: Node) -> None:
    sbx = Sandbox.create(template="base", timeout=120, envs={"STEP": "kept"})
    try:
        sid = sbx.sandbox_id
        # State in memory that must survive: a process holding a counter, a /tmp file.
        sbx.commands.run("python3 -c 'import time; time.sleep(3600)' >/dev/null 2>&1 &"
                         " echo $! > /tmp/holder.pid; echo scratch > /tmp/scratch",
                         timeout=30)
        assert swap_stats() is not None, f"no zram swap set up: {active_swaps()}"
        # Awake, envd and the holder take ~40 MiB; reclaimed, ~2-3 MiB stay.
        wait_for(lambda: swapped(sid) > 16 * MIB and
                 cgroup_value(sid, "memory.usage_in_bytes") < COLD_MIB * MIB, 60,
                 "the idle sandbox's memory in swap", sid)
        resident = cgroup_value(sid, "memory.usage_in_bytes")
        # Shut again after the reclaim: the kernel never swaps the sandbox by itself.
        wait_for(lambda: cgroup_value(sid, "memory.swappiness") == 0, 10, "swap shut", sid)

        out = sbx.commands.run("cat /tmp/scratch; echo $STEP; kill -0 $(cat /tmp/holder.pid)"
                               " && echo holder-alive")
        assert out.stdout == "scratch\nkept\nholder-alive\n"
        console = (cold_node.home / "run" / "sandboxes" / sid / "console.log").read_text(
            errors="replace")
        assert "envd dormant" not in console and "envd woken" not in console
        assert cgroup_value(sid, "memory.usage_in_bytes") > resident  # faulted back
        sbx.files.write("/home/user/after.txt", "written after the reclaim\n")
        assert sbx.files.read("/home/user/after.txt") == "written after the reclaim\n"
        # Idle again: reclaimed again.
        wait_for(lambda: cgroup_value(sid, "memory.usage_in_bytes") < COLD_MIB * MIB, 60,
                 "a second reclaim", sid)
        metrics = httpx.get(cold_node.url + "/metrics", timeout=10,
                            headers={"X-API-Key": cold_node.api_key}).text
        reclaims = next(float(ln.split()[-1]) for ln in metrics.splitlines()
                        if ln.startswith("aenv_sandbox_reclaims_total "))
        assert reclaims >= 2
    finally:
        sbx.kill()


def test_a_sandbox_at_its_limit_is_not_swapped(tmp_path: Path) -> None:
    """One whose memory and swap together reach its limit is left alone: no sandbox
    holds more swap than its own limit."""
    cg = tmp_path
    (cg / "memory.usage_in_bytes").write_text(str(100 * MIB))
    (cg / "memory.limit_in_bytes").write_text(str(512 * MIB))
    (cg / "memory.memsw.usage_in_bytes").write_text(str(600 * MIB))
    (cg / "memory.swappiness").write_text("0")
    assert reclaim_frozen(cg, lambda: True) == (0, 100 * MIB)
    assert (cg / "memory.swappiness").read_text() == "0"
    assert not (cg / "memory.force_empty").exists()
    # Under it, the reclaim is asked (and the cgroup's swap shut again after).
    (cg / "memory.memsw.usage_in_bytes").write_text(str(300 * MIB))
    reclaim_frozen(cg, lambda: True)
    assert (cg / "memory.force_empty").exists()
    assert (cg / "memory.swappiness").read_text() == "0"
    # Thawed before its turn: nothing is reclaimed.
    (cg / "memory.force_empty").unlink()
    reclaim_frozen(cg, lambda: False)
    assert not (cg / "memory.force_empty").exists()


def test_short_of_memory_the_delay_is_a_second() -> None:
    async def scenario() -> None:
        runtime = FakeRuntime()
        await runtime.start(SandboxSpec("a", Path("/"), "a", 1, 512, "", Path("/"), "/b",
                                        ["envd"]))
        short = [False]
        cold = ColdMemory(runtime, after_s=60, running=lambda: ["a"], short=lambda: short[0])
        runtime.freeze("a")
        cold.frozen("a")
        await asyncio.sleep(1.1)
        cold.tend()
        await asyncio.sleep(0.05)
        assert ("reclaim", "a") not in runtime.calls  # plentiful: 60 s
        short[0] = True
        cold.tend()
        await asyncio.sleep(0.05)
        assert ("reclaim", "a") in runtime.calls
        cold.close()

    asyncio.run(scenario())


def test_the_policy_reclaims_once_per_freeze_after_the_delay() -> None:
    async def scenario() -> None:
        runtime = FakeRuntime()
        running = ["a", "b"]
        for sid in running:
            await runtime.start(SandboxSpec(sid, Path("/"), sid, 1, 512, "", Path("/"), "/b",
                                            ["envd"]))
        cold = ColdMemory(runtime, after_s=0.2, running=lambda: running)
        runtime.freeze("a")
        cold.tend()
        await asyncio.sleep(0.3)
        cold.tend()
        await asyncio.sleep(0.05)
        assert ("reclaim", "a") in runtime.calls and ("reclaim", "b") not in runtime.calls
        assert cold.is_cold("a")
        calls = len(runtime.calls)
        cold.tend()
        await asyncio.sleep(0.05)
        assert len(runtime.calls) == calls  # once per freeze
        runtime.thaw("a")
        cold.tend()
        assert not cold.is_cold("a")
        runtime.freeze("a")
        cold.frozen("a")
        cold.tend()
        assert len(runtime.calls) == calls  # the delay again
        await asyncio.sleep(0.3)
        cold.tend()
        await asyncio.sleep(0.05)
        assert runtime.calls.count(("reclaim", "a")) == 2
        # Thawed and frozen again between two looks: the new freeze is told, and its
        # reclaim follows after the delay.
        runtime.thaw("a")
        runtime.freeze("a")
        cold.frozen("a")
        await asyncio.sleep(0.3)
        cold.tend()
        await asyncio.sleep(0.05)
        assert runtime.calls.count(("reclaim", "a")) == 3
        # One that left much in RAM (pages the kernel found referenced) is tried again
        # after the delay, at most MAX_TRIES times a freeze.
        runtime.reclaim_leaves = 20 << 20
        runtime.thaw("b")
        runtime.freeze("b")
        cold.frozen("b")
        for _ in range(6):
            await asyncio.sleep(0.25)
            cold.tend()
        await asyncio.sleep(0.05)
        assert runtime.calls.count(("reclaim", "b")) == 3
        assert cold.is_cold("b")
        cold.close()
        off = ColdMemory(runtime, after_s=0, running=lambda: running)
        runtime.thaw("b")
        runtime.freeze("b")
        off.frozen("b")
        calls = len(runtime.calls)
        off.tend()
        await asyncio.sleep(0.05)
        assert len(runtime.calls) == calls

    asyncio.run(scenario())
