"""Idempotent creates: a create sent with an ``Idempotency-Key`` happens once.

A retry with the same key (scoped to the API key that sent it) gets the first
answer again, body and all; a duplicate that arrives while the first is still
running waits for it and gets its answer; the same key with a different request is
a 422 (as Stripe does). Only successes are remembered: after a failure a retry
tries again. Answers are kept ``ttl_s`` (at most ``max_keys``, oldest dropped
first) in the node's SQLite file, so a restart keeps them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..sandbox_api import MAX_KEY_CHARS as MAX_KEY_CHARS
from .models import BadRequest, OrchestratorError

_PRUNE_EVERY = 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency (
    scope       TEXT NOT NULL,
    key         TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    body        TEXT NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS idempotency_created ON idempotency (created_at);
"""


class KeyReused(OrchestratorError):
    status = 422


def check_key(key: str) -> str:
    """An Idempotency-Key header: 1..255 printable ASCII characters, else a 400."""
    if not key or len(key) > MAX_KEY_CHARS or not all(" " <= c <= "~" for c in key):
        raise BadRequest(f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII "
                         "characters")
    return key


def fingerprint(request: Any) -> str:
    """What makes two requests the same request: their canonical JSON."""
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class IdempotencyKeys:
    def __init__(self, db_path: Path, ttl_s: float, max_keys: int) -> None:
        self._db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self.ttl_s, self.max_keys = ttl_s, max_keys
        self._running: dict[tuple[str, str], tuple[str, asyncio.Task[dict]]] = {}
        self._puts = 0

    def close(self) -> None:
        self._db.close()

    async def once(self, scope: str, key: str, print_: str,
                   make: Callable[[], Awaitable[dict]]) -> dict:
        """``make()``'s answer for this key: the remembered one, the running one's, or
        (none of those) a new one, remembered if it succeeds."""
        while True:
            stored = self._get(scope, key)
            if stored is not None:
                if stored[0] != print_:
                    raise self._reused(key)
                return json.loads(stored[1])
            running = self._running.get((scope, key))
            if running is None:
                break
            if running[0] != print_:
                raise self._reused(key)
            try:
                return dict(await asyncio.shield(running[1]))
            except asyncio.CancelledError:
                if running[1].cancelled():
                    continue  # the first one was cancelled: this one tries
                raise
            except Exception:
                continue  # the first one failed: this one tries again
        # Its own task: the answer is remembered even if this client hangs up meanwhile.
        task = asyncio.create_task(self._make(scope, key, print_, make))
        self._running[(scope, key)] = (print_, task)
        task.add_done_callback(lambda _: self._running.pop((scope, key), None))
        return dict(await asyncio.shield(task))

    async def _make(self, scope: str, key: str, print_: str,
                    make: Callable[[], Awaitable[dict]]) -> dict:
        body = await make()
        self._put(scope, key, print_, body)
        return body

    @staticmethod
    def _reused(key: str) -> KeyReused:
        return KeyReused(f"Idempotency-Key {key[:80]!r} was used with a different request; "
                         "use a new key for a new request")

    def _get(self, scope: str, key: str) -> tuple[str, str] | None:
        row = self._db.execute(
            "SELECT fingerprint, body FROM idempotency WHERE scope = ? AND key = ? AND "
            "created_at >= ?", (scope, key, time.time() - self.ttl_s)).fetchone()
        return (row[0], row[1]) if row else None

    def _put(self, scope: str, key: str, print_: str, body: dict) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO idempotency (scope, key, fingerprint, body, created_at) "
            "VALUES (?, ?, ?, ?, ?)", (scope, key, print_, json.dumps(body), time.time()))
        self._puts += 1
        if self._puts % _PRUNE_EVERY == 1:
            self._prune()

    def _prune(self) -> None:
        self._db.execute("DELETE FROM idempotency WHERE created_at < ?",
                         (time.time() - self.ttl_s,))
        (count,) = self._db.execute("SELECT COUNT(*) FROM idempotency").fetchone()
        if count > self.max_keys:
            self._db.execute(
                "DELETE FROM idempotency WHERE rowid IN (SELECT rowid FROM idempotency "
                "ORDER BY created_at LIMIT ?)", (count - self.max_keys,))
