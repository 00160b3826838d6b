"""``aenv image convert --estargz SRC DST``: rewrite an image's layers as eStargz and
push it, so that lazily loading nodes start it from the registry without converting
it (``docs/lazy-images.md``). It runs here, not on a node: SRC is read and DST written
from this machine."""

from __future__ import annotations

from typing import Annotated

import typer

from .config import CliError
from .pull import _credentials

image_app = typer.Typer(help="Images: convert for lazy loading.", no_args_is_help=True)


@image_app.command()
def convert(
    src: Annotated[str, typer.Argument(help="registry/repo:tag, oci-layout:DIR[:tag] or "
                                            "docker-archive:FILE.")],
    dst: Annotated[str, typer.Argument(help="registry/repo:tag to push to.")],
    estargz: Annotated[bool, typer.Option("--estargz", help="Write eStargz layers (the only "
                                                            "format so far).")] = False,
    chunk_mib: Annotated[int | None, typer.Option(
        help="Chunk size of large files, MiB (default: eStargz's own, 4).")] = None,
    level: Annotated[int, typer.Option(help="gzip level, 1-9.")] = 6,
    username: Annotated[str | None, typer.Option(help="Registry user name (both).")] = None,
    password_env: Annotated[str | None, typer.Option(
        "--password-env", help="Environment variable holding the registry password.")] = None,
) -> None:
    """Convert an image's layers to eStargz and push it to DST."""
    # Imported here: every `aenv` command (a gateway's too) would load the image code.
    from ..images.errors import ImageError
    from ..images.estargz_build import CHUNK_SIZE
    from ..images.estargz_convert import convert_image

    if chunk_mib is None:
        chunk_mib = CHUNK_SIZE >> 20
    if not estargz:
        raise CliError("say --estargz (the only target format)")
    if not 1 <= chunk_mib <= 64 or not 1 <= level <= 9:
        raise CliError("--chunk-mib must be 1-64 and --level 1-9")
    creds = _credentials(username, password_env) or {}
    try:
        digest = convert_image(src, dst, username=creds.get("username", ""),
                               password=creds.get("password", ""), chunk_size=chunk_mib << 20,
                               level=level, say=lambda line: typer.echo(line, err=True))
    except ImageError as exc:
        raise CliError(str(exc)) from exc
    typer.echo(f"{dst}@{digest}")
