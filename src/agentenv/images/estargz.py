"""eStargz layers read from their registry: the footer and TOC fetched by HTTP range,
the TOC checked and made a ``LayerIndex`` whose chunks are ranges of the blob.

An eStargz blob is a gzip stream made of members: each regular file's payload (or
each chunk of a large one) starts a member of its own, then the TOC
(``stargz.index.json``, the last tar entry, in a member of its own), then a 51-byte
footer: an empty gzip member whose extra field holds the TOC's offset. Every entry
of the TOC names its file's metadata; each regular file or chunk names the offset
of its gzip member (``offset``), its place in the file (``chunkOffset``,
``chunkSize``, ``innerOffset`` inside the member) and the sha256 of its bytes
(``chunkDigest``). A member's compressed length is not written anywhere: it ends
where the next member with a larger offset begins (or the TOC).

The TOC is hostile input: checked against the layer descriptor's
``containerd.io/snapshot/stargz/toc.digest`` annotation when there is one; a chunk
outside the file data, a file whose chunks do not cover its size, a name that
escapes the layer are refused with a message naming the entry.
"""

from __future__ import annotations

import base64
import bisect
import datetime
import functools
import hashlib
import io
import json
import re
import tarfile
import zlib
from dataclasses import dataclass

from agentenv.snapshot.layer_index import (
    MAX_ENTRIES,
    MAX_SPAN_CHUNK,
    BadLayerIndex,
    Entry,
    LayerIndex,
    RegistryBlob,
    check_span,
)

from .convert import TreeBuilder
from .errors import HostileInput
from .manifest import Layer
from .registry_client import RegistryClient

FOOTER_SIZE = 51
TOC_NAME = "stargz.index.json"
# Landmarks mark where prefetched files end; they are no files of the image.
LANDMARKS = frozenset((".prefetch.landmark", ".no.prefetch.landmark"))
HIDDEN = LANDMARKS | {TOC_NAME}
MAX_TOC_BLOB = 64 << 20  # the TOC's gzip member as stored
MAX_TOC_BYTES = 256 << 20  # decompressed
_SHA256 = re.compile(r"^sha256:[0-9a-f]{64}$")
_TYPES = {"dir": tarfile.DIRTYPE, "reg": tarfile.REGTYPE, "symlink": tarfile.SYMTYPE,
          "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
          "fifo": tarfile.FIFOTYPE}


def footer(toc_offset: int) -> bytes:
    """The footer: an empty gzip member whose extra field says where the TOC is."""
    sub = b"%016xSTARGZ" % toc_offset
    extra = b"SG" + len(sub).to_bytes(2, "little") + sub
    header = b"\x1f\x8b\x08\x04" + bytes(4) + b"\x00\xff" + len(extra).to_bytes(2, "little")
    # An empty final stored deflate block, then CRC32 and ISIZE of nothing.
    return header + extra + b"\x01\x00\x00\xff\xff" + bytes(8)


def toc_offset_of(tail: bytes) -> int | None:
    """The TOC's offset from a blob's last FOOTER_SIZE bytes; None when it is no
    eStargz footer (a plain gzip layer)."""
    if len(tail) != FOOTER_SIZE or tail[:4] != b"\x1f\x8b\x08\x04":
        return None
    if int.from_bytes(tail[10:12], "little") != 26 or tail[12:14] != b"SG" or \
            int.from_bytes(tail[14:16], "little") != 22 or tail[32:38] != b"STARGZ":
        return None
    try:
        return int(tail[16:32], 16)
    except ValueError:
        return None


def gunzip_member(data: bytes, limit: int, what: str) -> bytes:
    """The output of the gzip member at the start of ``data``, at most ``limit`` bytes."""
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(data, limit)
    except zlib.error as exc:
        raise HostileInput(f"{what}: not a gzip member ({exc})") from exc
    return out


@dataclass
class TocRead:
    index: LayerIndex
    toc_bytes: int  # the TOC's gzip member, as fetched
    fetched: int  # every byte read from the registry for it (footer included)


