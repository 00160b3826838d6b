"""What the node itself says to envd inside a sandbox: readiness, /init, commands and
the file transfers of filesystem-only pauses."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import h11
import httpx

from ..envd.protocol import ENVD_PORT, SANDBOX_KEEPALIVE_S

MAX_FRAME = 16 << 20  # one Connect message from envd
WAIT_READY_MAX_S = 120.0  # a sandbox still starting (using CPU) is waited for this long


# A files layer's reset or push: envd's kill pass may take up to 10 s (layers.py).
LAYER_TIMEOUT_S = 35.0
SMALL_ANSWER_MAX = 64 << 10


class EnvdUnavailable(RuntimeError):
    pass


async def small_post(address: str, path: str, token: str, body: bytes) -> tuple[int, bytes]:
    """One JSON POST to envd on a connection of its own, its answer read whole: (status,
    body). For a call on a files reset's path: httpx's layers (httpcore, anyio) cost
    ~3 CPU-ms and ~13 ms of wall per new connection to envd on this 2-core machine
    under load, this ~1 and ~5 (`bench_lifecycle.py --cpu --files-only`;
    git show 3857f5a:bench/results/lifecycle_cpu_files_both.md). The sandbox
    is not trusted: an answer over SMALL_ANSWER_MAX or malformed raises h11.ProtocolError
    (the caller bounds the time, asyncio.timeout)."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=SMALL_ANSWER_MAX)
    reader, writer = await asyncio.open_connection(address, ENVD_PORT)
    try:
        writer.write(conn.send(h11.Request(method="POST", target=path, headers=[
            ("Host", f"{address}:{ENVD_PORT}"), ("X-Access-Token", token),
            ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
            ("Connection", "close")])) + conn.send(h11.Data(data=body)) +
            conn.send(h11.EndOfMessage()))
        status, chunks, size = 0, [], 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(SMALL_ANSWER_MAX))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > SMALL_ANSWER_MAX:
                    raise h11.RemoteProtocolError(f"answer over {SMALL_ANSWER_MAX} bytes")
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return status, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("envd closed the connection unanswered")
    finally:
        writer.close()


class LayerRefused(RuntimeError):
    """envd has no files layer for that snapshot, or cannot make one (old bundle)."""


T = TypeVar("T")


