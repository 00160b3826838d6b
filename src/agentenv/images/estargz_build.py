"""Write an eStargz layer from a plain tar stream (what ``estargz`` reads): every
tar header in shared gzip members, each regular file's payload in members of its
own (one per ``chunk_size`` bytes of a large file), the no-prefetch landmark first,
then the TOC (``stargz.index.json``) as the last tar entry and the footer. The result
is one valid gzip stream of one valid tar: ``tar -xzf`` unpacks it anywhere (with
``stargz.index.json`` and the landmark as two extra files).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import json
import stat
import tarfile
import zlib
from dataclasses import dataclass
from typing import IO

from .estargz import HIDDEN, TOC_NAME, footer

CHUNK_SIZE = 4 << 20
LANDMARK = ".no.prefetch.landmark"
_MODE_BITS = {tarfile.DIRTYPE: stat.S_IFDIR, tarfile.SYMTYPE: stat.S_IFLNK,
              tarfile.CHRTYPE: stat.S_IFCHR, tarfile.BLKTYPE: stat.S_IFBLK,
              tarfile.FIFOTYPE: stat.S_IFIFO}
_KINDS = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink",
          tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo"}


@dataclass(frozen=True)
class EstargzLayer:
    digest: str  # sha256:... of the blob
    size: int
    diff_id: str  # sha256:... of the tar it decompresses to
    toc_digest: str  # sha256:... of the TOC's JSON (the descriptor's annotation)


class _Members:
    """Gzip members written one after another; the position, the blob's digest and the
    uncompressed stream's digest as they go."""

    def __init__(self, out: IO[bytes], level: int):
        self.out = out
        self.level = level
        self.pos = 0
        self.blob = hashlib.sha256()
        self.tar = hashlib.sha256()
        self._z: zlib._Compress | None = None

    def _emit(self, data: bytes) -> None:
        if data:
            self.out.write(data)
            self.blob.update(data)
            self.pos += len(data)

    def write(self, data: bytes) -> None:
        if self._z is None:
            self._z = zlib.compressobj(self.level, zlib.DEFLATED, 31)
        self.tar.update(data)
        self._emit(self._z.compress(data))

    def end_member(self) -> None:
        if self._z is not None:
            self._emit(self._z.flush())
            self._z = None

    def raw(self, data: bytes) -> None:
        self.end_member()
        self._emit(data)


def build_estargz(src: IO[bytes], out: IO[bytes], *, chunk_size: int = CHUNK_SIZE,
                  level: int = 6) -> EstargzLayer:
    """Read the tar ``src`` (plain, or compressed as tarfile detects), write the eStargz
    blob to ``out``."""
    w = _Members(out, level)
    entries: list[dict] = []
    landmark = tarfile.TarInfo(LANDMARK)
    landmark.size, landmark.mode = 1, 0o644
    _add(w, landmark, io.BytesIO(b"\x0f"), entries, chunk_size)
    with tarfile.open(fileobj=src, mode="r|*") as tar:
        for member in tar:
            if member.name.strip("/").removeprefix("./") in HIDDEN:
                continue  # a layer converted again: its old TOC and landmarks go
            data = tar.extractfile(member) if member.isreg() else None
            _add(w, member, data, entries, chunk_size)
    w.end_member()
    toc_at = w.pos
    toc = json.dumps({"version": 1, "entries": entries}, separators=(",", ":")).encode()
    info = tarfile.TarInfo(TOC_NAME)
    info.size, info.mode = len(toc), 0o644
    w.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + toc +
            bytes(-len(toc) % 512) + bytes(1024))  # the entry, then the tar's end
    w.raw(footer(toc_at))
    return EstargzLayer("sha256:" + w.blob.hexdigest(), w.pos, "sha256:" + w.tar.hexdigest(),
                        "sha256:" + hashlib.sha256(toc).hexdigest())


def _add(w: _Members, m: tarfile.TarInfo, data: IO[bytes] | None, entries: list[dict],
         chunk_size: int) -> None:
    w.write(m.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
    entry = _toc_entry(m)
    entries.append(entry)
    if not m.isreg() or not m.size:
        return
    assert data is not None
    whole = hashlib.sha256()
    done = 0
    while done < m.size:
        piece = data.read(min(chunk_size, m.size - done))
        if not piece:
            raise ValueError(f"tar entry {m.name!r} is truncated")
        w.end_member()  # each chunk starts a gzip member: its offset is where it is read
        at = w.pos
        w.write(piece)
        w.end_member()
        whole.update(piece)
        last = done + len(piece) == m.size
        chunk = entry if done == 0 else {"name": m.name, "type": "chunk"}
        chunk.update({"offset": at, "chunkOffset": done,
                      "chunkSize": 0 if last else len(piece),
                      "chunkDigest": "sha256:" + hashlib.sha256(piece).hexdigest()})
        if done:
            entries.append(chunk)
        done += len(piece)
    entry["digest"] = "sha256:" + whole.hexdigest()
    w.write(bytes(-m.size % 512))  # the payload's padding, with the next headers


def _toc_entry(m: tarfile.TarInfo) -> dict:
    kind = "reg" if m.isreg() else _KINDS.get(m.type, "reg")
    entry: dict = {"name": m.name, "type": kind,
                   "mode": _MODE_BITS.get(m.type, stat.S_IFREG) | (m.mode & 0o7777),
                   "uid": m.uid, "gid": m.gid,
                   "modtime": datetime.datetime.fromtimestamp(int(m.mtime), datetime.UTC)
                   .strftime("%Y-%m-%dT%H:%M:%SZ")}
    if m.uname:
        entry["userName"] = m.uname
    if m.gname:
        entry["groupName"] = m.gname
    if kind == "reg":
        entry["size"] = m.size
    if m.issym() or m.islnk():
        entry["linkName"] = m.linkname
    if m.ischr() or m.isblk():
        entry["devMajor"], entry["devMinor"] = m.devmajor, m.devminor
    xattrs = {k[len("SCHILY.xattr."):]: base64.b64encode(
        v.encode("utf-8", "surrogateescape")).decode()
        for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
    if xattrs:
        entry["xattrs"] = xattrs
    return entry
