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

Each context is one Jupyter kernel driven with jupyter_client (Python: ipykernel;
the other languages: the kernels in LANGUAGES); executions in a context run one at
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
import re
import shlex
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
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KERNEL_MARK = "AENV_CI_SERVER"


class Language:
    """A language: its Jupyter kernel and how to set env vars in it."""

    def __init__(self, name: str, kernel: str, args: list[str] | None = None,
                 ipc: bool = False) -> None:
        self.name = name
        self.kernel = kernel
        self.args = args or []
        # Unix sockets where the kernel takes them (ipykernel): nothing else in the
        # sandbox can dial it. The others (zeromq.js, pbdZMQ) listen on 127.0.0.1,
        # their messages signed with the connection file's key (root's, 0600).
        self.ipc = ipc

    def set_env(self, env: dict[str, str]) -> str:
        raise NotImplementedError

    def unset_env(self, names: list[str]) -> str:
        raise NotImplementedError


class Python(Language):
    # The names stay out of the user's namespace (no assignment at top level).
    def set_env(self, env: dict[str, str]) -> str:
        return f"__import__('os').environ.update(__import__('json').loads({json.dumps(env)!r}))"

    def unset_env(self, names: list[str]) -> str:
        return f"[__import__('os').environ.pop(k, None) for k in {names!r}]"


class JavaScript(Language):
    # JSON is a JS expression; one block so nothing is declared at top level.
    def set_env(self, env: dict[str, str]) -> str:
        return f"Object.assign(process.env, {json.dumps(env)});"

    def unset_env(self, names: list[str]) -> str:
        return f"{{ for (const k of {json.dumps(names)}) delete process.env[k]; }}"


class Bash(Language):
    def set_env(self, env: dict[str, str]) -> str:
        return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())

    def unset_env(self, names: list[str]) -> str:
        return "unset " + " ".join(names)


class R(Language):
    def set_env(self, env: dict[str, str]) -> str:
        # JSON strings (non-ASCII kept as is) are R string literals.
        args = ", ".join(f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in env.items())
        return f"invisible(Sys.setenv({args}))"

    def unset_env(self, names: list[str]) -> str:
        return f"invisible(Sys.unsetenv(c({', '.join(json.dumps(n) for n in names)})))"


# IPython's colour codes make tracebacks unreadable outside a terminal; the
# extension adds E2B's result formats (DataFrames as data, figures as charts).
PYTHON_ARGS = ["--InteractiveShell.colors=nocolor",
               "--IPKernelApp.extra_extensions=aenv_ci_display"]
LANGUAGES: dict[str, Language] = {
    "python": Python("python", "python3", PYTHON_ARGS, ipc=True),
    "javascript": JavaScript("javascript", "jslab"),
    "typescript": JavaScript("typescript", "tslab"),
    "bash": Bash("bash", "bash", ipc=True),
    "r": R("r", "ir"),
}
ALIASES = {"python3": "python", "py": "python", "js": "javascript", "ts": "typescript",
           "sh": "bash"}
