"""A sandbox's envd through the node's proxy: run a command, upload, download.

Plain HTTP, no SDK: commands go to envd's E2B-compatible ``process.Process/Start``
(Connect's streaming protocol, JSON codec: one request per command, output streamed
back as it comes), files to its ``/files`` endpoint. The node (or gateway) routes by
``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port``, as the e2b SDK does, and envd checks the
sandbox's access token. A durable command (agentenv's envd extension) is read back
from ``/aenv/commands/{pid}/output`` if its stream breaks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
from typing import Any, NamedTuple

import httpx

ENVD_PORT = 49983
END_STREAM = 0x02
MAX_MESSAGE = 16 << 20
# envd's own limit on one output read (durable.MAX_READ_LIMIT).
READ_LIMIT = 4 << 20


class ExecResult(NamedTuple):
    exit_code: int
    stdout: str
    stderr: str


class EnvdError(Exception):
    """envd refused a request or ended a command's stream with an error."""


class ExecTimeout(EnvdError):
    """The command outran its timeout (and was killed); the output it made is kept."""

    def __init__(self, timeout_s: float, stdout: str, stderr: str) -> None:
        super().__init__(f"command timed out after {timeout_s} s")
        self.stdout = stdout
        self.stderr = stderr


def _envelope(message: dict[str, Any]) -> bytes:
    raw = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(raw)) + raw


class Envd:
    """One sandbox's envd, over a shared HTTP client pointed at the node."""

    def __init__(self, client: httpx.AsyncClient, sandbox_id: str, token: str | None) -> None:
        self.client = client
        self.headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        if token:
            self.headers["X-Access-Token"] = token

    async def exec(self, cmd: str, timeout_s: float = 60.0, *, cwd: str | None = None,
                   envs: dict[str, str] | None = None, login: bool = False,
                   durable: bool = False) -> ExecResult:
        """``bash -c cmd`` (``-l -c`` with ``login``, as the e2b SDK runs every command).

        Not durable: envd kills it at the timeout (E2B's rule). Durable: it is killed
        at the timeout too, but a broken stream does not lose it; its output and exit
        code are read back from envd."""
        process: dict[str, Any] = {"cmd": "/bin/bash",
                                   "args": ["-l", "-c", cmd] if login else ["-c", cmd],
                                   "envs": envs or {}}
        if cwd:
            process["cwd"] = cwd
        headers = {**self.headers, "Content-Type": "application/connect+json",
                   "Connect-Protocol-Version": "1"}
        if durable:
            headers["X-Aenv-Durable"] = "1"
        else:
            headers["Connect-Timeout-Ms"] = str(max(1, int(timeout_s * 1000)))
        out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        state: dict[str, Any] = {"pid": None, "code": None}
        try:
            async with asyncio.timeout(timeout_s + 10 if not durable else timeout_s):
                try:
                    await self._stream(headers, {"process": process, "stdin": False}, out,
                                       state, timeout_s + 30)
                except (httpx.TransportError, EnvdError) as e:
                    if not durable or state["pid"] is None or isinstance(e, ExecTimeout):
                        raise
                    # The stream broke; the command did not: read what it wrote.
                    await self._recover(state, out)
        except TimeoutError:
            if state["pid"] is not None:
                await self.kill(state["pid"])
            raise ExecTimeout(timeout_s, *_text(out)) from None
        except ExecTimeout as e:
            raise ExecTimeout(timeout_s, *_text(out)) from e
        if state["code"] is None:
            raise EnvdError("the command's stream ended without its exit")
        return ExecResult(state["code"], *_text(out))

    async def _stream(self, headers: dict[str, str], request: dict[str, Any],
                      out: dict[str, list[bytes]], state: dict[str, Any],
                      read_timeout_s: float) -> None:
        async with self.client.stream(
                "POST", "/process.Process/Start", content=_envelope(request),
                headers=headers, timeout=httpx.Timeout(read_timeout_s, connect=10.0)) as r:
            if r.status_code != 200:
                body = await r.aread()
                raise EnvdError(f"start: {r.status_code} {body[:500]!r}")
            buf = bytearray()
            async for chunk in r.aiter_bytes():
                buf += chunk
                while len(buf) >= 5:
                    flags, size = struct.unpack(">BI", buf[:5])
                    if size > MAX_MESSAGE:
                        raise EnvdError(f"envd sent a {size}-byte message")
                    if len(buf) < 5 + size:
                        break
                    msg = json.loads(bytes(buf[5:5 + size]) or b"{}")
                    del buf[:5 + size]
                    if flags & END_STREAM:
                        error = msg.get("error")
                        if error:
                            if error.get("code") == "deadline_exceeded":
                                raise ExecTimeout(0, "", "")
                            raise EnvdError(f"{error.get('code')}: {error.get('message')}")
                        return
                    _event(msg.get("event") or {}, out, state)

    async def _recover(self, state: dict[str, Any], out: dict[str, list[bytes]]) -> None:
        pid = state["pid"]
        offsets = {s: sum(len(c) for c in out[s]) for s in out}
        done = {s: False for s in out}
        while not all(done.values()):
            for stream in out:
                if done[stream]:
                    continue
                r = await self.client.get(
                    f"/aenv/commands/{pid}/output", headers=self.headers,
                    params={"stream": stream, "offset": str(offsets[stream]),
                            "limit": str(READ_LIMIT), "wait": "10"},
                    timeout=httpx.Timeout(40.0, connect=10.0))
                if r.status_code != 200:
                    raise EnvdError(f"durable command {pid}: {r.status_code} {r.text[:300]}")
                if r.content:
                    out[stream].append(r.content)
                offsets[stream] = int(r.headers["x-aenv-next-offset"])
                if r.headers.get("x-aenv-ended") == "true":
                    done[stream] = True
                    state["code"] = int(r.headers["x-aenv-exit-code"])

    async def kill(self, pid: int) -> None:
        """SIGKILL a command (its whole session), if it still runs."""
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(
                "/process.Process/SendSignal",
                json={"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
                headers={**self.headers, "Connect-Protocol-Version": "1"})

    async def upload(self, path: str, data: bytes) -> None:
        r = await self.client.post("/files", params={"path": path}, content=data,
                                   headers={**self.headers,
                                            "Content-Type": "application/octet-stream"})
        if r.status_code != 200:
            raise EnvdError(f"upload {path}: {r.status_code} {r.text[:300]}")

    async def download(self, path: str) -> bytes:
        r = await self.client.get("/files", params={"path": path}, headers=self.headers)
        if r.status_code == 404:
            raise FileNotFoundError(path)
        if r.status_code != 200:
            raise EnvdError(f"download {path}: {r.status_code} {r.text[:300]}")
        return r.content


def _event(event: dict[str, Any], out: dict[str, list[bytes]], state: dict[str, Any]) -> None:
    if "start" in event:
        state["pid"] = int(event["start"].get("pid", 0))
    elif "data" in event:
        for stream in ("stdout", "stderr", "pty"):
            raw = event["data"].get(stream)
            if raw:
                out["stderr" if stream == "stderr" else "stdout"].append(base64.b64decode(raw))
    elif "end" in event:
        end = event["end"]
        # proto3 JSON leaves zero out; a signal's end says exitCode -1, exited false.
        state["code"] = int(end.get("exitCode", 0))


def _text(out: dict[str, list[bytes]]) -> tuple[str, str]:
    return (b"".join(out["stdout"]).decode(errors="replace"),
            b"".join(out["stderr"]).decode(errors="replace"))
