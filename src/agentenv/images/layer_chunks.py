"""Where a lazily served layer's chunks come from, and how each is verified: the
snapshot repository (blake3-addressed zstd chunks, a converted layer) or the image's
registry (gzip members of an eStargz blob read by HTTP range, checked against the
TOC's sha256 ``chunkDigest``; or spans of a plain gzip blob between two of its
checkpoints, read by range and inflated from the first, checked against the sha256 the
index recorded of each chunk). Both raise ``CorruptSnapshot`` for data that does not
match; the layer server (``lazyfs``) drops it and fetches once more.
"""

from __future__ import annotations

import hashlib
import threading
import time
import zlib
from collections import OrderedDict
from typing import Any, Protocol

from agentenv.snapshot.chunking import decompress_verified, verify_raw
from agentenv.snapshot.errors import CorruptSnapshot
from agentenv.snapshot.gzip_index import BadGzipIndex, GzipPoints, inflate_span
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
    def __init__(self, blob: RegistryBlob, username: str = "", password: str = "",
                 timeout: float = 30.0):
        from .registry_client import RegistryClient
        self.blob = blob
        self.client = RegistryClient(RegistryRef(blob.registry, blob.repository), username,
                                     password, timeout=timeout)
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


class GzipSpans(RegistryChunks):
    """A plain gzip blob read through its checkpoints: a chunk (its offset in the
    uncompressed stream, from its span) is cut from the spans that cover it, each span
    fetched by one range request and inflated from its checkpoint. Spans are kept
    decoded in memory, bounded by bytes, so that the small files of one span cost one
    fetch; a chunk that does not match its sha256 drops the spans it was cut from."""

    MEMORY = 64 << 20
    FAILED_HOLD_S = 1.0

    def __init__(self, blob: RegistryBlob, points: GzipPoints, username: str = "",
                 password: str = "", timeout: float = 30.0):
        super().__init__(blob, username, password, timeout)
        self.points = points
        self._outs = [p.out for p in points.points]
        self._spans: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self._flights: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        # A span whose fetch just failed (a stalled or refusing registry): the reads
        # that waited on it fail with it, rather than each waiting out the timeout.
        self._failed: dict[int, tuple[float, str]] = {}

    def fetch(self, digest: str, size: int, span: tuple[int, int, int] | None,
              where: str) -> bytes:
        if span is None:
            raise CorruptSnapshot(f"chunk sha256:{digest} ({where}) has no range of the blob")
        at = span[0]
        k = self.points.span_of(at)
        parts, used = [], []
        got = 0
        start = at - self._outs[k]
        while got < start + size:
            if k >= len(self._outs):
                raise CorruptSnapshot(f"chunk sha256:{digest} ({where}) reaches past the "
                                      "layer's end")
            data = self._span(k, where)
            parts.append(data)
            used.append(k)
            got += len(data)
            k += 1
        data = b"".join(parts)[start:start + size]
        if not self.verify(data, digest, size):
            with self._lock:  # fetched again next time, not served from memory
                for i in used:
                    old = self._spans.pop(i, None)
                    self._bytes -= len(old) if old is not None else 0
            raise CorruptSnapshot(f"chunk sha256:{digest} ({where}, bytes {at}...{at + size} "
                                  f"of the uncompressed blob {self.blob.digest}) does not match "
                                  "its digest in the layer's index")
        return data

    def _span(self, k: int, where: str) -> bytes:
        with self._lock:
            data = self._spans.get(k)
            if data is not None:
                self._spans.move_to_end(k)
                return data
            flight = self._flights.setdefault(k, threading.Lock())
        waited = time.monotonic()
        with flight:
            with self._lock:
                data = self._spans.get(k)
                failed = self._failed.get(k)
            if data is not None:
                return data
            # Failed while this read waited, or a moment ago (the read's own retry, the
            # next chunk of the same span): the same answer, at once.
            if failed is not None and (failed[0] >= waited or
                                       time.monotonic() - failed[0] < self.FAILED_HOLD_S):
                raise CorruptSnapshot(failed[1])
            try:
                data = self._inflate(k, where)
            except CorruptSnapshot as exc:
                with self._lock:
                    self._failed[k] = (time.monotonic(), str(exc))
                raise
            finally:
                with self._lock:
                    self._flights.pop(k, None)
            with self._lock:
                self._failed.pop(k, None)
            with self._lock:
                self._spans[k] = data
                self._bytes += len(data)
                while len(self._spans) > 1 and self._bytes > self.MEMORY:
                    self._bytes -= len(self._spans.popitem(last=False)[1])
            return data

    def _inflate(self, k: int, where: str) -> bytes:
        offset, length, _, want = self.points.span_range(k)
        # A deflate stream is at most a little larger than its output (stored blocks):
        # checkpoints that claim more are not followed into the blob.
        if offset + length > self.blob.size or length > 2 * want + (128 << 10):
            raise CorruptSnapshot(f"gzip span {k} of blob {self.blob.digest} ({where}): bytes "
                                  f"{offset}...{offset + length} for {want} bytes of output: "
                                  "the index points outside the blob")
        try:
            raw = self.client.blob_range(self.blob.digest, offset, length)
        except ImageError as exc:  # the registry: unreachable, refused, short, stalled
            raise CorruptSnapshot(f"gzip span {k} ({where}): {exc}") from exc
        self.fetched += len(raw)
        try:
            return inflate_span(self.points, k, raw)
        except BadGzipIndex as exc:
            raise CorruptSnapshot(f"{where}: {exc} (bytes {offset}...{offset + length} of "
                                  f"blob {self.blob.digest})") from exc
