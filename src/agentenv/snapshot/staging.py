"""The node's staging area: captures written by the runtime, waiting to be committed.

Layout (known to this module only):

    <staging>/<snapshot id>/             the capture's files, as the runtime wrote them
    <staging>/<snapshot id>.meta.json    a pause whose commit is pending: its metadata

A capture with its metadata file is a *pending pause*: the sandbox's only state until
its commit to the repository goes through (a restart commits it again, a resume may
restore from it directly). A capture without one is an interrupted snapshot or fork:
nothing needs it after a crash.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from .errors import SnapshotError, is_no_space, storage_full
from .manifest import check_name

_META = ".meta.json"
# Less free space than this (or 1 % of the disk) after a failed capture: the disk was full.
_FULL_MARGIN = 1 << 20


class Staging:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, snapshot_id: str) -> Path:
        return self.dir / check_name("snapshot id", snapshot_id)

    def _meta(self, snapshot_id: str) -> Path:
        return self.dir / (check_name("snapshot id", snapshot_id) + _META)

    def new(self, snapshot_id: str) -> Path:
        """An empty directory for the runtime to write a capture into."""
        path = self.path(snapshot_id)
        try:
            if path.exists():
                shutil.rmtree(path)
            path.mkdir(parents=True)
        except OSError as exc:
            if is_no_space(exc):
                raise storage_full(f"creating staging {path}", exc) from exc
            raise SnapshotError(f"cannot create staging {path}: {exc}") from exc
        return path

    def linked(self, snapshot_id: str) -> Path:
        """A copy of a staged capture made of hard links (no bytes copied), for a restore
        that does not wait for its commit: the commit renames the capture into the cache,
        the copy stays. The caller removes it (``shutil.rmtree``); a restart removes any
        left, as it is no pending pause. SnapshotError if the capture is gone."""
        source = self.path(snapshot_id)
        target = self.dir / f"{source.name}.restore-{uuid.uuid4().hex[:8]}"
        try:
            for rel, path, _size, _mode in self.files(source):
                (target / rel).parent.mkdir(parents=True, exist_ok=True)
                os.link(path, target / rel)
        except (OSError, SnapshotError) as exc:
            shutil.rmtree(target, ignore_errors=True)
            raise SnapshotError(f"capture {snapshot_id} is not staged: {exc}") from exc
        return target

    def free_bytes(self) -> int:
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def is_nearly_full(self) -> bool:
        """Whether the staging filesystem has (almost) no room left: runsc does not
        always say ENOSPC when a capture hits it (its state encoder may panic instead)."""
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return False
        free = st.f_bavail * st.f_frsize
        return free < max(_FULL_MARGIN, st.f_blocks * st.f_frsize // 100)

    def discard(self, snapshot_id: str) -> None:
        """Remove a capture and its pending metadata, if any."""
        shutil.rmtree(self.path(snapshot_id), ignore_errors=True)
        self._meta(snapshot_id).unlink(missing_ok=True)

    # -- pending pauses ---------------------------------------------------------------
    def hold_for_commit(self, snapshot_id: str, metadata: dict) -> None:
        """Mark a capture as a pending pause (atomically: a crash leaves it or not)."""
        meta = self._meta(snapshot_id)
        tmp = meta.with_name(meta.name + ".tmp")
        tmp.write_text(json.dumps(metadata))
        os.replace(tmp, meta)

    def committed(self, snapshot_id: str) -> None:
        """The pending pause reached the repository: it is pending no more."""
        self._meta(snapshot_id).unlink(missing_ok=True)

    def pending(self, snapshot_id: str) -> dict | None:
        """A pending pause's metadata, if its capture is still staged."""
        meta = self._meta(snapshot_id)
        if not (meta.is_file() and self.path(snapshot_id).is_dir()):
            return None
        try:
            return json.loads(meta.read_text())
        except (OSError, ValueError):
            return None

    def is_pending(self, snapshot_id: str) -> bool:
        return bool(snapshot_id) and self._meta(snapshot_id).is_file()

    def remove_leftovers(self, keep: Iterable[str]) -> list[str]:
        """After a crash: remove every capture (and stray metadata) that is not one of
        the pending pauses in ``keep``; return the names removed."""
        wanted = {sid for sid in keep if sid and self.pending(sid) is not None}
        removed = []
        for entry in self.dir.iterdir():
            # A metadata file a crash left half-written (.tmp) is never wanted.
            if entry.name.removesuffix(_META) in wanted:
                continue
            removed.append(entry.name)
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        return removed

    @staticmethod
    def files(staging: Path) -> list[tuple[str, Path, int, int]]:
        """A capture's regular files: (relative path, path, size, mode), sorted."""
        if not staging.is_dir():
            raise SnapshotError(f"staging {staging} is not a directory")
        out = []
        for dirpath, dirnames, filenames in os.walk(staging):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                st = path.lstat()
                if not os.path.isfile(path) or path.is_symlink():
                    raise SnapshotError(f"staging holds {path}, which is not a regular file")
                rel = path.relative_to(staging).as_posix()
                out.append((rel, path, st.st_size, st.st_mode & 0o7777))
        if not out:
            raise SnapshotError(f"staging {staging} is empty")
        return out
