"""Where a lazily served layer's chunks come from, and how each is verified: the
snapshot repository (blake3-addressed zstd chunks, a converted layer) or the image's
registry (gzip members of an eStargz blob read by HTTP range, checked against the
TOC's sha256 ``chunkDigest``). Both raise ``CorruptSnapshot`` for data that does not
match; the layer server (``lazyfs``) drops it and fetches once more.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Protocol

from agentenv.snapshot.chunking import decompress_verified, verify_raw
from agentenv.snapshot.errors import CorruptSnapshot
from agentenv.snapshot.layer_index import RegistryBlob

from .errors import ImageError
from .reference import RegistryRef

# A layer's server needs one of the two clients: each is imported when used (httpx and
# the repository backends cost a few hundred ms of a loaded machine's start).


class ChunkSource(Protocol):
    fetched: int  # bytes read from the source, as stored

    def verify(self, data: bytes, digest: str, size: int) -> bool: ...

    def fetch(self, digest: str, size: int, span: tuple[int, int, int] | None,
              where: str) -> bytes: ...

    def close(self) -> None: ...


class RepositoryChunks:
    def __init__(self, config: dict[str, Any]):
        from agentenv.snapshot.backends import open_repository
        self.repo = open_repository(config)
        self.fetched = 0

    def verify(self, data: bytes, digest: str, size: int) -> bool:
        return verify_raw(data, digest, size)

    def fetch(self, digest: str, size: int, span: tuple[int, int, int] | None,
              where: str) -> bytes:
        blob = self.repo.get_chunk(digest)
        self.fetched += len(blob)
        return decompress_verified(blob, digest, size, where)

    def close(self) -> None:
        self.repo.close()


class RegistryChunks:
    def __init__(self, blob: RegistryBlob, username: str = "", password: str = ""):
        from .registry_client import RegistryClient
        self.blob = blob
        self.client = RegistryClient(RegistryRef(blob.registry, blob.repository), username,
                                     password)
        self.fetched = 0

    def verify(self, data: bytes, digest: str, size: int) -> bool:
        return len(data) == size and hashlib.sha256(data).hexdigest() == digest

    def fetch(self, digest: str, size: int, span: tuple[int, int, int] | None,
              where: str) -> bytes:
        if span is None:
            raise CorruptSnapshot(f"chunk sha256:{digest} ({where}) has no range of the blob")
        offset, length, inner = span
        # A span runs to the next member the TOC names: a TOC naming few could make it
        # the whole blob. A gzip member of k bytes is at most a little over k (stored
        # deflate blocks), so no more than twice what is needed is read.
        length = min(length, 2 * (inner + size) + (128 << 10))
        try:
            raw = self.client.blob_range(self.blob.digest, offset, length)
        except ImageError as exc:  # the registry: unreachable, refused, short
            raise CorruptSnapshot(f"chunk sha256:{digest} ({where}): {exc}") from exc
        self.fetched += len(raw)
        try:
            data = zlib.decompressobj(wbits=31).decompress(raw, inner + size)[inner:]
        except zlib.error as exc:
            raise CorruptSnapshot(f"chunk sha256:{digest} ({where}, bytes {offset}..."
                                  f"{offset + length} of blob {self.blob.digest}) is not gzip: "
                                  f"{exc}") from exc
        if not self.verify(data, digest, size):
            raise CorruptSnapshot(f"chunk sha256:{digest} ({where}, bytes {offset}..."
                                  f"{offset + length} of blob {self.blob.digest}) does not "
                                  "match its chunkDigest")
        return data

    def close(self) -> None:
        self.client.close()
