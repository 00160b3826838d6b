"""Which repository backend a configuration opens: ``posix_fs`` (a directory, maybe a
shared mount) or ``oss`` (S3-compatible object storage)."""

from __future__ import annotations

from typing import Any

from agentenv.snapshot.errors import SnapshotConfigError
from agentenv.snapshot.posix import PosixRepository
from agentenv.snapshot.repository import Repository, RepositoryConfig


def open_repository(config: dict[str, Any] | RepositoryConfig) -> Repository:
    """Open the configured backend: ``posix_fs`` (default) or ``oss`` (S3-compatible)."""
    cfg = RepositoryConfig.from_dict(config)
    if cfg.backend == "posix_fs":
        if cfg.path is None:
            raise SnapshotConfigError("posix_fs repository needs a 'path'")
        return PosixRepository(cfg.path, fsync=cfg.fsync)
    if cfg.backend == "oss":
        # boto3 is imported only by nodes that use it (it costs ~0.3 s at start).
        from agentenv.snapshot.oss import S3Repository

        return S3Repository(cfg)
    raise SnapshotConfigError(f"unknown repository backend {cfg.backend!r} "
                              "(expected 'posix_fs' or 'oss')")
