"""Template build records and their logs, on disk so a build's status outlives a restart.

One JSON file per build (``<dir>/<buildID>.json``, replaced atomically) and one
append-only JSON-lines log beside it (``<buildID>.log``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path

WAITING, BUILDING, READY, ERROR = "waiting", "building", "ready", "error"
TRUNCATED = ("log truncated: the build's log reached its limit; later output of its steps "
             "is not kept (warnings and errors are), the build goes on")
REASON_LOG_LINES = 20
# A build's log is bounded, in entries and in bytes (``max_bytes``, the node's
# build_log_max_bytes): past either, one TRUNCATED entry, then only warnings and
# errors are kept, within a reserve (a step printing without end must fill neither
# the disk nor the node's memory). Lines are cut too (LineLog splits them).
MAX_LOG_ENTRIES = 20_000
MAX_LOG_BYTES = 8 << 20
RESERVE_ENTRIES = 1000
RESERVE_BYTES = 1 << 20
MAX_MESSAGE = 64 * 1024


@dataclass
class Build:
    build_id: str
    template_id: str
    names: list[str]
    tags: list[str] = field(default_factory=list)
    cpu_count: int | None = None
    memory_mb: int | None = None
    status: str = WAITING
    reason: dict | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    sandbox_id: str = ""
    snapshot_id: str = ""

    @property
    def done(self) -> bool:
        return self.status in (READY, ERROR)


def _timestamp() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def log_entry(message: str, level: str = "info", step: str = "") -> dict:
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE} more characters)"
    entry = {"timestamp": _timestamp(), "level": level, "message": message}
    if step:
        entry["step"] = step
    return entry


class BuildStore:
    def __init__(self, directory: Path, max_bytes: int = MAX_LOG_BYTES):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes
        self._builds: dict[str, Build] = {}
        self._logs: dict[str, list[dict]] = {}
        self._bytes: dict[str, int] = {}  # of each loaded log, as written
        self._truncated: set[str] = set()
        for path in sorted(self.dir.glob("*.json")):
            try:
                build = Build(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            self._builds[build.build_id] = build

    def all(self) -> list[Build]:
        return list(self._builds.values())

    def get(self, build_id: str) -> Build | None:
        return self._builds.get(build_id)

    def put(self, build: Build) -> None:
        self._builds[build.build_id] = build
        tmp = self.dir / f".{build.build_id}.json.tmp"
        tmp.write_text(json.dumps(asdict(build)))
        os.replace(tmp, self.dir / f"{build.build_id}.json")

    def delete(self, build_id: str) -> None:
        self._builds.pop(build_id, None)
        self._logs.pop(build_id, None)
        self._bytes.pop(build_id, None)
        self._truncated.discard(build_id)
        for suffix in (".json", ".log"):
            (self.dir / f"{build_id}{suffix}").unlink(missing_ok=True)

    def append(self, build_id: str, entry: dict) -> None:
        self.extend(build_id, [entry])

    def keeps_output(self, build_id: str) -> bool:
        """False once the build's log is truncated: its steps' output is dropped."""
        self.logs(build_id)
        return build_id not in self._truncated

    def extend(self, build_id: str, entries: Iterable[dict]) -> None:
        """Append the builder's own entries within the log's bounds (past them, only
        warnings and errors, within a reserve); one write for them all."""
        logs = self.logs(build_id)
        size = self._bytes.get(build_id, 0)
        lines: list[str] = []
        for entry in entries:
            important = entry.get("level") in ("warn", "error")
            if build_id in self._truncated and not important:
                continue
            line = json.dumps(entry)
            if len(logs) >= MAX_LOG_ENTRIES or size + len(line) + 1 > self.max_bytes:
                if not important:  # the first one over: say so, once
                    self._truncated.add(build_id)
                    entry = {**entry, "level": "warn", "message": TRUNCATED}
                    line = json.dumps(entry)
                if len(logs) >= MAX_LOG_ENTRIES + RESERVE_ENTRIES or \
                        size + len(line) + 1 > self.max_bytes + RESERVE_BYTES:
                    continue
            logs.append(entry)
            lines.append(line + "\n")
            size += len(line) + 1
        self._write(build_id, lines, size)

    def add_output(self, build_id: str, step: str, lines: list[str]) -> None:
        """A step's output lines as info entries: one timestamp and one write for them
        all, little work per line (a step may print millions of them), none at all once
        the log is truncated. The first line over the bounds truncates it."""
        logs = self.logs(build_id)
        if build_id in self._truncated or not lines:
            return
        stamp = _timestamp()
        head = f'{{"timestamp": "{stamp}", "level": "info", "message": '
        tail = f', "step": {_quote(step)}}}\n' if step else "}\n"
        size = self._bytes.get(build_id, 0)
        room = MAX_LOG_ENTRIES - len(logs)
        out: list[str] = []
        over = False
        for line in lines:
            if len(line) > MAX_MESSAGE:
                line = log_entry(line)["message"]
            text = head + _quote(line) + tail
            if room <= 0 or size + len(text) > self.max_bytes:
                over = True
                break
            entry = {"timestamp": stamp, "level": "info", "message": line}
            if step:
                entry["step"] = step
            logs.append(entry)
            out.append(text)
            size += len(text)
            room -= 1
        self._write(build_id, out, size)
        if over:
            self._truncated.add(build_id)
            self.extend(build_id, [log_entry(TRUNCATED, "warn", step)])

    def _write(self, build_id: str, lines: list[str], size: int) -> None:
        self._bytes[build_id] = size
        if lines:
            with open(self.dir / f"{build_id}.log", "a") as f:
                f.write("".join(lines))

    def logs(self, build_id: str) -> list[dict]:
        if build_id not in self._logs:
            entries: list[dict] = []
            size = 0
            with contextlib.suppress(OSError):
                for line in (self.dir / f"{build_id}.log").read_text().splitlines():
                    size += len(line) + 1
                    with contextlib.suppress(ValueError):
                        entries.append(json.loads(line))
            self._logs[build_id] = entries
            self._bytes[build_id] = size
            if any(e.get("message") == TRUNCATED for e in entries):
                self._truncated.add(build_id)
        return self._logs[build_id]
