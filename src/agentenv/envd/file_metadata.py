"""User-defined file metadata on uploads, as E2B's envd keeps it.

An upload's ``X-Metadata-<key>: <value>`` headers become ``user.e2b.<key>`` xattrs on
every file it writes (keys lowercased, the first of a repeated header wins). Each
upload *replaces* a file's metadata: keys absent from the request are removed, so a
write without any header clears what an earlier one set (``O_TRUNC`` keeps xattrs).
"""

from __future__ import annotations

import errno
import logging
import os

from .asgi import HTTPError
from .userfs_protocol import METADATA_XATTR_PREFIX

log = logging.getLogger("agentenv.envd")

HEADER_PREFIX = "x-metadata-"
# The VFS caps an xattr's name at 255 bytes, prefix included; E2B's envd caps one
# file's metadata (prefixed names plus values) at 4096 bytes, one ext4 block.
MAX_KEY_BYTES = 255 - len(METADATA_XATTR_PREFIX)
MAX_TOTAL_BYTES = 4096


def from_headers(headers) -> dict[str, str]:
    """The request's metadata, checked as E2B's envd checks it (400 otherwise)."""
    out: dict[str, str] = {}
    for raw_k, raw_v in headers:
        k = raw_k.decode("latin-1").lower()
        if not k.startswith(HEADER_PREFIX) or len(k) == len(HEADER_PREFIX):
            continue
        out.setdefault(k[len(HEADER_PREFIX):], raw_v.decode("latin-1"))
    total = 0
    for k, v in out.items():
        if len(k) > MAX_KEY_BYTES:
            raise HTTPError(400, f"invalid metadata: metadata key {k[:32]!r}... "
                                 f"exceeds {MAX_KEY_BYTES} bytes")
        for label, s in (("key", k), (f"value for key {k!r}", v)):
            bad = next((i for i, c in enumerate(s) if not " " <= c <= "~"), None)
            if bad is not None:
                raise HTTPError(400, f"invalid metadata: metadata {label} contains "
                                     f"non-printable-ASCII byte 0x{ord(s[bad]):02x} "
                                     f"at offset {bad}")
        total += len(METADATA_XATTR_PREFIX) + len(k) + len(v)
    if total > MAX_TOTAL_BYTES:
        raise HTTPError(400, f"invalid metadata: total metadata size {total} exceeds "
                             f"{MAX_TOTAL_BYTES} bytes")
    return out


def replace(fd: int, path: str, metadata: dict[str, str]) -> dict[str, str]:
    """Make ``metadata`` the open file's whole metadata; what it now holds is returned
    (nothing on a filesystem without xattrs, e.g. /proc: the bytes are written, so
    that is logged, not failed, as E2B's envd does)."""
    try:
        for name in os.listxattr(fd):
            if name.startswith(METADATA_XATTR_PREFIX) and \
                    name[len(METADATA_XATTR_PREFIX):] not in metadata:
                try:
                    os.removexattr(fd, name)
                except OSError as e:
                    if e.errno != errno.ENODATA:
                        raise
        for k, v in metadata.items():
            os.setxattr(fd, METADATA_XATTR_PREFIX + k, v.encode())
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            log.warning("no xattrs on the filesystem of '%s': metadata not kept", path)
            return {}
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.E2BIG):
            raise HTTPError(507, f"not enough space for the metadata of '{path}'") from None
        raise HTTPError(500, f"cannot store metadata on '{path}': {e.strerror}") from None
    return dict(metadata)
