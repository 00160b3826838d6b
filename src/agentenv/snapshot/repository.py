"""The repository: the committed source of truth, behind one small interface.

Two kinds of things live in a repository:
- content-addressed chunks (zstd blobs named by the blake3 of their raw bytes),
  written once, never changed, removed only by the garbage collector;
- small named objects: ``manifests/<id>.json``, ``aliases/<alias>``,
  ``leases/<name>``, ``locks/<name>``, and the templates published to a cluster
  (``templates/<id>.json``, ``template-aliases/<alias>``: ``shared_templates``),
  each written whole and atomically.

Every backend must be safe to call from many threads, and every write must be
atomic: an object is visible whole or not at all. A reader that fetches chunks
from elsewhere (a peer node) needs only ``get_chunk``; the store verifies every
chunk by its hash whatever its source.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agentenv.snapshot.errors import SnapshotConfigError


@runtime_checkable
class ChunkSource(Protocol):
    """Where chunk blobs can be read from (the repository; later a peer)."""

    def get_chunk(self, digest: str) -> bytes:
        """The stored (compressed) blob; raises ObjectMissing when absent."""
        ...


@runtime_checkable
class Repository(ChunkSource, Protocol):
    #: a short, secret-free description for logs and errors
    description: str

    # -- chunks ---------------------------------------------------------------
    def has_chunk(self, digest: str) -> bool: ...

    def put_chunk(self, digest: str, blob: bytes) -> None:
        """Store a blob under its digest (idempotent; atomic and durable on return)."""
        ...

    def list_chunks(self) -> Iterator[tuple[str, int]]:
        """(digest, stored size) of every chunk."""
        ...

    def delete_chunks(self, digests: Iterable[str]) -> int:
        """Delete chunks (missing ones are ignored); returns how many were asked for."""
        ...

    # -- named objects ----------------------------------------------------------
    def put_object(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write atomically. With exclusive, raise SnapshotExists if the key exists."""
        ...

    def get_object(self, key: str) -> bytes:
        """Raises ObjectMissing when absent."""
        ...

    def delete_object(self, key: str) -> None:
        """No error when absent."""
        ...

    def list_objects(self, prefix: str) -> list[str]:
        """Keys (relative to the repository) under a prefix such as ``manifests/``."""
        ...

    def close(self) -> None: ...


@dataclass
class RepositoryConfig:
    """Repository settings; build from a plain dict with ``from_dict``.

    posix_fs needs ``path``. oss needs ``bucket`` and ``region`` (an explicit
    region is required), optionally ``endpoint_url`` (any S3-compatible store),
    ``prefix`` and credentials, given inline or as files
    (``access_key_id_file`` / ``secret_access_key_file``); without them boto3's
    default chain applies. Secrets never appear in ``repr`` or errors.
    """

    backend: str = "posix_fs"
    path: Path | None = None
    endpoint_url: str | None = None
    bucket: str | None = None
    prefix: str = ""
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    access_key_id_file: Path | None = None
    secret_access_key_file: Path | None = None
    session_token: str | None = None
    addressing_style: str | None = None
    # posix_fs: fsync every chunk and directory before the manifest is written.
    fsync: bool = True
    # oss: seconds to wait for a connection; attempts per request.
    connect_timeout: float = 3.0
    read_timeout: float = 30.0
    max_attempts: int = 3
    max_connections: int = 32

    _SECRET = ("secret_access_key", "session_token", "access_key_id")

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name.startswith("_"):
                continue
            if f.name in self._SECRET:
                value = "***"
            parts.append(f"{f.name}={value!r}")
        return f"RepositoryConfig({', '.join(parts)})"

    __str__ = __repr__

    @classmethod
    def from_dict(cls, config: dict[str, Any] | RepositoryConfig) -> RepositoryConfig:
        if isinstance(config, RepositoryConfig):
            return config
        if not isinstance(config, dict):
            raise SnapshotConfigError("repository config must be a dict")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise SnapshotConfigError(f"unknown repository config keys: {', '.join(unknown)}")
        out = cls()
        for key, raw in config.items():
            if raw is None:
                continue
            kind = known[key].type
            try:
                if "Path" in str(kind):
                    value: Any = Path(raw)
                elif kind in (bool, "bool"):
                    value = raw if isinstance(raw, bool) else \
                        str(raw).lower() in ("1", "true", "yes", "on")
                elif kind in (int, "int"):
                    value = int(raw)
                elif kind in (float, "float"):
                    value = float(raw)
                else:
                    value = str(raw)
            except (TypeError, ValueError) as exc:
                raise SnapshotConfigError(f"repository config {key}: bad value") from exc
            setattr(out, key, value)
        return out
