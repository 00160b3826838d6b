"""Manifests: what a committed snapshot is made of.

A manifest lists each payload file as a sequence of ``(digest, size)`` chunks.
A digest is the blake3 hex of the chunk's raw bytes; the all-zero chunk is not
stored and is written as ``ZERO``. Manifests are immutable JSON documents; the
manifest is written last, so a snapshot exists exactly when its manifest does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from agentenv.snapshot.errors import CorruptSnapshot, SnapshotError

FORMAT_VERSION = 1
# A chunk made only of zero bytes: recorded by size, never stored or fetched.
ZERO = "0"
# Snapshot IDs and names: 1-128 of [A-Za-z0-9._:-], starting with a letter or digit,
# never two dots in a row (single, safe path components and object keys). The one
# rule: the API's models take NAME_PATTERN and NAME_MAX_LENGTH (the pattern says
# "no '..'" without a lookahead, so JSON Schema tools read it too), and
# check_name's message is the API's 400.
NAME_PATTERN = r"^[A-Za-z0-9](?:\.?[A-Za-z0-9_:-])*\.?$"
NAME_MAX_LENGTH = 128
NAME_RULE = ("1-128 characters of A-Z, a-z, 0-9, '.', '_', ':' and '-', starting with a "
             "letter or digit, without '..'")
_NAME = re.compile(NAME_PATTERN)
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def valid_name(name: str) -> bool:
    """Snapshot IDs and aliases are single, safe path components and object keys."""
    return isinstance(name, str) and len(name) <= NAME_MAX_LENGTH and bool(_NAME.fullmatch(name))


def check_name(kind: str, name: str) -> str:
    if not valid_name(name):
        raise SnapshotError(f"invalid {kind} {name!r}: use {NAME_RULE}")
    return name


def valid_digest(digest: str) -> bool:
    return bool(_DIGEST.match(digest))


@dataclass(frozen=True)
class FileEntry:
    """One payload file: its size, permission bits and chunks in order."""

    size: int
    mode: int = 0o644
    chunks: tuple[tuple[str, int], ...] = ()

    def digests(self) -> set[str]:
        return {d for d, _ in self.chunks if d != ZERO}


@dataclass(frozen=True)
class Manifest:
    snapshot_id: str
    alias: str | None
    created_at: float
    metadata: dict
    files: dict[str, FileEntry]
    total_bytes: int
    # Bytes (compressed, as stored) of the chunks this commit wrote that were not
    # in the repository before: what the snapshot cost in storage and upload.
    stored_bytes: int
    chunking: dict = field(default_factory=dict)

    def digests(self) -> set[str]:
        out: set[str] = set()
        for entry in self.files.values():
            out |= entry.digests()
        return out

    def with_alias(self, alias: str | None) -> Manifest:
        return self if alias == self.alias else replace(self, alias=alias)

    def to_json(self) -> bytes:
        doc = {
            "version": FORMAT_VERSION,
            "snapshot_id": self.snapshot_id,
            "alias": self.alias,
            "created_at": self.created_at,
            "metadata": self.metadata,
            "total_bytes": self.total_bytes,
            "stored_bytes": self.stored_bytes,
            "chunking": self.chunking,
            "files": {
                name: {"size": e.size, "mode": e.mode, "chunks": [list(c) for c in e.chunks]}
                for name, e in sorted(self.files.items())
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            doc: dict[str, Any] = json.loads(data)
            if doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"unknown manifest version {doc.get('version')!r}")
            files = {
                name: FileEntry(size=int(f["size"]), mode=int(f.get("mode", 0o644)),
                                chunks=tuple((str(d), int(n)) for d, n in f["chunks"]))
                for name, f in doc["files"].items()
            }
            return cls(snapshot_id=doc["snapshot_id"], alias=doc.get("alias"),
                       created_at=float(doc["created_at"]), metadata=doc.get("metadata") or {},
                       files=files, total_bytes=int(doc["total_bytes"]),
                       stored_bytes=int(doc.get("stored_bytes", 0)),
                       chunking=doc.get("chunking") or {})
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptSnapshot(f"unreadable manifest: {exc}") from exc
