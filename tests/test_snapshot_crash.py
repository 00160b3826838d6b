"""kill -9 of a process in the middle of a commit: the repository keeps the old
state or the new one, never half; the garbage a crash leaves is collected once
its lease has expired; the same staging commits fine afterwards. Both backends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from agentenv.snapshot import SnapshotNotFound, chunking
from test_snapshot_store import (  # noqa: F401  (fixtures)
    MiB,
    chunk_count,
    fixture_backend,
    fixture_config,
    fixture_s3_server,
    make_store,
    read_tree,
    stage,
)

LEASE_TTL = 3.0

# The child commits and is held (blocked, never to return) at one point of the commit:
# before its manifest ("manifest": every kill then lands mid-commit, whatever the
# machine's speed) or after it ("adopt": the snapshot is committed, the process not done).
CHILD = """
import json, sys, time
from pathlib import Path
from agentenv.snapshot import SnapshotStore, open_repository
cfg, home, sid, staging, ttl, hold = sys.argv[1:7]
store = SnapshotStore(open_repository(json.loads(cfg)), Path(home) / "cache",
                      Path(home) / "staging", threads=2, lease_ttl=float(ttl))

def held(*args, **kwargs):
    print("held", flush=True)
    time.sleep(3600)

if hold == "manifest":
    put = store.repo.put_object
    store.repo.put_object = lambda key, *a, **kw: (
        held() if key.startswith("manifests/") else put(key, *a, **kw))
else:
    store.cache.adopt = held
print("ready", flush=True)
store.commit(sid, Path(staging), {"source_sandbox_id": "crashy"})
print("done", flush=True)
"""


def _commit_and_kill(config: dict, home: Path, sid: str, staging: Path, store,
                     kill_after_new_chunks: int, hold: str = "manifest") -> None:
    """Run a commit in a child process held at ``hold``; kill -9 it once it stored N
    new chunks (held before its manifest), or once it is held after its manifest."""
    before = chunk_count(store)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(config), str(home), sid, str(staging),
         str(LEASE_TTL), hold], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        if hold == "manifest":
            deadline = time.monotonic() + 60
            while chunk_count(store) - before < kill_after_new_chunks:
                assert child.poll() is None and time.monotonic() < deadline, \
                    "the commit ended or stalled before the kill"
                time.sleep(0.005 if config["backend"] == "posix_fs" else 0.05)
        else:
            assert child.stdout.readline().strip() == "held"
        assert child.poll() is None, "the commit ended before the kill"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
    assert child.returncode == -signal.SIGKILL


def _garbage_left(store, left: set[str], old: set[str], after_kill: dict[int, set[str]],
                  gc_start: float, stats: dict) -> str:
    """What a collection that left garbage left: whose chunks, written when."""
    extra = left - old
    first, second = after_kill.get(1, set()), after_kill.get(60, set())
    path = getattr(store.repo, "_chunk_path", None)  # posix_fs: when each was written
    ages = sorted(os.stat(path(d)).st_mtime - gc_start for d in extra) if path else []
    return (f"{len(extra)} extra, {len(old - left)} missing; of the extra: "
            f"{len(extra & first)} listed after the first kill, "
            f"{len(extra & (second - first))} only after the second, "
            f"{len(extra - first - second)} never before the collection; "
            f"written {ages[:1]}..{ages[-1:]} s from its start; gc: {stats}")


def test_kill_9_mid_commit_leaves_old_or_new_state(config: dict, tmp_path: Path) -> None:
    home = tmp_path / "node"
    store = make_store(config, home, lease_ttl=LEASE_TTL)
    old = {"pages.img": os.urandom(4 * MiB), "checkpoint.img": os.urandom(100_000)}
    store.commit("old", stage(store, "old", old), {"source_sandbox_id": "crashy"})
    old_chunks = {d for d, _ in store.repo.list_chunks()}

    # Killed mid-commit, after the first chunk and after 60 (of ~200): the old state.
    new = {"pages.img": os.urandom(12 * MiB), "checkpoint.img": os.urandom(200_000)}
    staging = stage(store, "new", new)
    after_kill: dict[int, set[str]] = {}
    for n in (1, 60):
        _commit_and_kill(config, home, "new", staging, store, n)
        after_kill[n] = {d for d, _ in store.repo.list_chunks()}
        assert len(after_kill[n]) >= len(old_chunks) + n
        if n == 1:
            # The dead commit's lease protects its chunks until it expires.
            early = store.gc(wait=0)
            assert early["skipped"] and early["deleted_chunks"] == 0
        # The snapshot does not exist anywhere, the staging is intact.
        with pytest.raises(SnapshotNotFound):
            store.get("new")
        assert "new" not in [m.snapshot_id for m in store.list()]
        assert read_tree(staging) == new
        # The old snapshot is untouched.
        store.evict("old")
        assert read_tree(store.materialize("old")) == old

    # Once the lease has expired the collector removes exactly the unreferenced chunks.
    time.sleep(LEASE_TTL + 0.2)
    gc_start = time.time()
    stats = store.gc(wait=0)
    assert stats["skipped"] is None, stats
    assert stats["expired_leases"] >= 1
    left = {d for d, _ in store.repo.list_chunks()}
    assert left == old_chunks, _garbage_left(store, left, old_chunks, after_kill, gc_start, stats)
    assert store.repo.list_objects("leases/") == []

    # Killed after its manifest (the same staging, retried): the new state, complete and
    # byte-identical; its chunks are referenced, the old snapshot's too.
    _commit_and_kill(config, home, "new", staging, store, 0, hold="adopt")
    manifest = store.get("new")
    assert manifest.total_bytes == sum(len(v) for v in new.values())
    assert read_tree(store.materialize("new")) == new
    assert store.gc(wait=0)["deleted_chunks"] == 0
    assert {d for d, _ in store.repo.list_chunks()} == old_chunks | manifest.digests()
    assert store.repo.list_objects("leases/") == []
    store.evict("old")
    assert read_tree(store.materialize("old")) == old


def test_posix_crash_leaves_no_partial_files(tmp_path: Path) -> None:
    """A posix_fs writer killed mid-write leaves temp files only, which gc removes."""
    home = tmp_path / "node"
    config = {"backend": "posix_fs", "path": str(tmp_path / "repo")}
    store = make_store(config, home, lease_ttl=LEASE_TTL)
    staging = stage(store, "t", {"pages.img": os.urandom(16 * MiB)})
    _commit_and_kill(config, home, "t", staging, store, 10)
    root = Path(config["path"])
    for path in (root / "chunks").rglob("*"):
        if path.is_file():
            # Every chunk visible under its name is complete: it decompresses and verifies.
            blob = store.repo.get_chunk(path.name)
            data = zstandard.ZstdDecompressor().decompress(blob)
            assert chunking.digest(data) == path.name
    time.sleep(LEASE_TTL + 0.2)  # the dead writer's lease expires
    stats = store.gc(wait=0)
    assert stats["skipped"] is None
    assert list((root / "tmp").iterdir()) == []
    assert chunk_count(store) == 0
