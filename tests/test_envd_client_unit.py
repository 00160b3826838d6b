"""EnvdClient's one command-stream handler (run, run_logged, start) against a stand-in
envd that answers ``process.Process/Start`` with Connect envelopes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from agentenv.envd.protocol import ENVD_PORT
from agentenv.orchestrator.envd_client import (
    SMALL_ANSWER_MAX,
    EnvdClient,
    EnvdUnavailable,
    LayerRefused,
)


def _envelope(message: dict, flags: int = 0) -> bytes:
    data = json.dumps(message).encode()
    return bytes([flags]) + struct.pack(">I", len(data)) + data


def _data(stream: str, text: str) -> dict:
    return {"event": {"data": {stream: base64.b64encode(text.encode()).decode()}}}


START = {"event": {"start": {"pid": 42}}}


@asynccontextmanager
async def _stand_in(slot: int, respond: Callable[[bytes, asyncio.StreamReader],
                                                 Awaitable[bytes]]) -> AsyncIterator[str]:
    """A stand-in envd on a loopback address of its own (yields it): each request's head
    is read, then what ``respond`` makes of it (and the rest of the request) is written
    as it is and the connection closed."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await respond(await reader.readuntil(b"\r\n\r\n"), reader))
        await writer.drain()
        writer.close()

    address = f"127.28.{os.getpid() % 250}.{slot}"
    server = await asyncio.start_server(serve, address, ENVD_PORT)
    try:
        yield address
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def _envd(status: int, messages: list[dict], slot: int
                ) -> AsyncIterator[tuple[str, list[dict]]]:
    """A stand-in envd answering ``status`` and, when 200, ``messages`` as Connect
    envelopes: its address, and the requests it received (their first envelope, decoded)."""
    async def respond(head: bytes, reader: asyncio.StreamReader) -> bytes:
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        bodies.append(json.loads((await reader.readexactly(length))[5:]))
        answer = (f"HTTP/1.1 {status} X\r\nContent-Type: application/connect+json\r\n"
                  "Connection: close\r\n\r\n").encode()
        if status == 200:
            answer += b"".join(_envelope(m) for m in messages) + _envelope({}, flags=2)
        return answer

    bodies: list[dict] = []
    async with _stand_in(slot, respond) as address:
        yield address, bodies


async def test_run_and_run_logged_read_the_stream_to_its_exit_code() -> None:
    messages = [START, _data("stdout", "hello "), _data("stderr", "oops"),
                _data("stdout", "world"), {"event": {"end": {"exitCode": 3}}}]
    client = EnvdClient()
    try:
        async with _envd(200, messages, 1) as (address, requests):
            assert await client.run(address, "token", "true") == 3
            seen: list[tuple[str, bytes]] = []
            code = await client.run_logged(address, "token", "echo",
                                           lambda s, d: seen.append((s, d)),
                                           cwd="/work", envs={"A": "1"})
            assert code == 3
            assert requests[1]["process"] == {"cmd": "/bin/bash", "args": ["-l", "-c", "echo"],
                                              "cwd": "/work", "envs": {"A": "1"}}
            assert seen == [("stdout", b"hello "), ("stderr", b"oops"), ("stdout", b"world")]
            assert await client.start(address, "token", "sleep 9") == 42
    finally:
        await client.close()


async def test_a_stream_without_an_exit_code_or_a_refusal_is_envd_unavailable() -> None:
    client = EnvdClient()
    try:
        async with _envd(200, [START, _data("stdout", "x")], 2) as (address, _):
            with pytest.raises(EnvdUnavailable, match="without an exit code"):
                await client.run(address, "token", "true")
            with pytest.raises(EnvdUnavailable, match="without an exit code"):
                await client.run_logged(address, "token", "true", lambda s, d: None)
        async with _envd(200, [_data("stdout", "x")], 3) as (address, _):
            with pytest.raises(EnvdUnavailable, match="did not start the command"):
                await client.start(address, "token", "true")
        async with _envd(401, [], 4) as (address, _):
            with pytest.raises(EnvdUnavailable, match="refused the command: HTTP 401"):
                await client.run(address, "token", "true")
            with pytest.raises(EnvdUnavailable, match="refused the command: HTTP 401"):
                await client.start(address, "token", "true")
    finally:
        await client.close()


@asynccontextmanager
async def _answering(answer: bytes, slot: int) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A stand-in envd that reads a request and writes ``answer`` as it is (b"": says
    nothing and holds the connection): its address and the requests' heads."""
    async def respond(head: bytes, reader: asyncio.StreamReader) -> bytes:
        heads.append(head)
        if not answer:
            await asyncio.sleep(30)
        return answer

    heads: list[bytes] = []
    async with _stand_in(slot, respond) as address:
        yield address, heads


def _http(status: int, body: bytes) -> bytes:
    return f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def test_a_layer_call_reads_envd_s_answer_bounded_as_the_sandbox_s_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """/aenv/layer (a files reset's call, its own small HTTP client): the answer, a
    refusal, and each way a sandbox can answer badly, as a clear EnvdUnavailable."""
    client = EnvdClient()
    try:
        async with _answering(_http(200, b'{"depth": 1, "killed": 2}'), 5) as (address, heads):
            assert await client.layer(address, "tok", "reset", "snap1") == {"depth": 1,
                                                                            "killed": 2}
            assert b"POST /aenv/layer HTTP/1.1" in heads[0]
            assert b"X-Access-Token: tok" in heads[0]
        async with _answering(_http(409, b'{"message": "no files layer"}'), 6) as (address, _):
            with pytest.raises(LayerRefused, match="no files layer"):
                await client.layer(address, "tok", "reset", "snap1")
        bad = {
            "over the bound": _http(200, b'{"a": "' + b"x" * SMALL_ANSWER_MAX + b'"}'),
            "headers without an end": b"HTTP/1.1 200 X\r\n" + b"A: b\r\n" * 20000,
            "not HTTP": b"\x00garbage\r\n\r\n",
            "cut short": b"HTTP/1.1 200 X\r\nContent-Length: 99\r\n\r\n{",
            "a 500": _http(500, b"boom"),
            "not JSON": _http(200, b"[1, 2]"),
        }
        for slot, answer in enumerate(bad.values(), start=7):
            async with _answering(answer, slot) as (address, _):
                with pytest.raises(EnvdUnavailable, match="/aenv/layer reset"):
                    await client.layer(address, "tok", "reset", "snap1")
        monkeypatch.setattr("agentenv.orchestrator.envd_client.LAYER_TIMEOUT_S", 0.3)
        async with _answering(b"", 20) as (address, _):
            with pytest.raises(EnvdUnavailable, match="TimeoutError"):
                await client.layer(address, "tok", "reset", "snap1")
    finally:
        await client.close()
