"""The one walk of a filesystem tree that filesystem-only pauses compare: envd lists
the sandbox's own files with it (disk_capture.py), the node its template's rootfs
(orchestrator/disk_pause.py), and the two listings are compared entry by entry, so
both must see an entry the same way: one walker, one table of kinds.

Standard library only: it runs inside every sandbox's envd.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Set

# The kinds of entry a listing holds; sockets and device nodes are left out.
KINDS = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l", stat.S_IFIFO: "p"}
# Not the sandbox's own files: kernel views, devices, envd's bundle, the mount points
# of its files layers (envd/layers.py).
NOT_THE_SANDBOXS = frozenset({"/proc", "/sys", "/dev", "/.aenv", "/.aenv-layers"})

# An entry as listed and compared: kind, mode, uid, gid, size (files only, else 0),
# mtime_ns, link target (links only, else "").
Entry = tuple[str, int, int, int, int, int, str]


def walk(root: str, skip: Set[str] = frozenset()) -> Iterator[tuple[str, Entry]]:
    """``(path, entry)`` for every entry below ``root``, depth first, without following
    links. Paths are as seen from inside ``root`` (``/etc/passwd`` whatever ``root``
    is); those in ``skip``, and what is under them, are left out."""
    base = root.rstrip("/")  # "" for "/": paths below it are base + path
    stack = [""]
    while stack:
        below = stack.pop()
        try:
            entries = list(os.scandir(base + below or "/"))
        except OSError:
            continue
        for found in entries:
            path = f"{below}/{found.name}"
            if path in skip:
                continue
            try:
                st = found.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the directory was read
            kind = KINDS.get(stat.S_IFMT(st.st_mode))
            if kind is None:
                continue
            target = ""
            if kind == "l":
                with contextlib.suppress(OSError):
                    target = os.readlink(found.path)
            yield path, (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                         st.st_size if kind == "f" else 0, st.st_mtime_ns, target)
            if kind == "d":
                stack.append(path)
