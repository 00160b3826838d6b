"""Convert one OCI layer, read once from its source, into the repository's chunk form:
its regular files cut into content-defined chunks (FastCDC, blake3, zstd; the
snapshot store's chunks, so identical files of any image or snapshot are stored
once) and a ``LayerIndex`` of every path, written after its chunks.

The stream is verified as ``unpack_layer`` verifies it (blob digest, diff ID, size
bounds, names that escape the layer); nothing is written to local disk.
"""

from __future__ import annotations

import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from pyfastcdc import FastCDC

from agentenv.snapshot import image_objects
from agentenv.snapshot.chunking import AVG_SIZE, MAX_SIZE, MIN_SIZE, compress, digest
from agentenv.snapshot.layer_index import OPAQUE_XATTR, Entry, LayerIndex, key_of
from agentenv.snapshot.lease import begin_commit
from agentenv.snapshot.manifest import ZERO
from agentenv.snapshot.repository import Repository

from .errors import HostileInput
from .unpack import OPAQUE, WHITEOUT, clean_name, read_layer

# Chunks compressed and stored at once: zstd frees the GIL and a posix_fs write waits
# on its fsync, so more writers than cores pay; the bound keeps memory small.
THREADS = 6
IN_FLIGHT = 32
LEASE_TTL_S = 600.0
GC_WAIT_S = 300.0


class _Uploader:
    """Hashes, compresses and stores chunks beside the tar reading (blake3 and zstd free
    the GIL); a chunk's digest is known once its future is done."""

    def __init__(self, repo: Repository):
        self.repo = repo
        self.stored_bytes = 0
        self.written: list[str] = []
        self._claimed: set[str] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="layer-chunks")
        self._slots = threading.Semaphore(IN_FLIGHT)
        self._futures: list[Future] = []

    def add(self, data: bytes) -> Future:
        self._slots.acquire()
        future = self._pool.submit(self._put, data)
        self._futures.append(future)
        return future

    def _put(self, data: bytes) -> str:
        try:
            d = digest(data)
            with self._lock:
                if d == ZERO or d in self._claimed:
                    return d
                self._claimed.add(d)
            if not self.repo.has_chunk(d):
                blob = compress(data)
                self.repo.put_chunk(d, blob)
                with self._lock:
                    self.stored_bytes += len(blob)
                    self.written.append(d)
            return d
        finally:
            self._slots.release()

    def finish(self) -> None:
        try:
            for f in self._futures:
                f.result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)


def convert_layer(chunks: Iterator[bytes], repo: Repository, layer_hex: str, *,
                  digest_: str = "", diff_id: str = "", declared_size: int = -1,
                  max_bytes: int = 1 << 40, what: str = "layer",
                  progress: Callable[[int], None] | None = None,
                  cancel: threading.Event | None = None) -> LayerIndex:
    """Read the layer's blob stream, store its chunks, then its index; the index.

    Under a commit lease, as a snapshot commit: the garbage collector does not take
    chunks written before the index that references them exists."""
    lease = begin_commit(repo, f"layer-{layer_hex[:16]}", LEASE_TTL_S, GC_WAIT_S)
    try:
        return _convert(chunks, repo, layer_hex, digest_=digest_, diff_id=diff_id,
                        declared_size=declared_size, max_bytes=max_bytes, what=what,
                        progress=progress, cancel=cancel)
    finally:
        lease.release()


