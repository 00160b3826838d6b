"""The FUSE server of one lazily loaded layer: a subprocess per layer mount, started by
``lazy.LazyLayers`` (``python -m agentenv.images.lazyfs INDEX MOUNTPOINT CHUNKS``, its
settings as JSON on stdin: the repository's, and the registry credentials of an
eStargz layer), ended by unmounting its mount point.

Read-only. Lookups, ``getattr``, ``readdir``, ``readlink`` and xattrs answer from the
layer's index (loaded and checked before mounting); reads fetch the chunks they cover,
from the node's chunk cache (``CHUNKS/<digest>``, raw bytes) or else from the layer's
source (``layer_chunks``: the repository, or ranges of the registry blob for an eStargz
layer or a plain gzip layer with checkpoints), verify each against its digest (a
mismatch is dropped and fetched again once, then the read fails with EIO and a log line
naming the chunk), and keep them in the cache. The kernel's protocol is spoken directly
(``fuse_wire``): opening a file or a directory is no round trip here (the kernel's
no-open mode keeps their data and listings cached) and every answer carries long timeouts,
so once read a file is served from the kernel's page cache at local-disk speed, with no
call into this process. Metadata is answered in the thread reading the device; reads in
a few threads, so that fetches from the repository overlap.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import json
import logging
import os
import stat
import sys
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from agentenv.snapshot.errors import SnapshotError
from agentenv.snapshot.layer_index import BadLayerIndex, Entry, LayerIndex, load
from agentenv.snapshot.manifest import ZERO

from . import fuse_wire
from .fuse_wire import (
    READ_IN,
    XATTR_SIZE,
    Attr,
    FuseError,
    Handler,
    Session,
    attr_out,
    dirents,
    entry_out,
    statfs_out,
    xattr_reply,
)
from .layer_chunks import ChunkSource, GzipSpans, RegistryChunks, RepositoryChunks
from .prefetch import Prefetch

log = logging.getLogger("agentenv.lazyfs")
TIMEOUT = 86400  # seconds; the layer never changes: the kernel may cache every answer
MEMORY_CHUNKS = 64  # recently read chunks kept decoded (a chunk spans a few reads)
MEMORY_BYTES = 32 << 20  # and at most this much of them (eStargz chunks are 4 MiB)
ROOT = 1  # the kernel's inode number of the mount's root
READ_THREADS = 4  # reads that fetch chunks, at once (readahead asks for several)
KINDS = {"d": stat.S_IFDIR, "f": stat.S_IFREG, "l": stat.S_IFLNK, "p": stat.S_IFIFO,
         "w": stat.S_IFCHR}


def chunk_path(chunks_dir: Path, d: str) -> Path:
    return chunks_dir / d[:2] / d


class LazyLayerFS:
    def __init__(self, index: LayerIndex, source: ChunkSource, chunks_dir: Path, name: str):
        self.source = source
        self.chunks_dir = chunks_dir
        self.name = name
        # Inode numbers: ROOT for "", then the index's order.
        self.paths = sorted(index.entries)
        self.entries: list[Entry] = [index.entries[p] for p in self.paths]
        self.attrs = [self._attr(ROOT + i, e) for i, e in enumerate(self.entries)]
        self.inode_of = {p: ROOT + i for i, p in enumerate(self.paths)}
        self.children: dict[int, dict[bytes, int]] = {}
        for p, ino in self.inode_of.items():
            if p:
                parent, _, base = p.rpartition("/")
                self.children.setdefault(self.inode_of[parent], {})[os.fsencode(base)] = ino
        self.listing = {ino: [(name, i, self.attrs[i - ROOT].mode)
                              for name, i in sorted(names.items())]
                        for ino, names in self.children.items()}
        self._offsets: dict[int, list[int]] = {}
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_bytes = 0
        self._flights: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.prefetch: Prefetch | None = None  # the first run's files: noted or fetched

    def is_file(self, path: str) -> bool:
        i = self.inode_of.get(path)
        return i is not None and self.entries[i - ROOT].type == "f"

    def fetch_file(self, path: str) -> int:
        """The file's chunks into the cache, ahead of its reads; bytes fetched."""
        inode = self.inode_of[path]
        e = self.entries[inode - ROOT]
        fetched = 0
        for i, (d, n) in enumerate(e.chunks):
            if d == ZERO or chunk_path(self.chunks_dir, d).exists():
                continue
            self._chunk(d, n, e.spans[i] if e.spans else None, inode)
            fetched += n
        return fetched

    @staticmethod
    def _attr(inode: int, e: Entry) -> Attr:
        size = e.size if e.type == "f" else len(os.fsencode(e.link)) if e.link else 0
        # A whiteout is the 0/0 character device (rdev 0).
        return Attr(ino=inode, mode=KINDS[e.type] | e.mode, size=size, uid=e.uid, gid=e.gid,
                    mtime=e.mtime, nlink=2 if e.type == "d" else 1)

    def _index(self, inode: int) -> int:
        i = inode - ROOT
        if not 0 <= i < len(self.entries):
            raise FuseError(errno.ENOENT)
        return i

    def handlers(self) -> dict[int, Handler]:
        return {fuse_wire.LOOKUP: self.lookup, fuse_wire.GETATTR: self.getattr,
                fuse_wire.READLINK: self.readlink, fuse_wire.READ: self.read,
                fuse_wire.READDIR: self.readdir, fuse_wire.GETXATTR: self.getxattr,
                fuse_wire.LISTXATTR: self.listxattr, fuse_wire.STATFS: self.statfs}

    # Opening a file or a directory has no handler: ENOSYS puts the kernel in its
    # no-open mode (no open or release round trips; data and listings cached).

    def lookup(self, parent: int, body: bytes) -> bytes:
        name = body[:body.index(0)] if 0 in body else body
        ino = self.children.get(parent, {}).get(name)
        if ino is None:
            if name == b".":
                return entry_out(self.attrs[self._index(parent)], TIMEOUT)
            # A negative entry the kernel caches: overlayfs asks every lower layer.
            return entry_out(None, TIMEOUT)
        return entry_out(self.attrs[ino - ROOT], TIMEOUT)

    def getattr(self, inode: int, body: bytes) -> bytes:
        return attr_out(self.attrs[self._index(inode)], TIMEOUT)

    def readlink(self, inode: int, body: bytes) -> bytes:
        e = self.entries[self._index(inode)]
        if e.type != "l":
            raise FuseError(errno.EINVAL)
        return os.fsencode(e.link)

    def readdir(self, inode: int, body: bytes) -> bytes:
        if self.entries[self._index(inode)].type != "d":
            raise FuseError(errno.ENOTDIR)
        _, off, size, _ = READ_IN.unpack_from(body)
        return dirents(self.listing.get(inode, []), off, size)

    def read(self, inode: int, body: bytes) -> bytes:
        e = self.entries[self._index(inode)]
        if e.type != "f":
            raise FuseError(errno.EISDIR if e.type == "d" else errno.EINVAL)
        _, off, size, _ = READ_IN.unpack_from(body)
        if off >= e.size or size <= 0:
            return b""
        if self.prefetch is not None:
            self.prefetch.opened(self.paths[inode - ROOT])
        end = min(e.size, off + size)
        starts = self._offsets.get(inode)
        if starts is None:
            starts, at = [], 0
            for _, n in e.chunks:
                starts.append(at)
                at += n
            self._offsets[inode] = starts
        i = bisect.bisect_right(starts, off) - 1
        out = bytearray()
        while i < len(e.chunks) and starts[i] < end:
            d, n = e.chunks[i]
            data = bytes(n) if d == ZERO else \
                self._chunk(d, n, e.spans[i] if e.spans else None, inode)
            lo = max(off - starts[i], 0)
            hi = min(end - starts[i], n)
            out += data[lo:hi]
            i += 1
        return bytes(out)

    def _chunk(self, d: str, n: int, span: tuple[int, int, int] | None, inode: int) -> bytes:
        with self._lock:
            data = self._cached(d)
            if data is not None:
                return data
            # One fetch per chunk: readahead asks for several parts of one chunk at once.
            flight = self._flights.setdefault(d, threading.Lock())
        with flight:
            with self._lock:
                data = self._cached(d)
            if data is not None:
                return data
            try:
                data = self._load(d, n, span, self.paths[inode - ROOT])
            except FuseError:
                raise
            except Exception as exc:  # an error must fail this read, not end the server
                log.exception("lazyfs %s: reading chunk %s failed", self.name, d)
                raise FuseError(errno.EIO) from exc
            finally:
                with self._lock:
                    self._flights.pop(d, None)
            with self._lock:
                self._memory[d] = data
                self._memory_bytes += len(data)
                while len(self._memory) > MEMORY_CHUNKS or self._memory_bytes > MEMORY_BYTES:
                    self._memory_bytes -= len(self._memory.popitem(last=False)[1])
        return data

    def _cached(self, d: str) -> bytes | None:
        """(Under the lock.) A chunk kept decoded in memory."""
        data = self._memory.get(d)
        if data is not None:
            self._memory.move_to_end(d)
        return data

    def _load(self, d: str, n: int, span: tuple[int, int, int] | None, path: str) -> bytes:
        """A chunk from the cache, else from the layer's source; verified either way."""
        cached = chunk_path(self.chunks_dir, d)
        try:
            data = cached.read_bytes()
            if self.source.verify(data, d, n):
                os.utime(cached)  # its last use, for the cache's LRU
                return data
            log.warning("lazyfs %s: cached chunk %s is corrupt; fetching it again",
                        self.name, d)
            cached.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        for attempt in (1, 2):
            try:
                data = self.source.fetch(d, n, span, f"/{path} of layer {self.name}")
                break
            except SnapshotError as exc:
                log.error("lazyfs %s: chunk refused (attempt %d of 2): %s", self.name, attempt,
                          exc)
        else:
            raise FuseError(errno.EIO)
        tmp = cached.with_name(f".{d}.{uuid.uuid4().hex[:12]}.tmp")
        try:  # a cache that cannot keep it (disk full) only costs a fetch next time
            cached.parent.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, cached)
        except OSError as exc:
            log.warning("lazyfs %s: chunk %s not cached: %s", self.name, d, exc)
            tmp.unlink(missing_ok=True)
        return data

    def getxattr(self, inode: int, body: bytes) -> bytes:
        size, _ = XATTR_SIZE.unpack_from(body)
        name = body[XATTR_SIZE.size:].split(b"\0", 1)[0]
        value = self.entries[self._index(inode)].xattrs.get(os.fsdecode(name))
        if value is None:
            raise FuseError(errno.ENODATA)
        return xattr_reply(value.encode("latin-1"), size)

    def listxattr(self, inode: int, body: bytes) -> bytes:
        size, _ = XATTR_SIZE.unpack_from(body)
        names = b"".join(os.fsencode(k) + b"\0" for k in self.entries[self._index(inode)].xattrs)
        return xattr_reply(names, size)

    def statfs(self, inode: int, body: bytes) -> bytes:
        return statfs_out(len(self.entries))


