"""Durable commands (an agentenv extension of E2B's process API).

A command started with ``X-Aenv-Durable: 1`` on ``process.Process/Start`` (or with
``AENV_DURABLE=1`` among its envs, which the unchanged e2b SDK can send) is not tied
to any connection: the stream's deadline ends the stream, not the command; its output
is kept (the last ``output bytes`` of stdout, of stderr, and of both interleaved, each
with the offset of its first kept byte) and its exit status stays queryable after it
ends. Plain HTTP routes read them, with the envd access token like every other route:

  GET    /aenv/commands                  every durable command envd keeps
  GET    /aenv/commands/{pid}            one: running, exit code, output offsets
  GET    /aenv/commands/{pid}/output     ?stream=stdout|stderr|both&offset=N&limit=M&wait=S
                                         bytes from N; headers give the next offset and
                                         whether the output is complete
  DELETE /aenv/commands/{pid}            forget an ended command (409 while it runs)

Bounds: per command and stream ``AENV_DURABLE_OUTPUT_BYTES`` (default 2 MiB, 4 KiB..64
MiB; older bytes are dropped, the first kept offset says how many); at most 64
durable commands running at once; ended ones are kept, oldest dropped first, up to 64
of them and 64 MiB of their output together.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import time
from collections import OrderedDict
from typing import Any

from .asgi import HTTPError, send_json, send_response

PREFIX = "/aenv/commands"
DURABLE_HEADER = "x-aenv-durable"
OUTPUT_BYTES_HEADER = "x-aenv-output-bytes"
DURABLE_ENV = "AENV_DURABLE"
OUTPUT_BYTES_ENV = "AENV_DURABLE_OUTPUT_BYTES"

DEFAULT_OUTPUT_BYTES = 2 << 20
MIN_OUTPUT_BYTES = 4 << 10
MAX_OUTPUT_BYTES = 64 << 20
MAX_RUNNING = 64
MAX_ENDED = 64
MAX_ENDED_BYTES = 64 << 20
DEFAULT_READ_LIMIT = 1 << 20
MAX_READ_LIMIT = 16 << 20
MAX_WAIT_S = 60.0
# Ended commands' output carried over envd's dormancy at most (more keeps envd awake).
MAX_CARRIED_BYTES = 1 << 20
STREAMS = ("stdout", "stderr", "both")


def _truthy(raw: str | None) -> bool:
    return (raw or "").strip().lower() in ("1", "true", "yes", "on")


def requested(headers: Any, envs: dict[str, str]) -> tuple[bool, int]:
    """Whether a Start asks for durability, and the output bound it asks for (clamped)."""
    durable = _truthy(headers.get(DURABLE_HEADER)) or _truthy(envs.get(DURABLE_ENV))
    raw = headers.get(OUTPUT_BYTES_HEADER) or envs.get(OUTPUT_BYTES_ENV)
    try:
        size = int(raw) if raw else DEFAULT_OUTPUT_BYTES
    except ValueError:
        size = DEFAULT_OUTPUT_BYTES
    return durable, min(max(size, MIN_OUTPUT_BYTES), MAX_OUTPUT_BYTES)


class OutputLog:
    """The last ``cap`` bytes of one stream; offsets count every byte ever written."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.start = 0  # offset of buf[0]
        self.buf = bytearray()

    @property
    def end(self) -> int:
        return self.start + len(self.buf)

    def append(self, chunk: bytes) -> None:
        self.buf += chunk
        excess = len(self.buf) - self.cap
        if excess > 0:
            del self.buf[:excess]  # cheap: bytearray moves its start, not its bytes
            self.start += excess

    def read(self, offset: int, limit: int) -> tuple[int, bytes]:
        """From ``offset`` (or the first byte kept, if later): (first offset, bytes)."""
        first = max(offset, self.start)
        lo = first - self.start
        return first, bytes(self.buf[lo:lo + limit])


class DurableCommand:
    def __init__(self, pid: int, tag: str | None, cmd: str, args: list[str], cap: int) -> None:
        self.pid = pid
        self.tag = tag
        self.cmd = cmd
        self.args = args
        self.logs = {s: OutputLog(cap) for s in STREAMS}
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.status: str | None = None
        self._changed = asyncio.Event()

    @property
    def running(self) -> bool:
        return self.ended_at is None

    @property
    def kept_bytes(self) -> int:
        return sum(len(log.buf) for log in self.logs.values())

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def output(self, stream: str, chunk: bytes) -> None:
        self.logs["stderr" if stream == "stderr" else "stdout"].append(chunk)
        self.logs["both"].append(chunk)
        self._notify()

    def finish(self, exit_code: int, status: str) -> None:
        self.exit_code = exit_code
        self.status = status
        self.ended_at = time.time()
        self._notify()

    async def changed(self, within_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), within_s)

    def saved(self) -> dict[str, Any]:
        """An ended command, for envd's next start in this boot (dormancy.py)."""
        return {"pid": self.pid, "tag": self.tag, "cmd": self.cmd, "args": self.args,
                "cap": self.logs["both"].cap, "startedAt": self.started_at,
                "endedAt": self.ended_at, "exitCode": self.exit_code, "status": self.status,
                "logs": {s: [log.start, base64.b64encode(log.buf).decode()]
                         for s, log in self.logs.items()}}

    @classmethod
    def restored(cls, saved: dict[str, Any]) -> DurableCommand:
        command = cls(int(saved["pid"]), saved["tag"], str(saved["cmd"]),
                      [str(a) for a in saved["args"]], int(saved["cap"]))
        command.started_at = float(saved["startedAt"])
        command.ended_at = float(saved["endedAt"])
        command.exit_code = int(saved["exitCode"])
        command.status = str(saved["status"])
        for stream, (start, data) in saved["logs"].items():
            log = command.logs[stream]
            log.start, log.buf = int(start), bytearray(base64.b64decode(data))
        return command

    def info(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "tag": self.tag, "cmd": self.cmd, "args": self.args,
            "running": self.running, "exitCode": self.exit_code, "status": self.status,
            "startedAt": self.started_at, "endedAt": self.ended_at,
            "output": {s: {"start": log.start, "end": log.end} for s, log in self.logs.items()},
        }


