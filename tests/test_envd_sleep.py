"""envd sleeps when the host needs its memory, not after a fixed delay (issue 27).

The step after an agent's think gap must not pay envd's wake (0.3-0.7 s): with memory
plentiful, an idle sandbox keeps its envd awake (frozen by the idle freezer, it costs
no CPU) and answers at a warm command's speed. Below ``envd_dormancy_mb`` of available
memory the node asks idle envds to sleep (orchestrator/envd_sleep.py); a node of this
file's own sets that watermark above any host's memory, so it is always short.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from agentenv.orchestrator import envd_sleep
from agentenv.orchestrator.envd_sleep import Candidate, EnvdSleeper
from agentenv.testing import Node, sdk_env, serving
from agentenv.testing.nodes import free_cidr

PREFIX = f"es{os.getpid() % 4096:03x}"


def console(node: Node, sandbox_id: str) -> str:
    path = node.home / "run" / "sandboxes" / sandbox_id / "console.log"
    return path.read_text(errors="replace") if path.exists() else ""


def envd_get(node: Node, sbx: Sandbox, path: str) -> httpx.Response:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
               "X-Access-Token": sbx._envd_access_token or ""}
    return httpx.get(node.url + path, headers=headers, timeout=30)


def test_an_idle_sandbox_keeps_envd_awake_while_memory_is_plentiful(node: Node) -> None:
    """Past the old fixed delay (5 s) and frozen meanwhile, the next command wakes
    nothing: envd never went dormant (it did, by default, before)."""
    sbx = Sandbox.create(template="base", timeout=120)
    try:
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        time.sleep(7)  # the think gap under test
        assert sbx.commands.run("echo again").stdout == "again\n"
        assert "envd dormant" not in console(node, sbx.sandbox_id)
        assert envd_get(node, sbx, "/aenv/dormancy").json()["wakes"] == 0
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def short_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node whose host is always short of memory for awake envds (but not for
    pauses: memory_pressure_mb stays derived), and that moves no frozen sandbox's
    memory to swap: envds sleep where the host has no swap for that."""
    cidr = free_cidr(160, 20, os.getpid())
    with serving(Node(tmp_path_factory.mktemp("sleep"), PREFIX, cidr,
                      AENV_ENVD_DORMANCY_MB=str(1 << 30), AENV_MAX_SANDBOXES="6",
                      AENV_COLD_MEMORY_AFTER_S="0")) as node:
        with sdk_env(node.e2b_env()):
            yield node


def wait_for(what, within: float, why: str) -> None:
    end = time.monotonic() + within
    while not what():
        assert time.monotonic() < end, why
        time.sleep(0.2)


def test_short_of_memory_idle_envds_are_asked_to_sleep_and_busy_ones_are_not(
        short_node: Node) -> None:
    idle = Sandbox.create(template="base", timeout=120, envs={"KEPT": "yes"})
    busy = Sandbox.create(template="base", timeout=120)
    try:
        idle.files.write("/home/user/kept.txt", "before\n")
        busy.commands.run("sleep 600", background=True)
        # Idle for MIN_IDLE_S, then asked (a round every 2 s): dormant.
        wait_for(lambda: "envd dormant" in console(short_node, idle.sandbox_id), 30,
                 f"idle envd not asked to sleep:\n{console(short_node, idle.sandbox_id)}")
        assert "asked by the node" in console(short_node, idle.sandbox_id)
        # A sandbox with a process of its user's running is left awake (envd says why).
        time.sleep(envd_sleep.REFUSED_RETRY_S / 2)
        assert "envd dormant" not in console(short_node, busy.sandbox_id)
        # The dormant one wakes with what it had.
        out = idle.commands.run('echo "$KEPT"; cat /home/user/kept.txt')
        assert out.stdout == "yes\nbefore\n"
        assert envd_get(short_node, idle, "/aenv/dormancy").json()["wakes"] == 1
    finally:
        idle.kill()
        busy.kill()


