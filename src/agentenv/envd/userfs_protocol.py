"""The wire protocol between envd and its per-user file workers (see userfs).

One JSON message per ``SOCK_SEQPACKET`` datagram, each at most ``MAX_FRAME`` bytes
(long listings come as several ``more`` frames) with at most ``MAX_FDS``
descriptors attached (``SCM_RIGHTS``), so envd's event loop parses replies only in
bounded pieces. A reply is ``{"ok": result}``, ``{"err": [errno, message, path]}``
(an OSError, as the user got it), ``{"refused": [reason, detail]}`` or, before it,
any number of ``{"more": [...]}``. Both sides import the limits and errors below.
"""

from __future__ import annotations

from typing import Any

METADATA_XATTR_PREFIX = "user.e2b."
MAX_FRAME = 256 * 1024          # one datagram on a worker socket
BATCH_BYTES = 64 * 1024         # list entries per reply frame
MAX_METADATA_BYTES = 16 * 1024  # per entry, in an entry's info
MAX_FDS = 4                     # descriptors attached to one message
# ListDir: depth is clamped, and a listing of more entries than this is refused
# (RESOURCE_EXHAUSTED) instead of building a response of unbounded size.
MAX_LIST_DEPTH = 64
MAX_LIST_ENTRIES = 100_000
# Directories one recursive watcher may watch (inotify watches are kernel memory).
MAX_WATCH_DIRS = 8192


class WorkerGone(Exception):
    """The worker died or broke the protocol; the operation's outcome is unknown."""


class Refused(Exception):
    """The worker refused the operation for a reason that is not an OSError."""

    def __init__(self, reason: str, detail: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
