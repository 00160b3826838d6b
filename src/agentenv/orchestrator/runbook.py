"""The books of runs: a run owns the sandboxes created in it, and lives while its lease
is renewed (a heartbeat). Kept in the node's SQLite file beside the sandbox records, so
a restart keeps them; ending a run (its sandboxes killed or paused) is ``runs.py``'s.
"""

from __future__ import annotations

import builtins
import re
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .models import BadRequest, NotFound

RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MIN_LEASE_S, MAX_LEASE_S, DEFAULT_LEASE_S = 5, 86400, 300
ON_EXPIRY = ("kill", "pause")
# Runs a node keeps at once (each is a row and a line in every listing).
MAX_RUNS = 10_000
RUN_ID = re.compile(r"run_[a-z0-9]{20}")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id     TEXT PRIMARY KEY,
    name       TEXT NOT NULL,
    lease_s    INTEGER NOT NULL,
    on_expiry  TEXT NOT NULL,
    expires_at REAL NOT NULL,
    created_at REAL NOT NULL
);
"""


@dataclass
class Run:
    run_id: str
    name: str
    lease_s: int
    on_expiry: str
    expires_at: float
    created_at: float
    # Being ended (its lease lapsed or DELETE): no sandbox may join it any more.
    ending: bool = False

    def lapsed(self, now: float) -> bool:
        return now >= self.expires_at


def check_run(name: object, lease_s: object, on_expiry: object) -> tuple[str, int, str]:
    """A run's fields, or a clear 400 (every field is hostile)."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        raise BadRequest("name must be 1 to 64 characters of letters, digits, '.', '_' "
                         "and '-'")
    if isinstance(lease_s, bool) or not isinstance(lease_s, int) or \
            not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
        raise BadRequest(f"leaseSeconds must be an integer from {MIN_LEASE_S} to "
                         f"{MAX_LEASE_S}")
    if on_expiry not in ON_EXPIRY:
        raise BadRequest("onExpiry must be 'kill' or 'pause'")
    return name, lease_s, str(on_expiry)


class RunBook:
    def __init__(self, db_path: Path) -> None:
        self._db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._runs: dict[str, Run] = {}
        for row in self._db.execute("SELECT run_id, name, lease_s, on_expiry, expires_at, "
                                    "created_at FROM runs"):
            self._runs[row[0]] = Run(*row)

    def close(self) -> None:
        self._db.close()

    def create(self, name: str, lease_s: int, on_expiry: str) -> Run:
        if len(self._runs) >= MAX_RUNS:
            raise BadRequest(f"this node already keeps {MAX_RUNS} runs; end some first")
        now = time.time()
        run = Run("run_" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789")
                                   for _ in range(20)),
                  name, lease_s, on_expiry, now + lease_s, now)
        self._runs[run.run_id] = run
        self._put(run)
        return run

    def get(self, run_id: str) -> Run:
        run = self._runs.get(run_id)
        if run is None or run.ending:
            raise NotFound(f"run '{run_id[:80]}' not found (unknown, or ended)")
        return run

    def list(self) -> list[Run]:
        return sorted((r for r in self._runs.values() if not r.ending),
                      key=lambda r: r.created_at)

    def renew(self, run_id: str) -> Run:
        run = self.get(run_id)
        if run.lapsed(time.time()):  # lapsed, not yet ended by the loop: too late
            raise NotFound(f"run '{run_id}' not found (its lease lapsed)")
        run.expires_at = time.time() + run.lease_s
        self._put(run)
        return run

    def check_joinable(self, run_id: str) -> None:
        """A create may join ``run_id`` ("" is no run): else a clear 400."""
        if not run_id:
            return
        run = self._runs.get(run_id)
        if run is None or run.ending or run.lapsed(time.time()):
            raise BadRequest(f"run '{run_id[:80]}' is unknown or has ended; create a run "
                             "(POST /runs) and pass its runID")

    def lapsed(self, now: float) -> builtins.list[Run]:
        return [r for r in self._runs.values() if not r.ending and r.lapsed(now)]

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)
        self._db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))

    def _put(self, run: Run) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO runs (run_id, name, lease_s, on_expiry, expires_at, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (run.run_id, run.name, run.lease_s, run.on_expiry, run.expires_at, run.created_at))
