"""Garbage collection: delete the repository's chunks that no manifest or kept layer
index references, and the image objects (``image_objects``) past their retention.

Mark (without the lock), take ``locks/gc``, wait until no commit lease is live,
mark again (manifests and indexes written meanwhile may reference candidates), decide
which image layers go (their stamps are read only now: a node stamps a layer under a
commit lease before it reads the index), delete their objects, then sweep the chunks
that neither a manifest nor a kept index references.

Anything unreadable that may reference chunks (a manifest, a layer index) stops the
collection with its error before anything is deleted: its chunks cannot be told.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agentenv.snapshot import image_objects
from agentenv.snapshot.errors import ObjectMissing
from agentenv.snapshot.image_objects import ImageLayer
from agentenv.snapshot.layer_index import load
from agentenv.snapshot.lease import GC_LOCK, Lease, now, scan_leases, take_gc_lock
from agentenv.snapshot.manifest import Manifest
from agentenv.snapshot.repository import Repository

log = logging.getLogger("agentenv.snapshot")

DELETE_BATCH = 1000  # chunks deleted between two checks that the gc lock still holds
LOCK_LAPSED = "the gc lock lapsed (this process stalled past its expiry)"


def collect_garbage(repo: Repository, *, lease_ttl: float, wait: float,
                    cached_manifest: Callable[[str], Manifest | None],
                    image_retention_s: float = image_objects.RETENTION_S,
                    image_budget_bytes: int = 0) -> dict:
    """Delete unreferenced chunks and expired image objects; returns statistics.

    ``cached_manifest`` answers from the node's manifest cache (None when it has
    no copy); manifests are immutable, so a cached copy is as good as the
    repository's. When commits keep the repository busy for longer than ``wait``
    seconds, nothing is deleted and ``skipped`` says why.
    """
    t0 = time.perf_counter()
    stats: dict[str, Any] = {"manifests": 0, "chunks": 0, "referenced": 0,
                             "deleted_chunks": 0, "deleted_bytes": 0,
                             "expired_leases": 0, "skipped": None,
                             "image_layers": 0, "deleted_image_layers": 0}
    # Mark without the lock: what exists and what the manifests and indexes reference.
    marked = _Mark()
    marked.scan(repo, cached_manifest)
    chunks = dict(repo.list_chunks())
    stats["chunks"] = len(chunks)
    lock = Lease(repo, GC_LOCK, lease_ttl)
    if not take_gc_lock(lock):
        stats["skipped"] = "another garbage collection is running"
        return stats
    try:
        deadline = time.monotonic() + wait
        while True:
            live, stale = scan_leases(repo)
            for key in stale:
                repo.delete_object(key)
                stats["expired_leases"] += 1
            if not live:
                break
            if time.monotonic() > deadline:
                stats["skipped"] = f"{len(live)} commit(s) still in progress after {wait}s"
                return stats
            time.sleep(0.1)
        # No commit runs now and none can start: manifests and indexes written since
        # the mark may reference candidates, and no node is between its stamp and
        # its read of an index.
        marked.scan(repo, cached_manifest)
        if not lock.valid():
            stats["skipped"] = LOCK_LAPSED
            return stats
        doomed_layers = _expire_layers(repo, marked, image_retention_s, image_budget_bytes)
        referenced = marked.referenced()
        doomed = sorted(set(chunks) - referenced)
        for i in range(0, len(doomed), DELETE_BATCH):
            # A collector stalled past its lock's expiry may have had the lock taken
            # over by a commit that reuses a doomed chunk: it stops deleting.
            if not lock.valid():
                stats["skipped"] = LOCK_LAPSED
                break
            batch = doomed[i:i + DELETE_BATCH]
            repo.delete_chunks(batch)
            stats["deleted_chunks"] += len(batch)
            stats["deleted_bytes"] += sum(chunks[d] for d in batch)
        stats["image_layers"] = len(marked.layers) + len(doomed_layers)
        stats["deleted_image_layers"] = len(doomed_layers)
        clean = getattr(repo, "clean_tmp", None)
        if clean is not None:
            stats["removed_tmp"] = clean(lease_ttl)
    finally:
        lock.release()
    stats["manifests"] = len(marked.manifests)
    stats["referenced"] = len(marked.referenced() & set(chunks))
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    log.info("snapshot gc: %s", stats)
    return stats


class _Mark:
    """The chunks each manifest and each layer index references (read once each)."""

    def __init__(self) -> None:
        self.manifests: set[str] = set()
        self.manifest_chunks: set[str] = set()
        self.layers: dict[str, ImageLayer] = {}

    def referenced(self) -> set[str]:
        out = set(self.manifest_chunks)
        for layer in self.layers.values():
            out |= layer.chunks
        return out

    def scan(self, repo: Repository,
             cached_manifest: Callable[[str], Manifest | None]) -> None:
        ids = [k.removeprefix("manifests/").removesuffix(".json")
               for k in repo.list_objects("manifests/") if k.endswith(".json")]
        for sid in ids:
            if sid in self.manifests:
                continue
            m = cached_manifest(sid)
            if m is None:
                try:
                    data = repo.get_object(f"manifests/{sid}.json")
                except ObjectMissing:
                    continue
                # An unreadable manifest must stop the collector, not free its chunks.
                m = Manifest.from_json(data)
            self.manifest_chunks |= m.digests()
            self.manifests.add(sid)
        # Lazily loaded image layers: converted ones reference chunks too.
        found = image_objects.layers_in(repo)
        for h, layer in found.items():
            old = self.layers.get(h)
            if old is not None and old.index == layer.index:
                layer.chunks, layer.index_bytes = old.chunks, old.index_bytes
            elif layer.index is not None:
                try:
                    data = repo.get_object(layer.index)
                except ObjectMissing:
                    layer.index = None
                else:
                    # An unreadable index must stop the collector, not free its chunks.
                    layer.chunks = load(data, layer.index).digests()
                    layer.index_bytes = len(data)
        self.layers = found


def _expire_layers(repo: Repository, marked: _Mark, retention_s: float,
                   budget_bytes: int) -> list[str]:
    """(Under the gc lock, no lease live.) Delete the objects of the layers the rule in
    ``image_objects`` lets go; they leave ``marked``, so their chunks are free."""
    if not marked.layers:
        return []
    named = image_objects.template_layers(repo)
    if named is None:
        return []
    t = now()
    for h, layer in marked.layers.items():
        if h in named:
            continue
        layer.used_at = None if layer.used is None else \
            image_objects.read_stamp(repo, layer.used)
        if layer.used_at is None or layer.used_at != layer.used_at:
            # No stamp (older objects) or a damaged one: its clock starts now.
            image_objects.stamp(repo, h, t, "gc")
    doomed = image_objects.doomed_layers(marked.layers, named, t, retention_s=retention_s,
                                         budget_bytes=budget_bytes)
    for h in doomed:
        layer = marked.layers.pop(h)
        for key in layer.keys():
            repo.delete_object(key)
        log.info("snapshot gc: image layer %s collected (last used %.1f days ago, %d "
                 "index bytes, %d chunks of its own or shared)", h[:12],
                 (t - (layer.used_at or t)) / 86400, layer.index_bytes, len(layer.chunks))
    return doomed
