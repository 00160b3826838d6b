"""Garbage collection of what lazily loaded images leave in the shared repository: layer
indexes, prefetch lists, use stamps, and chunks only a collected index referenced.

Both backends (a directory and the real S3 server of test_snapshot_store). Layers are
converted or indexed by the real code paths (``convert_layer``, ``index_gzip_layer``),
used by a node's real ``LazyLayers``, prefetch lists written by the real recorder; the
retention window is made seconds long so that "unused for the window" is real time.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
import zstandard

from agentenv.images.convert import convert_layer
from agentenv.images.gzip_layer import index_gzip_layer
from agentenv.images.lazy import LazyLayers
from agentenv.images.prefetch import Prefetch
from agentenv.orchestrator.collect import SnapshotCollector
from agentenv.snapshot import CorruptSnapshot, SnapshotStore, open_repository
from agentenv.snapshot.image_objects import prefetch_key, stamp, used_key
from agentenv.snapshot.layer_index import LayerIndex, RegistryBlob, key_of
from agentenv.snapshot.shared_templates import SharedTemplates
from agentenv.testing.oci_registry import Entry, tar_layer
from test_snapshot_store import (  # noqa: F401  (fixtures)
    MiB,
    PausingRepo,
    S3Server,
    fixture_backend,
    fixture_config,
    fixture_s3_server,
    hold_commit,
    make_store,
    read_tree,
    stage,
)


def gz_layer(files: dict[str, bytes]) -> tuple[bytes, str, str]:
    """A plain gzip layer: its blob, the sha256 hex of the blob, its diff ID."""
    tar = tar_layer([Entry(name, data) for name, data in files.items()])
    blob = gzip.compress(tar, compresslevel=1, mtime=0)
    return blob, hashlib.sha256(blob).hexdigest(), "sha256:" + hashlib.sha256(tar).hexdigest()


def converted(repo, files: dict[str, bytes]) -> tuple[str, LayerIndex]:
    blob, h, diff_id = gz_layer(files)
    index = convert_layer(iter([blob]), repo, h, digest_=f"sha256:{h}", diff_id=diff_id)
    return h, index


def record_prefetch(config: dict, h: str, path: str) -> None:
    """The first run's list, as a layer server writes it."""
    rec = Prefetch(h, config, h[:12], known=lambda _: True, fetch=lambda _: 0)
    rec.opened(path)
    rec.write()


def node_layers(config: dict, root: Path) -> LazyLayers:
    lazy = LazyLayers(root, open_repository(config), config)
    lazy.index_dir.mkdir(parents=True, exist_ok=True)
    return lazy


def chunks(store: SnapshotStore) -> set[str]:
    return {d for d, _ in store.repo.list_chunks()}


def objects(store: SnapshotStore, h: str) -> set[str]:
    keys = {key_of(h), prefetch_key(h), used_key(h)}
    return {k for k in keys if k in store.repo.list_objects(k.split("/")[0] + "/")}


def test_unused_layer_and_its_own_chunks_collected_used_one_kept(
        config: dict, tmp_path: Path) -> None:
    # (The window is longer than a collection takes on a loaded machine: a stamp
    # written just before one is fresh when it reads it.)
    store = make_store(config, tmp_path / "gc", image_retention_s=5.0)
    repo = store.repo
    shared = os.urandom(300_000)
    ha, idx_a = converted(repo, {"shared": shared, "only-a": os.urandom(400_000)})
    hb, idx_b = converted(repo, {"shared": shared, "only-b": os.urandom(400_000)})
    # A plain gzip layer's index (ranges of its registry blob, no repository chunks).
    blob, hg, diff_id = gz_layer({"g": os.urandom(100_000)})
    index_g = index_gzip_layer(iter([blob]), RegistryBlob("r.example", "x/y", f"sha256:{hg}",
                                                          len(blob), len(blob)),
                               diff_id=diff_id)
    first = node_layers(config, tmp_path / "node1")
    first.keep_index(hg, index_g, share=True)
    for h in (ha, hb, hg):
        record_prefetch(config, h, "only-a")
        assert first.has_index(h)  # node 1 used all three (local copies of them)
    # A snapshot sharing a chunk with layer A: that chunk stays.
    snap = store.commit("s1", stage(store, "s1", {"f": shared}), {})
    only_a = idx_a.digests() - idx_b.digests() - snap.digests()
    assert only_a and idx_a.digests() & idx_b.digests()
    assert {k.split("/")[0] for h in (ha, hb, hg) for k in objects(store, h)} == \
        {"image-layers", "image-prefetch", "image-used"}

    time.sleep(5.5)  # past the retention window; then another node uses layer B
    second = node_layers(config, tmp_path / "node2")
    assert second.has_index(hb)
    stats = store.gc()
    assert stats["skipped"] is None
    assert stats["deleted_image_layers"] == 2 and stats["image_layers"] == 3
    assert objects(store, ha) == set() and objects(store, hg) == set()
    assert objects(store, hb) == {key_of(hb), prefetch_key(hb), used_key(hb)}
    left = chunks(store)
    assert not left & only_a
    assert idx_b.digests() <= left and snap.digests() <= left
    assert stats["deleted_chunks"] == len(only_a)
    # The snapshot and layer B still read back intact.
    store.evict("s1")
    assert read_tree(store.materialize("s1")) == {"f": shared}
    for d in idx_b.digests():
        store.repo.get_chunk(d)
    # Node 1, restarted, does not trust its local copy of A (its chunks are gone): it
    # indexes the layer again. Its copy of the plain gzip layer's index still serves.
    again = node_layers(config, tmp_path / "node1")
    assert not again.has_index(ha)
    assert not (again.index_dir / f"{ha}.json.zst").exists()
    assert again.has_index(hg)
    # A second run with nothing newly unused deletes nothing. (With a retention of an
    # hour: B's use is older than 5 s by now when the machine is slow, which would
    # rightly make it unused under the first store's window.)
    patient = make_store(config, tmp_path / "gc2", image_retention_s=3600.0)
    assert patient.gc()["deleted_image_layers"] == 0 and chunks(store) == left


