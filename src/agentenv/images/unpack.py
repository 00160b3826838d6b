"""Unpack one layer tar stream into a directory, safely, in overlayfs format.

The stream is read once: the compressed bytes are hashed against the layer's
digest and the tar bytes against its diff ID while entries are written. Every
entry must stay inside the layer: absolute names, ``..`` and writes through a
symlink are refused (the whole layer is rejected). Whiteouts become what a
kernel overlay mount understands: ``.wh.x`` a 0/0 character device ``x``,
``.wh..wh..opq`` the xattr ``trusted.overlay.opaque=y`` on its directory.
Device nodes are skipped: a sandbox never gets a host device from an image.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import queue
import shutil
import stat
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

from .errors import HostileInput, PullCancelled

log = logging.getLogger(__name__)
CHUNK = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
OPAQUE = ".wh..wh..opq"
WHITEOUT = ".wh."
ENTRY_OVERHEAD = 512  # bytes counted per entry on top of its data, for the cache budget


class _Compressed(io.RawIOBase):
    """The blob's chunks as a raw stream that hashes, counts and bounds what it reads."""

    def __init__(self, chunks: Iterator[bytes], limit: int, what: str,
                 progress: Callable[[int], None] | None, cancel: threading.Event | None):
        self._chunks = chunks
        self._chunk = memoryview(b"")
        self._limit = limit
        self._what = what
        self._progress = progress
        self._cancel = cancel
        self.hash = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def _pull(self) -> bool:
        if self._cancel is not None and self._cancel.is_set():
            raise PullCancelled(f"{self._what}: pull cancelled")
        try:
            chunk = next(self._chunks)
        except StopIteration:
            return False
        self.hash.update(chunk)
        self.count += len(chunk)
        if self.count > self._limit:
            raise HostileInput(f"{self._what}: blob is larger than the {self._limit} bytes "
                               "its descriptor declares")
        if self._progress is not None:
            self._progress(self.count)
        self._chunk = memoryview(chunk)
        return True

    def readinto(self, buffer) -> int:
        while not self._chunk:
            if not self._pull():
                return 0
        n = min(len(buffer), len(self._chunk))
        buffer[:n] = self._chunk[:n]
        self._chunk = self._chunk[n:]
        return n


class _Tar(io.RawIOBase):
    """The uncompressed tar bytes of a layer (gzip, zstd or plain), hashed and bounded."""

    def __init__(self, source: io.BufferedReader, max_bytes: int, what: str,
                 gzip: Callable[[], Any] | None = None):
        self.source = source
        # A gzip member's decompressor: zlib's, or one recording checkpoints (gzip_index).
        self._new_gzip = gzip or (lambda: zlib.decompressobj(wbits=31))
        self.hash = hashlib.sha256()
        self.count = 0
        self._max = max_bytes
        self._what = what
        self._pending = memoryview(b"")
        magic = source.peek(4)[:4]
        self.kind = ("gzip" if magic[:2] == GZIP_MAGIC else
                     "zstd" if magic == ZSTD_MAGIC else "tar")
        self.gzip = self._new_gzip() if self.kind == "gzip" else None
        self._zstd = (zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)
                      if self.kind == "zstd" else None)

    def readable(self) -> bool:
        return True

    def _inflate(self) -> bytes:
        """The next piece of gzip output, at most CHUNK bytes (bounds a bomb's memory)."""
        assert self.gzip is not None
        while True:
            if self.gzip.unconsumed_tail:
                out = self.gzip.decompress(self.gzip.unconsumed_tail, CHUNK)
            elif self.gzip.eof:
                rest = self.gzip.unused_data or self.source.read1(CHUNK)
                if not rest:
                    return b""
                # Concatenated gzip members are one stream (as gzip(1) reads them).
                self.gzip = self._new_gzip()
                out = self.gzip.decompress(rest, CHUNK)
            else:
                data = self.source.read1(CHUNK)
                if not data:
                    raise HostileInput(f"{self._what}: gzip stream is truncated or corrupt")
                out = self.gzip.decompress(data, CHUNK)
            if out:
                return out

    def next_chunk(self) -> bytes:
        """The next piece of tar bytes; at the end (b"") the blob has been read whole."""
        if self.gzip is not None:
            out = self._inflate()
        elif self._zstd is not None:
            out = self._zstd.read(CHUNK)
        else:
            out = self.source.read1(CHUNK)
        if not out:
            while self.source.read1(CHUNK):  # trailing bytes count for the digest
                pass
            return b""
        self.hash.update(out)
        self.count += len(out)
        if self.count > self._max:
            raise HostileInput(f"{self._what}: unpacks to more than {self._max} bytes")
        return out


