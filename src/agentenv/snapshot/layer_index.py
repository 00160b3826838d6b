"""A layer's index: every path of one OCI layer with its metadata, and for regular files
the content chunks (blake3, as the snapshot repository stores them) in order.

It is what a lazily loaded layer is served from (``lazyfs``): lookups and ``getattr``
answer from it, reads fetch the chunks. It lives in the shared repository as
``image-layers/<layer sha256 hex>.json.zst`` and is written after all its chunks, so
an index that exists names only stored chunks. It lives here, beside the snapshot
manifests, because the garbage collector must count its chunks as used. Read from a
repository it is hostile input like any blob: ``load`` refuses paths that escape,
entries without a parent directory, and files whose chunks do not cover exactly
their size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import zstandard

from agentenv.snapshot.chunking import MAX_SIZE
from agentenv.snapshot.errors import CorruptSnapshot
from agentenv.snapshot.gzip_index import BadGzipIndex, GzipPoints
from agentenv.snapshot.manifest import ZERO, valid_digest


class BadLayerIndex(CorruptSnapshot):
    """A layer index that cannot be served (unreadable, or pointing outside its data)."""


FORMAT = 1
PREFIX = "image-layers/"
MAX_ENTRIES = 2_000_000
MAX_INDEX_BYTES = 512 << 20  # decompressed
MAX_FILE = 1 << 40
MAX_LINK = 4096
# A layer served from its registry blob (eStargz): chunks are the blob's gzip members,
# read by range; their digests are sha256 of the raw chunk (the TOC's chunkDigest).
MAX_SPAN_CHUNK = 64 << 20
# d: directory, f: regular file, l: symlink, p: fifo, w: whiteout (an overlayfs
# 0/0 character device hiding the path in lower layers).
TYPES = frozenset("dflpw")
OPAQUE_XATTR = "trusted.overlay.opaque"
_HEX = re.compile(r"^[0-9a-f]{64}$")


def key_of(layer_hex: str) -> str:
    if not _HEX.match(layer_hex):
        raise BadLayerIndex(f"bad layer digest {layer_hex[:80]!r}")
    return f"{PREFIX}{layer_hex}.json.zst"


@dataclass
class Entry:
    type: str
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    size: int = 0
    link: str = ""
    chunks: list[tuple[str, int]] = field(default_factory=list)
    xattrs: dict[str, str] = field(default_factory=dict)  # values latin-1 (raw bytes)
    # Registry-served layers only, one per chunk: (offset of its gzip member in the
    # blob, bytes to read from there, offset of the chunk in the member's output); for
    # a plain gzip layer read through its checkpoints, (offset of the chunk in the
    # uncompressed stream, its bytes, 0).
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    def to_doc(self, path: str) -> dict:
        doc: dict = {"p": path, "t": self.type, "m": self.mode, "u": self.uid, "g": self.gid,
                     "mt": self.mtime}
        if self.type == "f":
            doc["s"] = self.size
            doc["c"] = [list(c) for c in self.chunks]
            if self.spans:
                doc["r"] = [list(r) for r in self.spans]
        if self.link:
            doc["l"] = self.link
        if self.xattrs:
            doc["x"] = self.xattrs
        return doc


@dataclass(frozen=True)
class RegistryBlob:
    """Where a registry-served layer's chunks are read: the blob and the end of its
    file data (the TOC's offset; no chunk may reach past it)."""

    registry: str
    repository: str
    digest: str
    size: int
    data_end: int

    def to_doc(self) -> dict:
        return {"registry": self.registry, "repository": self.repository,
                "digest": self.digest, "size": self.size, "dataEnd": self.data_end}


@dataclass
class LayerIndex:
    layer: str  # sha256:... of the compressed blob
    diff_id: str
    # Sorted by path: a parent always comes before its children ("" is the root).
    entries: dict[str, Entry]
    # Set when the chunks are ranges of the registry blob, not repository chunks.
    blob: RegistryBlob | None = None
    # Set for a plain gzip blob: its decompressor's checkpoints (``gzip_index``).
    gzip: GzipPoints | None = None

    def digests(self) -> set[str]:
        """The repository chunks it uses (none when served from its registry blob)."""
        if self.blob is not None:
            return set()
        return {d for e in self.entries.values() for d, _ in e.chunks if d != ZERO}

    def file_bytes(self) -> int:
        return sum(e.size for e in self.entries.values() if e.type == "f")

    def dump(self, level: int = 9) -> bytes:
        doc = {"version": FORMAT, "layer": self.layer, "diffID": self.diff_id,
               "entries": [e.to_doc(p) for p, e in sorted(self.entries.items())]}
        if self.blob is not None:
            doc["blob"] = self.blob.to_doc()
        if self.gzip is not None:
            doc["gzip"] = self.gzip.to_doc()
        raw = json.dumps(doc, separators=(",", ":")).encode()
        # The frame's checksum: a copy damaged in storage is refused, not served.
        return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)


