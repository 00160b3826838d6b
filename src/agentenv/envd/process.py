"""The ``process.Process`` Connect service: start, attach to and drive processes.

The RPCs only: starting a command is launch's job, and a started process's
output, exit and input are running's.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from aenv_envd_protos.process import process_pb as pb
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from . import durable as durable_cmds
from .launch import cwd_refused, enters_cwd_as_user, set_winsize, spawn_process
from .running import Proc, Registry, process_event
from .state import PathError, State, User, UserError, resolve_path
from .userfs import UserFS, user_key
from .userfs_protocol import WorkerGone

if TYPE_CHECKING:
    from connectrpc.request import RequestContext

KEEPALIVE_HEADER = "keepalive-ping-interval"
MIN_KEEPALIVE_S = 1.0
MAX_KEEPALIVE_S = 3600.0


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


def _deadline(ctx: RequestContext) -> float | None:
    """The request's deadline (Connect-Timeout-Ms) on the event loop's clock."""
    remaining_ms = ctx.timeout_ms
    if remaining_ms is None or ctx.request_headers.get("connect-timeout-ms") == "0":
        return None  # none; "0" is none too, as E2B's envd reads it
    return asyncio.get_running_loop().time() + max(remaining_ms, 0) / 1000


async def _until_deadline(events: AsyncGenerator[Any, None], deadline: float | None
                          ) -> AsyncIterator[Any]:
    """``events`` until ``deadline``, then the stream ends with deadline_exceeded, as
    E2B's envd ends it (its handler's context): the SDKs raise their timeout error for
    that, not an exit error for the process the deadline killed. Nothing is passed on
    after the deadline, even an event already queued (the kill's own end event)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            if deadline is not None and loop.time() >= deadline:
                raise ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded")
            try:
                async with asyncio.timeout_at(deadline):
                    ev = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded") from None
            yield ev
    finally:
        await events.aclose()


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

    async def _check_cwd(self, cwd: str, user: User, request: pb.StartRequest) -> None:
        """The requested cwd must be a directory *the user* may enter. exec-as enters it
        after dropping root (launch.enters_cwd_as_user); otherwise the child changes
        into it as root, so root's view must not decide: a file worker of the user's
        checks it first."""
        ok = os.path.isdir(cwd)
        if ok and user.uid != 0 and os.geteuid() == 0 and not enters_cwd_as_user(request):
            try:
                ok, _ = await self.userfs.call(user_key(user), "cwd_ok", path=cwd)
            except (OSError, WorkerGone):
                ok = False
        if not ok:
            raise cwd_refused(cwd, user)

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
            await self._check_cwd(cwd, user, request)
        deadline = _deadline(ctx)
        durable, output_bytes = durable_cmds.requested(
            ctx.request_headers, dict(cfg.envs) if cfg is not None else {})
        if durable and not self.registry.durable.can_start():
            raise ConnectError(Code.RESOURCE_EXHAUSTED,
                               f"{durable_cmds.MAX_RUNNING} durable commands already running")
        proc = spawn_process(self.state, self.registry, request, user, cwd)
        if durable:  # no connection bounds it: the deadline ends the stream only
            assert cfg is not None  # spawn_process refuses a request without one
            proc.durable = durable_cmds.DurableCommand(
                proc.pid, proc.tag, cfg.cmd, list(cfg.args), output_bytes)
            self.registry.durable.add(proc.durable)
        elif deadline is not None:  # E2B semantics: the stream's deadline bounds the process
            proc.set_deadline(deadline)
        q = proc.subscribe()
        started = pb.ProcessEvent.StartEvent(pid=proc.pid)
        yield pb.StartResponse(event=process_event(start=started))
        async for ev in _until_deadline(proc.events(q, _keepalive_s(ctx)), deadline):
            yield pb.StartResponse(event=ev)

    async def connect(self, request: pb.ConnectRequest, ctx: RequestContext
                      ) -> AsyncIterator[pb.ConnectResponse]:
        deadline = _deadline(ctx)  # bounds this stream only, not the process
        proc = self.registry.select(request.process)
        q = proc.subscribe()
        started = pb.ProcessEvent.StartEvent(pid=proc.pid)
        yield pb.ConnectResponse(event=process_event(start=started))
        async for ev in _until_deadline(proc.events(q, _keepalive_s(ctx)), deadline):
            yield pb.ConnectResponse(event=ev)

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        proc = self.registry.select(request.process)
        if request.pty is not None and request.pty.size is not None:
            if proc.pty_fd is None:
                raise ConnectError(Code.FAILED_PRECONDITION,
                                   f"process {proc.pid} was not started with a PTY")
            set_winsize(proc.pty_fd, request.pty.size.rows, request.pty.size.cols)
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