def test_template_named_and_unstamped_layers_are_kept(config: dict, tmp_path: Path) -> None:
    store = make_store(config, tmp_path / "gc", image_retention_s=1.0)
    repo = store.repo
    hc, _ = converted(repo, {"c": os.urandom(200_000)})
    hd, idx_d = converted(repo, {"d": os.urandom(200_000)})
    shared = SharedTemplates(repo)
    shared.publish({"templateID": "task-1", "aliases": ["task-1"],
                    "image": {"source": "r.example/x:1", "manifestDigest": "sha256:" + "0" * 64,
                              "layers": [{"digest": f"sha256:{hc}", "size": 1}]}})
    repo.delete_object(used_key(hd))  # an index written before stamps existed
    time.sleep(1.5)
    stats = store.gc()
    assert stats["deleted_image_layers"] == 0
    assert key_of(hc) in objects(store, hc)
    assert used_key(hd) in objects(store, hd)  # its clock started now
    time.sleep(1.5)
    assert store.gc()["deleted_image_layers"] == 1
    assert objects(store, hd) == set() and not chunks(store) & idx_d.digests()
    # The template gone, its layer goes once its last use is past the window.
    shared.unpublish("task-1", ["task-1"])
    assert store.gc()["deleted_image_layers"] == 1
    assert objects(store, hc) == set() and chunks(store) == set()


def test_budget_collects_least_recently_used_first(config: dict, tmp_path: Path) -> None:
    store = make_store(config, tmp_path / "gc", image_retention_s=30 * 86400.0)
    repo = store.repo
    layers = [converted(repo, {"x": os.urandom(150_000)}) for _ in range(3)]
    sizes = [len(repo.get_object(key_of(h))) for h, _ in layers]
    now = time.time()
    # Used 5 and 4 hours ago, and just now (by the conversion).
    stamp(repo, layers[0][0], now - 5 * 3600)
    stamp(repo, layers[1][0], now - 4 * 3600)
    store.image_budget_bytes = sizes[1] + sizes[2]
    assert store.gc()["deleted_image_layers"] == 1
    assert objects(store, layers[0][0]) == set()
    assert objects(store, layers[1][0]) and objects(store, layers[2][0])
    # A bound below what was used lately takes only what is older than three hours.
    store.image_budget_bytes = 1
    assert store.gc()["deleted_image_layers"] == 1
    assert objects(store, layers[1][0]) == set() and objects(store, layers[2][0])
    assert chunks(store) == layers[2][1].digests()


def test_concurrent_commit_is_not_broken(config: dict, tmp_path: Path) -> None:
    repo = PausingRepo(open_repository(config))
    store = SnapshotStore(repo, tmp_path / "cache", tmp_path / "staging",
                          image_retention_s=1.0)
    files = {"pages.img": os.urandom(3 * MiB)}
    # An expired layer whose chunk the commit also stores (the same bytes).
    ha, _ = converted(repo, {"pages.img": files["pages.img"]})
    time.sleep(1.5)
    finish = hold_commit(store, repo, "busy", stage(store, "busy", files))
    # The commit's chunks are stored, its manifest not written: nothing may go.
    stats = store.gc(wait=0.5)
    assert stats["skipped"] and "in progress" in stats["skipped"]
    assert stats["deleted_chunks"] == 0 and stats["deleted_image_layers"] == 0
    assert key_of(ha) in objects(store, ha)
    result = finish()
    assert result["skipped"] is None and result["deleted_image_layers"] == 1
    assert objects(store, ha) == set()
    manifest = store.get("busy")
    assert manifest.digests() <= chunks(store)  # shared with the collected index: kept
    store.evict("busy")
    assert read_tree(store.materialize("busy")) == files


