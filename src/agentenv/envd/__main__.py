"""``python -m agentenv.envd --port 49983``: run envd (normally as the sandbox's pid 1)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from . import DEFAULT_PORT

TOKEN_ENV = "AENV_ENVD_ACCESS_TOKEN"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="envd")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--log-level", default=os.environ.get("AENV_ENVD_LOG_LEVEL", "warning"))
    # Set by envd-stub when it wakes envd from dormancy (dormancy.py): the listening
    # socket it kept, and that the state saved before is to be loaded.
    ap.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--woken", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="envd %(levelname)s %(message)s")

    if args.woken:
        _restore_signals()
    import faulthandler

    # `kill -USR1 1` inside a sandbox writes envd's Python stacks to its console log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A write past RLIMIT_FSIZE (the disk quota) must fail with EFBIG, not end envd;
    # its commands get the default action back (Popen restores SIGXFSZ).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # Woken from dormancy, the process started long ago: count from here instead.
    t0 = time.monotonic()
    since = (lambda: (time.monotonic() - t0) * 1000) if args.woken else _since_process_start
    marks = [("interpreter", since())]
    # Listen before the heavy imports: the node's health probe connects at once
    # and is answered the moment the app is up, instead of polling a closed port.
    listener = _listen(args.host, args.port) if args.listen_fd is None \
        else _inherited(args.host, args.listen_fd)
    if os.getpid() == 1:
        # Before anything is forked: it alone needs CAP_SYS_ADMIN, then drops it.
        from .bootid import prepare

        prepare()
    from .protos import ensure_importable

    ensure_importable()
    marks.append(("protos path", since()))

    from . import dormancy
    from .oom import guard_from_env
    from .server import build_app
    from .state import State

    marks.append(("server imports", since()))
    saved = dormancy.load() if args.woken else {}
    if not args.woken and os.getpid() == 1:
        dormancy.discard()
    state = State(access_token=os.environ.pop(TOKEN_ENV, None) or None)
    state.restore(saved)
    app = build_app(state)
    app.registry.durable.restore(saved.get("durable"))
    from .layers import LAYERS

    LAYERS.restore(saved.get("layers"))
    app.wakes = int(saved.get("wakes") or 0) + (1 if args.woken else 0)
    app.dormant_s = float(saved.get("dormant_s") or 0.0)
    if args.woken and isinstance(saved.get("dormant_at"), (int, float)):
        app.dormant_s += max(0.0, time.time() - saved["dormant_at"])
    counted: list = [app]  # the dormancy watch wraps the app once the loop runs

    async def entry(scope, receive, send):
        await counted[0](scope, receive, send)

    marks.append(("app", since()))
    Config, Server = _uvicorn_core()
    config = Config(
        entry, host=args.host, port=args.port, http="h11", loop="none", lifespan="off",
        ws="none", interface="asgi3", log_level=args.log_level.lower(), access_log=False,
        server_header=False, date_header=False, timeout_keep_alive=75,
    )
    server = Server(config)
    marks.append(("imports and app", since()))

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        registry = app.registry
        # envd is init inside the sandbox: reap every child, route ours their status.
        loop.add_signal_handler(signal.SIGCHLD, registry.reap)
        registry.reap()
        if os.getpid() == 1 and os.geteuid() == 0:  # in a sandbox, never on a host
            from .sudo import start as start_sudo_broker

            start_sudo_broker(registry.children)
        print((f"{dormancy.WOKEN_LINE}, ms: " if args.woken else f"{dormancy.START_LINE} ms: ")
              + ", ".join(f"{k} {v:.0f}" for k, v in marks), file=sys.stderr, flush=True)
        from .userfs_fork import prepare_forks

        loop.call_later(0.2, prepare_forks)  # after the node's first requests
        guard = guard_from_env()
        guard_task = asyncio.create_task(guard.run()) if guard else None
        if guard is None and args.woken:  # (the guard's handler replaced envd-stub's SIG_IGN)
            signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        counted[0] = _dormancy(dormancy, app, server, listener, args) or app
        try:
            await server.serve(sockets=[listener])
        finally:
            if guard_task:
                guard_task.cancel()

    import selectors

    # poll(2), not epoll: an epoll set restored from a gVisor checkpoint can spin
    # without delivering events, leaving a restored envd deaf; poll has no kernel
    # state to restore.
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(
            selectors.PollSelector())) as runner:
        runner.run(serve())


def _dormancy(dormancy, app, server, listener, args):
    """The watch that makes envd dormant when idle (after its own delay, if any) or
    when the node asks; None when it never can be (not the sandbox's init, or no
    stub in the bundle)."""
    after = dormancy.after_from_env()
    app.dormant_after_s = after
    stub = dormancy.stub_path()
    argv = dormancy.relaunch_argv(args.host, args.port, args.log_level, listener.fileno())
    if os.getpid() != 1 or os.geteuid() != 0 or stub is None or argv is None:
        app.dormant_after_s = 0.0
        return None
    from .layers import LAYERS

    registry, files, userfs = app.registry, app.filesystem_service, app.userfs
    state = server.server_state

    def busy(serving: int = 0) -> str | None:
        """Why envd must stay awake; ``serving``: requests of envd's own that do not count
        (the node's ask to sleep, answered before the sleep)."""
        if registry.by_pid or registry.children.waiting:
            return "processes started by envd"
        if registry.durable.saved() is None:
            return "durable commands running, or too much of their output kept"
        if files.watchers or files.streams:
            return "watchers"
        if userfs.total > sum(len(ws) for ws in userfs.idle.values()):
            return "file operations"
        if len(state.tasks) > serving:
            return "requests"
        return None

    def connections() -> list[tuple[int, tuple]]:
        found = []
        for conn in list(state.connections):
            transport = conn.transport
            sock = transport.get_extra_info("socket") if transport else None
            if sock is not None and sock.fileno() >= 0:
                peer = transport.get_extra_info("peername")
                found.append((sock.fileno(), tuple(peer) if peer else ("fd", sock.fileno())))
        return found

    def saved() -> dict:
        return {**app.state.saved(), "durable": registry.durable.saved(), "wakes": app.wakes,
                "dormant_s": app.dormant_s, "layers": LAYERS.saved()}

    watch = dormancy.Dormancy(
        after, app, busy, lambda: [*(w.pid for ws in userfs.idle.values() for w in ws),
                                   *([LAYERS.keeper_pid] if LAYERS.keeper_pid else [])],
        saved, connections, listener.fileno(), argv, stub, before_exec=userfs.close)
    app.dormancy = watch  # POST /aenv/dormancy: the node asks it to sleep
    return watch


def _restore_signals() -> None:
    """envd-stub ignored every signal (dormancy.py); envd's commands inherit what is
    ignored, so back to what envd had at boot. SIGUSR1 and SIGUSR2 stay ignored until
    their handlers are in (the node may signal a dormant sandbox's init any time)."""
    keep = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGPIPE, signal.SIGXFSZ}  # (CPython ignores SIGPIPE and SIGXFSZ)
    for sig in signal.Signals:
        if sig not in keep and signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _inherited(host: str, fd: int):
    """The listening socket envd-stub kept open while envd was dormant."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly, as _listen: asyncio then sets TCP_NODELAY on accepted ones.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=fd)
    sock.set_inheritable(False)
    return sock


def _uvicorn_core():
    """uvicorn's ``Config`` and ``Server`` without running its package ``__init__``,
    which imports its command line (click, the multiprocessing supervisors): ~2.5 MB
    of every idle envd's memory for code envd never runs."""
    import importlib.util

    if "uvicorn" not in sys.modules:
        spec = importlib.util.find_spec("uvicorn")
        if spec is None:
            raise ImportError("uvicorn is not installed")
        sys.modules["uvicorn"] = importlib.util.module_from_spec(spec)  # not executed
    from uvicorn.config import Config
    from uvicorn.server import Server

    # `from uvicorn import Config` (uvicorn.lifespan) reads the package's attribute.
    package = sys.modules["uvicorn"]
    package.Config, package.Server = Config, Server
    return Config, Server


def _listen(host: str, port: int):
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say
    # so, and without it every response waits on Nagle and delayed ACKs (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _since_process_start() -> float:
    """Milliseconds since this process started (from /proc, so the interpreter counts)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return (uptime - start_ticks / os.sysconf("SC_CLK_TCK")) * 1000
    except (OSError, ValueError, IndexError):
        return 0.0


if __name__ == "__main__":
    main()
