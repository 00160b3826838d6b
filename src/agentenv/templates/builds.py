"""Template build records and their logs, on disk so a build's status outlives a restart.

One JSON file per build (``<dir>/<buildID>.json``, replaced atomically) and one
append-only JSON-lines log beside it (``<buildID>.log``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

WAITING, BUILDING, READY, ERROR = "waiting", "building", "ready", "error"
TRUNCATED = "(the log is too long: further output is not kept, only warnings and errors)"
REASON_LOG_LINES = 20
# A build's log is bounded: past this many entries only warnings and errors are
# kept (a step printing without end must not fill the disk); lines are cut too.
MAX_LOG_ENTRIES = 20_000
MAX_MESSAGE = 16 * 1024


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


def log_entry(message: str, level: str = "info", step: str = "") -> dict:
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE} more characters)"
    entry = {"timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
             "level": level, "message": message}
    if step:
        entry["step"] = step
    return entry


class BuildStore:
    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._builds: dict[str, Build] = {}
        self._logs: dict[str, list[dict]] = {}
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
        for suffix in (".json", ".log"):
            (self.dir / f"{build_id}{suffix}").unlink(missing_ok=True)

    def append(self, build_id: str, entry: dict) -> None:
        logs = self.logs(build_id)
        if len(logs) >= MAX_LOG_ENTRIES and entry.get("level") in ("info", "debug"):
            if len(logs) == MAX_LOG_ENTRIES:  # the first one over: say so, once
                entry = {**entry, "level": "warn", "message": TRUNCATED}
            else:
                return
        logs.append(entry)
        with open(self.dir / f"{build_id}.log", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def logs(self, build_id: str) -> list[dict]:
        if build_id not in self._logs:
            entries: list[dict] = []
            with contextlib.suppress(OSError):
                for line in (self.dir / f"{build_id}.log").read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        entries.append(json.loads(line))
            self._logs[build_id] = entries
        return self._logs[build_id]