class _Pipelined(io.RawIOBase):
    """The tar bytes, produced by a thread of their own: download, hashing and
    decompression (which free the GIL) run beside the file writes, as ``tar -xz``
    runs gzip beside tar."""

    def __init__(self, tar: _Tar):
        self._tar = tar
        self._queue: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=8)
        self._stop = threading.Event()
        self._pending = memoryview(b"")
        self._ended = False
        self._thread = threading.Thread(target=self._produce, name="layer-reader",
                                        daemon=True)
        self._thread.start()

    def readable(self) -> bool:
        return True

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                out = self._tar.next_chunk()
                self._put(out)
                if not out:
                    return
        except BaseException as exc:
            self._put(exc)

    def _put(self, item: bytes | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def readinto(self, buffer) -> int:
        if not self._pending:
            if self._ended:
                return 0
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._ended = True
                raise item
            if not item:
                self._ended = True
                return 0
            self._pending = memoryview(item)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def drain(self) -> None:
        """Read to the end: then the producer is done and the digests are final."""
        sink = bytearray(CHUNK)
        while self.readinto(sink):
            pass
        self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        # Not joined long: a producer stuck on the network ends when the caller closes
        # the blob stream; it writes nothing.
        self._thread.join(timeout=1.0)


@dataclass
class Unpacked:
    path: Path
    size: int  # bytes the layer takes in the cache (approximate: data + per entry)
    digest: str
    diff_id: str
    skipped: int  # device nodes and unsupported entries left out


def read_layer(chunks: Iterator[bytes],
               each: Callable[[tarfile.TarFile, tarfile.TarInfo], None], *,
               digest: str = "", diff_id: str = "", declared_size: int = -1,
               max_bytes: int = 1 << 40, what: str = "layer",
               progress: Callable[[int], None] | None = None,
               cancel: threading.Event | None = None,
               done: Callable[[], None] | None = None,
               gzip: Callable[[], Any] | None = None) -> tuple[str, str]:
    """Walk a layer's tar stream once, ``each`` member in order, checking it as hostile
    input: its size and digest as read, the gzip end, the tar bytes' digest against
    ``diff_id`` (either digest may be empty: then only computed). ``done`` runs however
    the walk ends; ``gzip`` makes each gzip member's decompressor. Returns (digest,
    diff ID)."""
    limit = declared_size if declared_size >= 0 else 1 << 62
    source = _Compressed(chunks, limit, what, progress, cancel)
    pipe = None
    try:
        stream = _Tar(io.BufferedReader(source, CHUNK), max_bytes, what, gzip)
        pipe = _Pipelined(stream)
        with tarfile.open(fileobj=io.BufferedReader(pipe, CHUNK), mode="r|",
                          encoding="utf-8", errors="surrogateescape") as tar:
            for member in tar:
                each(tar, member)
        pipe.drain()
    except (tarfile.TarError, zlib.error, zstandard.ZstdError, EOFError) as exc:
        raise HostileInput(f"{what}: corrupt or truncated layer ({exc})") from exc
    finally:
        if pipe is not None:
            pipe.stop()
        if done is not None:
            done()
    if stream.gzip is not None and not stream.gzip.eof:
        raise HostileInput(f"{what}: gzip stream is truncated or corrupt")
    got = "sha256:" + source.hash.hexdigest()
    if declared_size >= 0 and source.count != declared_size:
        raise HostileInput(f"{what}: got {source.count} bytes, its descriptor declares "
                           f"{declared_size} (truncated?)")
    if digest and got != digest:
        raise HostileInput(f"{what}: digest mismatch: content is {got}, expected {digest}")
    tar_digest = "sha256:" + stream.hash.hexdigest()
    if diff_id and tar_digest != diff_id:
        raise HostileInput(f"{what}: uncompressed digest {tar_digest} does not match the "
                           f"config's diff ID {diff_id}")
    return got, tar_digest


def unpack_layer(chunks: Iterator[bytes], dest: Path, *, digest: str = "", diff_id: str = "",
                 declared_size: int = -1, max_bytes: int = 1 << 40, what: str = "layer",
                 progress: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None) -> Unpacked:
    """Unpack into ``dest`` (a new, empty directory that the caller removes on error).

    ``digest`` is checked against the bytes as read, ``diff_id`` against the tar bytes;
    either may be empty (then it is only computed).
    """
    writer = _Writer(dest, what)
    got, tar_digest = read_layer(chunks, writer.add, digest=digest, diff_id=diff_id,
                                 declared_size=declared_size, max_bytes=max_bytes, what=what,
                                 progress=progress, cancel=cancel)
    writer.finish()
    return Unpacked(dest, writer.size, got, tar_digest, writer.skipped)


def clean_name(name: str, what: str) -> str:
    """A tar member name as a relative path inside the layer; refuses escapes."""
    if name.startswith("/"):
        raise HostileInput(f"{what}: entry {name[:200]!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise HostileInput(f"{what}: entry {name[:200]!r} contains '..'")
    return "/".join(parts)


class _Writer:
    def __init__(self, root: Path, what: str):
        self.root = str(root)
        self.what = what
        self.size = 0
        self.skipped = 0
        self._dirs: dict[str, tarfile.TarInfo] = {}
        self._known_dirs: set[str] = {""}

    def _parent(self, rel: str, create: bool = True) -> None:
        """Make sure every parent of ``rel`` is a real directory of this layer (never a
        symlink: writing through one could land outside the layer)."""
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub in self._known_dirs:
                continue
            path = os.path.join(self.root, sub)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if not create:
                    raise HostileInput(f"{self.what}: link target {rel!r} does not exist") \
                        from None
                os.mkdir(path, 0o755)
                self._known_dirs.add(sub)
                continue
            if stat.S_ISLNK(st.st_mode):
                raise HostileInput(f"{self.what}: entry {rel[:200]!r} would be written through "
                                   f"the symlink {sub!r}")
            if not stat.S_ISDIR(st.st_mode):
                raise HostileInput(f"{self.what}: entry {rel[:200]!r}: {sub!r} is not a "
                                   "directory")
            self._known_dirs.add(sub)

    def _clear(self, path: str, keep_dir: bool) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return
            shutil.rmtree(path)
            self._known_dirs = {""}  # whatever was below is gone
        else:
            os.unlink(path)

    def add(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        rel = clean_name(member.name, self.what)
        self.size += ENTRY_OVERHEAD
        if not rel:
            if member.isdir():
                self._dirs[""] = member
            return
        base = rel.rsplit("/", 1)[-1]
        if base.startswith(WHITEOUT):
            self._whiteout(rel, base)
            return
        self._parent(rel)
        path = os.path.join(self.root, rel)
        if member.isdir():
            self._clear(path, keep_dir=True)
            if not os.path.isdir(path):
                os.mkdir(path, 0o700)
            self._known_dirs.add(rel)
            self._dirs[rel] = member
            return
        if member.ischr() or member.isblk():
            log.info("%s: skipping device node %s", self.what, rel)
            self.skipped += 1
            return
        self._clear(path, keep_dir=False)
        if member.isreg():
            self._file(tar, member, path)
        elif member.issym():
            os.symlink(member.linkname, path)
            self._own(path, member, follow=False)
        elif member.islnk():
            target = clean_name(member.linkname, self.what)
            if not target:
                raise HostileInput(f"{self.what}: hard link {rel!r} to the layer root")
            self._parent(target, create=False)
            source = os.path.join(self.root, target)
            try:
                st = os.lstat(source)
            except FileNotFoundError:
                raise HostileInput(f"{self.what}: hard link {rel!r} to {target!r}, which is "
                                   "not in this layer") from None
            if stat.S_ISDIR(st.st_mode):
                raise HostileInput(f"{self.what}: hard link {rel!r} to a directory")
            os.link(source, path, follow_symlinks=False)
        elif member.isfifo():
            os.mkfifo(path, 0o600)
            self._own(path, member, follow=True)
        else:
            log.info("%s: skipping unsupported entry %s (type %r)", self.what, rel, member.type)
            self.skipped += 1

    def _whiteout(self, rel: str, base: str) -> None:
        self._parent(rel)
        parent = os.path.join(self.root, rel.rsplit("/", 1)[0]) if "/" in rel else self.root
        if base == OPAQUE:
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
            return
        if base.startswith(WHITEOUT + WHITEOUT):
            return  # aufs bookkeeping (.wh..wh.plnk and the like)
        name = base[len(WHITEOUT):]
        if name in ("", ".", ".."):
            raise HostileInput(f"{self.what}: malformed whiteout {rel!r}")
        path = os.path.join(parent, name)
        self._clear(path, keep_dir=False)
        os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))

    def _file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
        data: IO[bytes] | None = tar.extractfile(member)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            remaining = member.size
            while remaining > 0 and data is not None:
                chunk = data.read(min(CHUNK, remaining))
                if not chunk:
                    raise HostileInput(f"{self.what}: entry {member.name[:200]!r} is truncated")
                _write_all(fd, chunk)
                remaining -= len(chunk)
            self.size += member.size
            os.fchown(fd, member.uid, member.gid)
            os.fchmod(fd, member.mode & 0o7777)
            self._xattrs(fd, member)
            os.utime(fd, (member.mtime, member.mtime))
        finally:
            os.close(fd)

    def _own(self, path: str, member: tarfile.TarInfo, follow: bool) -> None:
        os.chown(path, member.uid, member.gid, follow_symlinks=follow)
        if follow:
            os.chmod(path, member.mode & 0o7777)
        os.utime(path, (member.mtime, member.mtime), follow_symlinks=follow)

    def _xattrs(self, target: int | str, member: tarfile.TarInfo) -> None:
        for key, value in member.pax_headers.items():
            if not key.startswith("SCHILY.xattr."):
                continue
            name = key[len("SCHILY.xattr."):]
            if name.startswith("trusted.overlay."):
                # Only whiteouts make overlay xattrs; a layer must not forge redirects.
                log.info("%s: dropping xattr %s of %s", self.what, name, member.name)
                continue
            try:
                os.setxattr(target, name, value.encode("utf-8", "surrogateescape"))
            except OSError as exc:
                log.info("%s: xattr %s of %s not kept: %s", self.what, name, member.name, exc)

    def finish(self) -> None:
        """Directory metadata last (a read-only directory must be filled first), deepest first."""
        if "" not in self._dirs:  # no entry for the root: the usual 0755, not mkdtemp's 0700
            os.chmod(self.root, 0o755)
        for rel in sorted(self._dirs, key=lambda r: r.count("/") + (1 if r else 0),
                          reverse=True):
            member = self._dirs[rel]
            path = os.path.join(self.root, rel) if rel else self.root
            os.chown(path, member.uid, member.gid)
            os.chmod(path, member.mode & 0o7777)
            self._xattrs(path, member)
            os.utime(path, (member.mtime, member.mtime))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
