"""SnapshotStore against both repository backends: a directory and a real S3 server.

The S3 server is moto in server mode on 127.0.0.1 (HTTP, the same boto3 client
a real deployment uses); nothing is mocked. Other snapshot test files import
the fixtures from here.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
from moto.moto_server.threaded_moto_server import MotoRequestHandler
from moto.moto_server.werkzeug_app import create_backend_app
from werkzeug.serving import BaseWSGIServer, make_server

from agentenv.snapshot import (
    CorruptSnapshot,
    SnapshotError,
    SnapshotExists,
    SnapshotNotFound,
    SnapshotStore,
    open_repository,
)

BACKENDS = ["posix_fs", "oss"]
MiB = 1 << 20
_count = itertools.count()


# -- fixtures (shared with the other test_snapshot_* files) -------------------------
class S3Server:
    """moto's S3 on a loopback port; stop() and start() keep its data (moto keeps it in
    this process). Its S3 app is served alone: moto's own server puts every request
    through a dispatcher that finds the service under one lock, which serialised the
    repository's parallel chunk transfers."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._server = make_server("127.0.0.1", self.port, _moto_s3_app(), threaded=True,
                                   request_handler=MotoRequestHandler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()  # refused from here on, as a server that is down
            assert self._thread is not None
            self._thread.join()
            self._server = self._thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")

    def new_bucket(self) -> str:
        name = f"snap-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def config(self, bucket: str | None = None, **extra) -> dict:
        return {"backend": "oss", "endpoint_url": self.url, "bucket": bucket or self.new_bucket(),
                "prefix": "repo", "region": "us-east-1", "access_key_id": "test",
                "secret_access_key": "test", "connect_timeout": 1, "max_attempts": 2, **extra}


@functools.cache
def _moto_s3_app() -> object:
    return create_backend_app("s3")


@pytest.fixture(scope="session", name="s3_server")
def fixture_s3_server() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    yield server
    server.stop()


def repo_config(backend: str, tmp_path: Path, s3: S3Server | None) -> dict:
    if backend == "posix_fs":
        return {"backend": "posix_fs", "path": str(tmp_path / f"repo{next(_count)}")}
    assert s3 is not None
    return s3.config()


@pytest.fixture(params=BACKENDS, name="backend")
def fixture_backend(request) -> str:
    return request.param


@pytest.fixture(name="config")
def fixture_config(backend: str, tmp_path: Path, request) -> dict:
    s3 = request.getfixturevalue("s3_server") if backend == "oss" else None
    return repo_config(backend, tmp_path, s3)


def make_store(config: dict, home: Path, **kwargs) -> SnapshotStore:
    return SnapshotStore(open_repository(config), home / "cache" / "snapshots",
                         home / "snapshots-staging", **kwargs)


@pytest.fixture(name="store")
def fixture_store(config: dict, tmp_path: Path) -> Iterator[SnapshotStore]:
    s = make_store(config, tmp_path / "node")
    yield s
    s.repo.close()


