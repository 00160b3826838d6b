"""``aenv``: the agentenv command line."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from .config import CliError


class _App(typer.Typer):
    """Errors are one line on stderr and exit 1; a traceback only with ``--debug``."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except KeyboardInterrupt:
            sys.stderr.write("aenv: interrupted\n")
            sys.exit(130)
        except Exception as exc:
            if _state["debug"]:
                raise
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if not isinstance(exc, CliError):
                message = f"{message} ({type(exc).__name__}; --debug shows the traceback)"
            sys.stderr.write(f"aenv: {message}\n")
            sys.exit(getattr(exc, "exit_code", 1))


_state = {"debug": bool(os.environ.get("AENV_DEBUG"))}

app = _App(
    name="aenv", help="agentenv: isolated, snapshot-able sandboxes for agents.",
    no_args_is_help=True, pretty_exceptions_enable=False,
)

from .keys import keys as _keys  # noqa: E402  (after the app it joins)

app.add_typer(_keys, name="keys")


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
) -> None:
    """agentenv: isolated, snapshot-able sandboxes for agents."""
    _state["debug"] = _state["debug"] or debug


FD_HELP = ("Serve on this inherited listening socket (socket activation) instead of "
           "binding one; --host and --port then say what it is bound to.")


@app.command()
def server(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    home: Annotated[Path | None, typer.Option(help="State directory (AENV_HOME).")] = None,
    fd: Annotated[int | None, typer.Option(help=FD_HELP)] = None,
) -> None:
    """Run a node server in the foreground."""
    from ..config import ConfigError, load_config
    from ..node.app import create_app
    from ..web.serving import server_options

    try:
        config = load_config({"host": host, "port": port, "home": home})
    except ConfigError as exc:
        typer.echo(f"aenv: {exc}", err=True)
        raise typer.Exit(2) from exc
    _configure_logging(config.log_level)
    import faulthandler
    import signal

    # `kill -USR1 <pid>` writes every thread's stack to stderr: a hung node explains itself.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    asgi = create_app(config)
    typer.echo(f"agentenv node on http://{config.host}:{config.port}  "
               f"(API key in {config.secrets_dir / 'api-key'})", err=True)
    _serve(asgi, config.host, config.port, fd, timeout_graceful_shutdown=10,
           **server_options(config.http_head_timeout))


def _serve(asgi, host: str, port: int, fd: int | None, **options) -> None:
    """uvicorn on host:port, or on the listening socket ``fd`` when given."""
    import uvicorn

    from ..web.parent_watch import watch_parent_from_env

    options = {"log_level": "warning", "lifespan": "on", **options}
    watch_parent_from_env()
    if fd is None:
        uvicorn.run(asgi, host=host, port=port, **options)
        return
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only then.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=fd)
    sock.set_inheritable(False)  # not into the node's sandboxes and helpers
    server = uvicorn.Server(uvicorn.Config(asgi, host=host, port=port, **options))
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)  # uvicorn's own exit status for a failed start-up



def _cluster_config(home: Path | None, redis_url: str | None):
    from ..config import ConfigError, load_config

    try:
        config = load_config({"home": home, "redis_url": redis_url})
    except ConfigError as exc:
        typer.echo(f"aenv: {exc}", err=True)
        raise typer.Exit(2) from exc
    _configure_logging(config.log_level)
    return config


# Libraries whose own debug lines would drown the servers' (and slow them down): the
# level set in the config is agentenv's; these stay at warnings.
_QUIET_LIBRARIES = ("httpx", "httpcore", "pyroute2", "asyncio", "botocore", "boto3",
                    "urllib3", "redis", "multipart")


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in _QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)


@app.command()
def scheduler(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 9090,
    redis_url: Annotated[str | None, typer.Option(help="Cluster state (AENV_REDIS_URL).")] = None,
    home: Annotated[Path | None, typer.Option(help="Holds secrets/api-key, the cluster's key.")
                    ] = None,
    fd: Annotated[int | None, typer.Option(help=FD_HELP)] = None,
) -> None:
    """Run the cluster scheduler: node registry and placement."""
    from ..cluster.scheduler import create_scheduler_app
    from ..web.keys import load_or_create_api_key
    from ..web.serving import server_options

    config = _cluster_config(home, redis_url)
    asgi = create_scheduler_app(config.redis_url, load_or_create_api_key(config.secrets_dir),
                                config.node_ttl_ms)
    typer.echo(f"agentenv scheduler on http://{host}:{port}", err=True)
    _serve(asgi, host, port, fd, **server_options(config.http_head_timeout))


@app.command()
def gateway(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    redis_url: Annotated[str | None, typer.Option(help="Cluster state (AENV_REDIS_URL).")] = None,
    scheduler_url: Annotated[str | None, typer.Option(help="AENV_SCHEDULER_URL.")] = None,
    home: Annotated[Path | None, typer.Option(help="Holds secrets/api-key, the cluster's key.")
                    ] = None,
    fd: Annotated[int | None, typer.Option(help=FD_HELP)] = None,
) -> None:
    """Run the cluster gateway: the node API in front of every node."""
    from ..cluster.gateway import create_gateway_app
    from ..web.keys import load_or_create_api_key
    from ..web.serving import server_options

    config = _cluster_config(home, redis_url)
    asgi = create_gateway_app(config.redis_url,
                              scheduler_url or config.scheduler_url or "http://127.0.0.1:9090",
                              load_or_create_api_key(config.secrets_dir), config.domain,
                              config.admission_queue_timeout_s, config.node_ttl_ms,
                              config.key_max_sandboxes, config.key_quotas)
    typer.echo(f"agentenv gateway on http://{host}:{port}", err=True)
    _serve(asgi, host, port, fd, timeout_graceful_shutdown=5,
           **server_options(config.http_head_timeout))


from . import commands  # noqa: E402  (the client commands, talking HTTP to a node)

app.registered_commands += commands.cli.registered_commands
app.registered_groups += commands.cli.registered_groups

from .templates import template_app  # noqa: E402

app.add_typer(template_app, name="template")

from .runs import run_app  # noqa: E402

app.add_typer(run_app, name="run")

from .pull import pull as _pull  # noqa: E402

app.command("pull")(_pull)

from .image import image_app  # noqa: E402

app.add_typer(image_app, name="image")

if __name__ == "__main__":
    app(prog_name="aenv")
