"""The FUSE server of one lazily loaded layer: a subprocess per layer mount, started by
``lazy.LazyLayers`` (``python -m agentenv.images.lazyfs INDEX MOUNTPOINT CHUNKS``, the
repository settings as JSON on stdin), ended by unmounting its mount point.

Read-only. Lookups, ``getattr``, ``readdir``, ``readlink`` and xattrs answer from
the layer's index (loaded and checked before mounting); reads fetch the chunks they
cover, from the node's chunk cache (``CHUNKS/<digest>``, raw bytes) or else from the
repository, verify each against its blake3 digest (a mismatch is dropped and fetched
again once, then the read fails with EIO and a log line naming the chunk), and keep
them in the cache. Files are opened with ``keep_cache`` and every answer carries long
timeouts: once read, a file is served from the kernel's page cache at local-disk
speed, with no call into this process.
"""

from __future__ import annotations

import bisect
import errno
import json
import logging
import os
import stat
import sys
import uuid
from collections import Counter, OrderedDict
from pathlib import Path

import pyfuse3
import trio

from agentenv.snapshot.backends import open_repository
from agentenv.snapshot.chunking import decompress_verified, verify_raw
from agentenv.snapshot.errors import SnapshotError
from agentenv.snapshot.layer_index import BadLayerIndex, Entry, LayerIndex, load
from agentenv.snapshot.manifest import ZERO

log = logging.getLogger("agentenv.lazyfs")
TIMEOUT = 86400.0  # the layer never changes: the kernel may cache every answer
MEMORY_CHUNKS = 64  # recently read chunks kept decoded (a chunk spans a few reads)
ROOT = pyfuse3.ROOT_INODE


def chunk_path(chunks_dir: Path, d: str) -> Path:
    return chunks_dir / d[:2] / d


