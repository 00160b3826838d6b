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
import difflib
import json
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .disk_pause import MAX_ENTRIES, MAX_LINE
from .models import OrchestratorError

# Kind, mode, uid, gid, size, mtime_ns, link target.
Entry = tuple[str, int, int, int, int, int, str]

MAX_LISTED = 10_000  # entries of each of added / removed / changed in an answer
MAX_TEXT_FILES = 50  # files given a unified diff
MAX_TEXT_BYTES = 256 << 10  # per version of a file given a unified diff
MAX_DIFF_LINES = 2_000  # per unified diff
EXPORT_LIMIT = 2 * MAX_TEXT_FILES * MAX_TEXT_BYTES + (4 << 20)


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