def test_asking_envd_to_sleep_needs_its_token(short_node: Node) -> None:
    sbx = Sandbox.create(template="base", timeout=60)
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
        r = httpx.post(short_node.url + "/aenv/dormancy", headers=headers, timeout=30)
        assert r.status_code == 401
        r = httpx.post(short_node.url + "/aenv/dormancy", timeout=30, headers={
            **headers, "X-Access-Token": sbx._envd_access_token or ""})
        assert r.status_code in (202, 409), r.text  # (409: a command of the node's runs)
        assert sbx.commands.run("echo up").stdout == "up\n"
    finally:
        sbx.kill()


# -- the policy alone (no sandboxes) -----------------------------------------------
class FakeHost:
    def __init__(self, available: int, n: int, busy: frozenset[str] = frozenset()) -> None:
        self.available = available
        self.awake = {f"s{i}": 60.0 - i for i in range(n)}  # idle seconds: s0 most idle
        self.busy = busy
        self.asked: list[str] = []

    def candidates(self) -> list[Candidate]:
        return [Candidate(sid, "10.0.0.1", "t", idle)
                for sid, idle in sorted(self.awake.items(), key=lambda kv: -kv[1])]

    async def ask(self, c: Candidate) -> str | None:
        self.asked.append(c.sandbox_id)
        if c.sandbox_id in self.busy:
            return "processes running"
        del self.awake[c.sandbox_id]
        self.available += envd_sleep.ENVD_MB
        return None


async def _rounds(sleeper: EnvdSleeper, n: int) -> None:
    for _ in range(n):
        sleeper._last_round = 0.0  # no round gap in a unit test
        sleeper.tend()
        if sleeper._round is not None:
            await sleeper._round


@pytest.mark.parametrize("available, asked", [(10_000, 0), (1000 - 50, 3), (0, 32)])
def test_a_round_asks_as_many_as_hold_the_memory_missing(available: int, asked: int) -> None:
    host = FakeHost(available, 100)
    sleeper = EnvdSleeper(lambda: 1000, host.candidates, host.ask, lambda: host.available)
    asyncio.run(_rounds(sleeper, 1))
    assert host.asked == [f"s{i}" for i in range(asked)]  # the most idle first


def test_a_busy_envd_is_not_asked_again_at_once() -> None:
    host = FakeHost(0, 3, busy=frozenset({"s0"}))
    sleeper = EnvdSleeper(lambda: 10_000, host.candidates, host.ask, lambda: host.available)
    asyncio.run(_rounds(sleeper, 2))
    assert host.asked == ["s0", "s1", "s2"]  # s0 refused once, then left alone
    never = EnvdSleeper(lambda: -1, host.candidates, host.ask, lambda: 0)
    asyncio.run(_rounds(never, 1))
    assert host.asked == ["s0", "s1", "s2"]  # -1: never asked


# -- a resume waits out a slow envd start, not a fixed 15 s ----------------------------
async def _slow_envd(delay_s: float, progress) -> None:
    """An envd stand-in on a loopback address of its own that answers /health after
    ``delay_s`` (a dormant envd restored on a saturated host, starting Python)."""
    from agentenv.envd.protocol import ENVD_PORT
    from agentenv.orchestrator.envd_client import EnvdClient

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(max(0.0, ready_at - time.monotonic()))
        writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    address = f"127.27.{os.getpid() % 250}.{int(delay_s * 10) % 250 + 1}"
    server = await asyncio.start_server(serve, address, ENVD_PORT)
    ready_at = time.monotonic() + delay_s
    client = EnvdClient()
    try:
        await client.wait_ready(address, deadline_s=0.5, progress=progress)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


def test_a_slow_envd_start_is_waited_for_while_the_sandbox_works() -> None:
    from agentenv.orchestrator.envd_client import EnvdUnavailable

    cpu = iter(range(1000))
    asyncio.run(_slow_envd(1.5, lambda: float(next(cpu))))  # using CPU: waited for
    with pytest.raises(EnvdUnavailable, match="did not answer"):
        asyncio.run(_slow_envd(1.5, lambda: 7.0))  # no progress: the deadline holds
    with pytest.raises(EnvdUnavailable, match="did not answer"):
        asyncio.run(_slow_envd(1.5, None))
