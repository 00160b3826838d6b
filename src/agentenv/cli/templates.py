"""``aenv template ls | rm | build``: templates over the node's HTTP API.

Builds read a Dockerfile with the e2b SDK's own parser and go through the same
template routes the SDK's ``Template.build`` uses; the build's log streams here.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import typer

from . import output
from .client import Client
from .config import CliError

template_app = typer.Typer(help="Templates: build from a Dockerfile, list, remove.",
                           no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
POLL_S = 0.2


@template_app.command("ls")
def template_ls(as_json: JsonOpt = False) -> None:
    """List the node's templates (built-in and built)."""
    with Client() as c:
        items = c.json("GET", "/templates")
    if as_json:
        output.print_json(items)
        return
    output.table(
        ["TEMPLATE ID", "ALIASES", "CPU", "MEMORY", "BUILD ID", "CREATED"],
        [[t["templateID"], ", ".join(t.get("aliases") or []) or "-",
          str(t.get("cpuCount", "-")), f"{t.get('memoryMB', '-')} MiB",
          t.get("buildID", "-")[:8], output.ago(t.get("createdAt"))]
         for t in sorted(items, key=lambda t: t["templateID"])],
    )


@template_app.command("rm")
def template_rm(
    templates: Annotated[list[str], typer.Argument(help="Template IDs or aliases.")],
) -> None:
    """Remove templates: built ones with their snapshots, pulled images with their
    layers no other template uses (not while sandboxes use them)."""
    with Client() as c:
        images = c.json("GET", "/images")["images"]
        pulled = {i["name"] for i in images} | {i["templateID"] for i in images}
        for name in templates:
            kind = "images" if name in pulled else "templates"
            c.request("DELETE", "/" + kind + "/" + quote(name, safe=""))
            typer.echo(name)


def _default_name(context: Path) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", context.resolve().name.lower()).strip("-._")
    return name or "template"


@template_app.command("build")
def template_build(
    file: Annotated[Path, typer.Option("-f", "--file", help="The Dockerfile.", exists=True,
                                       dir_okay=False, readable=True)],
    context: Annotated[Path | None, typer.Option(
        "--context", help="Build context for COPY (default: the Dockerfile's directory).",
        exists=True, file_okay=False)] = None,
    name: Annotated[str | None, typer.Option(
        "-n", "--name", help="Template name (alias); default: the context directory's name.")
    ] = None,
    cpu: Annotated[int | None, typer.Option("--cpu", help="CPU cores of its sandboxes.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", help="Memory (MiB).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Build a template from a Dockerfile (RUN, COPY, ENV, WORKDIR, USER, CMD/ENTRYPOINT
    as the start command); its log streams to stderr, its ID goes to stdout."""
    from e2b import Template
    from e2b.exceptions import BuildException, TemplateException

    context = context or file.parent
    name = name or _default_name(context)
    with Client() as c:
        api: dict[str, Any] = {"api_key": c.creds.key, "api_url": c.url}
        try:
            template = Template(file_context_path=str(context)).from_dockerfile(str(file))
        except (TemplateException, ValueError, OSError) as exc:
            raise CliError(f"{file}: {exc}") from exc

        def show(entry) -> None:
            if not as_json:
                output.err.print(f"{_clock(entry.timestamp)} {entry.message}", markup=False)

        info = None
        try:
            info = Template.build_in_background(template, name, cpu_count=cpu, memory_mb=memory,
                                                on_build_logs=show, **api)
            status = _follow(Template, info, show, api)
        except KeyboardInterrupt:
            if info is not None:  # the build stops with us
                _cancel(c, info)
            raise
        except (BuildException, TemplateException) as exc:
            raise CliError(f"build failed: {exc}") from exc
    if status.status.value != "ready":
        reason = status.reason.message if status.reason else "unknown error"
        raise CliError(f"build failed: {reason}")
    if as_json:
        output.print_json({"templateID": info.template_id, "buildID": info.build_id,
                           "name": name, "status": "ready"})
    else:
        typer.echo(info.template_id)


def _cancel(c: Client, info) -> None:
    """Cancel the build on Ctrl-C; a failure to is said, and the interrupt goes on."""
    output.err.print("cancelling the build...", markup=False)
    try:
        c.request("DELETE", f"/templates/{quote(info.template_id, safe='')}/builds/"
                            f"{quote(info.build_id, safe='')}", timeout=30)
    except CliError as exc:
        output.err.print(f"the build was not cancelled: {exc}", markup=False)


def _follow(template_cls, info, show, api: dict):
    """Poll the build's status, showing each new log entry, until it ends."""
    offset = 0
    while True:
        status = template_cls.get_build_status(info, logs_offset=offset, **api)
        for entry in status.log_entries:
            show(entry)
        offset += len(status.log_entries)
        if status.status.value in ("ready", "error") and not status.log_entries:
            return status
        if not status.log_entries:
            time.sleep(POLL_S)


def _clock(ts) -> str:
    try:
        return ts.strftime("%H:%M:%S")
    except AttributeError:
        return str(ts)[:19]