def _awake(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """The sandbox at ``address`` is kept thawed while the call lasts (idling.py)."""
    @functools.wraps(fn)
    async def call(self: EnvdClient, address: str, *args: Any, **kwargs: Any) -> T:
        with self.awake_at(address):
            return await fn(self, address, *args, **kwargs)
    return call


class EnvdClient:
    def __init__(self) -> None:
        # No pooling across sandboxes: slot addresses are reused by new sandboxes.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(5.0), trust_env=False,
            limits=httpx.Limits(keepalive_expiry=SANDBOX_KEEPALIVE_S))
        # The manager's: a frozen idle sandbox thawed, and kept so, while a call lasts.
        self.awake_at: Callable[[str], contextlib.AbstractContextManager[None]] = \
            lambda address: contextlib.nullcontext()

    async def close(self) -> None:
        await self._http.aclose()

    @_awake
    async def wait_ready(self, address: str, deadline_s: float = 15.0,
                         progress: Callable[[], float | None] | None = None) -> None:
        """Poll ``GET /health`` until envd answers.

        envd listens before it finishes starting, so a probe usually connects at
        once and waits for the answer; retries only cover the moments before that.
        ``progress`` (the sandbox's CPU seconds so far): past the deadline, envd is
        waited for as long as the sandbox keeps using CPU between two looks
        ``deadline_s`` apart, up to WAIT_READY_MAX_S. A restored envd that was dormant
        starts Python first; on a saturated host that took 9 s and more (issue 27),
        and a fixed deadline failed resumes of sandboxes that were only slow.
        """
        url = f"http://{address}:{ENVD_PORT}/health"
        start = time.monotonic()
        end = start + deadline_s
        seen = progress() if progress is not None else None
        delay = 0.005
        last: Exception | None = None
        while True:
            now = time.monotonic()
            if now >= end:
                now_cpu = progress() if progress is not None else None
                if seen is None or now_cpu is None or now_cpu <= seen or \
                        now - start >= WAIT_READY_MAX_S:
                    break
                seen, end = now_cpu, min(now + deadline_s, start + WAIT_READY_MAX_S)
            try:
                r = await self._http.get(url, timeout=max(0.1, end - time.monotonic()))
                if r.status_code < 500:
                    return
            except httpx.HTTPError as exc:
                last = exc
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.02)
        raise EnvdUnavailable(f"envd did not answer within {time.monotonic() - start:.0f}s "
                              f"({last!r})")

    @_awake
    async def init(
        self, address: str, access_token: str, env_vars: dict[str, str],
        default_user: str = "user", current_token: str | None = None,
        default_workdir: str = "", boot_id: str = "", file_access: str = "",
    ) -> None:
        """Set env vars and the access token; ``current_token`` authorizes a rotation
        (a fork's child gets a token of its own); ``boot_id`` names a new boot."""
        body = {
            "envVars": env_vars,
            "accessToken": access_token,
            "defaultUser": default_user,
            "timestamp": _rfc3339_now(),
        }
        if default_workdir:
            body["defaultWorkdir"] = default_workdir
        if boot_id:
            body["bootID"] = boot_id
        if file_access:
            body["fileAccess"] = file_access
        headers = {"X-Access-Token": current_token} if current_token else {}
        r = await self._http.post(f"http://{address}:{ENVD_PORT}/init", json=body, headers=headers)
        if r.status_code >= 300:
            raise EnvdUnavailable(f"envd /init answered {r.status_code}")

    async def ask_dormant(self, address: str, token: str) -> str | None:
        """Ask envd to go dormant once idle (envd/dormancy.py): None when it will, else
        why not (busy, or it cannot sleep in this sandbox). The caller thaws the
        sandbox: this is no activity of its user's (idling.IdleFreezer.thawed)."""
        r = await self._http.post(
            httpx.URL(scheme="http", host=address, port=ENVD_PORT, path="/aenv/dormancy"),
            headers={"X-Access-Token": token}, timeout=2.0)
        if r.status_code == 202:
            return None
        try:
            return str(r.json().get("message") or r.status_code)
        except ValueError:
            return f"HTTP {r.status_code}"

    # -- files layers (envd's /aenv/layer: resets in filesystem mode) -----------------
    @_awake
    async def layer(self, address: str, token: str, op: str, tag: str) -> dict[str, Any]:
        """``push`` a files layer tagged ``tag`` over the sandbox's files, or ``reset``
        the layer so tagged (envd/layers.py). LayerRefused when envd has no such layer
        or cannot layer (the caller then resets in full); EnvdUnavailable otherwise."""
        try:
            async with asyncio.timeout(LAYER_TIMEOUT_S):
                status, raw = await small_post(address, "/aenv/layer", token,
                                               json.dumps({"op": op, "tag": tag}).encode())
        except (OSError, TimeoutError, h11.ProtocolError) as exc:
            raise EnvdUnavailable(f"envd /aenv/layer {op}: {exc!r}") from exc
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        if status == 200 and isinstance(body, dict):
            return body
        why = str(body.get("message") if isinstance(body, dict) else "") or \
            raw[:200].decode("utf-8", "replace")
        if status in (404, 409, 501):  # no such layer, or no layers in this envd
            raise LayerRefused(why)
        raise EnvdUnavailable(f"envd /aenv/layer {op} answered {status}: {why}")

    # -- filesystem-only pauses (envd's /aenv/fs/*) -----------------------------------

    def _disk_url(self, address: str, op: str) -> httpx.URL:
        return httpx.URL(scheme="http", host=address, port=ENVD_PORT, path=f"/aenv/fs/{op}")

    @_awake
    async def disk_download(self, address: str, token: str, op: str, dest: Path,
                            limit: int, body: Path | None = None) -> int:
        """``GET list`` or ``POST export`` (with ``body``) into ``dest``; at most ``limit``
        bytes (envd answers for a sandbox whose user may have replaced it)."""
        method = "POST" if body is not None else "GET"
        timeout = httpx.Timeout(10.0, read=300.0)
        written = 0
        with contextlib.ExitStack() as files:
            content = files.enter_context(open(body, "rb")) if body is not None else None
            out = files.enter_context(open(dest, "wb"))
            async with self._http.stream(
                    method, self._disk_url(address, op), headers={"X-Access-Token": token},
                    content=_file_chunks(content) if content is not None else None,
                    timeout=timeout) as r:
                if r.status_code != 200:
                    raise EnvdUnavailable(f"envd /aenv/fs/{op} answered {r.status_code}")
                async for chunk in r.aiter_raw():
                    written += len(chunk)
                    if written > limit:
                        raise EnvdUnavailable(f"envd /aenv/fs/{op} sent over {limit} bytes")
                    await asyncio.to_thread(out.write, chunk)
        return written

    @_awake
    async def disk_upload(self, address: str, token: str, op: str, body: Path) -> dict:
        """``POST prune`` (a listing) or ``POST import`` (a tar) from a file."""
        with open(body, "rb") as content:
            r = await self._http.post(
                self._disk_url(address, op), headers={"X-Access-Token": token},
                content=_file_chunks(content), timeout=httpx.Timeout(10.0, read=300.0))
        if r.status_code != 200:
            raise EnvdUnavailable(f"envd /aenv/fs/{op} answered {r.status_code}: "
                                  f"{r.text[:300]}")
        return r.json()

    # -- processes (Connect protocol, JSON codec, over HTTP/1.1) ---------------------

    def _process_request(self, token: str, user: str, command: str, cwd: str = "",
                         envs: dict[str, str] | None = None) -> tuple[dict, bytes]:
        process: dict = {"cmd": "/bin/bash", "args": ["-l", "-c", command]}
        if cwd:
            process["cwd"] = cwd
        if envs:
            process["envs"] = envs
        return self._stream_headers(token, user), _envelope({"process": process})

    def _stream_headers(self, token: str, user: str) -> dict[str, str]:
        return {**self._unary_headers(token, user),
                "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}

    @contextlib.asynccontextmanager
    async def _process_stream(self, address: str, headers: dict[str, str], body: bytes,
                              timeouts: httpx.Timeout | float, what: str = "the command"
                              ) -> AsyncIterator[AsyncIterator[dict]]:
        """``process.Process/Start``'s event stream: its messages, once envd took it.
        Leaving the block ends the stream, not the process (envd's contract)."""
        url = f"http://{address}:{ENVD_PORT}/process.Process/Start"
        async with self._http.stream("POST", url, headers=headers, content=body,
                                     timeout=timeouts) as r:
            if r.status_code != 200:
                raise EnvdUnavailable(f"envd refused {what}: HTTP {r.status_code}")
            yield _frames(r)

    async def _run_to_end(self, address: str, headers: dict[str, str], body: bytes,
                          timeouts: httpx.Timeout | float,
                          on_output: Callable[[str, bytes], None] | None) -> int:
        """A command's stream read to its end: its output handed on (if anyone wants
        it), its exit code returned."""
        exit_code = None
        async with self._process_stream(address, headers, body, timeouts) as frames:
            async for frame in frames:
                event = frame.get("event", {})
                if on_output is not None:
                    for stream, data in event.get("data", {}).items():
                        if stream in ("stdout", "stderr") and data:
                            on_output(stream, base64.b64decode(data))
                end = event.get("end")
                if end is not None:
                    exit_code = int(end.get("exitCode", 0))
        if exit_code is None:
            raise EnvdUnavailable("envd ended the command's stream without an exit code")
        return exit_code

    @_awake
    async def run(self, address: str, token: str, command: str, user: str = "root",
                  deadline_s: float = 60.0) -> int:
        """Run a shell command to its end; return its exit code."""
        headers, body = self._process_request(token, user, command)
        return await self._run_to_end(address, headers, body, deadline_s, on_output=None)

    @_awake
    async def run_logged(self, address: str, token: str, command: str,
                         on_output: Callable[[str, bytes], None], user: str = "root",
                         cwd: str = "", envs: dict[str, str] | None = None,
                         deadline_s: float | None = None) -> int:
        """Run a shell command to its end, handing each chunk of its output to
        ``on_output("stdout"|"stderr", data)``; return its exit code."""
        headers, body = self._process_request(token, user, command, cwd, envs)
        return await self._run_to_end(address, headers, body,
                                      httpx.Timeout(5.0, read=deadline_s), on_output)

    @_awake
    async def start(self, address: str, token: str, command: str, user: str = "root",
                    cwd: str = "", envs: dict[str, str] | None = None) -> int:
        """Start a shell command in the background; return its pid once it runs."""
        headers, body = self._process_request(token, user, command, cwd, envs)
        # The client's own timeouts: the stream is left as soon as the process runs.
        async with self._process_stream(address, headers, body, self._http.timeout) as frames:
            async for frame in frames:
                start = frame.get("event", {}).get("start")
                if start is not None:
                    # Leaving the stream leaves the process running (envd's contract).
                    return int(start.get("pid", 0))
        raise EnvdUnavailable("envd did not start the command")

    # -- a PTY (the web console's terminal) --------------------------------------------

    @contextlib.asynccontextmanager
    async def pty(self, address: str, token: str, cols: int, rows: int, user: str = "user"
                  ) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        """A login shell on a new PTY: ``(pid, its output)``. Leaving the block kills it
        (envd keeps a process whose stream ends running). The sandbox is kept thawed
        while the terminal is open: a shell waiting for keys is not idle to its user."""
        body = _envelope({
            "process": {"cmd": "/bin/bash", "args": ["-i", "-l"],
                        "envs": {"TERM": "xterm-256color", "LANG": "C.UTF-8"}},
            "pty": {"size": {"cols": cols, "rows": rows}}})
        pid = 0
        with self.awake_at(address):
            async with self._process_stream(address, self._stream_headers(token, user), body,
                                            httpx.Timeout(10.0, read=None),
                                            what="the terminal") as frames:
                async for frame in frames:
                    start = frame.get("event", {}).get("start")
                    if start is not None:
                        pid = int(start.get("pid", 0))
                        break
                if not pid:
                    raise EnvdUnavailable("envd did not start the terminal")

                async def output() -> AsyncIterator[bytes]:
                    async for frame in frames:
                        event = frame.get("event", {})
                        data = event.get("data", {}).get("pty")
                        if data:
                            yield base64.b64decode(data)
                        if event.get("end") is not None:
                            return

                try:
                    yield pid, output()
                finally:
                    with contextlib.suppress(httpx.HTTPError, EnvdUnavailable):
                        await self._unary(address, token, "SendSignal", {
                            "process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})

    async def pty_input(self, address: str, token: str, pid: int, data: bytes) -> None:
        await self._unary(address, token, "SendInput", {
            "process": {"pid": pid}, "input": {"pty": base64.b64encode(data).decode()}})

    async def pty_resize(self, address: str, token: str, pid: int, cols: int, rows: int
                         ) -> None:
        await self._unary(address, token, "Update", {
            "process": {"pid": pid}, "pty": {"size": {"cols": cols, "rows": rows}}})

    def _unary_headers(self, token: str, user: str = "user") -> dict[str, str]:
        return {"X-Access-Token": token,
                "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}

    async def _unary(self, address: str, token: str, method: str, message: dict) -> None:
        r = await self._http.post(f"http://{address}:{ENVD_PORT}/process.Process/{method}",
                                  json=message, headers=self._unary_headers(token))
        if r.status_code != 200:
            raise EnvdUnavailable(f"envd {method}: HTTP {r.status_code} {r.text[:200]}")


def _envelope(message: dict) -> bytes:
    """One Connect streaming request message (flags 0, 4-byte length, JSON)."""
    data = json.dumps(message).encode()
    return b"\x00" + struct.pack(">I", len(data)) + data


async def _file_chunks(f: BinaryIO, size: int = 1 << 20) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(f.read, size):
        yield chunk


async def _frames(response: httpx.Response):
    """Connect streaming envelopes: 1 flag byte, 4-byte length, JSON message."""
    buf = b""
    async for chunk in response.aiter_bytes():
        buf += chunk
        while len(buf) >= 5:
            flags, size = buf[0], struct.unpack(">I", buf[1:5])[0]
            if size > MAX_FRAME:  # a sandbox's envd is not trusted with our memory
                raise EnvdUnavailable(f"envd sent a {size}-byte message")
            if len(buf) < 5 + size:
                break
            message, buf = json.loads(buf[5:5 + size] or b"{}"), buf[5 + size:]
            if flags & 0x02:  # end of stream: an error, or nothing
                if message.get("error"):
                    raise EnvdUnavailable(f"envd: {message['error'].get('message', 'error')}")
                return
            yield message


def _rfc3339_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
