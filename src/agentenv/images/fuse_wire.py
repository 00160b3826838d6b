"""The kernel's FUSE protocol on ``/dev/fuse`` for a read-only filesystem, without
libfuse: the mount, the request loop and the wire structures (``linux/fuse.h``).

Spoken directly so that the server can use what its Python binding (pyfuse3) could not:
the kernel's no-open mode (``FUSE_NO_OPEN_SUPPORT``, ``FUSE_NO_OPENDIR_SUPPORT``), in
which opening a file or a directory is no round trip to the server and the kernel keeps
file data and directory listings cached (``FOPEN_KEEP_CACHE``, ``FOPEN_CACHE_DIR``),
because every read names its inode. gVisor's gofer opens each file twice per
application open, so on an immutable layer those round trips were the hot path.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Opcodes
LOOKUP, FORGET, GETATTR, READLINK, OPEN, READ, STATFS = 1, 2, 3, 5, 14, 15, 17
RELEASE, GETXATTR, LISTXATTR, FLUSH, INIT, OPENDIR, READDIR = 18, 22, 23, 25, 26, 27, 28
RELEASEDIR, INTERRUPT, DESTROY, BATCH_FORGET = 29, 36, 38, 42
WRITING = {4, 6, 8, 9, 10, 11, 12, 13, 16, 21, 24, 35, 43, 45, 47, 51}  # refused: EROFS
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
NAMES = {LOOKUP: "lookup", FORGET: "forget", GETATTR: "getattr", READLINK: "readlink",
         OPEN: "open", READ: "read", STATFS: "statfs", RELEASE: "release",
         GETXATTR: "getxattr", LISTXATTR: "listxattr", FLUSH: "flush", INIT: "init",
         OPENDIR: "opendir", READDIR: "readdir", RELEASEDIR: "releasedir",
         INTERRUPT: "interrupt", DESTROY: "destroy", BATCH_FORGET: "batch_forget"}

# INIT flags
ASYNC_READ, BIG_WRITES, PARALLEL_DIROPS = 1 << 0, 1 << 5, 1 << 18
NO_OPEN_SUPPORT, MAX_PAGES, CACHE_SYMLINKS = 1 << 17, 1 << 22, 1 << 23
NO_OPENDIR_SUPPORT, INIT_EXT = 1 << 24, 1 << 30
WANT = (ASYNC_READ | BIG_WRITES | PARALLEL_DIROPS | NO_OPEN_SUPPORT | MAX_PAGES
        | CACHE_SYMLINKS | NO_OPENDIR_SUPPORT)

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, ext
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid, generation, entry/attr valid (s, ns)
ATTR_OUT = struct.Struct("<QII")  # attr valid (s, ns), dummy
READ_IN = struct.Struct("<QQII")  # fh, offset, size, read_flags
DIRENT = struct.Struct("<QQII")  # ino, next offset, name length, type
XATTR_SIZE = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # fuse_init_out, 64 bytes

MAX_WRITE = 128 << 10
MAX_PAGES_N = 256  # reads of up to 1 MiB
BUFFER = MAX_WRITE + 4096
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4


class FuseError(Exception):
    def __init__(self, code: int):
        super().__init__(os.strerror(code))
        self.code = code


@dataclass
class Attr:
    ino: int
    mode: int
    size: int
    uid: int
    gid: int
    mtime: int
    nlink: int

    def pack(self) -> bytes:
        blocks = (self.size + 511) // 512
        return ATTR.pack(self.ino, self.size, blocks, self.mtime, self.mtime, self.mtime,
                         0, 0, 0, self.mode, self.nlink, self.uid, self.gid, 0, 4096, 0)


def entry_out(attr: Attr | None, valid_s: int) -> bytes:
    """A lookup's answer; ``None``: a negative entry the kernel keeps for ``valid_s``."""
    if attr is None:
        return ENTRY_OUT.pack(0, 0, valid_s, 0, 0, 0) + bytes(ATTR.size)
    return ENTRY_OUT.pack(attr.ino, 0, valid_s, valid_s, 0, 0) + attr.pack()


def attr_out(attr: Attr, valid_s: int) -> bytes:
    return ATTR_OUT.pack(valid_s, 0, 0) + attr.pack()


