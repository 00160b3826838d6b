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

Each context is one Jupyter kernel driven with jupyter_client (aenv_ci_kernels:
ipykernel for Python, and the kernels in its LANGUAGES); executions in a context run one at
a time and keep their state between calls. A client that goes away mid-execution
(the SDK's timeout) interrupts the kernel; a kernel found dead (killed, crashed) is
started again before the next execution. As in E2B's template, the kernels run as
root with /home/user as the default working directory, and the sandbox's env vars
(asked of envd) are set in each kernel, a request's ``env_vars`` for that execution
only. The server itself is kept running by supervise.sh.

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
from typing import Any

from aenv_ci_kernels import (
    DEFAULT_LANGUAGES,
    ENV_NAME,
    KERNEL_START_TIMEOUT,
    Context,
    HTTPError,
    KernelDied,
    end_orphan_kernels,
    resolve_language,
)

log = logging.getLogger("code-interpreter")

PORT = 49999
ENVD_PORT = 49983
ENVD_TIMEOUT = 2.0
MAX_ENVS = 1 << 20
DEFAULT_CWD = os.environ.get("CODE_INTERPRETER_CWD", "/home/user")
MAX_BODY = 16 << 20


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


class Server:
    def __init__(self) -> None:
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}  # language -> its default context
        self.ready = asyncio.Event()
        self.warmed = asyncio.Event()  # the warm-up is over, however it went
        self._default_lock = asyncio.Lock()

    # -- contexts ---------------------------------------------------------------------
    async def new_context(self, language: str | None, cwd: str | None) -> Context:
        language = resolve_language(language)
        context = Context(language, cwd or DEFAULT_CWD)
        await context.start()
        self.contexts[context.id] = context
        log.info("context %s (%s) in %s", context.id, language, context.cwd)
        return context

    async def default_context(self, language: str | None) -> Context:
        language = resolve_language(language)
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
        """Start the default contexts (Python, JavaScript) before anyone asks: /health
        waits for them, so a sandbox's create returns with both listed, as on E2B."""
        try:
            ended = await asyncio.to_thread(end_orphan_kernels)
            if ended:
                log.warning("ended %d kernels of an earlier server", ended)
            for language in DEFAULT_LANGUAGES:
                try:
                    await self.default_context(language)
                except Exception:
                    log.exception("the default %s context did not start", language)
                    if language == "python":
                        return  # /health stays 503: the template is broken
            self.ready.set()
        finally:
            self.warmed.set()

    async def _route(self, scope, receive, send) -> None:
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        if path == "/health" and method == "GET":
            if self.ready.is_set():
                await _json(send, 200, {"status": "ok"})
            else:
                await _json(send, 503, {"code": 503, "message": "the kernel is starting"})
            return
        # Until the default contexts are up (a server started again), requests wait
        # for them: a client then sees the same contexts as after a create.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.warmed.wait(), 2 * KERNEL_START_TIMEOUT)
        if path == "/execute" and method == "POST":
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
        _check_env_names(env)
        # The sandbox's own env vars (a create's envs) are asked of envd at each run:
        # this server may have started before they were given to envd (a sandbox
        # restored from its template's image, or a snapshot), as E2B's server does.
        sandbox_env = {k: v for k, v in (await envd_env_vars(token)).items()
                       if ENV_NAME.fullmatch(k) and "\0" not in v}
        if body.get("context_id"):
            if body.get("language"):
                raise HTTPError(400, "give context_id or language, not both")
            context = self.context(body["context_id"])
        else:
            context = await self.default_context(body.get("language"))

        gone = asyncio.Event()

        async def watch_disconnect() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone.set()
                    return

        async with context.lock:
            # A kernel found dead starts again before the response does: should
            # that fail, the client gets a JSON error, not a cut stream.
            await context.ensure_alive()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson"),
                                    (b"cache-control", b"no-store")]})
            watcher = asyncio.get_running_loop().create_task(watch_disconnect())
            try:
                await self._run(context, code, sandbox_env, env, send, gone)
            finally:
                watcher.cancel()
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b""})

    async def _run(self, context: Context, code: str, sandbox_env: dict[str, str],
                   env: dict[str, str], send, gone: asyncio.Event) -> None:
        async def emit(line: dict[str, Any]) -> None:
            await send({"type": "http.response.body", "more_body": True,
                        "body": json.dumps(line).encode() + b"\n"})

        for attempt in (1, 2):
            context.started = False
            try:
                await context.apply_env(sandbox_env, env)
                outputs = context.execute(code).__aiter__()
                while True:
                    step = asyncio.ensure_future(outputs.__anext__())
                    stop = asyncio.ensure_future(gone.wait())
                    done, _ = await asyncio.wait({step, stop},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if step not in done:
                        # The client went away (its timeout): stop the code, drain it.
                        step.cancel()
                        await context.interrupt()
                        with contextlib.suppress(BaseException):
                            await step
                        break
                    stop.cancel()
                    try:
                        line = step.result()
                    except StopAsyncIteration:
                        await emit({"type": "end_of_execution"})
                        break
                    await emit(line)
                if env and await context.manager.is_alive():
                    await context.reset_env(env)
                return
            except KernelDied:
                await context.restart()
                if attempt == 1 and not context.started:
                    # Killed before it took the code (between the liveness check and
                    # the request): the code never ran, so it runs in the new kernel.
                    log.warning("context %s: the kernel died before the code ran; "
                                "running it in a new kernel", context.id)
                    continue
                await emit({"type": "error", "name": "KernelDied",
                            "value": "the kernel died while running the code; it was restarted",
                            "traceback": ""})
                return


def _check_env_names(env: dict[str, str]) -> None:
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            raise HTTPError(400, f"env var name {name[:64]!r} is not valid "
                                 "(letters, digits and _, not starting with a digit)")
        if "\0" in value:
            raise HTTPError(400, f"env var {name!r} holds a NUL character")


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
