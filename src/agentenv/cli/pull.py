"""``aenv pull IMAGE --name NAME``: pull an OCI image into the node as a template,
with a progress bar per layer (the node streams NDJSON progress)."""

from __future__ import annotations

import json
import os
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)

from .client import ApiError, Client
from .config import CliError


def _credentials(username: str | None, password_env: str | None) -> dict | None:
    if not (username or password_env):
        return None
    password = os.environ.get(password_env or "", "")
    if password_env and not password:
        raise CliError(f"${password_env} is empty")
    return {"username": username or "", "password": password}


def image_body(template: str, image: str | None, setup: str | None, username: str | None,
               password_env: str | None) -> dict | None:
    """``aenv start --image``'s create body (None without --image)."""
    if image is None:
        if setup is not None or username or password_env:
            raise CliError("--setup, --username and --password-env go with --image")
        if not template:
            raise CliError("give a template (or --image)")
        return None
    if template:
        raise CliError("give a template or --image, not both")
    body: dict = {"image": image}
    if setup is not None:
        body["imageSetup"] = setup
    creds = _credentials(username, password_env)
    if creds:
        body["imageCredentials"] = creds
    return body


def pull(
    image: Annotated[str, typer.Argument(help="registry/repo:tag, oci-layout:DIR[:tag] or "
                                              "docker-archive:FILE (paths on the node).")],
    name: Annotated[str, typer.Option("--name", help="Template name for the image.")],
    username: Annotated[str | None, typer.Option(help="Registry user name.")] = None,
    password_env: Annotated[str | None, typer.Option(
        "--password-env", help="Environment variable holding the registry password.")] = None,
    loading: Annotated[str | None, typer.Option(
        "--loading", help="lazy, unpack or auto (lazy above the node's image_lazy_above_mb); "
                          "default: the node's image_loading.")] = None,
) -> None:
    """Pull an image as a template (layers cached on the node, fetched again when evicted)."""
    body: dict = {"image": image, "name": name}
    if loading is not None:
        body["loading"] = loading
    creds = _credentials(username, password_env)
    if creds:
        body["credentials"] = creds
    err = Console(stderr=True)
    with Client(timeout=600) as c, Progress(
        TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), console=err, transient=False,
    ) as bar:
        tasks: dict[str, TaskID] = {}
        record: dict | None = None

        def task(digest: str, size: int) -> TaskID:
            if digest not in tasks:
                tasks[digest] = bar.add_task(digest.split(":")[-1][:12], total=size or None)
            return tasks[digest]

        try:
            with c.http.stream("POST", "/images", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    try:
                        message = r.json().get("message") or r.text
                    except ValueError:
                        message = r.text
                    raise ApiError(r.status_code, message)
                for line in r.iter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    status = event.get("status")
                    if status == "error":
                        raise ApiError(int(event.get("code", 500)), event.get("message", ""))
                    if status == "resolved":
                        for layer in event.get("layers", []):
                            task(layer["digest"], layer["size"])
                    elif status == "downloading":
                        bar.update(task(event["digest"], event["size"]), completed=event["done"])
                    elif status in ("done-layer", "cached"):
                        t = task(event["digest"], event["size"])
                        bar.update(t, completed=event["size"],
                                   description=f"{event['digest'].split(':')[-1][:12]}"
                                               f"{' (cached)' if status == 'cached' else ''}")
                    elif status == "done":
                        record = event["template"]
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach {c.url}: {exc}") from exc
    if record is None:
        raise CliError("the node ended the pull without a result")
    digest = record["image"]["manifestDigest"]
    typer.echo(f"{record['templateID']}  {digest}")
