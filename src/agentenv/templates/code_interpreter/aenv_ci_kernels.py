"""The code-interpreter server's kernels: one Jupyter kernel per context.

The languages this template builds and how each sets env vars, a context's kernel
(started, restarted when found dead, interrupted, its executions one at a time), and
the translation of Jupyter's IOPub messages into the SDK's output lines. server.py
(the HTTP side) drives it. Installed into the template's Python environment; it
imports nothing from agentenv.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import time
import uuid
from typing import Any

log = logging.getLogger("code-interpreter")

KERNEL_START_TIMEOUT = 60.0
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KERNEL_MARK = "AENV_CI_SERVER"


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Language:
    """A language: its Jupyter kernel and how to set env vars in it."""

    def __init__(self, name: str, kernel: str, args: list[str] | None = None,
                 ipc: bool = False) -> None:
        self.name = name
        self.kernel = kernel
        self.args = args or []
        # Unix sockets where the kernel takes them (ipykernel; tslab as the template
        # build patches it): nothing else in the sandbox can dial it, and nothing
        # notifies them while a checkpoint is saved (netstack does TCP's). pbdZMQ (R)
        # listens on 127.0.0.1, its messages signed with the connection file's key
        # (root's, 0600).
        self.ipc = ipc

    def set_env(self, env: dict[str, str]) -> str:
        raise NotImplementedError

    def unset_env(self, names: list[str]) -> str:
        raise NotImplementedError

    def stream(self, text: str) -> list[str]:
        """A stream message's text as the SDK's log lines."""
        return [text]


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


class Java(Language):
    """JJava (JShell). As on E2B, env vars are Java system properties (the JVM's own
    environment is fixed at its start): ``System.getProperty("NAME")``. JSON strings
    (ASCII, ``\\uXXXX`` escapes) are Java string literals."""

    def set_env(self, env: dict[str, str]) -> str:
        return " ".join(f"System.setProperty({json.dumps(k)}, {json.dumps(v)});"
                        for k, v in env.items())

    def unset_env(self, names: list[str]) -> str:
        return " ".join(f"System.clearProperty({json.dumps(k)});" for k in names)

    def stream(self, text: str) -> list[str]:
        # E2B's Java kernel (IJava) sends a println's text and its line end as two
        # stream messages (E2B's test_java_kernel reads stdout[0] == "Hello, World!");
        # JJava sends one.
        if len(text) > 1 and text.endswith("\n"):
            return [text[:-1], "\n"]
        return [text]


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
    "javascript": JavaScript("javascript", "jslab", ipc=True),
    "typescript": JavaScript("typescript", "tslab", ipc=True),
    "bash": Bash("bash", "bash", ipc=True),
    "r": R("r", "ir"),
    # JJava's sockets are JeroMQ's, on 127.0.0.1 (its ipc is not Unix sockets), signed
    # with the connection file's key as R's are.
    "java": Java("java", "java"),
}
ALIASES = {"python3": "python", "py": "python", "js": "javascript", "ts": "typescript",
           "sh": "bash"}
# Why a language E2B's template has is missing, when its kernel is not installed.
NOT_BUILT = {
    "java": "this template was built without Java (AENV_CI_JAVA=0 "
            "scripts/build-code-interpreter-template.sh; the default build has it)",
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
            if line is None:
                continue
            if kind == "stream":
                for text in self.spec.stream(line["text"]):
                    yield {**line, "text": text}
            else:
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


def resolve_language(language: str | None) -> str:
    """The language a request names (aliases allowed), or a 400 saying what is."""
    name = (language or "python").strip().lower()
    name = ALIASES.get(name, name)
    if name in NOT_BUILT and not _kernel_installed(LANGUAGES[name].kernel):
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


