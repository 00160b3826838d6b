"""``aenv run ls | rm``: runs (a trainer's lease on the sandboxes it creates)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

import typer

from . import output
from .client import Client

run_app = typer.Typer(help="Runs: leases that own sandboxes (RL trainers).",
                      no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


@run_app.command("ls")
def run_ls(as_json: JsonOpt = False) -> None:
    """List the node's runs."""
    with Client() as c:
        items = c.json("GET", "/runs")
    if as_json:
        output.print_json(items)
        return
    output.table(
        ["RUN ID", "NAME", "SANDBOXES", "LEASE", "ON EXPIRY", "EXPIRES"],
        [[r["runID"], r["name"], str(r["sandboxes"]), f"{r['leaseSeconds']}s",
          r["onExpiry"], output.until(r["expiresAt"])] for r in items],
    )


@run_app.command("rm")
def run_rm(
    runs: Annotated[list[str], typer.Argument(help="Run IDs.")],
) -> None:
    """End runs: their sandboxes are killed (or paused, as each run asked)."""
    with Client() as c:
        for run_id in runs:
            c.request("DELETE", f"/runs/{quote(run_id, safe='')}")
            typer.echo(run_id)
