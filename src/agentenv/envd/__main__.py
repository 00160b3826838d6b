"""``python -m agentenv.envd --port 49983``: run envd (normally as the sandbox's pid 1)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from . import DEFAULT_PORT

TOKEN_ENV = "AENV_ENVD_ACCESS_TOKEN"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="envd")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--log-level", default=os.environ.get("AENV_ENVD_LOG_LEVEL", "warning"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="envd %(levelname)s %(message)s")

    import faulthandler

    # `kill -USR1 1` inside a sandbox writes envd's Python stacks to its console log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A write past RLIMIT_FSIZE (the disk quota) must fail with EFBIG, not end envd;
    # its commands get the default action back (Popen restores SIGXFSZ).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    marks = [("interpreter", _since_process_start())]
    # Listen before the heavy imports: the node's health probe connects at once
    # and is answered the moment the app is up, instead of polling a closed port.
    listener = _listen(args.host, args.port)
    if os.getpid() == 1:
        # Before anything is forked: it alone needs CAP_SYS_ADMIN, then drops it.
        from .bootid import prepare

        prepare()
    from .protos import ensure_importable

    ensure_importable()
    marks.append(("protos path", _since_process_start()))

    from .oom import guard_from_env
    from .server import build_app
    from .state import State

    marks.append(("server imports", _since_process_start()))
    state = State(access_token=os.environ.pop(TOKEN_ENV, None) or None)
    app = build_app(state)

    marks.append(("app", _since_process_start()))
    Config, Server = _uvicorn_core()
    config = Config(
        app, host=args.host, port=args.port, http="h11", loop="none", lifespan="off",
        ws="none", interface="asgi3", log_level=args.log_level.lower(), access_log=False,
        server_header=False, date_header=False, timeout_keep_alive=75,
    )
    server = Server(config)
    marks.append(("imports and app", _since_process_start()))

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        registry = app.registry
        # envd is init inside the sandbox: reap every child, route ours their status.
        loop.add_signal_handler(signal.SIGCHLD, registry.reap)
        registry.reap()
        if os.getpid() == 1 and os.geteuid() == 0:  # in a sandbox, never on a host
            from .sudo import start as start_sudo_broker

            start_sudo_broker(registry.children)
        print("envd start-up ms: " + ", ".join(f"{k} {v:.0f}" for k, v in marks),
              file=sys.stderr, flush=True)
        from .userfs_fork import prepare_forks

        loop.call_later(0.2, prepare_forks)  # after the node's first requests
        guard = guard_from_env()
        guard_task = asyncio.create_task(guard.run()) if guard else None
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