def _convert(chunks: Iterator[bytes], repo: Repository, layer_hex: str, *, digest_: str,
             diff_id: str, declared_size: int, max_bytes: int, what: str,
             progress: Callable[[int], None] | None,
             cancel: threading.Event | None) -> LayerIndex:
    builder = TreeBuilder(what)
    uploader = _Uploader(repo)

    def add(tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        builder.add(member, lambda entry: _cut(tar, member, entry, uploader))

    got, tar_digest = read_layer(chunks, add,
                                 digest=digest_, diff_id=diff_id, declared_size=declared_size,
                                 max_bytes=max_bytes, what=what, progress=progress,
                                 cancel=cancel, done=uploader.finish)
    for entry in builder.entries.values():  # the workers are done: digests, not futures
        entry.chunks = [(f.result(), n) for f, n in entry.chunks]  # type: ignore[attr-defined]
    index = LayerIndex(got, tar_digest, builder.entries)
    sync = getattr(repo, "sync_chunks", None)  # posix_fs: the chunks' directory entries
    if sync is not None:
        sync(uploader.written)
    # Last, as a snapshot's manifest: an index that exists names only stored chunks;
    # its use stamped first (under the lease), so the collector keeps it.
    image_objects.stamp(repo, layer_hex, time.time(), socket.gethostname())
    repo.put_object(key_of(layer_hex), index.dump())
    return index


def _cut(tar: tarfile.TarFile, member: tarfile.TarInfo, entry: Entry, up: _Uploader) -> None:
    """A regular file's chunks (futures until the uploader is done)."""
    data = tar.extractfile(member)
    if data is not None and 0 < member.size <= MAX_SIZE:
        whole = data.read()  # one chunk (most files): no cutting
        entry.chunks.append((up.add(whole), len(whole)))  # type: ignore[arg-type]
    elif data is not None and member.size:
        cdc = FastCDC(AVG_SIZE, min_size=MIN_SIZE, max_size=MAX_SIZE)
        for piece in cdc.cut_stream(data):
            chunk = bytes(piece.data)
            entry.chunks.append((up.add(chunk), len(chunk)))  # type: ignore[arg-type]


class TreeBuilder:
    """Tar entries in order, with tar's rule that a later entry replaces an earlier one
    (whiteouts, opaque directories, hard links). A regular file's chunks come from
    ``fill``: cut from the tar stream (a conversion) or read from an eStargz TOC."""

    def __init__(self, what: str):
        self.what = what
        self.entries: dict[str, Entry] = {"": Entry("d", mode=0o755)}

    def _parents(self, rel: str) -> None:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            e = self.entries.get(sub)
            if e is None:
                self.entries[sub] = Entry("d", mode=0o755)
            elif e.type != "d":
                raise HostileInput(f"{self.what}: entry {rel[:200]!r}: {sub!r} is not a "
                                   "directory")

    def _drop(self, rel: str) -> None:
        """A path replaced by a non-directory: whatever was below it goes too."""
        old = self.entries.pop(rel, None)
        if old is not None and old.type == "d":
            prefix = rel + "/"
            for p in [p for p in self.entries if p.startswith(prefix)]:
                del self.entries[p]

    def add(self, member: tarfile.TarInfo, fill: Callable[[Entry], None]) -> None:
        rel = clean_name(member.name, self.what)
        def new(kind: str, **kw) -> Entry:
            return Entry(kind, mode=member.mode & 0o7777, uid=member.uid, gid=member.gid,
                         mtime=int(member.mtime), **kw)

        if not rel:
            if member.isdir():
                root = self.entries[""]
                self.entries[""] = new("d", xattrs=root.xattrs)
            return
        self._parents(rel)
        parent, _, base = rel.rpartition("/")
        if base.startswith(WHITEOUT):
            if base == OPAQUE:
                self.entries[parent].xattrs[OPAQUE_XATTR] = "y"
            elif not base.startswith(WHITEOUT + WHITEOUT):  # aufs bookkeeping is skipped
                name = base[len(WHITEOUT):]
                if name in ("", ".", ".."):
                    raise HostileInput(f"{self.what}: malformed whiteout {rel!r}")
                target = f"{parent}/{name}" if parent else name
                self._drop(target)
                self.entries[target] = Entry("w", mode=0)
            return
        if member.isdir():
            old = self.entries.get(rel)
            if old is not None and old.type == "d":
                fresh = new("d")
                old.mode, old.uid, old.gid, old.mtime = (fresh.mode, fresh.uid, fresh.gid,
                                                        fresh.mtime)
                old.xattrs.update(_xattrs(member))
                return
            self._drop(rel)
            self.entries[rel] = new("d", xattrs=_xattrs(member))
            return
        if member.ischr() or member.isblk():
            return  # a sandbox never gets a host device from an image
        if member.isreg():
            entry = new("f", size=member.size, xattrs=_xattrs(member))
            fill(entry)
            if sum(n for _, n in entry.chunks) != member.size:
                raise HostileInput(f"{self.what}: entry {member.name[:200]!r} is truncated")
        elif member.issym():
            if not member.linkname:
                raise HostileInput(f"{self.what}: symlink {rel[:200]!r} without a target")
            entry = new("l", link=member.linkname)
        elif member.islnk():
            target = clean_name(member.linkname, self.what)
            source = self.entries.get(target)
            if not target or source is None or source.type != "f":
                raise HostileInput(f"{self.what}: hard link {rel!r} to {target!r}, which is "
                                   "not a file of this layer")
            # Its own inode here: the same content and metadata, chunks shared.
            entry = Entry("f", mode=source.mode, uid=source.uid, gid=source.gid,
                          mtime=source.mtime, size=source.size, chunks=list(source.chunks),
                          xattrs=dict(source.xattrs), spans=list(source.spans))
        elif member.isfifo():
            entry = new("p")
        else:
            return
        self._drop(rel)
        self.entries[rel] = entry


def _xattrs(member: tarfile.TarInfo) -> dict[str, str]:
    out = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            name = key[len("SCHILY.xattr."):]
            if not name.startswith("trusted.overlay."):  # a layer must not forge these
                out[name] = value.encode("utf-8", "surrogateescape").decode("latin-1")
    return out
