"""``aenv upload`` / ``aenv download``: files and directories (recursively), with progress bars."""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from . import output
from .config import CliError

CHUNK = 1 << 20


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                    DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                    console=output.err)


def _remote_kind(sbx, path: str) -> str | None:
    from e2b import FileType, NotFoundException

    try:
        info = sbx.files.get_info(path)
    except NotFoundException:
        return None
    return "dir" if info.type == FileType.DIR else "file"


def upload(sbx, local: Path, remote: str) -> int:
    """Copy ``local`` into the sandbox at ``remote`` (into it, if it is a directory)."""
    if not local.exists():
        raise CliError(f"{local}: no such file or directory")
    kind = _remote_kind(sbx, remote)
    if kind == "dir" or remote.endswith("/"):
        remote = posixpath.join(remote, local.name)
    if local.is_dir():
        dirs, files = [remote], []
        for root, dnames, fnames in os.walk(local):
            rel = Path(root).relative_to(local)
            base = posixpath.join(remote, *rel.parts)
            dirs += [posixpath.join(base, d) for d in sorted(dnames)]
            files += [(Path(root) / f, posixpath.join(base, f)) for f in sorted(fnames)]
    else:
        dirs, files = [], [(local, remote)]
    for d in dirs:
        sbx.files.make_dir(d)
    total = sum(p.stat().st_size for p, _ in files)
    with _progress() as bar:
        overall = bar.add_task(f"{local} -> {remote}", total=total)
        for src, dst in files:
            sbx.files.write(dst, _chunks(src, bar, overall))
    return len(files)


def _chunks(path: Path, bar: Progress, task) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            bar.advance(task, len(chunk))
            yield chunk


def _walk_remote(sbx, remote: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Directories (relative) and files (relative, size) under the sandbox directory ``remote``."""
    from e2b import FileType

    dirs: list[str] = []
    files: list[tuple[str, int]] = []
    pending = [""]
    while pending:
        rel = pending.pop()
        for entry in sbx.files.list(posixpath.join(remote, rel) if rel else remote, depth=1):
            child = posixpath.join(rel, entry.name) if rel else entry.name
            if entry.type == FileType.DIR:
                dirs.append(child)
                pending.append(child)
            elif entry.type == FileType.FILE:
                files.append((child, entry.size))
    return sorted(dirs), sorted(files)


def download(sbx, remote: str, local: Path) -> int:
    """Copy ``remote`` out of the sandbox to ``local`` (into it, if it is a directory)."""
    kind = _remote_kind(sbx, remote)
    if kind is None:
        raise CliError(f"{remote}: no such file or directory in the sandbox")
    if local.is_dir():
        local = local / posixpath.basename(remote.rstrip("/"))
    if kind == "dir":
        dirs, files = _walk_remote(sbx, remote)
        local.mkdir(parents=True, exist_ok=True)
        for d in dirs:
            (local / d).mkdir(parents=True, exist_ok=True)
        pairs = [(posixpath.join(remote, rel), local / rel, size) for rel, size in files]
    else:
        local.parent.mkdir(parents=True, exist_ok=True)
        pairs = [(remote, local, sbx.files.get_info(remote).size)]
    with _progress() as bar:
        overall = bar.add_task(f"{remote} -> {local}", total=sum(s for _, _, s in pairs))
        for src, dst, _ in pairs:
            stream = sbx.files.read(src, format="stream")
            with contextlib.closing(stream), open(dst, "wb") as f:
                for chunk in stream:
                    f.write(chunk)
                    bar.advance(overall, len(chunk))
    return len(pairs)