class LazyLayerFS(pyfuse3.Operations):
    def __init__(self, index: LayerIndex, repo, chunks_dir: Path, name: str):
        super().__init__()
        self.repo = repo
        self.chunks_dir = chunks_dir
        self.name = name
        # Inode numbers: ROOT for "", then the index's order.
        self.paths = sorted(index.entries)
        self.entries: list[Entry] = [index.entries[p] for p in self.paths]
        self.inode_of = {p: ROOT + i for i, p in enumerate(self.paths)}
        self.children: dict[int, dict[bytes, int]] = {}
        for p, ino in self.inode_of.items():
            if p:
                parent, _, base = p.rpartition("/")
                self.children.setdefault(self.inode_of[parent], {})[os.fsencode(base)] = ino
        self.listing = {ino: sorted(names.items()) for ino, names in self.children.items()}
        self._offsets: dict[int, list[int]] = {}
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self.fetched = 0  # bytes (as stored) read from the repository
        self.calls: Counter[str] = Counter()  # requests served, logged at the end

    def _entry(self, inode: int) -> Entry:
        i = inode - ROOT
        if not 0 <= i < len(self.entries):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.entries[i]

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        e = self._entry(inode)
        a = pyfuse3.EntryAttributes()
        kind = {"d": stat.S_IFDIR, "f": stat.S_IFREG, "l": stat.S_IFLNK, "p": stat.S_IFIFO,
                "w": stat.S_IFCHR}[e.type]
        a.st_ino = inode
        a.st_mode = kind | e.mode
        a.st_nlink = 2 if e.type == "d" else 1
        a.st_uid, a.st_gid = e.uid, e.gid
        a.st_rdev = 0  # a whiteout is the 0/0 character device
        a.st_size = e.size if e.type == "f" else len(os.fsencode(e.link)) if e.link else 0
        a.st_blksize = 4096
        a.st_blocks = (a.st_size + 511) // 512
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = e.mtime * 1_000_000_000
        a.entry_timeout = a.attr_timeout = TIMEOUT
        return a

    async def lookup(self, parent_inode, name, ctx=None):
        self.calls["lookup"] += 1
        ino = self.children.get(parent_inode, {}).get(bytes(name))
        if ino is None:
            if name == b".":
                return self._attr(parent_inode)
            # A negative entry the kernel caches: overlayfs asks every lower layer.
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0
            a.entry_timeout = TIMEOUT
            return a
        return self._attr(ino)

    async def getattr(self, inode, ctx=None):
        self.calls["getattr"] += 1
        return self._attr(inode)

    async def readlink(self, inode, ctx):
        e = self._entry(inode)
        if e.type != "l":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(e.link)

    async def opendir(self, inode, ctx):
        self.calls["opendir"] += 1
        if self._entry(inode).type != "d":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        names = self.listing.get(fh, [])
        for i in range(start_id, len(names)):
            name, ino = names[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i + 1):
                return

    async def open(self, inode, flags, ctx):
        self.calls["open"] += 1
        if self._entry(inode).type != "f":
            raise pyfuse3.FUSEError(errno.EINVAL)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        self.calls["read"] += 1
        e = self._entry(fh)
        if off >= e.size or size <= 0:
            return b""
        end = min(e.size, off + size)
        starts = self._offsets.get(fh)
        if starts is None:
            starts, at = [], 0
            for _, n in e.chunks:
                starts.append(at)
                at += n
            self._offsets[fh] = starts
        i = bisect.bisect_right(starts, off) - 1
        out = bytearray()
        while i < len(e.chunks) and starts[i] < end:
            d, n = e.chunks[i]
            data = bytes(n) if d == ZERO else await self._chunk(d, n, fh)
            lo = max(off - starts[i], 0)
            hi = min(end - starts[i], n)
            out += data[lo:hi]
            i += 1
        return bytes(out)

    async def _chunk(self, d: str, n: int, inode: int) -> bytes:
        data = self._memory.get(d)
        if data is not None:
            self._memory.move_to_end(d)
            return data
        try:
            data = await trio.to_thread.run_sync(self._load, d, n, self.paths[inode - ROOT])
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # an error must fail this read, not end the server
            log.exception("lazyfs %s: reading chunk %s failed", self.name, d)
            raise pyfuse3.FUSEError(errno.EIO) from exc
        self._memory[d] = data
        if len(self._memory) > MEMORY_CHUNKS:
            self._memory.popitem(last=False)
        return data

    def _load(self, d: str, n: int, path: str) -> bytes:
        """A chunk from the cache, else from the repository; verified either way."""
        cached = chunk_path(self.chunks_dir, d)
        try:
            data = cached.read_bytes()
            if verify_raw(data, d, n):
                os.utime(cached)  # its last use, for the cache's LRU
                return data
            log.warning("lazyfs %s: cached chunk %s is corrupt; fetching it again",
                        self.name, d)
            cached.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        for attempt in (1, 2):
            try:
                blob = self.repo.get_chunk(d)
                self.fetched += len(blob)
                data = decompress_verified(blob, d, n, f"/{path} of layer {self.name}")
                break
            except SnapshotError as exc:
                log.error("lazyfs %s: chunk refused (attempt %d of 2): %s", self.name, attempt,
                          exc)
        else:
            raise pyfuse3.FUSEError(errno.EIO)
        tmp = cached.with_name(f".{d}.{uuid.uuid4().hex[:12]}.tmp")
        try:  # a cache that cannot keep it (disk full) only costs a fetch next time
            cached.parent.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, cached)
        except OSError as exc:
            log.warning("lazyfs %s: chunk %s not cached: %s", self.name, d, exc)
            tmp.unlink(missing_ok=True)
        return data

    async def getxattr(self, inode, name, ctx):
        value = self._entry(inode).xattrs.get(os.fsdecode(name))
        if value is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value.encode("latin-1")

    async def listxattr(self, inode, ctx):
        return [os.fsencode(k) for k in self._entry(inode).xattrs]

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_files = len(self.entries)
        s.f_namemax = 255
        return s


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
    repo = open_repository(json.loads(sys.stdin.read()))
    fs = LazyLayerFS(index, repo, Path(chunks), name)
    options = set(pyfuse3.default_options) | {"fsname=aenv-lazy", "ro", "allow_other"}
    pyfuse3.init(fs, mountpoint, options)
    print("ready", flush=True)  # mounted: the node may stack it now
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)
        repo.close()
        log.info("lazyfs %s: unmounted; %d bytes fetched from the repository; requests: %s",
                 name, fs.fetched, dict(fs.calls))


if __name__ == "__main__":
    main()
