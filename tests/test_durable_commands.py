"""Durable commands (envd extension): a foreground command started durably by the
unchanged e2b SDK outlives its stream, its output is read back from any offset through
the node's proxy, and its exit code stays queryable; a plain command behaves as in E2B."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from e2b import AsyncSandbox
from e2b.exceptions import TimeoutException

from agentenv.testing import Node

LINES = 30
# Foreground, ~3 s, both streams, exit 3.
CMD = (f"for i in $(seq 1 {LINES}); do echo line-$i; echo err-$i >&2; sleep 0.1; done; "
       "exit 3")
STDOUT = "".join(f"line-{i}\n" for i in range(1, LINES + 1)).encode()
STDERR = "".join(f"err-{i}\n" for i in range(1, LINES + 1)).encode()
DURABLE = {"AENV_DURABLE": "1"}


def _envd(node: Node, sbx: AsyncSandbox, token: bool = True) -> httpx.AsyncClient:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    if token:
        headers["X-Access-Token"] = sbx._envd_access_token or ""
    return httpx.AsyncClient(base_url=node.url, headers=headers, timeout=30)


async def _pid_of(envd: httpx.AsyncClient, marker: str) -> int:
    """The durable command whose args contain ``marker`` (listed by envd)."""
    for _ in range(100):
        listing = (await envd.get("/aenv/commands")).json()
        for c in listing:
            if any(marker in a for a in c["args"]):
                return c["pid"]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no durable command with {marker!r}: {listing}")


async def _read_all(envd: httpx.AsyncClient, pid: int, stream: str, offset: int = 0
                    ) -> tuple[bytes, httpx.Response]:
    """Everything from ``offset`` to the end, long-polling while the command runs."""
    out = b""
    for _ in range(400):
        r = await envd.get(f"/aenv/commands/{pid}/output",
                           params={"stream": stream, "offset": offset, "wait": 5})
        assert r.status_code == 200, r.text
        assert int(r.headers["x-aenv-offset"]) == offset
        out += r.content
        offset = int(r.headers["x-aenv-next-offset"])
        if r.headers["x-aenv-ended"] == "true":
            return out, r
    raise AssertionError("output never ended")


@pytest.mark.timeout(120)
async def test_durable_foreground_command_survives_its_stream(node: Node) -> None:
    sbx = await AsyncSandbox.create()
    try:
        async with _envd(node, sbx) as envd:
            # A: the client's task is cancelled mid-command (its stream drops).
            a = asyncio.create_task(sbx.commands.run(f"{CMD} # A", envs=DURABLE))
            # B: the stream's deadline passes mid-command (E2B would kill it).
            b = asyncio.create_task(sbx.commands.run(f"{CMD} # B", envs=DURABLE, timeout=1))
            # C, D: plain commands, as E2B: the deadline kills; a dropped stream does not.
            c = asyncio.create_task(sbx.commands.run("sleep 2; echo x > /tmp/c", timeout=1))
            d = asyncio.create_task(sbx.commands.run("sleep 1; echo x > /tmp/d"))
            pid_a = await _pid_of(envd, "# A")
            pid_b = await _pid_of(envd, "# B")
            await asyncio.sleep(0.5)
            for t in (a, d):
                t.cancel()
            for t in (a, d):
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            for t in (b, c):
                with pytest.raises(TimeoutException):
                    await t

            # Reconnected: all of A's output from offset 0, then from the middle.
            out, last = await _read_all(envd, pid_a, "stdout")
            assert out == STDOUT
            assert last.headers["x-aenv-exit-code"] == "3"
            middle = len(STDOUT) // 2
            rest, _ = await _read_all(envd, pid_a, "stdout", middle)
            assert rest == STDOUT[middle:]
            err, _ = await _read_all(envd, pid_a, "stderr")
            assert err == STDERR
            both, _ = await _read_all(envd, pid_a, "both")
            assert sorted(both.splitlines()) == sorted((STDOUT + STDERR).splitlines())
            out_b, _ = await _read_all(envd, pid_b, "stdout")
            assert out_b == STDOUT  # the deadline ended B's stream, not B

            state = (await envd.get(f"/aenv/commands/{pid_a}")).json()
            assert state["running"] is False and state["exitCode"] == 3
            assert state["status"] == "exit status 3"
            assert state["output"]["stdout"] == {"start": 0, "end": len(STDOUT)}
            # Ended durable commands are not running processes for the E2B API.
            assert pid_a not in [p.pid for p in await sbx.commands.list()]

            # C was killed by its deadline; D outlived its dropped stream; neither is kept.
            await asyncio.sleep(1.5)
            files = await sbx.commands.run("ls /tmp/c /tmp/d 2>&1; true")
            assert "/tmp/d" in files.stdout and "cannot access '/tmp/c'" in files.stdout
            listed = [x["pid"] for x in (await envd.get("/aenv/commands")).json()]
            assert sorted(listed) == sorted([pid_a, pid_b])

            # Bounded output: the last 4 KiB kept, with the offset of its first byte.
            big = await sbx.commands.run(
                "head -c 10000 /dev/zero | tr '\\0' x", envs={
                    **DURABLE, "AENV_DURABLE_OUTPUT_BYTES": "4096"})
            assert len(big.stdout) == 10000
            pid_big = await _pid_of(envd, "head -c 10000")
            r = await envd.get(f"/aenv/commands/{pid_big}/output", params={"stream": "stdout"})
            assert r.headers["x-aenv-offset"] == str(10000 - 4096)
            assert r.content == b"x" * 4096 and r.headers["x-aenv-exit-code"] == "0"

            # Hostile or wrong requests: clear errors, envd still serving.
            async with _envd(node, sbx, token=False) as anon:
                assert (await anon.get("/aenv/commands")).status_code == 401
            bad = [
                (f"/aenv/commands/{pid_a}/output?offset={len(STDOUT) + 1}&stream=stdout", 400),
                (f"/aenv/commands/{pid_a}/output?stream=stdin", 400),
                (f"/aenv/commands/{pid_a}/output?offset=-1", 400),
                (f"/aenv/commands/{pid_a}/output?wait=nan", 400),
                ("/aenv/commands/notapid", 400),
                ("/aenv/commands/999999", 404),
            ]
            for path, status in bad:
                r = await envd.get(path)
                assert r.status_code == status, (path, r.text)
                assert r.json()["code"] == status and r.json()["message"]
            running = await sbx.commands.run("sleep 30", envs=DURABLE, background=True)
            assert (await envd.delete(f"/aenv/commands/{running.pid}")).status_code == 409
            await running.kill()
            assert (await envd.delete(f"/aenv/commands/{pid_a}")).status_code == 204
            assert (await envd.get(f"/aenv/commands/{pid_a}")).status_code == 404
            assert (await sbx.commands.run("echo ok")).stdout == "ok\n"
    finally:
        await sbx.kill()


def test_output_log_and_book_bounds() -> None:
    """The kept output is the last cap bytes, offsets counting every byte; ended
    commands are dropped oldest first past the count bound; running ones never."""
    from agentenv.envd import durable

    log = durable.OutputLog(10)
    for chunk in (b"0123456", b"789abc", b"def"):
        log.append(chunk)
    assert (log.start, log.end) == (6, 16)
    assert log.read(0, 100) == (6, b"6789abcdef")
    assert log.read(12, 2) == (12, b"cd")
    assert durable.requested({}, {"AENV_DURABLE": "1", "AENV_DURABLE_OUTPUT_BYTES": "1"}) \
        == (True, durable.MIN_OUTPUT_BYTES)
    assert durable.requested({"x-aenv-durable": "0"}, {}) == (False, durable.DEFAULT_OUTPUT_BYTES)

    book = durable.DurableBook()
    running = durable.DurableCommand(1, None, "sleep", [], 4096)
    book.add(running)
    for pid in range(2, 2 + durable.MAX_ENDED + 5):
        cmd = durable.DurableCommand(pid, None, "true", [], 4096)
        book.add(cmd)
        cmd.finish(0, "exit status 0")
        book.ended(cmd)
    assert len(book.commands) == durable.MAX_ENDED + 1
    assert 1 in book.commands and 2 not in book.commands  # oldest ended went first
