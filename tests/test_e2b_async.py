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


async def test_from_the_moment_a_kill_starts_health_is_502_not_found(node: Node) -> None:
    """The window of that race: once a kill has started (here behind a snapshot that
    holds the sandbox a while), envd's /health through the proxy is the 502 "was not
    found" that tells the SDK the sandbox is gone: never a relay to the envd being
    torn down ("did not answer") nor "not running"."""
    sbx = await AsyncSandbox.create(template="base", timeout=60)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    async with httpx.AsyncClient(base_url=node.url, headers=headers, timeout=30) as client, \
            httpx.AsyncClient(base_url=node.url, headers={"X-API-Key": node.api_key},
                              timeout=60) as api:
        assert (await client.get("/health")).status_code in (200, 204)
        snap = asyncio.create_task(api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots"))
        kill = asyncio.create_task(sbx.kill())
        answers: list[tuple[int, str]] = []
        while not kill.done():
            r = await client.get("/health")
            answers.append((r.status_code, r.text if r.status_code >= 300 else ""))
        await kill
        await snap
    failed = [a for a in answers if a[0] >= 300]
    assert failed, answers  # some came while the kill was under way
    assert all(code == 502 and "was not found" in text for code, text in failed), answers
    assert all(a[0] >= 300 for a in answers[answers.index(failed[0]):]), answers


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
