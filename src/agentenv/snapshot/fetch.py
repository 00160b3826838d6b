"""Materialize's download: write a manifest's files into a directory, chunk by chunk.

Each chunk comes from a related snapshot already in the node cache when it has
it, else from the repository; either way it is verified against its hash. Zero
chunks stay holes.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentenv.snapshot import chunking
from agentenv.snapshot.cache import NodeCache
from agentenv.snapshot.errors import CorruptSnapshot, ObjectMissing
from agentenv.snapshot.manifest import ZERO, Manifest, valid_name
from agentenv.snapshot.repository import Repository

#: digest -> (file holding the chunk, offset, size)
LocalChunks = dict[str, tuple[Path, int, int]]


def local_chunks(cache: NodeCache, related: Iterable[str | None]) -> LocalChunks:
    """Chunks of the related snapshots that are in the node cache."""
    index: LocalChunks = {}
    for sid in dict.fromkeys(r for r in related if r and valid_name(r)):
        if not cache.is_cached(sid):
            continue
        try:
            other = cache.complete_manifest(sid)
        except (OSError, CorruptSnapshot):
            continue
        base = cache.path(sid)
        for rel, entry in other.files.items():
            off = 0
            for d, n in entry.chunks:
                if d != ZERO:
                    index.setdefault(d, (base / rel, off, n))
                off += n
    return index


def fetch_files(manifest: Manifest, dest: Path, repo: Repository, local: LocalChunks,
                threads: int) -> int:
    """Write the manifest's files under ``dest`` and fsync them; returns the bytes
    read from the repository. A missing or corrupt chunk raises CorruptSnapshot."""
    where: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    sizes: dict[str, int] = {}
    fds: dict[str, int] = {}
    try:
        for rel, entry in manifest.files.items():
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, entry.mode or 0o644)
            fds[rel] = fd
            os.ftruncate(fd, entry.size)  # zero chunks stay holes
            off = 0
            for d, n in entry.chunks:
                if d != ZERO:
                    where[d].append((fds[rel], off, n))
                    sizes[d] = n
                off += n
            if off != entry.size:
                raise CorruptSnapshot(f"manifest of {manifest.snapshot_id}: chunks of {rel} "
                                      f"add up to {off} bytes, not {entry.size}")

        def fetch(d: str) -> int:
            data = None
            n = sizes[d]
            if d in local:
                data = _read_local(*local[d])
                if data is not None and not chunking.verify_raw(data, d, n):
                    data = None
            fetched = 0
            if data is None:
                try:
                    blob = repo.get_chunk(d)
                except ObjectMissing:
                    raise CorruptSnapshot(
                        f"snapshot {manifest.snapshot_id}: chunk {d} is missing from "
                        f"{repo.description}") from None
                data = chunking.decompress_verified(
                    blob, d, n, f"snapshot {manifest.snapshot_id}")
                fetched = len(blob)
            for fd, off, _ in where[d]:
                _pwrite_all(fd, data, off)
            return fetched

        total = _run_bounded(fetch, list(where), threads)
        for fd in fds.values():
            os.fsync(fd)
        return total
    finally:
        for fd in fds.values():
            os.close(fd)


def _run_bounded(fn: Callable[[Any], int], items: Iterable, threads: int) -> int:
    """Run fn over items on a thread pool with a bounded number in flight; sum the results."""
    total = 0
    pending: collections.deque[Future] = collections.deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="snap-io") as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                while len(pending) >= threads * 4:
                    total += pending.popleft().result()
            while pending:
                total += pending.popleft().result()
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return total


def _read_local(path: Path, offset: int, size: int) -> bytes | None:
    try:
        with open(path, "rb", buffering=0) as f:
            data = os.pread(f.fileno(), size, offset)
        return data if len(data) == size else None
    except OSError:
        return None


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
