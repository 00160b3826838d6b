"""Faults a user would meet: a full disk (a real, small tmpfs) and an S3 store
that goes away. Each must surface as a clear error, lose nothing that was
committed, leave nothing half-committed, and a retry must work."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.snapshot import (
    RepositoryUnavailable,
    SnapshotNotFound,
    SnapshotStore,
    StorageFull,
    open_repository,
)
from test_snapshot_store import (  # noqa: F401  (fixtures)
    MiB,
    S3Server,
    chunk_count,
    fixture_s3_server,
    make_store,
    read_tree,
    stage,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"),
                                reason="mounting a tmpfs needs root")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, unmounted at the end."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mnt)],
                   check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@needs_root
def test_repository_disk_full_during_commit(small_disk: Path, tmp_path: Path) -> None:
    store = SnapshotStore(open_repository({"backend": "posix_fs", "path": str(small_disk)}),
                          tmp_path / "cache", tmp_path / "staging")
    small = {"pages.img": os.urandom(MiB)}
    store.commit("small", stage(store, "small", small), {})
    big = {"pages.img": os.urandom(12 * MiB)}
    staging = stage(store, "big", big)
    with pytest.raises(StorageFull, match="no space left"):
        store.commit("big", staging, {})
    # Nothing half-committed; the committed snapshot and the staging are intact.
    with pytest.raises(SnapshotNotFound):
        store.get("big")
    assert [m.snapshot_id for m in store.list()] == ["small"]
    assert read_tree(staging) == big
    assert list((small_disk / "tmp").iterdir()) == []
    assert store.repo.list_objects("leases/") == []
    # The collector frees what the failed commit wrote (no lease protects it).
    stats = store.gc(wait=0)
    assert stats["deleted_chunks"] > 0
    store.evict("small")
    assert read_tree(store.materialize("small")) == small
    assert _used(small_disk) < 2 * MiB


@needs_root
def test_cache_disk_full_during_materialize(small_disk: Path, tmp_path: Path) -> None:
    repo = open_repository({"backend": "posix_fs", "path": str(tmp_path / "repo")})
    writer = SnapshotStore(repo, tmp_path / "writer-cache", tmp_path / "staging")
    big = {"pages.img": os.urandom(12 * MiB)}
    writer.commit("big", stage(writer, "big", big), {})
    node = SnapshotStore(repo, small_disk / "cache", tmp_path / "staging2")
    with pytest.raises(StorageFull, match="materializing snapshot big"):
        node.materialize("big")
    assert not node.is_cached("big")
    assert not (small_disk / "cache" / "big").exists()
    assert list((small_disk / "cache" / ".tmp").iterdir()) == []
    assert _used(small_disk) < MiB
    # Still committed, and a smaller one fits.
    assert writer.get("big").total_bytes == 12 * MiB
    writer.commit("fits", stage(writer, "fits", {"a": os.urandom(MiB)}), {})
    assert read_tree(node.materialize("fits")) == {"a": (node.cache_dir / "fits/a").read_bytes()}
    assert node.is_cached("fits")


@needs_root
def test_staging_disk_full_is_storage_full(small_disk: Path, tmp_path: Path) -> None:
    """A capture that fills the staging disk: the commit is refused, not half-made."""
    store = SnapshotStore(open_repository({"backend": "posix_fs", "path": str(tmp_path / "r")}),
                          tmp_path / "cache", small_disk / "staging")
    staging = store.new_staging("cap")
    with pytest.raises(OSError) as info, open(staging / "pages.img", "wb") as f:
        for _ in range(16):
            f.write(os.urandom(MiB))
            f.flush()
    assert info.value.errno == 28
    # The runtime reports the failed capture; the store drops its staging.
    store.discard_staging("cap")
    assert not staging.exists()
    assert _used(small_disk) < MiB
    with pytest.raises(SnapshotNotFound):
        store.get("cap")


@pytest.fixture
def own_s3() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    yield server
    server.stop()


def test_s3_unreachable_then_back(own_s3: S3Server, tmp_path: Path) -> None:
    config = own_s3.config()
    store = make_store(config, tmp_path / "node", lease_ttl=3)
    first = {"pages.img": os.urandom(2 * MiB)}
    store.commit("first", stage(store, "first", first), {"source_sandbox_id": "s"})
    second = {"pages.img": os.urandom(2 * MiB)}
    staging = stage(store, "second", second)

    own_s3.stop()
    t0 = time.monotonic()
    with pytest.raises(RepositoryUnavailable, match="unreachable"):
        store.commit("second", staging, {"source_sandbox_id": "s"})
    assert time.monotonic() - t0 < 20
    with pytest.raises(RepositoryUnavailable):
        store.list()
    # Local state intact: the staging, and the cached snapshot restores without S3.
    assert read_tree(staging) == second
    assert read_tree(store.materialize("first")) == first
    store.evict("first")
    with pytest.raises(RepositoryUnavailable):
        store.materialize("first")
    assert not store.is_cached("first")

    own_s3.start()
    manifest = store.commit("second", staging, {"source_sandbox_id": "s"})
    assert manifest.total_bytes == 2 * MiB
    assert [m.snapshot_id for m in store.list()] == ["first", "second"]
    store.evict("second")
    assert read_tree(store.materialize("second")) == second
    assert read_tree(store.materialize("first")) == first


def test_s3_goes_away_mid_commit(own_s3: S3Server, tmp_path: Path) -> None:
    config = own_s3.config()
    store = make_store(config, tmp_path / "node", lease_ttl=2, threads=2)
    old = {"pages.img": os.urandom(MiB)}
    store.commit("old", stage(store, "old", old), {})
    before = chunk_count(store)
    new = {"pages.img": os.urandom(16 * MiB)}
    staging = stage(store, "new", new)
    errors: list[BaseException] = []

    def commit() -> None:
        try:
            store.commit("new", staging, {})
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=commit)
    t.start()
    deadline = time.monotonic() + 30
    while chunk_count(store) < before + 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    own_s3.stop()
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RepositoryUnavailable), errors
    own_s3.start()
    # Old state: "new" does not exist, "old" is intact, the staging is intact.
    with pytest.raises(SnapshotNotFound):
        store.get("new")
    assert read_tree(staging) == new
    store.evict("old")
    assert read_tree(store.materialize("old")) == old
    # The retry succeeds; the partial upload's chunks are reused, not duplicated.
    store.commit("new", staging, {})
    store.evict("new")
    assert read_tree(store.materialize("new")) == new
    time.sleep(2.2)  # the interrupted commit's lease expires
    stats = store.gc(wait=0)
    assert stats["skipped"] is None and stats["deleted_chunks"] == 0