# Languages E2B's template has that this one does not build, and why.
NOT_BUILT = {
    "java": "Java is not in this template: its JDK (openjdk-17-jdk-headless, ~260 MB "
            "installed) and two JVMs per context (JShell) did not fit the template's size "
            "and memory budget",
}
# Started with the server (E2B's template starts these two).
DEFAULT_LANGUAGES = ("python", "javascript")

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
    "e2b/data": "data",
    "e2b/chart": "chart",
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
        self.spec = LANGUAGES[language]
        self.cwd = cwd
        self.lock = asyncio.Lock()
        self.manager: Any = None
        self.client: Any = None
        self.running: str | None = None  # msg_id of the execution in progress
        self.started = False  # whether the kernel took the execution in progress
        # The sandbox's env vars as last set in this kernel (empty for a new kernel).
        self.sandbox_env: dict[str, str] = {}

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        if not os.path.isdir(self.cwd):
            raise HTTPError(400, f"cwd '{self.cwd}' is not a directory")
        await self._launch()

    async def _launch(self) -> None:
        from jupyter_client.manager import AsyncKernelManager

        # A new manager each time: shutting a kernel down ends its manager's sockets.
        if self.spec.ipc:
            self.manager = AsyncKernelManager(kernel_name=self.spec.kernel, transport="ipc",
                                              ip=os.path.join(_runtime_dir(), self.id))
        else:
            self.manager = AsyncKernelManager(kernel_name=self.spec.kernel, transport="tcp",
                                              ip="127.0.0.1")
        self.sandbox_env = {}
        self.running = None
        # Marked with this server's pid: a server started again ends the kernels of
        # the one before (tslab and IRkernel do not exit with their parent).
        env = {**os.environ, KERNEL_MARK: str(os.getpid())}
        await self.manager.start_kernel(cwd=self.cwd, extra_arguments=self.spec.args, env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            await self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT)
        except RuntimeError as e:
            raise HTTPError(500, f"the kernel did not start: {e}") from None

    async def restart(self) -> None:
        """A fresh kernel in the same context (the SDK's restart, or after a death)."""
        with contextlib.suppress(Exception):
            self.client.stop_channels()
        # shutdown (not restart_kernel): it also copes with a kernel already gone.
        with contextlib.suppress(Exception):
            await self.manager.shutdown_kernel(now=True)
        await self._launch()

    async def ensure_alive(self) -> None:
        if not await self.manager.is_alive():
            log.warning("context %s: the kernel is gone; starting a new one", self.id)
            await self.restart()

    async def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_channels()
        with contextlib.suppress(Exception):
            await self.manager.shutdown_kernel(now=True)

    async def apply_env(self, sandbox_env: dict[str, str], run_env: dict[str, str]) -> None:
        """Set the sandbox's env vars that changed since last time, and this run's."""
        changed = {k: v for k, v in sandbox_env.items() if self.sandbox_env.get(k) != v}
        env = {**changed, **run_env}
        if env:
            await self.run_silently(self.spec.set_env(env))
        self.sandbox_env = {**self.sandbox_env, **changed}

    async def reset_env(self, run_env: dict[str, str]) -> None:
        """Put back what ``run_env`` replaced: the sandbox's value, or nothing."""
        back = {k: self.sandbox_env[k] for k in run_env if k in self.sandbox_env}
        gone = [k for k in run_env if k not in self.sandbox_env]
        if back:
            await self.run_silently(self.spec.set_env(back))
        if gone:
            await self.run_silently(self.spec.unset_env(gone))

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
        self.started = False
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False,
                                     stop_on_error=True)
        self.running = msg_id
        async for kind, content in self._messages(msg_id):
            self.started = True  # the kernel took the request (busy, then the rest)
            line = _output(kind, content)
            if line is not None:
                yield line


class KernelDied(Exception):
    pass


def end_orphan_kernels() -> int:
    """Kill the kernels an earlier server left (it was killed); how many there were."""
    mark = f"{KERNEL_MARK}=".encode()
    mine = mark + str(os.getpid()).encode()
    ended = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(mark) and v != mine for v in environ):
            with contextlib.suppress(OSError):
                os.kill(int(entry), 9)
                ended += 1
    return ended


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
        text = result.get("text")
        # As E2B's server: a repr's one pair of surrounding quotes goes ('hello' -> hello).
        if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            result["text"] = text[1:-1]
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


class Server:
    def __init__(self) -> None:
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}  # language -> its default context
        self.ready = asyncio.Event()
        self.warmed = asyncio.Event()  # the warm-up is over, however it went
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


def _language(language: str | None) -> str:
    name = (language or "python").strip().lower()
    name = ALIASES.get(name, name)
    if name in NOT_BUILT:
        raise HTTPError(400, f"language '{language}' is not supported: {NOT_BUILT[name]}")
    if name not in LANGUAGES or not _kernel_installed(LANGUAGES[name].kernel):
        supported = ", ".join(n for n, spec in LANGUAGES.items()
                              if _kernel_installed(spec.kernel))
        raise HTTPError(400, f"language '{language}' is not supported (supported: {supported})")
    return name


def _kernel_installed(kernel: str) -> bool:
    from jupyter_client.kernelspec import KernelSpecManager

    return kernel in _kernel_specs(KernelSpecManager)


_SPECS: set[str] | None = None


def _kernel_specs(manager_class: Any) -> set[str]:
    global _SPECS
    if _SPECS is None:
        _SPECS = set(manager_class().find_kernel_specs())
    return _SPECS


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