def read_layer_toc(client: RegistryClient, layer: Layer, what: str) -> TocRead | None:
    """The layer's index from its footer and TOC (two range requests); None when the
    blob has no eStargz footer (then it is a plain layer)."""
    if layer.size < FOOTER_SIZE + 512:
        return None
    tail = client.blob_range(layer.digest, layer.size - FOOTER_SIZE, FOOTER_SIZE)
    toc_at = toc_offset_of(tail)
    if toc_at is None:
        if layer.toc_digest:
            raise HostileInput(f"{what}: has a TOC digest annotation but no eStargz footer")
        return None
    data_end = layer.size - FOOTER_SIZE
    if not 0 <= toc_at < data_end or data_end - toc_at > MAX_TOC_BLOB:
        raise HostileInput(f"{what}: the eStargz footer puts the TOC at byte {toc_at} of "
                           f"{layer.size}: outside the blob or too large")
    member = client.blob_range(layer.digest, toc_at, data_end - toc_at)
    toc = toc_json(gunzip_member(member, MAX_TOC_BYTES, f"{what} TOC"), what)
    if layer.toc_digest and "sha256:" + hashlib.sha256(toc).hexdigest() != layer.toc_digest:
        raise HostileInput(f"{what}: its TOC does not match the layer's TOC digest "
                           f"{layer.toc_digest}")
    blob = RegistryBlob(client.ref.registry, client.ref.repository, layer.digest, layer.size,
                        toc_at)
    index = index_from_toc(toc, blob, layer.diff_id, what)
    return TocRead(index, len(member), len(tail) + len(member))


def toc_json(tar_bytes: bytes, what: str) -> bytes:
    """The TOC's JSON from its member's output: a tar entry named TOC_NAME."""
    try:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            member = tar.next()
            if member is None or member.name != TOC_NAME or not member.isreg():
                raise HostileInput(f"{what}: the eStargz TOC member holds no {TOC_NAME}")
            f = tar.extractfile(member)
            assert f is not None
            data = f.read()
    except tarfile.TarError as exc:
        raise HostileInput(f"{what}: unreadable eStargz TOC ({exc})") from exc
    if len(data) != member.size:
        raise HostileInput(f"{what}: the eStargz TOC is truncated")
    return data