def stage(store: SnapshotStore, sid: str, files: dict[str, bytes]) -> Path:
    path = store.new_staging(sid)
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def payload(size: int = 6 * MiB) -> dict[str, bytes]:
    """Something shaped like a checkpoint: random pages, a zero run, small metadata files."""
    pages = os.urandom(size // 2) + bytes(size // 4) + os.urandom(size // 4)
    return {"checkpoint.img": os.urandom(300_000), "pages.img": pages,
            "pages_meta.img": os.urandom(5000), "fs/layer.tar": os.urandom(70_000),
            "empty": b""}


def read_tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


def chunk_count(store: SnapshotStore) -> int:
    return sum(1 for _ in store.repo.list_chunks())


class CountingRepo:
    """Wraps a repository and counts every call (to prove a path touches none)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.description = inner.description

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return call


# -- tests ----------------------------------------------------------------------------
def test_round_trip_is_byte_identical(store: SnapshotStore) -> None:
    files = payload()
    manifest = store.commit("snap-a", stage(store, "snap-a", files),
                            {"template_id": "base", "source_sandbox_id": "sbx1"})
    assert manifest.total_bytes == sum(len(v) for v in files.values())
    assert 0 < manifest.stored_bytes < manifest.total_bytes  # the zero run is not stored
    assert set(manifest.files) == set(files)
    # The staged files became this node's cache: no download needed here.
    assert store.is_cached("snap-a")
    assert read_tree(store.materialize("snap-a")) == files
    # A cold node (empty cache) fetches and verifies every chunk.
    store.evict("snap-a")
    assert not store.is_cached("snap-a")
    path = store.materialize("snap-a")
    assert read_tree(path) == files
    assert store.is_cached("snap-a")
    # A fresh store on the same repository (another node) sees the same snapshot.
    other = SnapshotStore(store.repo, store.cache_dir.parent / "other", store.staging_dir)
    assert read_tree(other.materialize("snap-a")) == files
    assert other.get("snap-a").metadata == {"template_id": "base", "source_sandbox_id": "sbx1"}


def test_cached_restore_touches_no_repository(config: dict, tmp_path: Path) -> None:
    repo = CountingRepo(open_repository(config))
    store = SnapshotStore(repo, tmp_path / "cache", tmp_path / "staging")
    files = payload(2 * MiB)
    store.commit("s1", stage(store, "s1", files), {})
    repo.calls.clear()
    for _ in range(3):
        assert read_tree(store.materialize("s1")) == files
        assert store.is_cached("s1")
    assert repo.calls == []
    # After an eviction the first materialize downloads, the next ones do not.
    store.evict("s1")
    store.materialize("s1")
    assert "get_chunk" in repo.calls
    repo.calls.clear()
    store.materialize("s1")
    assert repo.calls == []


def test_second_snapshot_after_1mib_change_stores_only_changed_chunks(
        store: SnapshotStore) -> None:
    base = os.urandom(32 * MiB)
    full = store.commit("v1", stage(store, "v1", {"pages.img": base}),
                        {"source_sandbox_id": "sbx"})
    # Insert 1 MiB in the middle: every later byte shifts (what a new allocation does
    # to pages.img).
    changed = base[:10 * MiB] + os.urandom(MiB) + base[10 * MiB:]
    before = chunk_count(store)
    second = store.commit("v2", stage(store, "v2", {"pages.img": changed}),
                          {"source_sandbox_id": "sbx", "parent_snapshot_id": "v1"})
    ratio = second.stored_bytes / full.stored_bytes
    print(f"full {full.stored_bytes} B, after a 1 MiB change {second.stored_bytes} B "
          f"({100 * ratio:.2f}%), new chunks {chunk_count(store) - before}")
    assert ratio <= 0.05
    assert second.stored_bytes >= MiB  # the new data itself is stored
    store.evict("v2")
    assert read_tree(store.materialize("v2")) == {"pages.img": changed}


def test_other_node_fetches_only_chunks_its_template_snapshots_lack(
        config: dict, tmp_path: Path) -> None:
    """Issue 18, item 6: a snapshot made on node A, restored on node B, reads from the
    repository only the chunks B's cached snapshots of the same template lack (B's
    boot image of the template shares most of a sandbox's memory)."""
    base = os.urandom(16 * MiB)
    node_a = make_store(config, tmp_path / "a")
    repo_b = CountingRepo(open_repository(config))
    node_b = SnapshotStore(repo_b, tmp_path / "b" / "cache", tmp_path / "b" / "staging")
    node_b.commit("b-image", stage(node_b, "b-image", {"pages.img": base}),
                  {"kind": "template", "template_id": "t1"})
    changed = base[:5 * MiB] + os.urandom(MiB) + base[5 * MiB:]
    node_a.commit("a-pause", stage(node_a, "a-pause", {"pages.img": changed}),
                  {"kind": "pause", "template_id": "t1", "source_sandbox_id": "sbx"})
    repo_b.calls.clear()
    assert read_tree(node_b.materialize("a-pause")) == {"pages.img": changed}
    chunks = repo_b.calls.count("get_chunk")
    total = len(node_a.get("a-pause").files["pages.img"].chunks)
    assert 0 < chunks <= total // 4, (chunks, total)  # the 1 MiB changed, not 17 MiB
    node_a.repo.close()
    repo_b.inner.close()


def test_zero_chunks_are_not_stored(store: SnapshotStore) -> None:
    files = {"pages.img": bytes(20 * MiB) + b"\x01" + bytes(3 * MiB)}
    m = store.commit("z", stage(store, "z", files), {})
    assert m.stored_bytes < 64 * 1024
    assert chunk_count(store) <= 2
    store.evict("z")
    path = store.materialize("z")
    assert read_tree(path) == files
    # Zero runs are holes in the cached file, not written blocks.
    assert os.stat(path / "pages.img").st_blocks * 512 < 2 * MiB


def test_get_list_resolve_alias_delete(store: SnapshotStore) -> None:
    store.commit("s1", stage(store, "s1", {"a": b"one" * 1000}),
                 {"source_sandbox_id": "sbx1", "template_id": "t1"}, alias="ready")
    store.commit("s2", stage(store, "s2", {"a": b"two" * 1000}),
                 {"source_sandbox_id": "sbx2", "template_id": "t1"})
    store.commit("s3", stage(store, "s3", {"a": b"three" * 1000}),
                 {"source_sandbox_id": "sbx1", "template_id": "t2"})
    assert store.get("s1").alias == "ready"
    assert store.resolve("ready").snapshot_id == "s1"
    assert store.resolve("s2").snapshot_id == "s2"
    assert [m.snapshot_id for m in store.list()] == ["s1", "s2", "s3"]
    assert [m.snapshot_id for m in store.list(source_sandbox_id="sbx1")] == ["s1", "s3"]
    assert [m.snapshot_id for m in store.list(template_id="t1")] == ["s1", "s2"]
    assert [m.snapshot_id for m in store.list(source_sandbox_id="sbx1", template_id="t2")] \
        == ["s3"]
    assert store.list(source_sandbox_id="nobody") == []
    # Re-pointing an alias is one atomic write; the old snapshot loses it.
    store.commit("s4", stage(store, "s4", {"a": b"four" * 1000}), {}, alias="ready")
    assert store.resolve("ready").snapshot_id == "s4"
    assert store.get("s1").alias is None
    assert {m.snapshot_id: m.alias for m in store.list()}["s4"] == "ready"
    store.set_alias("ready", "s2")
    assert store.resolve("ready").snapshot_id == "s2"
    # Snapshots are immutable.
    with pytest.raises(SnapshotExists):
        store.commit("s2", stage(store, "s2again", {"a": b"x"}), {})
    # delete removes the snapshot and its alias; the others stay.
    store.delete("s2")
    with pytest.raises(SnapshotNotFound):
        store.get("s2")
    with pytest.raises(SnapshotNotFound):
        store.resolve("ready")
    with pytest.raises(SnapshotNotFound):
        store.materialize("s2")
    with pytest.raises(SnapshotNotFound):
        store.delete("s2")
    assert not store.is_cached("s2")
    assert [m.snapshot_id for m in store.list()] == ["s1", "s3", "s4"]
    # Bad names never reach the repository as keys.
    with pytest.raises(SnapshotNotFound):
        store.get("../etc/passwd")
    with pytest.raises(SnapshotError):
        store.new_staging("a/b")


def test_corrupt_or_missing_chunk_is_a_clear_error(store: SnapshotStore) -> None:
    files = {"pages.img": os.urandom(3 * MiB)}
    m = store.commit("c", stage(store, "c", files), {})
    digests = [d for d, _ in m.files["pages.img"].chunks]
    store.evict("c")
    # Replace one stored chunk with another chunk's content: well-formed zstd, wrong data.
    store.repo.put_chunk(digests[1], store.repo.get_chunk(digests[0]))
    with pytest.raises(CorruptSnapshot, match=digests[1]):
        store.materialize("c")
    assert not store.is_cached("c")
    assert not (store.cache_dir / "c").exists()
    # Garbage bytes.
    store.repo.put_chunk(digests[1], b"not zstd at all")
    with pytest.raises(CorruptSnapshot, match="decompress"):
        store.materialize("c")
    # Missing.
    store.repo.delete_chunks([digests[1]])
    with pytest.raises(CorruptSnapshot, match="missing"):
        store.materialize("c")
    assert not store.is_cached("c")
    assert list((store.cache_dir / ".tmp").iterdir()) == []


def test_gc_removes_only_unreferenced_chunks(store: SnapshotStore) -> None:
    shared = os.urandom(4 * MiB)
    a = {"pages.img": shared + os.urandom(2 * MiB)}
    b = {"pages.img": shared + os.urandom(2 * MiB)}
    ma = store.commit("a", stage(store, "a", a), {})
    mb = store.commit("b", stage(store, "b", b), {})
    only_a = ma.digests() - mb.digests()
    assert only_a and ma.digests() & mb.digests()
    # Leftovers of a crashed commit: chunks no manifest names.
    orphan = os.urandom(100_000)
    from agentenv.snapshot import chunking

    orphan_digest = chunking.digest(orphan)
    store.repo.put_chunk(orphan_digest, chunking.compress(orphan))
    stats = store.gc()
    assert stats["skipped"] is None
    assert stats["deleted_chunks"] == 1
    assert not store.repo.has_chunk(orphan_digest)
    store.delete("a")
    stats = store.gc()
    assert stats["deleted_chunks"] == len(only_a)
    assert stats["deleted_bytes"] > 0
    remaining = {d for d, _ in store.repo.list_chunks()}
    assert remaining == mb.digests()
    store.evict("b")
    assert read_tree(store.materialize("b")) == b
    assert store.gc()["deleted_chunks"] == 0


class PausingRepo(CountingRepo):
    """Holds a commit just before its manifest is written."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.reached = threading.Event()
        self.go = threading.Event()

    def put_object(self, key, data, **kwargs):
        if key.startswith("manifests/"):
            self.reached.set()
            assert self.go.wait(30)
        return self.inner.put_object(key, data, **kwargs)


def hold_commit(store: SnapshotStore, repo: PausingRepo, sid: str,
                staging: Path) -> Callable[[], dict]:
    """Start committing ``staging`` in a thread and return once it is held before its
    manifest. The returned ``finish`` releases it beside a collection that waits for
    commits, and returns that collection's statistics once both are done."""
    errors: list[BaseException] = []

    def commit() -> None:
        try:
            store.commit(sid, staging, {})
        except BaseException as exc:
            errors.append(exc)

    committing = threading.Thread(target=commit)
    committing.start()
    assert repo.reached.wait(30)

    def finish() -> dict:
        result: dict = {}
        collecting = threading.Thread(target=lambda: result.update(store.gc(wait=30)))
        collecting.start()
        time.sleep(0.3)
        repo.go.set()
        committing.join(30)
        collecting.join(30)
        assert not errors, errors
        return result

    return finish


def test_gc_during_a_commit_keeps_its_chunks(config: dict, tmp_path: Path) -> None:
    repo = PausingRepo(open_repository(config))
    store = SnapshotStore(repo, tmp_path / "cache", tmp_path / "staging")
    files = {"pages.img": os.urandom(3 * MiB)}
    finish = hold_commit(store, repo, "busy", stage(store, "busy", files))
    # Every chunk of the commit is uploaded and none is referenced yet.
    stats = store.gc(wait=0.5)
    assert stats["skipped"] and "in progress" in stats["skipped"]
    assert stats["deleted_chunks"] == 0
    # A collector that waits long enough lets the commit finish first.
    result = finish()
    assert result["skipped"] is None and result["deleted_chunks"] == 0
    store.evict("busy")
    assert read_tree(store.materialize("busy")) == files


def test_commit_waits_while_gc_holds_the_lock(store: SnapshotStore) -> None:
    expires = time.time() + 1.5
    store.repo.put_object("locks/gc", b'{"owner": "x", "expires": %f}' % expires,
                          exclusive=True)
    store.commit("w", stage(store, "w", {"a": os.urandom(1000)}), {})
    # It waited for the lock to go stale. (Timed from the lock's expiry, not from the
    # commit's start: writing the lock to S3 took most of its 1.5 s once, at load 10.)
    assert time.time() >= expires
    assert store.get("w")


def test_concurrent_commits_and_materializes(store: SnapshotStore) -> None:
    common = os.urandom(2 * MiB)
    data = {f"p{i}": {"pages.img": common + os.urandom(MiB)} for i in range(6)}
    errors: list[BaseException] = []

    def work(sid: str) -> None:
        try:
            store.commit(sid, stage(store, sid, data[sid]), {"source_sandbox_id": "same"})
            store.evict(sid)
            assert read_tree(store.materialize(sid)) == data[sid]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(sid,)) for sid in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(store.list(source_sandbox_id="same")) == 6
    # Many restores of one snapshot at once: one download, the same files for all.
    store.evict("p0")
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(store.materialize("p0")))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(set(paths)) == 1 and len(paths) == 6
    assert read_tree(paths[0]) == data["p0"]


