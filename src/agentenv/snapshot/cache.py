"""The node-local cache's layout: materialized snapshots and copies of manifests.

Layout (known to this module only):

    <cache>/<snapshot id>/              a snapshot's files, as restores read them
    <cache>/.complete/<id>.json         its manifest: the entry is complete (written last)
    <cache>/.tmp/                       entries being built or thrown away
    <cache>/.manifests/<id>.json        committed manifests read before (immutable)

An entry counts only once its marker exists, so a crash mid-build leaves
nothing a restore would use. Callers serialize work on one snapshot ID.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from agentenv.snapshot.errors import CorruptSnapshot
from agentenv.snapshot.manifest import Manifest, valid_name

log = logging.getLogger("agentenv.snapshot")


class NodeCache:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self._sizes: dict[str, int] = {}  # entries' bytes (manifests' total), read once
        for d in (self.dir, self._meta_dir, self._tmp_dir, self._manifest_dir):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def _meta_dir(self) -> Path:
        return self.dir / ".complete"

    @property
    def _tmp_dir(self) -> Path:
        return self.dir / ".tmp"

    @property
    def _manifest_dir(self) -> Path:
        return self.dir / ".manifests"

    def path(self, snapshot_id: str) -> Path:
        return self.dir / snapshot_id

    def _marker(self, snapshot_id: str) -> Path:
        return self._meta_dir / f"{snapshot_id}.json"

    # -- materialized snapshots ----------------------------------------------------
    def is_cached(self, snapshot_id: str) -> bool:
        return valid_name(snapshot_id) and self._marker(snapshot_id).exists() \
            and self.path(snapshot_id).is_dir()

    def touch(self, snapshot_id: str) -> None:
        """Mark the entry used now (its marker's mtime: the cache's LRU order)."""
        with contextlib.suppress(OSError):
            os.utime(self._marker(snapshot_id))

    def used_at(self, snapshot_id: str) -> float | None:
        try:
            return self._marker(snapshot_id).stat().st_mtime
        except OSError:
            return None

    def entries(self) -> dict[str, tuple[float, int]]:
        """Complete entries: snapshot ID -> (last use, bytes)."""
        out: dict[str, tuple[float, int]] = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._meta_dir):
                sid = entry.name.removesuffix(".json")
                if not entry.name.endswith(".json") or not valid_name(sid):
                    continue
                try:
                    used = entry.stat().st_mtime
                    size = self._sizes.get(sid)
                    if size is None:
                        size = self._sizes[sid] = self.complete_manifest(sid).total_bytes
                except (OSError, CorruptSnapshot):
                    continue
                out[sid] = (used, size)
        return out

    def complete_manifest(self, snapshot_id: str) -> Manifest:
        """The manifest of a complete entry (raises OSError or CorruptSnapshot)."""
        return Manifest.from_json(self._marker(snapshot_id).read_bytes())

    def of_template(self, template_id: str, scan: int = 16, most: int = 4) -> list[str]:
        """Complete entries of snapshots of one template (a sandbox of it shares most
        of its memory with them: the template's boot image, other sandboxes' pauses),
        newest first; among the ``scan`` newest entries, at most ``most``."""
        try:
            markers = sorted(self._meta_dir.glob("*.json"), key=_mtime, reverse=True)[:scan]
        except OSError:
            return []
        out = []
        for marker in markers:
            sid = marker.name.removesuffix(".json")
            try:
                meta = self.complete_manifest(sid).metadata
            except (OSError, CorruptSnapshot):
                continue
            if meta.get("template_id") == template_id and self.is_cached(sid):
                out.append(sid)
                if len(out) >= most:
                    break
        return out

    def new_tmp(self, snapshot_id: str) -> Path:
        """A fresh path (not created) to build an entry in before install()."""
        return self._tmp_dir / f"{snapshot_id}.{uuid.uuid4().hex[:8]}"

    def install(self, manifest: Manifest, built: Path) -> Path:
        """Make a fully written (and synced) directory the snapshot's entry."""
        sid = manifest.snapshot_id
        target = self.path(sid)
        if target.exists():  # an incomplete entry from an interrupted run
            self.evict(sid)
        os.rename(built, target)
        _atomic_write(self._marker(sid), manifest.to_json())
        return target

    def adopt(self, manifest: Manifest, staging: Path) -> None:
        """Turn the staged files into the cache entry of the committed snapshot."""
        sid = manifest.snapshot_id
        target = self.path(sid)
        try:
            if self._marker(sid).exists() or target.exists():
                shutil.rmtree(staging, ignore_errors=True)
                return
            for rel in manifest.files:
                _fsync_file(staging / rel)
            os.rename(staging, target)
            _atomic_write(self._marker(sid), manifest.to_json())
        except OSError as exc:
            # The snapshot is committed; only the local shortcut is lost.
            log.warning("snapshot %s committed, but its staging was not kept as cache: %s",
                        sid, exc)
            if exc.errno == errno.EXDEV:
                shutil.rmtree(staging, ignore_errors=True)

    def evict(self, snapshot_id: str) -> None:
        """Drop the entry: its marker first, then its files."""
        self._marker(snapshot_id).unlink(missing_ok=True)
        self._sizes.pop(snapshot_id, None)
        path = self.path(snapshot_id)
        if path.exists():
            trash = self._tmp_dir / f"evict-{snapshot_id}.{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):
                os.rename(path, trash)
                path = trash
            shutil.rmtree(path, ignore_errors=True)

    # -- copies of committed manifests --------------------------------------------------
    def remember(self, manifest: Manifest, data: bytes | None = None) -> None:
        with contextlib.suppress(OSError):
            path = self._manifest_dir / f"{manifest.snapshot_id}.json"
            if not path.exists():
                _atomic_write(path, data or manifest.to_json(), sync=False)

    def manifest(self, snapshot_id: str) -> Manifest | None:
        try:
            return Manifest.from_json((self._manifest_dir / f"{snapshot_id}.json").read_bytes())
        except (OSError, CorruptSnapshot):
            return None

    def forget(self, snapshot_id: str) -> None:
        with contextlib.suppress(OSError):
            (self._manifest_dir / f"{snapshot_id}.json").unlink(missing_ok=True)

    def prune_manifests(self, live: set[str]) -> None:
        """Drop the copies of manifests not in ``live``."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._manifest_dir):
                sid = entry.name.removesuffix(".json")
                if entry.name.endswith(".json") and sid not in live:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, *, sync: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
