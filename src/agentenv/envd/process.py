"""The ``process.Process`` Connect service: start, attach to and drive processes.

envd is the sandbox's init, so it reaps every child itself (SIGCHLD handler with
``waitpid(-1)``); processes it started get their exit status routed to them, any
other zombie (re-parented orphans) is just reaped. Nothing here uses asyncio's
subprocess machinery, whose child watchers would race with that reaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import math
import os
import signal
import struct
import subprocess
import termios
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aenv_envd_protos.process import process_pb as pb
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from .spawn import as_user
from .state import PathError, State, User, UserError, resolve_path
from .userfs import UserFS, WorkerGone, user_key

if TYPE_CHECKING:
    from connectrpc.request import RequestContext

READ_CHUNK = 64 * 1024
# A subscriber queue this deep pauses reading the process's output (back-pressure);
# reading resumes once every queue has drained below LOW_WATER.
HIGH_WATER = 64
LOW_WATER = 16
# After the main process exits, how long to wait for EOF on its output (a
# background grandchild may keep the pipes open forever).
EOF_GRACE_S = 0.25
KEEPALIVE_HEADER = "keepalive-ping-interval"
MIN_KEEPALIVE_S = 1.0
MAX_KEEPALIVE_S = 3600.0
MAX_PTY_DIM = 4096

_SIGNAL_NAMES = {
    signal.SIGKILL: "killed",
    signal.SIGTERM: "terminated",
    signal.SIGINT: "interrupt",
    signal.SIGHUP: "hangup",
    signal.SIGQUIT: "quit",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGABRT: "aborted",
    signal.SIGPIPE: "broken pipe",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception",
    signal.SIGILL: "illegal instruction",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGUSR2: "user defined signal 2",
}


def _event(**kw: Any) -> pb.ProcessEvent:
    ((field, value),) = kw.items()
    return pb.ProcessEvent(event=Oneof(field, value))


def _data(field: str, chunk: bytes) -> pb.ProcessEvent:
    return _event(data=pb.ProcessEvent.DataEvent(output=Oneof(field, chunk)))


def _keepalive() -> pb.ProcessEvent:
    return _event(keepalive=pb.ProcessEvent.KeepAlive())


def _null_stdin() -> int:
    """/dev/null, or (in a rootfs without it) an already-closed pipe: EOF either way."""
    if os.path.exists(os.devnull):
        return subprocess.DEVNULL
    r, w = os.pipe()
    os.close(w)
    return r  # Popen dups it onto fd 0; closed by the caller below


def _set_controlling_tty() -> None:  # runs in the child, after setsid
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    rows = min(max(rows, 0), MAX_PTY_DIM) or 24  # the kernel's fields are 16-bit
    cols = min(max(cols, 0), MAX_PTY_DIM) or 80
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Proc:
    def __init__(self, registry: Registry, popen: subprocess.Popen, config: pb.ProcessConfig,
                 tag: str | None, out_fds: dict[int, str], stdin_fd: int | None,
                 pty_fd: int | None) -> None:
        self.registry = registry
        self.popen = popen
        self.pid = popen.pid
        self.config = config
        self.tag = tag
        self.pty_fd = pty_fd
        self.stdin_fd = stdin_fd
        self._out = dict(out_fds)  # fd -> "stdout" | "stderr" | "pty"
        self._subs: set[asyncio.Queue] = set()
        self._paused = False
        self._write_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._status: int | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.ended = False
        for fd in self._out:
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._on_readable, fd)

    # -- subscribers ----------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._subs.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subs.discard(q)
        self._maybe_resume()

    def _broadcast(self, ev: pb.ProcessEvent | None) -> None:
        for q in self._subs:
            q.put_nowait(ev)
        if not self._paused and any(q.qsize() >= HIGH_WATER for q in self._subs):
            self._paused = True
            for fd in self._out:
                self._loop.remove_reader(fd)

    def _maybe_resume(self) -> None:
        if self._paused and all(q.qsize() < LOW_WATER for q in self._subs):
            self._paused = False
            for fd in self._out:
                self._loop.add_reader(fd, self._on_readable, fd)

    async def events(self, q: asyncio.Queue, keepalive_s: float | None) -> AsyncIterator[Any]:
        try:
            while True:
                if keepalive_s:
                    try:
                        ev = await asyncio.wait_for(q.get(), keepalive_s)
                    except TimeoutError:
                        yield _keepalive()
                        continue
                else:
                    ev = await q.get()
                self._maybe_resume()
                if ev is None:
                    return
                yield ev
        finally:
            self.unsubscribe(q)

    # -- output ---------------------------------------------------------------------
    def _on_readable(self, fd: int) -> None:
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError as e:  # EIO on a pty master once the slave side is gone
            if e.errno not in (errno.EIO, errno.EBADF):
                raise
            chunk = b""
        if chunk:
            self._broadcast(_data(self._out[fd], chunk))
        else:
            self._close_out(fd)
            self._maybe_finish()

    def _close_out(self, fd: int) -> None:
        if fd in self._out:
            self._loop.remove_reader(fd)
            del self._out[fd]
            if fd != self.pty_fd:
                os.close(fd)

    def _drain(self) -> None:
        """Read whatever is buffered now, without waiting for EOF."""
        for fd in list(self._out):
            while fd in self._out:
                try:
                    chunk = os.read(fd, READ_CHUNK)
                except BlockingIOError:
                    break
                except OSError:
                    chunk = b""
                if chunk:
                    self._broadcast(_data(self._out[fd], chunk))
                else:
                    self._close_out(fd)

    # -- lifecycle ------------------------------------------------------------------
    def on_exit(self, status: int) -> None:
        self._status = status
        self.popen.returncode = os.waitstatus_to_exitcode(status)
        self._maybe_finish()
        if not self.ended:
            if self._paused:  # nobody reading fast enough: don't wait for them
                self._paused = False
            self._grace = self._loop.call_later(EOF_GRACE_S, self._finish_now)

    def _finish_now(self) -> None:
        self._drain()
        for fd in list(self._out):
            self._close_out(fd)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.ended or self._status is None or self._out:
            return
        self.ended = True
        for h in (self._grace, self._deadline):
            if h is not None:
                h.cancel()
        self._close_inputs()
        st = self._status
        if os.WIFSIGNALED(st):
            sig = os.WTERMSIG(st)
            status = f"signal: {_SIGNAL_NAMES.get(sig, f'signal {sig}')}"
            end = pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=status,
                                           error=status)
        else:
            code = os.WEXITSTATUS(st) if os.WIFEXITED(st) else -1
            status = f"exit status {code}"
            end = pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=status)
            if code != 0:
                end.error = status
        self._broadcast(_event(end=end))
        self._broadcast(None)
        self.registry.remove(self)

    def _close_inputs(self) -> None:
        for attr in ("stdin_fd", "pty_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, None)

    def set_deadline(self, seconds: float) -> None:
        self._deadline = self._loop.call_later(seconds, self.signal, signal.SIGKILL)

    def signal(self, sig: int) -> None:
        if self.ended:
            return
        try:  # the whole session: `bash -c cmd` must not leave `cmd` behind
            os.killpg(self.pid, sig)
        except OSError:
            with contextlib.suppress(OSError):
                os.kill(self.pid, sig)

    # -- input ----------------------------------------------------------------------
    async def write(self, fd: int | None, data: bytes, what: str) -> None:
        if fd is None:
            raise ConnectError(Code.FAILED_PRECONDITION,
                               f"process {self.pid} has no open {what}")
        async with self._write_lock:
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                    view = view[n:]
                except BlockingIOError:
                    fut = self._loop.create_future()
                    self._loop.add_writer(fd, lambda f=fut: f.done() or f.set_result(None))
                    try:
                        await fut
                    finally:
                        self._loop.remove_writer(fd)
                except OSError as e:
                    msg = f"cannot write to process {self.pid}: {e.strerror}"
                    raise ConnectError(Code.FAILED_PRECONDITION, msg) from None

    async def send_input(self, inp: pb.ProcessInput | None) -> None:
        match inp.input if inp is not None else None:
            case Oneof(field="stdin", value=data):
                if self.pty_fd is not None and self.stdin_fd is None:
                    await self.write(self.pty_fd, data, "pty")
                else:
                    await self.write(self.stdin_fd, data, "stdin")
            case Oneof(field="pty", value=data):
                await self.write(self.pty_fd, data, "pty")
            case _:
                pass

    def close_stdin(self) -> None:
        if self.pty_fd is not None:
            raise ConnectError(Code.FAILED_PRECONDITION,
                               "cannot close stdin of a PTY process; send Ctrl+D (0x04) instead")
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None


class Registry:
    def __init__(self) -> None:
        self.by_pid: dict[int, Proc] = {}

    def add(self, proc: Proc) -> None:
        self.by_pid[proc.pid] = proc

    def remove(self, proc: Proc) -> None:
        self.by_pid.pop(proc.pid, None)

    def reap(self) -> None:
        """Collect every exited child: ours get their status, orphans are reaped."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            proc = self.by_pid.get(pid)
            if proc is not None:
                proc.on_exit(status)

    def select(self, sel: pb.ProcessSelector | None) -> Proc:
        match sel.selector if sel is not None else None:
            case Oneof(field="pid", value=pid):
                proc = self.by_pid.get(pid)
                if proc is None:
                    raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
                return proc
            case Oneof(field="tag", value=tag):
                for proc in self.by_pid.values():
                    if proc.tag == tag:
                        return proc
                raise ConnectError(Code.NOT_FOUND, f"process with tag '{tag}' not found")
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "process selector (pid or tag) missing")