class HoldingIndexReads:
    """A repository whose reads of layer indexes wait until ``go`` (a node between its
    use stamp and its read of the index)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.reached = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_object(self, key: str) -> bytes:
        if key.startswith("image-layers/"):
            self.reached.set()
            assert self.go.wait(30)
        return self.inner.get_object(key)


def test_a_node_reading_an_index_during_gc_keeps_it(config: dict, tmp_path: Path) -> None:
    # (The window is longer than the node is held below: its stamp is fresh then.)
    store = make_store(config, tmp_path / "gc", image_retention_s=5.0)
    hb, idx_b = converted(store.repo, {"b": os.urandom(300_000)})
    time.sleep(5.5)  # unused past the window: the collector would take it now
    lazy = LazyLayers(tmp_path / "node", HoldingIndexReads(open_repository(config)), config)
    lazy.index_dir.mkdir(parents=True)
    found: list[bool] = []
    reader = threading.Thread(target=lambda: found.append(lazy.has_index(hb)))
    reader.start()
    assert lazy.repo.reached.wait(30)
    stats = store.gc(wait=0.5)  # the node's lease is live: nothing is decided
    assert stats["skipped"] and stats["deleted_image_layers"] == 0
    result: dict = {}
    gc_thread = threading.Thread(target=lambda: result.update(store.gc(wait=30)))
    gc_thread.start()
    time.sleep(0.3)
    lazy.repo.go.set()
    reader.join(30)
    gc_thread.join(30)
    assert found == [True]
    assert result["skipped"] is None and result["deleted_image_layers"] == 0
    assert key_of(hb) in objects(store, hb) and idx_b.digests() <= chunks(store)


@pytest.mark.parametrize("damage", ["not zstd", "points outside its data"])
def test_corrupt_index_stops_the_collection(config: dict, tmp_path: Path,
                                            damage: str) -> None:
    store = make_store(config, tmp_path / "gc", image_retention_s=1.0)
    repo = store.repo
    ha, _ = converted(repo, {"a": os.urandom(300_000)})
    hx, _ = converted(repo, {"x": os.urandom(300_000)})
    store.commit("s1", stage(store, "s1", {"f": os.urandom(200_000)}), {})
    store.delete("s1")  # its chunks are garbage now
    if damage == "not zstd":
        bad = os.urandom(5000)
    else:
        doc = json.loads(zstandard.ZstdDecompressor().decompress(repo.get_object(key_of(hx))))
        for entry in doc["entries"]:
            if entry["t"] == "f":
                entry["s"] += 1
        bad = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    repo.put_object(key_of(hx), bad)
    time.sleep(1.5)
    before = chunks(store)
    layers_before = {h: objects(store, h) for h in (ha, hx)}
    with pytest.raises(CorruptSnapshot) as err:
        store.gc()
    assert key_of(hx) in str(err.value)
    assert "unreadable" in str(err.value) or "points outside" in str(err.value)
    assert chunks(store) == before  # nothing swept: the bad index's chunks are unknown
    assert {h: objects(store, h) for h in (ha, hx)} == layers_before
    assert "locks/gc" not in repo.list_objects("locks/")  # the next run is not blocked
    # Removed by an operator: the next run collects as usual.
    repo.delete_object(key_of(hx))
    stats = store.gc()
    assert stats["deleted_image_layers"] == 2 and chunks(store) == set()


def test_gc_leaves_foreign_names_alone(config: dict, tmp_path: Path) -> None:
    """Only layer-digest names are the collector's (anything else is not its to judge)."""
    store = make_store(config, tmp_path / "gc", image_retention_s=1.0)
    store.repo.put_object("image-prefetch/notes.json", b"{}")
    store.repo.put_object("image-used/README", b"x")
    time.sleep(1.2)
    assert store.gc()["deleted_image_layers"] == 0
    assert "image-prefetch/notes.json" in store.repo.list_objects("image-prefetch/")
    assert store.repo.get_object("image-used/README") == b"x"


def test_the_collection_also_runs_on_a_timer(tmp_path: Path) -> None:
    """Layers expire with time, not with a delete: a node runs the collection every
    snapshot_gc_interval_s too."""
    store = make_store({"backend": "posix_fs", "path": str(tmp_path / "repo")},
                       tmp_path / "gc", image_retention_s=0.5)
    h, _ = converted(store.repo, {"x": os.urandom(100_000)})
    time.sleep(0.7)

    async def run() -> None:
        collector = SnapshotCollector(store)
        collector.start(0.3)
        for _ in range(200):  # 20 s at most
            if not objects(store, h):
                break
            await asyncio.sleep(0.1)
        await collector.close()

    asyncio.run(run())
    assert objects(store, h) == set() and chunks(store) == set()
