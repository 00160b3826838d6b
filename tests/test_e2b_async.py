"""The e2b SDK's asyncio flavour (AsyncSandbox) against a node: the main paths."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from e2b import AsyncSandbox, CommandExitException, SandboxQuery, TimeoutException
from e2b_code_interpreter import AsyncSandbox as AsyncCodeSandbox

from agentenv.testing import Node


async def test_kill_sandbox_while_command_is_running(node: Node) -> None:
    """E2B's own test, async (tests/async/.../test_sandbox_killed_during_run.py)."""
    sbx = await AsyncSandbox.create(template="base", timeout=60)
    cmd = await sbx.commands.run("sleep 60", background=True)
    await sbx.kill()
    with pytest.raises(TimeoutException) as exc_info:
        await cmd.wait()
    assert "sandbox was killed or reached its end of life" in str(exc_info.value)


HANGS = ("python3 -c \"import socket, time\ns = socket.socket()\n"
         "s.bind(('0.0.0.0', 8000)); s.listen()\nc, _ = s.accept()\n"
         "print('accepted', flush=True); time.sleep(600)\"")


async def test_a_request_a_kill_cuts_is_answered_502_not_found(node: Node) -> None:
    """The race's other half: a request relayed before the kill began and cut by it
    (a command's stream; here a server that never answers) is answered as every
    request after the kill: the 502 "was not found" the SDK reads as killed, not
    "did not answer" or "port is not open" (which it reports as unreachable)."""
    sbx = await AsyncSandbox.create(template="base", timeout=60)
    accepted = asyncio.Event()
    await sbx.commands.run(HANGS, background=True, on_stdout=lambda _: accepted.set())
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
    async with httpx.AsyncClient(base_url=node.url, headers=headers, timeout=60) as client:
        pending = None
        for _ in range(100):  # until the server listens and takes the request
            pending = asyncio.create_task(client.get("/hangs"))
            done, _ = await asyncio.wait([pending], timeout=0.2)
            if not done or accepted.is_set():
                break
        await asyncio.wait_for(accepted.wait(), 30)
        await sbx.kill()
        r = await pending
        health = await client.get("/health", headers={"E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502 and "was not found" in r.json()["message"], r.text
    assert health.status_code == 502 and "was not found" in health.json()["message"]


async def test_async_sandbox_main_paths(node: Node) -> None:
    sbx = await AsyncSandbox.create(template="base", timeout=120, metadata={"flavour": "async"})
    try:
        # commands, concurrently
        results = await asyncio.gather(*(sbx.commands.run(f"echo {i}") for i in range(5)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
        with pytest.raises(CommandExitException) as failed:
            await sbx.commands.run("exit 9")
        assert failed.value.exit_code == 9
        handle = await sbx.commands.run("sleep 0.5; echo bg", background=True)
        assert (await handle.wait()).stdout == "bg\n"

        # files
        await sbx.files.write("/home/user/async.txt", "async text")
        assert await sbx.files.read("/home/user/async.txt") == "async text"
        assert await sbx.files.exists("/home/user/async.txt")

        # info and listing
        info = await sbx.get_info()
        assert info.metadata == {"flavour": "async"}
        pager = AsyncSandbox.list(query=SandboxQuery(metadata={"flavour": "async"}))
        assert [s.sandbox_id for s in await pager.next_items()] == [sbx.sandbox_id]
        assert await sbx.is_running()
    finally:
        await sbx.kill()
    assert not await sbx.is_running()


@pytest.mark.needs_build("code-interpreter")
async def test_async_code_interpreter(node: Node) -> None:
    sbx = await AsyncCodeSandbox.create(timeout=120)
    try:
        await sbx.run_code("acc = []")
        for i in range(3):
            await sbx.run_code(f"acc.append({i})")
        execution = await sbx.run_code("print('sum'); sum(acc)")
        assert execution.text == "3" and execution.logs.stdout == ["sum\n"]
    finally:
        await sbx.kill()


async def test_async_command_timeout_raises_timeout_exception(node: Node) -> None:
    """Issue 14.9: as the sync SDK (and E2B's envd, which ends the stream with
    deadline_exceeded): a command past its ``timeout`` is a TimeoutException, not a
    CommandExitException for the kill; the command is killed. Likewise a stream
    attached with ``connect``."""
    sbx = await AsyncSandbox.create(template="base", timeout=120)
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 10", timeout=2)
        assert asyncio.get_running_loop().time() - t0 < 8
        await asyncio.sleep(0.5)
        assert not [p for p in await sbx.commands.list() if "sleep 10" in p.cmd + " ".join(p.args)]
        # a command that ends in time is unaffected
        assert (await sbx.commands.run("echo quick", timeout=5)).stdout == "quick\n"
        # a stream attached with connect(timeout=) ends at its deadline; the command
        # itself keeps running (E2B's envd bounds only the stream there)
        bg = await sbx.commands.run("sleep 30", background=True)
        attached = await sbx.commands.connect(bg.pid, timeout=1)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutException):
            await attached.wait()
        assert asyncio.get_running_loop().time() - t0 < 8
        assert bg.pid in [p.pid for p in await sbx.commands.list()]
        await bg.kill()
    finally:
        await sbx.kill()
