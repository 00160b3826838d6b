"""The code-interpreter template's in-sandbox server (port 49999).

Speaks the HTTP protocol the ``e2b-code-interpreter`` SDKs use:

  POST   /execute                {code, context_id?, language?, env_vars?}
         -> 200, one JSON object per line, streamed as the code runs:
            {"type": "stdout"|"stderr", "text", "timestamp"}   (ns since the epoch)
            {"type": "result", <format>: ..., "is_main_result"} (execute_result / display_data)
            {"type": "error", "name", "value", "traceback"}
            {"type": "number_of_executions", "execution_count"}
            {"type": "end_of_execution"}
  GET    /contexts               -> [{id, language, cwd}]
  POST   /contexts               {language?, cwd?} -> {id, language, cwd}
  DELETE /contexts/{id}          -> 204
  POST   /contexts/{id}/restart  -> 204
  GET    /health                 -> 200 once the default Python context is up

Each context is one Jupyter kernel (ipykernel, driven with jupyter_client);
executions in a context run one at a time and keep their state between calls.
A client that goes away mid-execution (the SDK's timeout) interrupts the kernel.

Runs inside the sandbox with the template's own Python environment; it imports
nothing from agentenv. Errors are JSON ``{"code": <status>, "message": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from typing import Any

log = logging.getLogger("code-interpreter")

PORT = 49999
ENVD_PORT = 49983
ENVD_TIMEOUT = 2.0
MAX_ENVS = 1 << 20
DEFAULT_CWD = os.environ.get("CODE_INTERPRETER_CWD", "/home/user")
MAX_BODY = 16 << 20
KERNEL_START_TIMEOUT = 60.0
# IPython's colour codes make tracebacks unreadable outside a terminal.
KERNEL_ARGS = ["--InteractiveShell.colors=nocolor"]
LANGUAGES = {"python": "python3", "python3": "python3"}

# Jupyter MIME types -> the result fields the SDKs read.
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Context:
    """One kernel, its client, and the lock that keeps its executions in order."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = asyncio.Lock()
        self.manager: Any = None
        self.client: Any = None
        self.running: str | None = None  # msg_id of the execution in progress

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        from jupyter_client.manager import AsyncKernelManager

        if not os.path.isdir(self.cwd):
            raise HTTPError(400, f"cwd '{self.cwd}' is not a directory")
        # Unix sockets, not TCP: nothing else in the sandbox can dial the kernel.
        self.manager = AsyncKernelManager(kernel_name=LANGUAGES[self.language], transport="ipc",
                                          ip=os.path.join(_runtime_dir(), self.id))
        await self.manager.start_kernel(cwd=self.cwd, extra_arguments=KERNEL_ARGS)
        await self._connect()

    async def _connect(self) -> None:
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            await self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT)
        except RuntimeError as e:
            raise HTTPError(500, f"the kernel did not start: {e}") from None

    async def restart(self) -> None:
        self.client.stop_channels()
        await self.manager.restart_kernel(now=True)
        await self._connect()

    async def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_channels()
        with contextlib.suppress(Exception):
            await self.manager.shutdown_kernel(now=True)

    async def interrupt(self, wait: float = 10.0) -> None:
        """Stop the running execution and wait until the kernel has let go of it."""
        with contextlib.suppress(Exception):
            await self.manager.interrupt_kernel()
        if self.running:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(wait):
                    async for _ in self._messages(self.running):
                        pass

    async def run_silently(self, code: str) -> None:
        """Run bookkeeping code (environment variables) without output or history."""
        msg_id = self.client.execute(code, silent=True, store_history=False)
        async for _ in self._messages(msg_id):
            pass

    async def _messages(self, msg_id: str):
        """IOPub messages answering ``msg_id``, until the kernel is idle again."""
        while True:
            try:
                msg = await self.client.get_iopub_msg(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # queue.Empty: nothing this second
                if not await self.manager.is_alive():
                    raise KernelDied() from None
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "status" and msg["content"].get("execution_state") == "idle":
                return
            yield kind, msg["content"]

    async def execute(self, code: str):
        """Run ``code``; yield the SDK's output lines (dicts) as they come."""
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False,
                                     stop_on_error=True)
        self.running = msg_id
        async for kind, content in self._messages(msg_id):
            line = _output(kind, content)
            if line is not None:
                yield line


class KernelDied(Exception):
    pass


