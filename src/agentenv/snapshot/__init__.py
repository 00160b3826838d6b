"""Snapshots: content-addressed, incremental storage of sandbox captures.

Three layers: a staging directory the runtime writes a capture into; the
repository (posix_fs or an S3-compatible ``oss`` store), the committed source of
truth; and a node-local cache of materialized files that restores read.

    repo = open_repository({"backend": "posix_fs", "path": "/var/lib/aenv/snapshots"})
    store = SnapshotStore(repo, cache_dir=home / "cache/snapshots",
                          staging_dir=home / "snapshots-staging")
    staging = store.new_staging(sid)            # runsc checkpoint --image-path staging
    manifest = store.commit(sid, staging, {"template_id": "base", ...}, alias="ready")
    path = store.materialize(sid)               # runsc restore --image-path path

Metadata keys the store itself reads: ``source_sandbox_id`` and ``template_id``
(``list`` filters) and ``parent_snapshot_id`` (chunks it already has are not
re-checked or re-downloaded). Everything else is carried as given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentenv.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from agentenv.snapshot.backends import open_repository
    from agentenv.snapshot.chunking import Chunking
    from agentenv.snapshot.errors import (
        CorruptSnapshot,
        RepositoryUnavailable,
        SnapshotConfigError,
        SnapshotError,
        SnapshotExists,
        SnapshotNotFound,
        StorageFull,
    )
    from agentenv.snapshot.manifest import FileEntry, Manifest
    from agentenv.snapshot.repository import ChunkSource, Repository, RepositoryConfig
    from agentenv.snapshot.store import SnapshotStore

# Imported on first use: a lazy layer's server needs the chunking and index modules only.
_WHERE = {
    "open_repository": "backends", "Chunking": "chunking", "CorruptSnapshot": "errors",
    "RepositoryUnavailable": "errors", "SnapshotConfigError": "errors", "SnapshotError": "errors",
    "SnapshotExists": "errors", "SnapshotNotFound": "errors", "StorageFull": "errors",
    "FileEntry": "manifest", "Manifest": "manifest", "ChunkSource": "repository",
    "Repository": "repository", "RepositoryConfig": "repository", "SnapshotStore": "store",
}
__getattr__ = lazy_exports(__name__, _WHERE)
__all__ = [
    "ChunkSource",
    "Chunking",
    "CorruptSnapshot",
    "FileEntry",
    "Manifest",
    "Repository",
    "RepositoryConfig",
    "RepositoryUnavailable",
    "SnapshotConfigError",
    "SnapshotError",
    "SnapshotExists",
    "SnapshotNotFound",
    "SnapshotStore",
    "StorageFull",
    "open_repository",
]
