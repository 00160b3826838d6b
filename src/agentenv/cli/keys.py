"""``aenv keys``: the node's API key on this machine (rotation)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

keys = typer.Typer(help="The node's API key (run on the node's machine).", no_args_is_help=True)


@keys.command("rotate")
def rotate(
    grace: Annotated[float, typer.Option(
        help="Seconds the old key keeps working (0: refused at once).", min=0)] = 0,
    home: Annotated[Path | None, typer.Option(help="State directory (AENV_HOME).")] = None,
    show: Annotated[bool, typer.Option("--show", help="Print the new key.")] = False,
) -> None:
    """Replace the node's API key; a running node uses the new one from its next request."""
    from ..config import ConfigError, load_config
    from ..web.keys import KEY_FILE, rotate_api_key

    try:
        config = load_config({"home": home})
    except ConfigError as exc:
        typer.echo(f"aenv: {exc}", err=True)
        raise typer.Exit(2) from exc
    key = rotate_api_key(config.secrets_dir, grace)
    where = config.secrets_dir / KEY_FILE
    note = f"; the old key works for {grace:g} more seconds" if grace else \
        "; the old key is refused from now on"
    typer.echo(f"new API key written to {where} (mode 0600){note}", err=True)
    if show:
        typer.echo(key)


@keys.command("id")
def key_id_cmd(
    key: Annotated[str | None, typer.Argument(
        help="The API key (default: the one in AENV_API_KEY, else the node's file).")] = None,
    home: Annotated[Path | None, typer.Option(help="State directory (AENV_HOME).")] = None,
) -> None:
    """Print an API key's ID: what per-key quotas are configured by (key_quotas)."""
    import os

    from ..config import ConfigError, load_config
    from ..web.keys import KEY_FILE
    from ..web.keys import key_id as id_of

    if not key:
        key = os.environ.get("AENV_API_KEY", "")
    if not key:
        try:
            config = load_config({"home": home})
        except ConfigError as exc:
            typer.echo(f"aenv: {exc}", err=True)
            raise typer.Exit(2) from exc
        try:
            key = (config.secrets_dir / KEY_FILE).read_text()
        except OSError as exc:
            typer.echo(f"aenv: no API key given and none readable here: {exc}", err=True)
            raise typer.Exit(2) from exc
    typer.echo(id_of(key.strip()))
