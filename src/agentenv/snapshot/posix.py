"""posix_fs: a repository in a directory, possibly a shared-filesystem mount.

Several nodes may write at once, so every object is written to a private temp
file in ``tmp/`` (same filesystem), fsynced, then renamed into place (or
hard-linked, when the write must not replace an existing object): a reader sees
the old object, the new one or none, never a partial one.

Layout: ``chunks/<d[:2]>/<digest>``, ``manifests/``, ``aliases/``, ``leases/``,
``locks/``, ``tmp/``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentenv.snapshot.errors import (
    ObjectMissing,
    RepositoryUnavailable,
    SnapshotError,
    SnapshotExists,
    is_no_space,
    storage_full,
)
from agentenv.snapshot.manifest import valid_digest

_KEY_DIRS = ("manifests", "aliases", "leases", "locks", "templates", "template-aliases",
             "image-layers", "image-prefetch", "image-used")


class PosixRepository:
    def __init__(self, root: Path | str, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.description = f"posix_fs:{self.root}"
        self._tag = f"{socket.gethostname()}.{os.getpid()}"
        self._made: set[Path] = set()
        self._lock = threading.Lock()
        try:
            for sub in ("chunks", "tmp", *_KEY_DIRS):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if is_no_space(exc):
                raise storage_full(f"creating repository {self.root}", exc) from exc
            raise RepositoryUnavailable(f"cannot use repository directory {self.root}: {exc}") \
                from exc

    # -- helpers ----------------------------------------------------------------
    def _chunk_path(self, digest: str) -> Path:
        if not valid_digest(digest):
            raise SnapshotError(f"invalid chunk digest {digest!r}")
        return self.root / "chunks" / digest[:2] / digest

    def _key_path(self, key: str) -> Path:
        top, _, name = key.partition("/")
        if top not in _KEY_DIRS or not name or "/" in name or name.startswith("."):
            raise SnapshotError(f"invalid repository key {key!r}")
        return self.root / top / name

    def _mkdir(self, d: Path) -> None:
        if d in self._made:
            return
        d.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._made.add(d)

    def _sync_dir(self, d: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write(self, final: Path, data: bytes, *, exclusive: bool, what: str) -> None:
        tmp = self.root / "tmp" / f"{final.name}.{self._tag}.{uuid.uuid4().hex[:12]}"
        try:
            self._mkdir(final.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise SnapshotExists(f"{what} already exists") from None
            else:
                os.replace(tmp, final)
        except OSError as exc:
            if is_no_space(exc):
                raise storage_full(f"writing {what} to {self.description}", exc) from exc
            raise RepositoryUnavailable(f"cannot write {what} to {self.description}: {exc}") \
                from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    # -- chunks -----------------------------------------------------------------
    def has_chunk(self, digest: str) -> bool:
        return self._chunk_path(digest).exists()

    def put_chunk(self, digest: str, blob: bytes) -> None:
        # Directory entries are made durable by sync_chunks() before a manifest.
        self._write(self._chunk_path(digest), blob, exclusive=False, what=f"chunk {digest}")

    def sync_chunks(self, digests: Iterable[str], threads: int = 8) -> None:
        """Make the directory entries of just-written chunks durable (one fsync per dir).

        A commit's chunks land in ~100 of the 256 directories: one after the other,
        their fsyncs were most of a small snapshot's commit (50-300 ms here); side by
        side the disk takes them together."""
        dirs = [self.root / "chunks" / d for d in sorted({digest[:2] for digest in digests})]
        if len(dirs) <= 1 or threads <= 1 or not self.fsync:
            for d in dirs:
                self._sync_dir(d)
            return
        with ThreadPoolExecutor(min(threads, len(dirs)), thread_name_prefix="snap-sync") as pool:
            list(pool.map(self._sync_dir, dirs))

    def link_chunk(self, digest: str, source: PosixRepository) -> bool:
        """Take ``source``'s chunk as a hard link, without copying it (chunks are named by
        their content and never change). False where a link cannot be made (another
        filesystem); raises ObjectMissing when ``source`` lacks it."""
        final = self._chunk_path(digest)
        try:
            self._mkdir(final.parent)
            os.link(source._chunk_path(digest), final)
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise ObjectMissing(f"chunk {digest} is not in {source.description}") from None
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                return False
            raise RepositoryUnavailable(f"cannot link chunk {digest}: {exc}") from exc
        return True

    def get_chunk(self, digest: str) -> bytes:
        try:
            return self._chunk_path(digest).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"chunk {digest} is not in {self.description}") from None
        except OSError as exc:
            raise RepositoryUnavailable(f"cannot read chunk {digest}: {exc}") from exc

    def list_chunks(self) -> Iterator[tuple[str, int]]:
        base = self.root / "chunks"
        for sub in sorted(os.scandir(base), key=lambda e: e.name):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if valid_digest(entry.name):
                    try:
                        yield entry.name, entry.stat().st_size
                    except FileNotFoundError:
                        continue

    def delete_chunks(self, digests: Iterable[str]) -> int:
        n = 0
        for digest in digests:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._chunk_path(digest))
            n += 1
        return n

    # -- named objects ------------------------------------------------------------
    def put_object(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        final = self._key_path(key)
        self._write(final, data, exclusive=exclusive, what=key)
        try:
            self._sync_dir(final.parent)
        except OSError as exc:
            raise RepositoryUnavailable(f"cannot sync {key}: {exc}") from exc

    def get_object(self, key: str) -> bytes:
        try:
            return self._key_path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"{key} is not in {self.description}") from None
        except OSError as exc:
            raise RepositoryUnavailable(f"cannot read {key}: {exc}") from exc

    def delete_object(self, key: str) -> None:
        try:
            os.unlink(self._key_path(key))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise RepositoryUnavailable(f"cannot delete {key}: {exc}") from exc

    def list_objects(self, prefix: str) -> list[str]:
        top, _, start = prefix.partition("/")
        if top not in _KEY_DIRS:
            raise SnapshotError(f"invalid repository prefix {prefix!r}")
        try:
            names = os.listdir(self.root / top)
        except FileNotFoundError:
            return []
        return sorted(f"{top}/{n}" for n in names if n.startswith(start) and not n.startswith("."))

    # -- housekeeping -----------------------------------------------------------
    def clean_tmp(self, older_than: float) -> int:
        """Remove temp files left by crashed writers (older than ``older_than`` seconds)."""
        n = 0
        cutoff = time.time() - older_than
        for entry in os.scandir(self.root / "tmp"):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    n += 1
        return n

    def close(self) -> None:
        pass


__all__ = ["PosixRepository"]
