"""Unified diffs of files from inside sandboxes, computed in a process of their own.

difflib's matcher is quadratic in the worst case: two versions of 60 000 short lines
in different orders took 26 s of CPU each (issue 29, finding 4), on the node's event
loop's own interpreter. So the caller bounds the input (lines per file and in all),
and the work runs here in a short-lived child process that is killed at its deadline:
the node's loop never runs it, and no request can buy more CPU than the deadline.
This module imports nothing of the package so that the child starts in ~50 ms.
"""

from __future__ import annotations

import difflib
import multiprocessing
import time
from multiprocessing.connection import Connection

MAX_DIFF_LINES = 2_000  # output lines per unified diff

# (path, old version or None if absent, new version or None if absent)
Item = tuple[str, bytes | None, bytes | None]


def unified(path: str, old: bytes | None, new: bytes | None) -> str | None:
    """A unified diff of two versions (None: the file is absent), or None if either is
    not text."""
    texts: list[list[str]] = []
    for data in (old, new):
        if data is None:
            texts.append([])
            continue
        if b"\0" in data:
            return None
        try:
            texts.append(data.decode().splitlines(keepends=True))
        except UnicodeDecodeError:
            return None
    lines = list(difflib.unified_diff(texts[0], texts[1],
                                      fromfile=f"a{path}" if old is not None else "/dev/null",
                                      tofile=f"b{path}" if new is not None else "/dev/null"))
    if len(lines) > MAX_DIFF_LINES:
        lines = [*lines[:MAX_DIFF_LINES], f"... {len(lines) - MAX_DIFF_LINES} more lines\n"]
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                   for line in lines)


def _child(conn: Connection, items: list[Item]) -> None:
    out = {}
    for path, old, new in items:
        if (diff := unified(path, old, new)) is not None:
            out[path] = diff
    conn.send(out)
    conn.close()


def diff_all(items: list[Item], timeout_s: float) -> dict[str, str]:
    """Each item's unified diff (text files only), computed in a child process that is
    killed past ``timeout_s`` (then TimeoutError). Blocking: call it from a thread."""
    if not items:
        return {}
    ctx = multiprocessing.get_context("forkserver")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(theirs, items), daemon=True)
    proc.start()
    theirs.close()
    try:
        end = time.monotonic() + timeout_s
        if not ours.poll(max(0.0, end - time.monotonic())):
            raise TimeoutError(f"the diffs took more than {timeout_s:g} s")
        try:
            return ours.recv()
        except EOFError:
            raise RuntimeError(f"the diff process ended with {proc.exitcode}") from None
    finally:
        ours.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)


# The forkserver imports only this module (not the node's __main__, the whole CLI).
multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
