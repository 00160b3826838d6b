"""What changed between two states of a sandbox's files: two snapshots, a snapshot and
a running sandbox, or two sandboxes ("what did this rollout's agent change?").

Each side is read from a running sandbox through envd's filesystem listing and export
(the routes filesystem-only pauses use: disk_capture.py). A snapshot is first restored
into a short-lived sandbox of its own, no network, killed afterwards: a memory
snapshot's files live inside its memory image, which only gVisor can read.

Entries compare by kind, mode, owner, size, modification time and link target (a
directory by kind, mode and owner). With ``text``, changed, added and removed regular
files small enough and valid UTF-8 get a unified diff. Listings and archives come
from inside sandboxes: bounded, parsed in a worker thread, and never used to build a
path on this host.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..textdiff import MAX_DIFF_LINES, Item, diff_all, unified
from .admission import TooManyRequests
from .disk_pause import MAX_ENTRIES, MAX_LINE
from .models import OrchestratorError

__all__ = ["MAX_DIFF_LINES", "diff_all", "unified"]

# Kind, mode, uid, gid, size, mtime_ns, link target.
Entry = tuple[str, int, int, int, int, int, str]

MAX_LISTED = 10_000  # entries of each of added / removed / changed in an answer
MAX_TEXT_FILES = 50  # files given a unified diff
MAX_TEXT_BYTES = 256 << 10  # per version of a file given a unified diff
EXPORT_LIMIT = 2 * MAX_TEXT_FILES * MAX_TEXT_BYTES + (4 << 20)
# The text diffs' work (issue 29): difflib is quadratic in lines at worst, so lines
# bound it, per version of a file (longer ones are listed, not diffed) and in all (a
# 413); a child process does it and is killed at DIFF_TIMEOUT_S (a 413 too). 5 000 x
# 5 000 shuffled short lines: 0.2-0.4 s here, so 50 000 in all is ~2 s at worst.
MAX_TEXT_LINES = 5_000
MAX_TOTAL_LINES = 50_000
DIFF_TIMEOUT_S = 20.0
# Diffs in flight: per API key, and on the node (each may restore two snapshots).
MAX_DIFFS_PER_KEY = 1
MAX_DIFFS = 2


class DiffTooLarge(OrchestratorError):
    status = 413


class DiffGate:
    """At most MAX_DIFFS_PER_KEY diffs of one key and MAX_DIFFS in all at once; more
    are a 429 at once (a diff holds sandboxes, so it does not queue)."""

    def __init__(self, per_key: int = MAX_DIFFS_PER_KEY, total: int = MAX_DIFFS) -> None:
        self.per_key, self.total = per_key, total
        self._running: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, owner: str):
        mine = self._running.get(owner, 0)
        if mine >= self.per_key:
            raise TooManyRequests(f"this API key already has {mine} diff(s) running (the "
                                  "most at once); retry once it is done", 5)
        if sum(self._running.values()) >= self.total:
            raise TooManyRequests(f"{self.total} diffs are running on this node (the most at "
                                  "once); retry later", 5)
        self._running[owner] = mine + 1
        try:
            yield
        finally:
            left = self._running.pop(owner) - 1
            if left:
                self._running[owner] = left


def text_work(paths: list[str], versions: list[dict[str, bytes]], listings: list[Listing]
              ) -> tuple[list[Item], dict[str, str]]:
    """What the text diffs compare, and the files left out with why; a DiffTooLarge
    when all of it is more lines than MAX_TOTAL_LINES."""
    items: list[Item] = []
    skipped: dict[str, str] = {}
    total = 0
    for path in paths:
        pair = [versions[i].get(path) if path in listings[i].entries else None
                for i in (0, 1)]
        lines = [data.count(b"\n") + 1 if data else 0 for data in pair]
        if max(lines) > MAX_TEXT_LINES:
            skipped[path] = f"more than {MAX_TEXT_LINES} lines: not diffed"
            continue
        total += sum(lines)
        items.append((path, pair[0], pair[1]))
    if total > MAX_TOTAL_LINES:
        raise DiffTooLarge(f"the text diffs would compare {total} lines (at most "
                           f"{MAX_TOTAL_LINES}): ask without text=true, or compare fewer "
                           "changed files")
    return items, skipped


def diffs(items: list[Item]) -> dict[str, str]:
    """The unified diffs, in a child process bounded by DIFF_TIMEOUT_S (blocking)."""
    try:
        return diff_all(items, DIFF_TIMEOUT_S)
    except TimeoutError:
        raise DiffTooLarge(f"the text diffs took more than {DIFF_TIMEOUT_S:g} s: ask "
                           "without text=true, or compare fewer changed files") from None


@dataclass
class Listing:
    entries: dict[str, Entry]


def parse_listing(raw: Path) -> Listing:
    """envd's ``/aenv/fs/list`` answer (JSON lines), bounded."""
    entries: dict[str, Entry] = {}
    with open(raw, "rb") as f:
        for count, line in enumerate(f, 1):
            if count > MAX_ENTRIES or len(line) > MAX_LINE:
                raise OrchestratorError("the sandbox's file listing is too large")
            try:
                path, kind, mode, uid, gid, size, mtime_ns, target = json.loads(line)
                entry = (str(kind), int(mode), int(uid), int(gid), int(size), int(mtime_ns),
                         str(target or ""))
            except (ValueError, TypeError) as exc:
                raise OrchestratorError(f"envd's file listing is malformed: {exc}") from exc
            if not isinstance(path, str) or not path.startswith("/"):
                raise OrchestratorError("envd's file listing is malformed")
            entries[path] = entry
    return Listing(entries)