def _keepalive_s(ctx: RequestContext) -> float | None:
    """The client's keepalive interval, clamped: "1e-9" must not make a busy loop,
    nor "nan"/"inf" an error."""
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    try:
        v = float(raw) if raw else 0.0
    except ValueError:
        v = 0.0
    if not math.isfinite(v) or v <= 0:
        return None
    return min(max(v, MIN_KEEPALIVE_S), MAX_KEEPALIVE_S)


def _request_user(state: State, ctx: RequestContext) -> User:
    try:
        return state.user_from_authorization(ctx.request_headers.get("authorization"))
    except UserError as e:
        raise ConnectError(Code.UNAUTHENTICATED, str(e)) from None


class ProcessService:
    """Implements ``aenv_envd_protos.process.process_connect.Process``."""

    def __init__(self, state: State, registry: Registry, userfs: UserFS | None = None) -> None:
        self.state = state
        self.registry = registry
        self.userfs = userfs or UserFS()

    async def _check_cwd(self, cwd: str, user: User) -> None:
        """The requested cwd must be a directory *the user* may enter: the child
        changes into it before dropping root, so root's view must not decide."""
        ok = os.path.isdir(cwd)
        if ok and user.uid != 0 and os.geteuid() == 0:
            try:
                ok, _ = await self.userfs.call(user_key(user), "cwd_ok", path=cwd)
            except (OSError, WorkerGone):
                ok = False
        if not ok:
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"cwd '{cwd}' does not exist, is not a directory, or "
                               f"'{user.name}' may not enter it")

    # -- spawning -------------------------------------------------------------------
    def _spawn(self, request: pb.StartRequest, user: User, cwd: str | None) -> Proc:
        cfg = request.process
        if cfg is None or not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process config with a cmd is required")
        cmd = cfg.cmd
        if cmd == "/bin/bash" and not os.path.exists(cmd) and os.path.exists("/bin/sh"):
            cmd = "/bin/sh"  # the SDK always asks for bash; minimal rootfses have only sh
        argv = [cmd, *cfg.args]
        env = self.state.process_env(user, dict(cfg.envs))
        if cwd is None:
            cwd = self.state.default_cwd(user)
        creds: dict[str, Any] = {}
        if os.geteuid() == 0:
            try:
                groups = os.getgrouplist(user.name, user.gid)
            except OSError:
                groups = [user.gid]
            creds = {"user": user.uid, "group": user.gid, "extra_groups": groups}
        elif user.uid != os.geteuid():
            raise ConnectError(Code.PERMISSION_DENIED,
                               f"envd is not root and cannot run commands as '{user.name}'")
        use_stdin = request.stdin if request.has_field("stdin") else True
        pty = request.pty
        try:
            if pty is not None:
                master, slave = os.openpty()
                try:
                    size = pty.size
                    _set_winsize(slave, size.rows if size else 24, size.cols if size else 80)
                    popen = subprocess.Popen(
                        argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                        start_new_session=True, preexec_fn=_set_controlling_tty, **creds)
                finally:
                    os.close(slave)
                proc = Proc(self.registry, popen, cfg, request.tag if request.has_field("tag")
                            else None, {master: "pty"}, None, master)
            else:
                # Through setpriv when the user changes: a vfork instead of a fork.
                spawn_argv = argv
                if creds:
                    via = as_user(argv, user.uid, user.gid, creds["extra_groups"],
                                  env.get("PATH", ""))
                    if via is not None:
                        spawn_argv, creds = via, {}
                stdin_src = subprocess.PIPE if use_stdin else _null_stdin()
                popen = subprocess.Popen(
                    spawn_argv, stdin=stdin_src,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                    start_new_session=True, **creds)
                if isinstance(stdin_src, int) and stdin_src >= 0:
                    os.close(stdin_src)
                out = {os.dup(popen.stdout.fileno()): "stdout",
                       os.dup(popen.stderr.fileno()): "stderr"}
                popen.stdout.close()
                popen.stderr.close()
                stdin_fd = None
                if popen.stdin is not None:
                    stdin_fd = os.dup(popen.stdin.fileno())
                    popen.stdin.close()
                    os.set_blocking(stdin_fd, False)
                popen.stdin = popen.stdout = popen.stderr = None
                proc = Proc(self.registry, popen, cfg, request.tag if request.has_field("tag")
                            else None, out, stdin_fd, None)
        except OSError as e:
            if pty is not None:
                with contextlib.suppress(OSError, UnboundLocalError):
                    os.close(master)
            why = e.strerror or str(e)
            if e.filename and e.filename != cmd:
                why += f": '{e.filename}'"
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"failed to start process '{cmd}': {why}") from None
        if pty is not None:
            os.set_blocking(master, False)
        self.registry.add(proc)
        return proc

    # -- RPCs -----------------------------------------------------------------------
    async def list(self, request: pb.ListRequest, ctx: RequestContext) -> pb.ListResponse:
        return pb.ListResponse(processes=[
            pb.ProcessInfo(config=p.config, pid=p.pid, tag=p.tag)
            for p in self.registry.by_pid.values() if not p.ended
        ])

    async def start(self, request: pb.StartRequest, ctx: RequestContext
                    ) -> AsyncIterator[pb.StartResponse]:
        user = _request_user(self.state, ctx)
        cwd = None
        cfg = request.process
        if cfg is not None and cfg.has_field("cwd") and cfg.cwd:
            try:
                cwd = resolve_path(cfg.cwd, user)
            except PathError as e:
                raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None
            await self._check_cwd(cwd, user)
        proc = self._spawn(request, user, cwd)
        timeout_ms = ctx.timeout_ms
        if timeout_ms:  # E2B semantics: the stream's deadline bounds the process
            proc.set_deadline(timeout_ms / 1000)
        q = proc.subscribe()
        yield pb.StartResponse(event=_event(start=pb.ProcessEvent.StartEvent(pid=proc.pid)))
        async for ev in proc.events(q, _keepalive_s(ctx)):
            yield pb.StartResponse(event=ev)

    async def connect(self, request: pb.ConnectRequest, ctx: RequestContext
                      ) -> AsyncIterator[pb.ConnectResponse]:
        proc = self.registry.select(request.process)
        q = proc.subscribe()
        yield pb.ConnectResponse(event=_event(start=pb.ProcessEvent.StartEvent(pid=proc.pid)))
        async for ev in proc.events(q, _keepalive_s(ctx)):
            yield pb.ConnectResponse(event=ev)

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        proc = self.registry.select(request.process)
        if request.pty is not None and request.pty.size is not None:
            if proc.pty_fd is None:
                raise ConnectError(Code.FAILED_PRECONDITION,
                                   f"process {proc.pid} was not started with a PTY")
            _set_winsize(proc.pty_fd, request.pty.size.rows, request.pty.size.cols)
        return pb.UpdateResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest],
                           ctx: RequestContext) -> pb.StreamInputResponse:
        proc: Proc | None = None
        async for msg in request:
            match msg.event:
                case Oneof(field="start", value=start):
                    proc = self.registry.select(start.process)
                case Oneof(field="data", value=data):
                    if proc is None:
                        raise ConnectError(Code.FAILED_PRECONDITION,
                                           "stream input: data before start event")
                    await proc.send_input(data.input)
                case _:
                    pass
        return pb.StreamInputResponse()

    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext
                         ) -> pb.SendInputResponse:
        proc = self.registry.select(request.process)
        await proc.send_input(request.input)
        return pb.SendInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: RequestContext
                          ) -> pb.SendSignalResponse:
        proc = self.registry.select(request.process)
        sig = {pb.Signal.SIGKILL: signal.SIGKILL, pb.Signal.SIGTERM: signal.SIGTERM}.get(
            request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal}")
        proc.signal(sig)
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: RequestContext
                          ) -> pb.CloseStdinResponse:
        proc = self.registry.select(request.process)
        proc.close_stdin()
        return pb.CloseStdinResponse()