def _runtime_dir() -> str:
    path = os.environ.get("CODE_INTERPRETER_RUNTIME_DIR") or os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"code-interpreter-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _now_ns() -> int:
    return time.time_ns()


def _output(kind: str, content: dict[str, Any]) -> dict[str, Any] | None:
    if kind == "stream":
        name = "stderr" if content.get("name") == "stderr" else "stdout"
        return {"type": name, "text": content.get("text", ""), "timestamp": _now_ns()}
    if kind in ("execute_result", "display_data"):
        result: dict[str, Any] = {"type": "result", "is_main_result": kind == "execute_result"}
        extra: dict[str, Any] = {}
        for mime, value in (content.get("data") or {}).items():
            field = FORMATS.get(mime)
            if field is not None:
                result[field] = value
            else:
                extra[mime] = value
        if extra:
            result["extra"] = extra
        return result
    if kind == "error":
        return {"type": "error", "name": content.get("ename", ""),
                "value": content.get("evalue", ""),
                "traceback": "\n".join(content.get("traceback") or [])}
    if kind == "execute_input":
        return {"type": "number_of_executions",
                "execution_count": content.get("execution_count")}
    return None


async def envd_env_vars(token: str | None) -> dict[str, str]:
    """envd's env vars (GET /envs on 127.0.0.1:49983); {} when envd does not say."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", ENVD_PORT), ENVD_TIMEOUT)
        auth = f"X-Access-Token: {token}\r\n" if token and token.isprintable() else ""
        writer.write(f"GET /envs HTTP/1.0\r\nHost: localhost\r\n{auth}\r\n".encode())
        await writer.drain()
        raw = b""
        while chunk := await asyncio.wait_for(reader.read(65536), ENVD_TIMEOUT):
            raw += chunk
            if len(raw) > MAX_ENVS:
                return {}
        head, _, body = raw.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.") or head.split(b" ", 2)[1:2] != [b"200"]:
            return {}
        envs = json.loads(body)
        if isinstance(envs, dict):
            return {k: v for k, v in envs.items() if isinstance(k, str) and isinstance(v, str)}
    except (OSError, TimeoutError, ValueError, IndexError):
        pass
    finally:
        if writer is not None:
            writer.close()
    return {}


def _env_code(env: dict[str, str]) -> tuple[str, str]:
    """Code that sets ``env`` in the kernel, and code that puts the old values back."""
    payload = json.dumps(env)
    setup = (
        "import os as _aenv_os, json as _aenv_json\n"
        f"_aenv_env = _aenv_json.loads({payload!r})\n"
        "_aenv_saved = {k: _aenv_os.environ.get(k) for k in _aenv_env}\n"
        "_aenv_os.environ.update(_aenv_env)\n"
    )
    restore = (
        "for _aenv_k, _aenv_v in _aenv_saved.items():\n"
        "    if _aenv_v is None:\n"
        "        _aenv_os.environ.pop(_aenv_k, None)\n"
        "    else:\n"
        "        _aenv_os.environ[_aenv_k] = _aenv_v\n"
        "del _aenv_env, _aenv_saved\n"
    )
    return setup, restore


class Server:
    def __init__(self) -> None:
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}  # language -> its default context
        self.ready = asyncio.Event()
        self._default_lock = asyncio.Lock()

    # -- contexts ---------------------------------------------------------------------
    async def new_context(self, language: str | None, cwd: str | None) -> Context:
        language = _language(language)
        context = Context(language, cwd or DEFAULT_CWD)
        await context.start()
        self.contexts[context.id] = context
        log.info("context %s (%s) in %s", context.id, language, context.cwd)
        return context

    async def default_context(self, language: str | None) -> Context:
        language = _language(language)
        async with self._default_lock:
            cid = self.defaults.get(language)
            if cid is None or cid not in self.contexts:
                context = await self.new_context(language, DEFAULT_CWD)
                self.defaults[language] = context.id
                cid = context.id
        return self.contexts[cid]

    def context(self, context_id: str) -> Context:
        context = self.contexts.get(context_id)
        if context is None:
            raise HTTPError(404, f"context '{context_id}' not found")
        return context

    # -- ASGI ---------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except HTTPError as e:
            await _json(send, e.status, {"code": e.status, "message": e.message})
        except Exception as e:  # pragma: no cover - logged and reported
            log.exception("request failed")
            await _json(send, 500, {"code": 500, "message": f"{type(e).__name__}: {e}"})

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                asyncio.get_running_loop().create_task(self._warm_up())
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                for context in list(self.contexts.values()):
                    await context.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _warm_up(self) -> None:
        """Start the default Python context before anyone asks: /health waits for it."""
        try:
            await self.default_context("python")
            self.ready.set()
        except Exception:
            log.exception("the default context did not start")

    async def _route(self, scope, receive, send) -> None:
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        if path == "/health" and method == "GET":
            if self.ready.is_set():
                await _json(send, 200, {"status": "ok"})
            else:
                await _json(send, 503, {"code": 503, "message": "the kernel is starting"})
        elif path == "/execute" and method == "POST":
            token = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                          if k == b"x-access-token"), None)
            await self._execute(await _body_json(receive), receive, send, token)
        elif path == "/contexts" and method == "GET":
            await _json(send, 200, [c.describe() for c in self.contexts.values()])
        elif path == "/contexts" and method == "POST":
            body = await _body_json(receive)
            context = await self.new_context(body.get("language"), body.get("cwd"))
            await _json(send, 200, context.describe())
        elif len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            context = self.context(parts[1])
            self.contexts.pop(context.id, None)
            await context.shutdown()
            await _empty(send, 204)
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" \
                and method == "POST":
            context = self.context(parts[1])
            async with context.lock:
                await context.restart()
            await _empty(send, 204)
        else:
            raise HTTPError(404, f"{method} {path} not found")

    async def _execute(self, body: dict[str, Any], receive, send,
                       token: str | None = None) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "'code' must be a string")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise HTTPError(400, "'env_vars' must map strings to strings")
        # The sandbox's own env vars (a create's envs) come first: this server may have
        # started before they were given to envd (a sandbox restored from its
        # template's image), so they are asked of envd, as E2B's server does.
        env = {**await envd_env_vars(token), **env}
        if body.get("context_id"):
            if body.get("language"):
                raise HTTPError(400, "give context_id or language, not both")
            context = self.context(body["context_id"])
        else:
            context = await self.default_context(body.get("language"))

        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson"),
                                (b"cache-control", b"no-store")]})
        gone = asyncio.Event()

        async def watch_disconnect() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    return

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            async with context.lock:
                await self._run(context, code, env, send, gone)
        finally:
            watcher.cancel()
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b""})

    async def _run(self, context: Context, code: str, env: dict[str, str], send,
                   gone: asyncio.Event) -> None:
        async def emit(line: dict[str, Any]) -> None:
            await send({"type": "http.response.body", "more_body": True,
                        "body": json.dumps(line).encode() + b"\n"})

        setup, restore = _env_code(env) if env else ("", "")
        try:
            if setup:
                await context.run_silently(setup)
            outputs = context.execute(code).__aiter__()
            while True:
                step = asyncio.ensure_future(outputs.__anext__())
                stop = asyncio.ensure_future(gone.wait())
                done, _ = await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
                if step not in done:
                    # The client went away (its timeout): stop the code, drain its output.
                    step.cancel()
                    await context.interrupt()
                    with contextlib.suppress(BaseException):
                        await step
                    return
                stop.cancel()
                try:
                    line = step.result()
                except StopAsyncIteration:
                    break
                await emit(line)
            await emit({"type": "end_of_execution"})
        except KernelDied:
            await emit({"type": "error", "name": "KernelDied",
                        "value": "the kernel died while running the code; it was restarted",
                        "traceback": ""})
            await context.restart()
        finally:
            if restore and await context.manager.is_alive():
                await context.run_silently(restore)


def _language(language: str | None) -> str:
    name = (language or "python").lower()
    if name not in LANGUAGES:
        raise HTTPError(400, f"language '{language}' is not supported (supported: python)")
    return "python"


async def _body_json(receive) -> dict[str, Any]:
    buf = bytearray()
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise HTTPError(400, "client disconnected")
        buf += msg.get("body", b"")
        if len(buf) > MAX_BODY:
            raise HTTPError(413, "request body too large")
        if not msg.get("more_body", False):
            break
    if not buf.strip():
        return {}
    try:
        body = json.loads(buf)
    except ValueError:
        raise HTTPError(400, "body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body must be a JSON object")
    return body


async def _json(send, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _empty(send, status: int) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    port = int(os.environ.get("CODE_INTERPRETER_PORT", PORT))
    uvicorn.run(Server(), host="0.0.0.0", port=port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
