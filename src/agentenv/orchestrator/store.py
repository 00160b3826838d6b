"""The node's durable record of its sandboxes: one SQLite file under AENV_HOME.

SQLite gives atomic, durable writes that survive a crash of the server; every
call here is a single short statement, cheap enough for the event loop.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from .models import SandboxRecord, SandboxState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id   TEXT PRIMARY KEY,
    template_id  TEXT NOT NULL,
    alias        TEXT NOT NULL,
    state        TEXT NOT NULL,
    node_id      TEXT NOT NULL,
    cpu_count    INTEGER NOT NULL,
    memory_mb    INTEGER NOT NULL,
    disk_size_mb INTEGER NOT NULL,
    started_at   REAL NOT NULL,
    end_at       REAL NOT NULL,
    auto_pause   INTEGER NOT NULL,
    internet     INTEGER NOT NULL,
    metadata     TEXT NOT NULL,
    env_vars     TEXT NOT NULL,
    envd_token   TEXT NOT NULL,
    slot_index   INTEGER NOT NULL,
    slot_address TEXT NOT NULL,
    snapshot_id  TEXT NOT NULL DEFAULT '',
    network      TEXT NOT NULL DEFAULT '{}',
    traffic_token TEXT NOT NULL DEFAULT '',
    error        TEXT NOT NULL DEFAULT '',
    auto_pause_memory INTEGER NOT NULL DEFAULT 1,
    auto_resume  INTEGER NOT NULL DEFAULT 0,
    resume_timeout INTEGER NOT NULL DEFAULT 0,
    mask_request_host TEXT NOT NULL DEFAULT '',
    owner        TEXT NOT NULL DEFAULT '',
    run_id       TEXT NOT NULL DEFAULT '',
    queued_at    REAL NOT NULL DEFAULT 0,
    booted_at    REAL NOT NULL DEFAULT 0,
    ready_at     REAL NOT NULL DEFAULT 0,
    origin       TEXT NOT NULL DEFAULT '',
    resets       TEXT NOT NULL DEFAULT '[]'
);
"""
_COLUMNS = [
    "sandbox_id", "template_id", "alias", "state", "node_id", "cpu_count", "memory_mb",
    "disk_size_mb", "started_at", "end_at", "auto_pause", "internet", "metadata", "env_vars",
    "envd_token", "slot_index", "slot_address", "snapshot_id", "network",
    "traffic_token", "error", "auto_pause_memory", "auto_resume", "resume_timeout",
    "mask_request_host", "owner", "run_id", "queued_at", "booted_at", "ready_at",
    "origin", "resets",
]
# Columns added after the first release, with their defaults (for old files).
_ADDED = {"snapshot_id": "TEXT NOT NULL DEFAULT ''", "network": "TEXT NOT NULL DEFAULT '{}'",
          "traffic_token": "TEXT NOT NULL DEFAULT ''", "error": "TEXT NOT NULL DEFAULT ''",
          "auto_pause_memory": "INTEGER NOT NULL DEFAULT 1",
          "auto_resume": "INTEGER NOT NULL DEFAULT 0",
          "resume_timeout": "INTEGER NOT NULL DEFAULT 0",
          "mask_request_host": "TEXT NOT NULL DEFAULT ''",
          "owner": "TEXT NOT NULL DEFAULT ''", "run_id": "TEXT NOT NULL DEFAULT ''",
          "queued_at": "REAL NOT NULL DEFAULT 0", "booted_at": "REAL NOT NULL DEFAULT 0",
          "ready_at": "REAL NOT NULL DEFAULT 0", "origin": "TEXT NOT NULL DEFAULT ''",
          "resets": "TEXT NOT NULL DEFAULT '[]'"}


class SandboxStore:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # The file holds env vars and envd tokens: owner-only.
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.close(fd)
        os.chmod(path, 0o600)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(sandboxes)")}
        for column, decl in _ADDED.items():
            if column not in have:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {column} {decl}")

    def close(self) -> None:
        self._db.close()

    def put(self, record: SandboxRecord) -> None:
        row = _to_row(record)
        marks = ",".join("?" for _ in _COLUMNS)
        self._db.execute(
            f"INSERT OR REPLACE INTO sandboxes ({','.join(_COLUMNS)}) VALUES ({marks})", row
        )

    def delete(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))

    def all(self) -> list[SandboxRecord]:
        cur = self._db.execute(f"SELECT {','.join(_COLUMNS)} FROM sandboxes ORDER BY started_at")
        return [_from_row(r) for r in cur.fetchall()]


def _to_row(r: SandboxRecord) -> tuple:
    return (
        r.sandbox_id, r.template_id, r.alias, r.state.value, r.node_id, r.cpu_count, r.memory_mb,
        r.disk_size_mb, r.started_at, r.end_at, int(r.auto_pause), int(r.internet),
        json.dumps(r.metadata), json.dumps(r.env_vars), r.envd_token, r.slot_index,
        r.slot_address, r.snapshot_id, json.dumps(r.network),
        r.traffic_token, r.error, int(r.auto_pause_memory), int(r.auto_resume),
        r.resume_timeout, r.mask_request_host, r.owner, r.run_id, r.queued_at,
        r.booted_at, r.ready_at, r.origin, json.dumps(r.resets),
    )


def _from_row(row: tuple) -> SandboxRecord:
    d = dict(zip(_COLUMNS, row, strict=True))
    d["state"] = SandboxState(d["state"])
    d["auto_pause"] = bool(d["auto_pause"])
    d["auto_pause_memory"] = bool(d["auto_pause_memory"])
    d["internet"] = bool(d["internet"])
    d["auto_resume"] = bool(d["auto_resume"])
    d["metadata"] = json.loads(d["metadata"])
    d["env_vars"] = json.loads(d["env_vars"])
    d["network"] = json.loads(d["network"] or "{}")
    d["resets"] = json.loads(d["resets"] or "[]")
    return SandboxRecord(**d)
