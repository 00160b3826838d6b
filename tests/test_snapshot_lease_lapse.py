"""A process stalled past its lease (SIGSTOP, a paused VM, swap) must not act on it
afterwards: a commit whose lease a collector saw expire does not write its manifest
(the collector may have deleted its chunks), and a collector whose gc lock lapsed
deletes nothing more (a commit may have taken the lock over and reused a chunk).

Real posix_fs repository; the stall is made by holding the repository calls of the
stalled process (its work and its lease's refreshes) until the other side has acted.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agentenv.snapshot import SnapshotError, SnapshotNotFound, SnapshotStore, open_repository
from agentenv.snapshot.collector import LOCK_LAPSED, collect_garbage

TTL = 1.0
WAIT = 30.0  # how long a held call waits for the test at most


class HeldRepo:
    """A repository whose chosen calls wait for the test (the rest pass through)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.description = inner.description
        self.chunks_written = 0
        self.first_chunk = threading.Event()
        self.go = threading.Event()  # the held commit may go on writing chunks
        self.refreshes: dict[str, int] = {}
        self.refreshed = threading.Condition()
        self.hold_refresh_of = ""  # a key prefix whose first refresh waits for ...
        self.released = threading.Event()  # ... this
        self.refresh_held = threading.Event()
        self.manifest_lists = 0
        self.hold_second_mark = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_chunk(self, digest: str, blob: bytes) -> None:
        self.inner.put_chunk(digest, blob)
        self.chunks_written += 1
        self.first_chunk.set()
        assert self.go.wait(WAIT)

    def put_object(self, key: str, data: bytes, *, exclusive: bool = False) -> None:
        prefix = key.split("/")[0]
        if not exclusive and (key in self.refreshes or prefix == "locks"):
            # A refresh (the first write of a lease or lock is its acquire).
            n = self.refreshes.get(key, 0) + 1
            if n == 1 and self.hold_refresh_of and key.startswith(self.hold_refresh_of):
                self.refresh_held.set()
                assert self.released.wait(WAIT)
            self.inner.put_object(key, data, exclusive=exclusive)
            with self.refreshed:
                self.refreshes[key] = n
                self.refreshed.notify_all()
            return
        self.inner.put_object(key, data, exclusive=exclusive)
        if prefix in ("leases", "locks"):
            self.refreshes.setdefault(key, 0)

    def list_objects(self, prefix: str) -> list[str]:
        if prefix == "manifests/":
            self.manifest_lists += 1
            if self.manifest_lists == 2 and self.hold_second_mark:
                # The collector's second mark, under its lock: the process stalls past
                # the lock's expiry (its refreshes are held as well).
                self.refresh_held.wait(WAIT)
                assert not self.released.wait(TTL * 1.5)
                self.released.set()
        return self.inner.list_objects(prefix)


def _repo(tmp_path: Path) -> Any:
    return open_repository({"backend": "posix_fs", "path": str(tmp_path / "repo")})


def test_a_commit_whose_lease_lapsed_writes_no_manifest(tmp_path: Path) -> None:
    held = HeldRepo(_repo(tmp_path))
    held.hold_refresh_of = "leases/"
    store = SnapshotStore(held, tmp_path / "cache", tmp_path / "staging", threads=1,
                          lease_ttl=TTL)
    staging = store.new_staging("s")
    (staging / "pages.img").write_bytes(os.urandom(2 << 20))
    failure: list[BaseException] = []

    def commit() -> None:
        try:
            store.commit("s", staging, {})
        except BaseException as exc:  # reported by the test
            failure.append(exc)

    worker = threading.Thread(target=commit)
    worker.start()
    try:
        # The commit wrote a chunk; its process stalls (its lease's refresh is held)
        # until a collector has seen the lease expire and deleted the chunk.
        assert held.first_chunk.wait(WAIT) and held.refresh_held.wait(WAIT)
        collector = SnapshotStore(_repo(tmp_path), tmp_path / "gc-cache",
                                  tmp_path / "gc-staging", lease_ttl=TTL)
        stats: dict = {"expired_leases": 0}
        for _ in range(int(WAIT / 0.1)):
            stats = collector.gc(wait=0)
            if stats["expired_leases"]:
                break
            time.sleep(0.1)
        assert stats["expired_leases"] == 1 and stats["deleted_chunks"] >= 1, stats
        # The process runs again: the held refresh lands, then a timely one.
        held.released.set()
        lease = next(k for k in held.refreshes if k.startswith("leases/"))
        with held.refreshed:
            assert held.refreshed.wait_for(lambda: held.refreshes.get(lease, 0) >= 2, WAIT)
    finally:
        held.go.set()
        worker.join(WAIT)
    assert failure and isinstance(failure[0], SnapshotError), failure
    assert "lease" in str(failure[0])
    with pytest.raises(SnapshotNotFound):
        store.get("s")
    assert (staging / "pages.img").exists()  # left as it was: the commit can be retried
    # Retried, it commits whole (the deleted chunk written again) and restores.
    store.commit("s", staging, {})
    store.evict("s")
    assert store.materialize("s").joinpath("pages.img").stat().st_size == 2 << 20


def test_a_collector_whose_lock_lapsed_deletes_nothing(tmp_path: Path) -> None:
    held = HeldRepo(_repo(tmp_path))
    held.go.set()
    held.hold_refresh_of = "locks/"
    held.hold_second_mark = True
    garbage = [f"{i:02x}" * 32 for i in range(3)]
    for digest in garbage:
        held.inner.put_chunk(digest, b"unreferenced")
    stats = collect_garbage(held, lease_ttl=TTL, wait=0, cached_manifest=lambda _: None)
    assert stats["skipped"] == LOCK_LAPSED, stats
    assert stats["deleted_chunks"] == 0
    assert sorted(d for d, _ in held.inner.list_chunks()) == garbage
    # The next collection, not stalled, deletes them.
    held.hold_second_mark, held.hold_refresh_of = False, ""
    stats = collect_garbage(held, lease_ttl=TTL, wait=0, cached_manifest=lambda _: None)
    assert stats["skipped"] is None and stats["deleted_chunks"] == 3, stats
    assert list(held.inner.list_chunks()) == []
