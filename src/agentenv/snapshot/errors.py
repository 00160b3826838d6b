"""Snapshot errors. Every error this package raises is a ``SnapshotError``."""

from __future__ import annotations

import errno

from ..errors import AgentenvError


class SnapshotError(AgentenvError):
    """Base class of every snapshot error."""

    message_prefix = "snapshot"


class SnapshotNotFound(SnapshotError, KeyError):
    """No committed snapshot has this ID or alias."""

    status = 404
    message_prefix = ""  # the message names the snapshot

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "snapshot not found"


class SnapshotExists(SnapshotError):
    """A snapshot with this ID is already committed (snapshots are immutable)."""

    status = 409


class SnapshotConfigError(SnapshotError, ValueError):
    """The repository configuration is missing or malformed."""


class RepositoryUnavailable(SnapshotError):
    """The repository cannot be reached or refused the request (network, credentials, bucket)."""

    status = 503
    message_prefix = "snapshot repository unavailable"


class StorageFull(SnapshotError, OSError):
    """A disk ran out of space (ENOSPC / EDQUOT) while writing snapshot data."""

    status = 507
    message_prefix = "snapshot storage is full"


class CorruptSnapshot(SnapshotError):
    """A chunk is missing or its content does not match its hash."""


class ObjectMissing(SnapshotError, KeyError):
    """Internal: a repository object or chunk does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "object missing"


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def storage_full(where: str, exc: OSError) -> StorageFull:
    err = StorageFull(f"no space left on device while {where}: {exc.strerror or exc}")
    err.errno = exc.errno
    return err
