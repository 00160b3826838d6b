"""Repository leases: the handshake that keeps commits and garbage collection apart.

A commit holds a lease ``leases/<id>.<nonce>`` while it writes; the collector
holds the lock ``locks/gc`` while it deletes. Both are repository objects kept
alive by a heartbeat, so they expire when their writer dies. Each side writes
its own object before reading the other's, so at least one of them sees the
other (the full protocol is in ``store``'s module doc).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from agentenv.snapshot.errors import ObjectMissing, SnapshotError, SnapshotExists
from agentenv.snapshot.repository import Repository

log = logging.getLogger("agentenv.snapshot")

GC_LOCK = "locks/gc"


def now() -> float:
    return time.time()


class Lease:
    """A repository object that says "I am working"; a heartbeat keeps it alive."""

    def __init__(self, repo: Repository, key: str, ttl: float) -> None:
        self.repo = repo
        self.key = key
        self.ttl = ttl
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok = 0.0
        # Once a refresh landed too late (someone may have seen the lease expire and
        # acted: a collector deleting a commit's chunks, a commit taking a gc lock over),
        # the lease is no longer valid, even after later refreshes succeed.
        self._lapsed = False

    def _body(self) -> bytes:
        t = now()
        return json.dumps({"owner": self.owner, "written": t, "expires": t + self.ttl}).encode()

    def acquire(self, *, exclusive: bool = False) -> None:
        t = now()
        self.repo.put_object(self.key, self._body(), exclusive=exclusive)
        self._last_ok, self._lapsed = t, False
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lease {self.key}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            t = now()
            try:
                self.repo.put_object(self.key, self._body())
            except SnapshotError as exc:
                log.warning("cannot refresh %s: %s", self.key, exc)
                continue
            if now() >= self._last_ok + self.ttl * 0.75:
                # Written after the margin (a stalled process, a slow repository): what
                # was stored before may have been seen expired in between.
                if not self._lapsed:
                    log.warning("%s lapsed: refreshed %.1fs after the last refresh "
                                "(ttl %.1fs)", self.key, now() - self._last_ok, self.ttl)
                self._lapsed = True
            self._last_ok = t

    def valid(self) -> bool:
        """True while no one else can have seen this lease expire (with a safety margin)
        and no one can have since it was taken."""
        return not self._lapsed and now() < self._last_ok + self.ttl * 0.75

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with contextlib.suppress(SnapshotError):
            if self.key.startswith("locks/"):
                # Delete a lock only while it is still ours (a stale one may be taken over).
                body = json.loads(self.repo.get_object(self.key))
                if body.get("owner") != self.owner:
                    return
            self.repo.delete_object(self.key)


def expired(body: bytes, at: float) -> bool:
    """True when a lease or lock body says it expired before ``at`` (or is unreadable)."""
    try:
        return float(json.loads(body)["expires"]) < at
    except (ValueError, KeyError, TypeError):
        return True


# -- the commit's side -----------------------------------------------------------
def begin_commit(repo: Repository, snapshot_id: str, ttl: float, wait: float) -> Lease:
    """A held commit lease, taken when no garbage collection holds the repository.

    A stale gc lock (its collector died) is removed; a live one is waited out for
    up to ``wait`` seconds, then SnapshotError.
    """
    deadline = time.monotonic() + wait
    while True:
        lease = Lease(repo, f"leases/{snapshot_id}.{uuid.uuid4().hex[:12]}", ttl)
        lease.acquire()
        try:
            body = repo.get_object(GC_LOCK)
        except ObjectMissing:
            return lease
        except BaseException:
            lease.release()
            raise
        lease.release()
        if expired(body, now()):
            # A collector died holding the lock: it is stale, take it away.
            with contextlib.suppress(SnapshotError):
                if repo.get_object(GC_LOCK) == body:
                    repo.delete_object(GC_LOCK)
            continue
        if time.monotonic() > deadline:
            raise SnapshotError("garbage collection has held the repository for "
                                f"{wait}s; commit of {snapshot_id} not started")
        time.sleep(0.2)


# -- the collector's side ----------------------------------------------------------
def take_gc_lock(lock: Lease) -> bool:
    """Acquire the gc lock (taking over a stale one); False while another holds it."""
    repo = lock.repo
    for _ in range(2):
        try:
            lock.acquire(exclusive=True)
            return True
        except SnapshotExists:
            try:
                body = repo.get_object(GC_LOCK)
            except ObjectMissing:
                continue
            if not expired(body, now()):
                return False
            with contextlib.suppress(SnapshotError):
                repo.delete_object(GC_LOCK)
    return False


def scan_leases(repo: Repository) -> tuple[list[str], list[str]]:
    """The commit leases in the repository: (live keys, expired keys)."""
    live: list[str] = []
    stale: list[str] = []
    t = now()
    for key in repo.list_objects("leases/"):
        try:
            body = repo.get_object(key)
        except ObjectMissing:
            continue
        (stale if expired(body, t) else live).append(key)
    return live, stale