class DurableBook:
    """The durable commands envd keeps: every running one, and the latest ended ones."""

    def __init__(self) -> None:
        self.commands: OrderedDict[int, DurableCommand] = OrderedDict()

    def saved(self) -> list[dict[str, Any]] | None:
        """Every command kept, to carry over a dormancy; None while one runs or when
        their output is too much to carry cheaply (envd then stays awake)."""
        commands = list(self.commands.values())
        if any(c.running for c in commands) or \
                sum(c.kept_bytes for c in commands) > MAX_CARRIED_BYTES:
            return None
        return [c.saved() for c in commands]

    def restore(self, saved: object) -> None:
        if not isinstance(saved, list):
            return
        for entry in saved:
            try:
                self.add(DurableCommand.restored(entry))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue

    def running_count(self) -> int:
        return sum(1 for c in self.commands.values() if c.running)

    def can_start(self) -> bool:
        return self.running_count() < MAX_RUNNING

    def add(self, command: DurableCommand) -> None:
        # A pid reused by the kernel replaces the ended command that had it.
        self.commands.pop(command.pid, None)
        self.commands[command.pid] = command

    def ended(self, command: DurableCommand) -> None:
        """After ``command`` ends: drop the oldest ended ones past the bounds."""
        ended = [c for c in self.commands.values() if not c.running]
        ended.sort(key=lambda c: c.ended_at or 0.0)
        total = sum(c.kept_bytes for c in ended)
        while ended and (len(ended) > MAX_ENDED or total > MAX_ENDED_BYTES):
            old = ended.pop(0)
            total -= old.kept_bytes
            self.commands.pop(old.pid, None)

    def get(self, pid: int) -> DurableCommand:
        command = self.commands.get(pid)
        if command is None:
            raise HTTPError(404, f"no durable command with pid {pid}")
        return command


def _int(query: dict[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise HTTPError(400, f"{name} must be an integer") from None
    if value < lo:
        raise HTTPError(400, f"{name} must be at least {lo}")
    return min(value, hi)


def _wait_s(query: dict[str, str]) -> float:
    raw = query.get("wait")
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise HTTPError(400, "wait must be a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise HTTPError(400, "wait must be a number of seconds")
    return min(value, MAX_WAIT_S)


class CommandsEndpoint:
    """``/aenv/commands`` routes over a ``DurableBook`` (the caller authenticates)."""

    def __init__(self, book: DurableBook) -> None:
        self.book = book

    async def __call__(self, method: str, path: str, query: dict[str, str], send) -> None:
        parts = [p for p in path[len(PREFIX):].split("/") if p]
        if not parts:
            if method != "GET":
                raise HTTPError(405, "method not allowed")
            await send_json(send, 200, [c.info() for c in self.book.commands.values()])
            return
        try:
            pid = int(parts[0])
        except ValueError:
            raise HTTPError(400, f"'{parts[0][:64]}' is not a pid") from None
        if len(parts) == 1 and method == "GET":
            await send_json(send, 200, self.book.get(pid).info())
        elif len(parts) == 1 and method == "DELETE":
            command = self.book.get(pid)
            if command.running:
                raise HTTPError(409, f"command {pid} is still running; kill it first")
            self.book.commands.pop(pid, None)
            await send_response(send, 204)
        elif len(parts) == 2 and parts[1] == "output" and method == "GET":
            await self._output(pid, query, send)
        elif len(parts) <= 2:
            raise HTTPError(405 if len(parts) == 1 or parts[1] == "output" else 404,
                            f"{method} {path[:200]} not found")
        else:
            raise HTTPError(404, f"{method} {path[:200]} not found")

    async def _output(self, pid: int, query: dict[str, str], send) -> None:
        command = self.book.get(pid)
        stream = query.get("stream", "both")
        if stream not in STREAMS:
            raise HTTPError(400, "stream must be stdout, stderr or both")
        offset = _int(query, "offset", 0, 0, 1 << 62)
        limit = _int(query, "limit", DEFAULT_READ_LIMIT, 1, MAX_READ_LIMIT)
        log = command.logs[stream]
        if offset > log.end:
            raise HTTPError(400, f"offset {offset} is past the output's end ({log.end})")
        wait = _wait_s(query)
        if wait and offset == log.end and command.running:
            await command.changed(wait)  # long poll: until output or the end
        first, data = log.read(offset, limit)
        nxt = first + len(data)
        complete = not command.running and nxt == log.end
        headers = [(b"x-aenv-offset", str(first).encode()),
                   (b"x-aenv-next-offset", str(nxt).encode()),
                   (b"x-aenv-ended", b"true" if complete else b"false"),
                   (b"x-aenv-running", b"true" if command.running else b"false")]
        if command.exit_code is not None:
            headers.append((b"x-aenv-exit-code", str(command.exit_code).encode()))
        await send_response(send, 200, data, "application/octet-stream", headers)