def load(blob: bytes, what: str) -> LayerIndex:
    """Parse and check an index; BadLayerIndex names what is wrong with it."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=MAX_INDEX_BYTES)
        doc = json.loads(raw)
    except (zstandard.ZstdError, ValueError) as exc:
        raise BadLayerIndex(f"{what}: unreadable layer index ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("version") != FORMAT:
        raise BadLayerIndex(f"{what}: unknown layer index format")
    items = doc.get("entries")
    if not isinstance(items, list) or len(items) > MAX_ENTRIES:
        raise BadLayerIndex(f"{what}: layer index has no entry list or too many entries")
    location = _blob(doc.get("blob"), what)
    points = None
    if doc.get("gzip") is not None:
        try:
            points = GzipPoints.from_doc(doc["gzip"])
        except BadGzipIndex as exc:
            raise BadLayerIndex(f"{what}: {exc}") from exc
        if location is None or points.size != location.size or \
                location.data_end != location.size:
            raise BadLayerIndex(f"{what}: gzip checkpoints of another blob than the index's")
    entries: dict[str, Entry] = {}
    for item in items:
        try:
            path, entry = _entry(item, what, location, points)
        except (KeyError, TypeError, ValueError) as exc:
            raise BadLayerIndex(f"{what}: malformed layer index entry ({exc})") from exc
        if path in entries:
            raise BadLayerIndex(f"{what}: layer index lists {path[:200]!r} twice")
        if path:
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            if parent not in entries or entries[parent].type != "d":
                raise BadLayerIndex(f"{what}: layer index entry {path[:200]!r} has no parent "
                                   "directory before it")
        elif entry.type != "d":
            raise BadLayerIndex(f"{what}: layer index root is not a directory")
        entries[path] = entry
    if "" not in entries:
        entries[""] = Entry("d")
    layer = str(doc.get("layer", ""))
    if location is not None and layer != location.digest:
        raise BadLayerIndex(f"{what}: the index is of layer {layer[:80]!r} but reads blob "
                            f"{location.digest}")
    return LayerIndex(layer, str(doc.get("diffID", "")), entries, location, points)


def _blob(doc: object, what: str) -> RegistryBlob | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise BadLayerIndex(f"{what}: malformed blob location in the layer index")
    try:
        blob = RegistryBlob(str(doc["registry"]), str(doc["repository"]), str(doc["digest"]),
                            int(doc["size"]), int(doc["dataEnd"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise BadLayerIndex(f"{what}: malformed blob location in the layer index") from exc
    if not re.match(r"^sha256:[0-9a-f]{64}$", blob.digest) or \
            not 0 <= blob.data_end <= blob.size or not blob.registry or not blob.repository:
        raise BadLayerIndex(f"{what}: bad blob location in the layer index")
    return blob


def check_span(span: tuple[int, int, int], n: int, blob: RegistryBlob, path: str,
               what: str) -> None:
    """A chunk read from the blob must lie in its file data: before the TOC."""
    offset, length, inner = span
    if not (0 <= offset and 0 < length and offset + length <= blob.data_end and
            0 <= inner <= MAX_SPAN_CHUNK and 0 < n <= MAX_SPAN_CHUNK):
        raise BadLayerIndex(
            f"{what}: file {path[:200]!r} has a chunk at bytes {offset}..{offset + length} "
            f"of the blob (+{inner}, {n} bytes), outside its file data (bytes 0..{blob.data_end}"
            f" of {blob.size}): the index points outside the blob")


def check_tar_span(span: tuple[int, int, int], n: int, points: GzipPoints, path: str,
                   what: str) -> None:
    """A chunk of a plain gzip layer must lie in the blob's uncompressed stream."""
    offset, length, inner = span
    if not (0 <= offset and length == n and inner == 0 and 0 < n <= MAX_SPAN_CHUNK and
            offset + n <= points.tar_size):
        raise BadLayerIndex(
            f"{what}: file {path[:200]!r} has a chunk at bytes {offset}..{offset + length} of "
            f"the uncompressed layer ({n} bytes), outside its {points.tar_size} bytes: the "
            "index points outside the blob")


