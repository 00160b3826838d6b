"""Processes envd has started: fanning their output out to subscribers, their exit,
their input, and the registry that finds them and reaps every child.

envd is the sandbox's init, so it reaps every child itself (SIGCHLD handler with
``waitpid(-1)``); processes it started get their exit status routed to them, any
other zombie (re-parented orphans) is just reaped. Nothing here uses asyncio's
subprocess machinery, whose child watchers would race with that reaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
from collections.abc import AsyncGenerator
from typing import Any

from aenv_envd_protos.process import process_pb as pb
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from .durable import DurableBook, DurableCommand
from .sudo import Children

READ_CHUNK = 64 * 1024
# A subscriber queue this deep pauses reading the process's output (back-pressure);
# reading resumes once every queue has drained below LOW_WATER.
HIGH_WATER = 64
LOW_WATER = 16
# After the main process exits, how long to wait for EOF on its output (a
# background grandchild may keep the pipes open forever).
EOF_GRACE_S = 0.25

_SIGNAL_NAMES: dict[int, str] = {
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


def process_event(**kw: Any) -> pb.ProcessEvent:
    ((field, value),) = kw.items()
    return pb.ProcessEvent(event=Oneof(field, value))


def _data(field: str, chunk: bytes) -> pb.ProcessEvent:
    return process_event(data=pb.ProcessEvent.DataEvent(output=Oneof(field, chunk)))


def _keepalive() -> pb.ProcessEvent:
    return process_event(keepalive=pb.ProcessEvent.KeepAlive())


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
        # Set when started durable: keeps its output and exit status (durable.py).
        self.durable: DurableCommand | None = None
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

    async def events(self, q: asyncio.Queue, keepalive_s: float | None
                     ) -> AsyncGenerator[Any, None]:
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
            self._output(fd, chunk)
        else:
            self._close_out(fd)
            self._maybe_finish()

    def _output(self, fd: int, chunk: bytes) -> None:
        if self.durable is not None:
            self.durable.output(self._out[fd], chunk)
        self._broadcast(_data(self._out[fd], chunk))

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
                    self._output(fd, chunk)
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

    def discard(self) -> None:
        """Forget a process that never became the command (exec-as refused its cwd and
        exits by itself): no events, no listing; its pipes closed, its pid reaped as
        any orphan's."""
        self.ended = True
        self.registry.remove(self)
        for h in (self._grace, self._deadline):
            if h is not None:
                h.cancel()
        for fd in list(self._out):
            self._close_out(fd)
        self._close_inputs()

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
        self._broadcast(process_event(end=end))
        self._broadcast(None)
        self.registry.remove(self)
        if self.durable is not None:
            self.durable.finish(end.exit_code, status)
            self.registry.durable.ended(self.durable)

    def _close_inputs(self) -> None:
        for attr in ("stdin_fd", "pty_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, None)

    def set_deadline(self, when: float) -> None:
        """SIGKILL at ``when`` (the event loop's clock)."""
        self._deadline = self._loop.call_at(when, self.signal, signal.SIGKILL)

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
                    self._loop.add_writer(fd, resolve_future, fut)
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
        # The sudo broker's processes (started outside the process service).
        self.children = Children()
        # Durable commands, running and recently ended (durable.py).
        self.durable = DurableBook()

    def add(self, proc: Proc) -> None:
        self.by_pid[proc.pid] = proc

    def remove(self, proc: Proc) -> None:
        self.by_pid.pop(proc.pid, None)

    def reap(self) -> None:
        """Collect every exited child: ours get their status, orphans are reaped."""
        with self.children.lock:
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
                else:
                    self.children.exited(pid, status)

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


def resolve_future(fut: asyncio.Future) -> None:
    """A descriptor is ready: wake whoever awaits ``fut`` (once)."""
    if not fut.done():
        fut.set_result(None)