def dirents(names: list[tuple[bytes, int, int]], start: int, size: int) -> bytes:
    """``(name, ino, mode)`` from ``start`` on, as many as fit ``size`` bytes."""
    out = bytearray()
    for i in range(start, len(names)):
        name, ino, mode = names[i]
        record = DIRENT.pack(ino, i + 1, len(name), (mode >> 12) & 0o17) + name
        record += bytes(-len(record) % 8)
        if len(out) + len(record) > size:
            break
        out += record
    return bytes(out)


def xattr_reply(value: bytes, size: int) -> bytes:
    """getxattr/listxattr: the length when asked with size 0, else the bytes."""
    if size == 0:
        return XATTR_SIZE.pack(len(value), 0)
    if len(value) > size:
        raise FuseError(errno.ERANGE)
    return value


def statfs_out(files: int) -> bytes:
    return STATFS_OUT.pack(0, 0, 0, files, 0, 4096, 255, 4096, 0)


def mount(point: Path, fsname: str) -> int:
    """Mount a read-only FUSE filesystem at ``point`` (as root); its ``/dev/fuse`` fd."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    st = os.stat(point)
    libc = ctypes.CDLL(None, use_errno=True)
    data = (f"fd={fd},rootmode={st.st_mode & 0o170000:o},user_id=0,group_id=0,"
            "allow_other,default_permissions").encode()
    if libc.mount(fsname.encode(), os.fsencode(point), f"fuse.{fsname}".encode(),
                  MS_RDONLY | MS_NOSUID | MS_NODEV, data) != 0:
        code = ctypes.get_errno()
        os.close(fd)
        raise OSError(code, f"mount of {point}: {os.strerror(code)}")
    return fd


Handler = Callable[[int, bytes], bytes]


class Session:
    """Reads requests from the device and answers them: metadata in the reading thread
    (it is all in memory), ``slow`` opcodes (reads that may fetch) in a pool of
    threads, each reply one write. ``run`` returns when the filesystem is unmounted."""

    def __init__(self, fd: int, handlers: dict[int, Handler], slow: set[int], threads: int):
        self.fd = fd
        self.handlers = handlers
        self.slow = slow
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="fuse-read")
        self.requests: dict[str, int] = {}  # by opcode name, for the server's log
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            while True:
                try:
                    buf = os.read(self.fd, BUFFER)
                except OSError as exc:
                    if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # interrupted, or a request aborted before we read it
                    if exc.errno == errno.ENODEV:
                        return  # unmounted
                    raise
                self._dispatch(buf)
        finally:
            self.pool.shutdown(wait=True)
            os.close(self.fd)

    def _dispatch(self, buf: bytes) -> None:
        _, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(buf)
        name = NAMES.get(opcode, str(opcode))
        self.requests[name] = self.requests.get(name, 0) + 1
        body = buf[IN_HEADER.size:]
        if opcode in NO_REPLY:
            return
        if opcode == INIT:
            self._reply(unique, 0, self._init(body))
            return
        if opcode in self.slow:
            self.pool.submit(self._answer, opcode, unique, nodeid, body)
        else:
            self._answer(opcode, unique, nodeid, body)

    def _answer(self, opcode: int, unique: int, nodeid: int, body: bytes) -> None:
        handler = self.handlers.get(opcode)
        if handler is None:
            self._reply(unique, errno.EROFS if opcode in WRITING else errno.ENOSYS)
            return
        try:
            data = handler(nodeid, body)
        except FuseError as exc:
            self._reply(unique, exc.code)
        except Exception:  # unanswered, the reader would wait forever: fail it instead
            log.exception("FUSE %s request failed", NAMES.get(opcode, opcode))
            self._reply(unique, errno.EIO)
        else:
            self._reply(unique, 0, data)

    def _init(self, body: bytes) -> bytes:
        major, minor, readahead, flags = struct.unpack_from("<IIII", body)
        if major != 7:
            raise RuntimeError(f"FUSE protocol {major}.{minor} is not 7.x")
        granted = flags & WANT
        return INIT_OUT.pack(7, min(minor, 38), readahead, granted, 16, 12, MAX_WRITE, 1,
                             MAX_PAGES_N, 0, 0, 0)

    def _reply(self, unique: int, error: int, data: bytes = b"") -> None:
        header = OUT_HEADER.pack(OUT_HEADER.size + (0 if error else len(data)), -error, unique)
        try:
            os.write(self.fd, header if error else header + data)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):  # interrupted, or unmounted
                raise