def _entry(item: dict, what: str, blob: RegistryBlob | None = None,
           points: GzipPoints | None = None) -> tuple[str, Entry]:
    path = item["p"]
    if not isinstance(path, str) or path.startswith("/") or len(path) > 4096 or \
            (path and any(p in ("", ".", "..") for p in path.split("/"))) or "\0" in path:
        raise BadLayerIndex(f"{what}: layer index path {str(path)[:200]!r} escapes the layer")
    kind = item["t"]
    if kind not in TYPES:
        raise BadLayerIndex(f"{what}: layer index entry {path[:200]!r} has type {kind!r}")
    entry = Entry(kind, mode=int(item["m"]) & 0o7777, uid=_id(item["u"]), gid=_id(item["g"]),
                  mtime=int(item.get("mt", 0)))
    if kind == "l":
        entry.link = str(item["l"])
        if not entry.link or len(entry.link) > MAX_LINK or "\0" in entry.link:
            raise BadLayerIndex(f"{what}: symlink {path[:200]!r} has a bad target")
    xattrs = item.get("x") or {}
    if not isinstance(xattrs, dict) or len(xattrs) > 64:
        raise ValueError("bad xattrs")
    for name, value in xattrs.items():
        if not isinstance(name, str) or not isinstance(value, str) or len(value) > 65536:
            raise ValueError("bad xattr")
        value.encode("latin-1")  # raw bytes, one per character (UnicodeError: refused)
        name.encode()
        # Only whiteouts make overlay xattrs (a layer must not forge redirects).
        if name.startswith("trusted.overlay.") and (name != OPAQUE_XATTR or kind != "d"):
            raise BadLayerIndex(f"{what}: layer index entry {path[:200]!r} carries {name}")
    entry.xattrs = dict(xattrs)
    if kind == "f":
        entry.size = int(item["s"])
        if not 0 <= entry.size <= MAX_FILE:
            raise BadLayerIndex(f"{what}: file {path[:200]!r} has size {entry.size}")
        covered = 0
        largest = MAX_SIZE if blob is None else MAX_SPAN_CHUNK
        for digest, n in item["c"]:
            n = int(n)
            if not (digest == ZERO or valid_digest(str(digest))) or not 0 < n <= largest:
                raise BadLayerIndex(f"{what}: file {path[:200]!r} names a bad chunk "
                                   f"({str(digest)[:70]!r}, {n} bytes)")
            entry.chunks.append((str(digest), n))
            covered += n
        if blob is not None:
            spans = item.get("r") or []
            if len(spans) != len(entry.chunks):
                raise BadLayerIndex(f"{what}: file {path[:200]!r} has {len(spans)} blob ranges "
                                   f"for {len(entry.chunks)} chunks")
            for (_, n), r in zip(entry.chunks, spans, strict=True):
                span = (int(r[0]), int(r[1]), int(r[2]))
                if points is not None:
                    check_tar_span(span, n, points, path, what)
                else:
                    check_span(span, n, blob, path, what)
                entry.spans.append(span)
        if covered != entry.size:
            raise BadLayerIndex(f"{what}: file {path[:200]!r}: its chunks cover {covered} bytes, "
                               f"its size is {entry.size} (the index points outside its data)")
    return path, entry


def _id(value: object) -> int:
    n = int(value)  # type: ignore[call-overload]
    if not 0 <= n < 1 << 32:
        raise ValueError(f"id {n} out of range")
    return n