def test_failed_commit_leaves_staging_for_a_retry(store: SnapshotStore) -> None:
    staging = stage(store, "r", {"a": os.urandom(1000)})
    (staging / "link").symlink_to("a")
    with pytest.raises(SnapshotError, match="not a regular file"):
        store.commit("r", staging, {})
    assert (staging / "a").exists()
    (staging / "link").unlink()
    store.commit("r", staging, {})
    assert not staging.exists()
    with pytest.raises(SnapshotError, match="empty"):
        store.commit("e", store.new_staging("e"), {})


def test_staging_owns_pending_pauses(tmp_path: Path) -> None:
    """A pending pause (capture + metadata) survives a restart's clean-up; an interrupted
    snapshot (capture only), stray metadata and half-written metadata do not."""
    from agentenv.snapshot.staging import Staging

    staging = Staging(tmp_path / "staging")
    for sid in ("pause1", "snap1", "pause2"):
        (staging.new(sid) / "pages.img").write_bytes(b"x")
    staging.hold_for_commit("pause1", {"kind": "pause", "n": 1})
    staging.hold_for_commit("pause2", {"kind": "pause", "n": 2})
    staging.hold_for_commit("orphan", {"kind": "pause"})  # its capture is gone
    (staging.dir / "pause1.meta.json.tmp").write_text("{")  # a crash mid-write
    assert staging.pending("pause1") == {"kind": "pause", "n": 1}
    assert staging.pending("snap1") is None and staging.pending("orphan") is None

    removed = staging.remove_leftovers(keep={"pause1", "snap1", "orphan"})
    assert sorted(removed) == ["orphan.meta.json", "pause1.meta.json.tmp", "pause2",
                               "pause2.meta.json", "snap1"]
    assert sorted(p.name for p in staging.dir.iterdir()) == ["pause1", "pause1.meta.json"]

    staging.committed("pause1")
    assert not staging.is_pending("pause1") and staging.path("pause1").is_dir()
    staging.discard("pause1")
    assert list(staging.dir.iterdir()) == []
    with pytest.raises(SnapshotError):
        staging.path("../escape")


def test_a_posix_repository_links_another_ones_chunk(tmp_path: Path) -> None:
    """A chunk taken from a repository on the same filesystem is the same file (no copy);
    a chunk the source lacks is a clear error."""
    from agentenv.snapshot.errors import ObjectMissing
    from agentenv.snapshot.posix import PosixRepository

    src, dst = PosixRepository(tmp_path / "a", fsync=False), PosixRepository(tmp_path / "b",
                                                                               fsync=False)
    digest = "ab" * 32
    src.put_chunk(digest, b"chunk")
    assert dst.link_chunk(digest, src) and dst.link_chunk(digest, src)  # twice: one link
    assert dst.get_chunk(digest) == b"chunk"
    assert [d for d, _ in dst.list_chunks()] == [digest]
    first, second = (r.root / "chunks" / digest[:2] / digest for r in (src, dst))
    assert os.stat(first).st_ino == os.stat(second).st_ino
    with pytest.raises(ObjectMissing):
        dst.link_chunk("cd" * 32, src)