def main() -> None:
    index_file, mountpoint, chunks = sys.argv[1:4]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = Path(index_file).name.split(".")[0][:12]
    try:
        index = load(Path(index_file).read_bytes(), f"layer {name}")
    except (OSError, BadLayerIndex) as exc:
        print(f"error: {exc}", flush=True)
        sys.exit(2)
    settings = json.loads(sys.stdin.read())
    if "repository" not in settings:  # the repository's settings alone (older callers)
        settings = {"repository": settings}
    source: ChunkSource
    creds = settings.get("registry") or {}
    user, password = str(creds.get("username", "")), str(creds.get("password", ""))
    timeout = min(max(float(settings.get("registry_timeout_s", 30.0)), 0.1), 300.0)
    origin = settings.get("origin")
    if index.blob is not None and isinstance(origin, list) and len(origin) == 2:
        # This node's registry for the blob (the index may have been made from another).
        index.blob = dataclasses.replace(index.blob, registry=str(origin[0]),
                                         repository=str(origin[1]))
    if index.blob is not None and index.gzip is not None:
        source = GzipSpans(index.blob, index.gzip, user, password, timeout)
    elif index.blob is not None:
        source = RegistryChunks(index.blob, user, password, timeout)
    else:
        source = RepositoryChunks(settings["repository"])
    fs = LazyLayerFS(index, source, Path(chunks), name)
    if settings.get("prefetch") and settings.get("repository"):
        fs.prefetch = Prefetch(Path(index_file).name.split(".")[0], settings["repository"],
                               name, fs.is_file, fs.fetch_file)
    try:
        fd = fuse_wire.mount(Path(mountpoint), "aenv-lazy")
    except OSError as exc:
        print(f"error: {exc}", flush=True)
        sys.exit(2)
    print("ready", flush=True)  # mounted: the node may stack it now
    session = Session(fd, fs.handlers(), slow={fuse_wire.READ}, threads=READ_THREADS)
    if fs.prefetch is not None:
        fs.prefetch.start()
    try:
        session.run()
    finally:
        if fs.prefetch is not None:
            fs.prefetch.stop()
        source.close()
        log.info("lazyfs %s: unmounted; %d bytes fetched from the %s; requests: %s", name,
                 source.fetched, "registry" if index.blob else "repository",
                 json.dumps(session.requests))


if __name__ == "__main__":
    main()