def compare(before: Listing, after: Listing) -> dict[str, Any]:
    """Added, removed and changed paths, sorted, each list at most MAX_LISTED long."""
    added = sorted(p for p in after.entries if p not in before.entries)
    removed = sorted(p for p in before.entries if p not in after.entries)
    changed = sorted(p for p, new in after.entries.items()
                     if p in before.entries and _differs(before.entries[p], new))
    return {
        "added": [_brief(p, after.entries[p]) for p in added[:MAX_LISTED]],
        "removed": [_brief(p, before.entries[p]) for p in removed[:MAX_LISTED]],
        "changed": [{**_brief(p, after.entries[p]),
                     "before": _detail(before.entries[p]), "after": _detail(after.entries[p])}
                    for p in changed[:MAX_LISTED]],
        "truncated": max(len(added), len(removed), len(changed)) > MAX_LISTED,
    }


def text_candidates(result: dict[str, Any], before: Listing, after: Listing) -> list[str]:
    """The regular files a unified diff is worth reading both versions for."""
    paths = []
    for item in [*result["changed"], *result["added"], *result["removed"]]:
        path = item["path"]
        old, new = before.entries.get(path), after.entries.get(path)
        if all(e is None or (e[0] == "f" and e[4] <= MAX_TEXT_BYTES) for e in (old, new)):
            paths.append(path)
    return paths[:MAX_TEXT_FILES]


def read_export(tar_path: Path, wanted: list[str]) -> dict[str, bytes]:
    """The regular files of an envd export, by path (only those asked for, bounded)."""
    want = set(wanted)
    out: dict[str, bytes] = {}
    with tarfile.open(tar_path, "r|") as tar:
        for member in tar:
            path = "/" + member.name.lstrip("/")
            if path not in want or not member.isfile() or member.size > MAX_TEXT_BYTES:
                continue
            f = tar.extractfile(member)
            if f is not None:
                out[path] = f.read(MAX_TEXT_BYTES + 1)[:MAX_TEXT_BYTES]
    return out


def paths_body(paths: list[str], dest: Path) -> None:
    dest.write_text("".join(json.dumps(p) + "\n" for p in paths))


@contextlib.contextmanager
def scratch_dir(parent: Path):
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="diff-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _differs(old: Entry, new: Entry) -> bool:
    if old[0] == "d" and new[0] == "d":
        return old[:4] != new[:4]
    return old != new


def _brief(path: str, e: Entry) -> dict[str, Any]:
    return {"path": path, "kind": _KIND_NAMES.get(e[0], e[0]), "size": e[4]}


def _detail(e: Entry) -> dict[str, Any]:
    return {"kind": _KIND_NAMES.get(e[0], e[0]), "mode": f"{e[1]:o}", "uid": e[2], "gid": e[3],
            "size": e[4], "mtimeNs": e[5], **({"target": e[6]} if e[6] else {})}


_KIND_NAMES = {"f": "file", "d": "dir", "l": "symlink", "p": "fifo"}