def index_from_toc(toc: bytes, blob: RegistryBlob, diff_id: str, what: str) -> LayerIndex:
    """The layer's index: each TOC entry as the tar entry it describes (whiteouts, hard
    links and later-replaces-earlier as in a conversion), each file's chunks with the
    ranges of the blob that hold them."""
    try:
        doc = json.loads(toc)
    except ValueError as exc:
        raise HostileInput(f"{what}: the eStargz TOC is not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("version") != 1 or \
            not isinstance(doc.get("entries"), list):
        raise HostileInput(f"{what}: not an eStargz TOC (version 1 with entries)")
    items = doc["entries"]
    if len(items) > MAX_ENTRIES:
        raise HostileInput(f"{what}: the TOC lists {len(items)} entries; at most {MAX_ENTRIES}")
    files = _group(items, what)
    ends = sorted({o for f in files for o in f.offsets} | {blob.data_end})
    builder = TreeBuilder(what)
    for f in files:
        builder.add(f.member, functools.partial(f.fill, blob=blob, ends=ends, what=what))
    return LayerIndex(blob.digest, diff_id, builder.entries, blob)


class _File:
    """One TOC entry (a ``reg`` entry with its ``chunk`` entries after it)."""

    def __init__(self, member: tarfile.TarInfo):
        self.member = member
        # (offset in the blob, offset in the file, bytes, inner offset, sha256 hex)
        self.chunks: list[tuple[int, int, int, int, str]] = []

    @property
    def offsets(self) -> list[int]:
        return [c[0] for c in self.chunks]

    def fill(self, entry: Entry, blob: RegistryBlob, ends: list[int], what: str) -> None:
        at = 0
        for offset, chunk_offset, n, inner, digest in self.chunks:
            if chunk_offset != at:
                raise HostileInput(f"{what}: TOC entry {self.member.name[:200]!r}: a chunk at "
                                   f"{chunk_offset} where {at} was expected")
            # Up to the next member's start (a gzip member does not say its length).
            i = bisect.bisect_right(ends, offset)
            end = ends[i] if i < len(ends) else blob.data_end
            span = (offset, end - offset, inner)
            try:
                check_span(span, n, blob, self.member.name, what)
            except BadLayerIndex as exc:
                raise HostileInput(str(exc)) from exc
            entry.chunks.append((digest, n))
            entry.spans.append(span)
            at += n


def _group(items: list, what: str) -> list[_File]:
    files: list[_File] = []
    last: _File | None = None
    for item in items:
        if not isinstance(item, dict):
            raise HostileInput(f"{what}: malformed TOC entry")
        name = str(item.get("name", ""))
        kind = item.get("type")
        try:
            if kind == "chunk":
                if last is None or last.member.name != name:
                    raise HostileInput(f"{what}: TOC chunk of {name[:200]!r} follows no file "
                                       "of that name")
                _add_chunk(last, item, what)
                continue
            if name.strip("/") in HIDDEN or name.removeprefix("./") in HIDDEN:
                last = None
                continue
            if kind not in _TYPES:
                raise HostileInput(f"{what}: TOC entry {name[:200]!r} has type {kind!r}")
            last = _File(_member(item, name, kind))
            files.append(last)
            if kind == "reg" and last.member.size:
                _add_chunk(last, item, what)
        except (KeyError, TypeError, ValueError) as exc:
            raise HostileInput(f"{what}: malformed TOC entry {name[:200]!r} ({exc})") from exc
    for f in files:
        if f.member.isreg() and f.member.size and \
                sum(c[2] for c in f.chunks) != f.member.size:
            raise HostileInput(f"{what}: TOC entry {f.member.name[:200]!r}: its chunks cover "
                               f"{sum(c[2] for c in f.chunks)} of {f.member.size} bytes")
    return files


def _add_chunk(f: _File, item: dict, what: str) -> None:
    size = f.member.size
    chunk_offset = int(item.get("chunkOffset", 0))
    n = int(item.get("chunkSize", 0)) or size - chunk_offset  # 0: the rest of the file
    digest = str(item.get("chunkDigest", ""))
    if not _SHA256.match(digest):
        raise HostileInput(f"{what}: TOC entry {f.member.name[:200]!r} has no sha256 "
                           "chunkDigest: its contents cannot be verified")
    if not 0 < n <= MAX_SPAN_CHUNK or not 0 <= chunk_offset < size:
        raise HostileInput(f"{what}: TOC entry {f.member.name[:200]!r}: chunk of {n} bytes at "
                           f"{chunk_offset} of a {size}-byte file")
    f.chunks.append((int(item["offset"]), chunk_offset, n, int(item.get("innerOffset", 0)),
                     digest[7:]))


def _member(item: dict, name: str, kind: str) -> tarfile.TarInfo:
    """The tar entry a TOC entry describes (what ``TreeBuilder`` takes)."""
    m = tarfile.TarInfo(name)
    m.type = _TYPES[kind]
    m.mode = int(item.get("mode", 0)) & 0o7777
    m.uid, m.gid = int(item.get("uid", 0)), int(item.get("gid", 0))
    m.size = int(item.get("size", 0)) if kind == "reg" else 0
    if not 0 <= m.size < 1 << 40:
        raise ValueError(f"size {m.size}")
    m.linkname = str(item.get("linkName", ""))
    m.mtime = _mtime(str(item.get("modtime") or ""))
    xattrs = item.get("xattrs") or {}
    if not isinstance(xattrs, dict) or len(xattrs) > 64:
        raise ValueError("bad xattrs")
    # Values are bytes, base64 in JSON; kept as tar keeps them.
    m.pax_headers = {f"SCHILY.xattr.{k}": base64.b64decode(str(v), validate=True)
                     .decode("utf-8", "surrogateescape") for k, v in xattrs.items()}
    return m


@functools.lru_cache(maxsize=4096)  # a layer's files share a few times
def _mtime(value: str) -> int:
    if not value:
        return 0
    try:
        return int(datetime.datetime.fromisoformat(value).timestamp())
    except ValueError:
        return 0
