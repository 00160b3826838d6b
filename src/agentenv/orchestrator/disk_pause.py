"""Filesystem-only pauses (E2B's ``memory: false``): a sandbox's files without its memory.

The capture asks envd for a listing of the sandbox's files, compares it with the
template's rootfs on this host (what the sandbox booted from), and has envd archive
only what differs. A capture directory holds:

    listing.jsonl   every path the sandbox had (a resume removes all others)
    files.tar       the entries that differ from the template's rootfs

A resume boots the template afresh, prunes it to the listing and extracts the tar
before anything else runs: the sandbox has rebooted with every file change kept.
The listing comes from inside the sandbox and is hostile: bounded in size and count,
parsed in a worker thread, and never used to build a path on this host.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from ..envd.fs_walk import NOT_THE_SANDBOXS, Entry, walk
from .envd_client import EnvdClient, EnvdUnavailable
from .models import OrchestratorError

LISTING = "listing.jsonl"
FILES = "files.tar"
MAX_LISTING_BYTES = 512 << 20
MAX_ENTRIES = 2_000_000
MAX_LINE = 64 << 10
# The archive can be as large as the sandbox's disk may hold, and some.
ARCHIVE_SLACK = 64 << 20
# The sandbox's /tmp is a filesystem of its own, not the template's: every entry of
# it counts as changed.
_NOT_LISTED = NOT_THE_SANDBOXS | {"/tmp"}


def is_disk_capture(directory: Path) -> bool:
    return (directory / LISTING).is_file()


class TemplateListings:
    """What each template's rootfs holds, walked once per rootfs (they are read-only)."""

    def __init__(self) -> None:
        self._cache: dict[Path, dict[str, Entry]] = {}
        self._lock = threading.Lock()

    def get(self, rootfs: Path) -> dict[str, Entry]:
        with self._lock:
            cached = self._cache.get(rootfs)
            if cached is None:
                cached = self._cache[rootfs] = dict(walk(str(rootfs), _NOT_LISTED))
            return cached


def changed_paths(listing: Path, lower: dict[str, Entry], keep_out: Path) -> list[str]:
    """The sandbox's entries that differ from its template's rootfs; writes every
    path it has to ``keep_out`` (one JSON string a line)."""
    changed: list[str] = []
    count = 0
    with open(listing, "rb") as f, open(keep_out, "w") as keep:
        for raw in f:
            count += 1
            if count > MAX_ENTRIES or len(raw) > MAX_LINE:
                raise OrchestratorError("the sandbox's file listing is too large")
            try:
                path, kind, mode, uid, gid, size, mtime_ns, target = json.loads(raw)
            except (ValueError, TypeError) as exc:
                raise OrchestratorError(f"envd's file listing is malformed: {exc}") from exc
            if not isinstance(path, str) or not path.startswith("/"):
                raise OrchestratorError("envd's file listing is malformed")
            keep.write(json.dumps(path) + "\n")
            old = lower.get(path)
            if kind == "d":
                differs = old is None or old[:4] != (kind, mode, uid, gid)
            else:
                differs = old != (kind, mode, uid, gid, size, mtime_ns, target)
            if differs:
                changed.append(path)
    return changed


async def capture(envd: EnvdClient, address: str, token: str, rootfs: Path,
                  listings: TemplateListings, staging: Path, disk_limit: int) -> int:
    """Write the sandbox's filesystem capture into ``staging``; return the files' bytes."""
    raw = staging / "listing.raw"
    try:
        await envd.disk_download(address, token, "list", raw, MAX_LISTING_BYTES)
        lower = await asyncio.to_thread(listings.get, rootfs)
        changed = await asyncio.to_thread(changed_paths, raw, lower, staging / LISTING)
    except EnvdUnavailable as exc:
        raise OrchestratorError(f"listing the sandbox's files failed: {exc}") from exc
    finally:
        raw.unlink(missing_ok=True)
    wanted = staging / "export.jsonl"
    await asyncio.to_thread(
        wanted.write_text, "".join(json.dumps(p) + "\n" for p in changed))
    try:
        return await envd.disk_download(address, token, "export", staging / FILES,
                                        disk_limit + ARCHIVE_SLACK, body=wanted)
    except EnvdUnavailable as exc:
        raise OrchestratorError(f"archiving the sandbox's files failed: {exc}") from exc
    finally:
        wanted.unlink(missing_ok=True)


async def restore(envd: EnvdClient, address: str, token: str, capture_dir: Path) -> None:
    """Bring a freshly booted sandbox's files to the capture's."""
    try:
        await envd.disk_upload(address, token, "prune", capture_dir / LISTING)
        await envd.disk_upload(address, token, "import", capture_dir / FILES)
    except EnvdUnavailable as exc:
        raise OrchestratorError(f"restoring the sandbox's files failed: {exc}") from exc
