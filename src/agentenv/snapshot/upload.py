"""Commit's upload: chunk staged files and store the chunks the repository lacks.

Chunks are hashed, compressed and written on a thread pool with a bounded number
in flight; a chunk known to be present (or already claimed by another worker)
is neither checked nor written again.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from agentenv.snapshot import chunking
from agentenv.snapshot.chunking import Chunking
from agentenv.snapshot.errors import SnapshotError
from agentenv.snapshot.manifest import ZERO, FileEntry
from agentenv.snapshot.repository import Repository

StagedFile = tuple[str, Path, int, int]  # (relative path, path, size, mode)


def store_files(repo: Repository, chunker: Chunking, files: list[StagedFile],
                known: set[str], *, threads: int, zstd_level: int
                ) -> tuple[dict[str, FileEntry], int, list[str]]:
    """Store the files' chunks; returns (manifest entries, new bytes stored, digests
    written). ``known`` are chunks surely present already."""
    claimed = set(known)
    claim_lock = threading.Lock()
    written: list[str] = []

    def work(data: bytes) -> tuple[str, int, int]:
        d = chunking.digest(data)
        if d == ZERO:
            return d, len(data), 0
        with claim_lock:
            if d in claimed:
                return d, len(data), 0
            claimed.add(d)
        if repo.has_chunk(d):
            return d, len(data), 0
        blob = chunking.compress(data, zstd_level)
        repo.put_chunk(d, blob)
        with claim_lock:
            written.append(d)
        return d, len(data), len(blob)

    entries: dict[str, FileEntry] = {}
    stored = 0
    limit = threads * 4
    pending: collections.deque[Future] = collections.deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="snap-commit") as pool:
        try:
            for rel, path, size, mode in files:
                chunks: list[tuple[str, int]] = []
                seen = 0
                try:
                    for data in chunker.split(path):
                        seen += len(data)
                        pending.append(pool.submit(work, data))
                        while len(pending) >= limit:
                            stored += _collect(pending.popleft(), chunks)
                except SnapshotError:
                    raise
                except OSError as exc:
                    raise SnapshotError(f"cannot read staged file {path}: {exc}") from exc
                while pending:
                    stored += _collect(pending.popleft(), chunks)
                if seen != size:
                    raise SnapshotError(f"staged file {rel} changed size during commit "
                                        f"({size} -> {seen} bytes)")
                entries[rel] = FileEntry(size=size, mode=mode, chunks=tuple(chunks))
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return entries, stored, written


def _collect(fut: Future, chunks: list[tuple[str, int]]) -> int:
    d, n, new = fut.result()
    chunks.append((d, n))
    return new
